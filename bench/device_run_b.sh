#!/usr/bin/env bash
# On the GPU machine: PC sampling through the agent, the decode sweep with the page-prefetch
# option, the kernels' GPU gates, and PC samples re-recorded for tests/data (the kernel changed).
set -uo pipefail
bash bench/device_setup.sh >/dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
cd bench
echo "== pcs agent"; timeout 200 python3 -u gpu_pcs_agent.py > "$OUT/gpu_pcs_agent.log" 2>&1; echo rc=$?
tail -c 400 "$OUT/gpu_pcs_agent.log"; echo
echo "== pcsampling"; timeout 120 python3 -u gpu_pcsampling.py > "$OUT/pcs.log" 2>&1; echo rc=$?
echo "== bench"; timeout 200 python3 -m kdash.kernels.bench --sweep decode --out "$OUT/kernels-h200.json" > "$OUT/bench.log" 2>&1; echo rc=$?
tail -c 1500 "$OUT/bench.log"; echo
cd ..
echo "== gates"; TRITON_INTERPRET=0 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_decode.py > "$OUT/gates.log" 2>&1; echo rc=$?
tail -5 "$OUT/gates.log"
