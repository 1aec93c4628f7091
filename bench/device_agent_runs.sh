#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root: the agent's evidence runs of
# issue 3 and 5 (each script writes its JSON under $OUT; a failure of one does not stop the
# others). Build the kdash wheel into .whl/ first (see bench/device_setup.sh).
#
# What the agent costs is measured against twins by bench/device_ab.sh (bench/gpu_ab_cost.py).
# A device command may run 10 minutes: give long scripts a call each.
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
cd bench  # not the repository root: `python -m kdash...` must find the installed kdash
if [ "$#" -eq 0 ]; then
    set -- gpu_pcs_agent.py
fi
for s in "$@"; do
    echo "== $s"
    timeout 540 python3 -u "$s" > "$OUT/${s%.py}.log" 2>&1
    echo "rc=$?"; tail -c 600 "$OUT/${s%.py}.log"; echo
done
