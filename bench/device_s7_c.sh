#!/usr/bin/env bash
# On the GPU machine (device tool), from the repository root, carry `.whl`: the decode launch
# paths (DECODE_ONLY kernel gates and bench), then PC-sample attribution on a steady decode step.
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
DECODE_ONLY=1 timeout 420 bash bench/device_kernels.sh 2>&1 | tail -40 | cut -c1-400
cd bench
PCS_STEADY=1 timeout 130 python3 -u gpu_pcs_agent.py 2>&1 | tail -2 | cut -c1-1500
python3 - <<'PY'
import json, os
p = os.path.join(os.environ["OUT"], "pcs-attribution-h200-steady.json")
if os.path.exists(p):
    d = json.load(open(p))
    print("attribution", d["summary"])
    for r in d["attribution"].get("ranges", [])[:12]:
        print(" ", r["max_gap_points"], r["max_gap_points_coverage"],
              [(k["kernel"][:24], k["gpu_time_share"], k["coverage_share"], k["sample_share"]) for k in r["kernels"]])
PY
