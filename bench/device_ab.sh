#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root: the twin-process cost bench.
# Build the kdash wheel into .whl/ first (see bench/device_setup.sh); carry `.whl`.
#   bash bench/device_ab.sh --screen graph_tiny     # which factor lingers (~8 min)
#   bash bench/device_ab.sh [--pc] [--targets ...]  # the A/B on the three targets
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd bench  # not the repository root: `python -m kdash...` must find the installed kdash
timeout 580 python3 -u gpu_ab_cost.py "$@" 2>&1 | tee "$OUT/ab.log"
