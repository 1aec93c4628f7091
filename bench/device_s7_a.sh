#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root, carry `.whl`: the eager target's
# cost split into its parts against never-attached twins (the target pinned to CPU 2: the
# method's noise, a CPU-bound neighbour, kdash without its agent, kdash at defaults twice),
# then the live source pane on a torch.compile target with PC sampling at 80x24 and 120x40.
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
cd bench
echo "cpus $(nproc); cpu2 siblings $(cat /sys/devices/system/cpu/cpu2/topology/thread_siblings_list 2>/dev/null)"
timeout 390 python3 -u gpu_ab_cost.py --targets eager --variants null,burn,no_inject,default,default#2 \
    --pin 2 --name agent-ab-h200-s7-eager.json 2>&1 | grep -E "^eager|failed|Error" | cut -c1-900
timeout 150 python3 -u gpu_pcs_record.py --tmux-only 2>&1 | tail -5 | cut -c1-3000
cat "$OUT/tmux-pcs-compile.txt" 2>/dev/null
