#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root: the twin-process cost benches.
# Build the kdash wheel into .whl/ first (see bench/device_setup.sh); carry `.whl`.
#   bash bench/device_ab.sh "--screen graph_tiny"          # which factor lingers (~8 min)
#   bash bench/device_ab.sh "--screen finalize2" ""        # two runs of gpu_ab_cost.py, in order
# Each argument is one run of bench/gpu_ab_cost.py with those options ("" = the A/B).
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
cd bench  # not the repository root: `python -m kdash...` must find the installed kdash
for opts in "$@"; do
    echo "== gpu_ab_cost.py $opts"
    # shellcheck disable=SC2086
    timeout 580 python3 -u gpu_ab_cost.py $opts 2>&1 | tee -a "$OUT/ab.log"
done
