#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root, carry `.whl`: the eager target's
# cost by part against interleaved twins (alternate 1-s turns, so the machine's drift falls on
# both), then the tiny-kernel graph's sequential A/B again (after-detach figure repeated).
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
cd bench
timeout 330 python3 -u gpu_ab_cost.py --targets eager --interleaved 1 \
    --variants null,no_inject,nvml_only,default,default#2 --name agent-ab-h200-s7-eager-il.json \
    2>&1 | grep -E "^eager|failed|Error" | cut -c1-700
timeout 170 python3 -u gpu_ab_cost.py --targets graph_tiny --name agent-ab-h200-s7-tiny.json \
    2>&1 | grep -E "^graph_tiny|failed|Error" | cut -c1-700
