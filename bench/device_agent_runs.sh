#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root: the agent's evidence runs of
# issue 3 and 5 in one go (each script writes its JSON under $OUT; a failure of one does not
# stop the others). Build the kdash wheel into .whl/ first (see bench/device_setup.sh).
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site
cd bench  # not the repository root: `python -m kdash...` must find the installed kdash
for s in gpu_attach_inject.py gpu_pcs_agent.py gpu_agent_cost.py; do
    echo "== $s"
    timeout 300 python3 -u "$s" > "$OUT/${s%.py}.log" 2>&1
    echo "rc=$?"; tail -c 600 "$OUT/${s%.py}.log"; echo
done
