#!/usr/bin/env bash
# Device-tool call for the plans' graph launch (kernels/graph_launch.py) on the H200, in one
# call (~7 min at most): its GPU gates and the plan's graph tests (a failure skips the rest);
# bench/gpu_decode_graph_launch.py at two shapes (the plan's run with and without its graph
# slot, torch's replay, a bare cuGraphLaunch -> $OUT/decode-graph-launch-h200.json); then the
# decode table under the defaults (graph launch on; each shape's default path only) -> $OUT/kernels-h200-decode-graph.json,
# its summary lines in the log (the bench saves after every row, so a timeout keeps the rows
# done). Log: $OUT/graph.log. Before the call, rebuild the kdash wheel and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Run: bash bench/device_graph_launch.sh [SHAPES for the probe, default 1x65536,64xlognormal]
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
log=$OUT/graph.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  echo "== GPU gates: graph launch, plan (graph, capture, host)"
  timeout -k 5 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels_graph_launch.py "tests/test_kernels_plan.py" -k "graph or host or capture" \
    > "$OUT/graph-gates.log" 2>&1
  rc=$?; echo "rc=$rc"; grep -E "passed|failed|FAILED|Error" "$OUT/graph-gates.log" | tail -12
  if [[ $rc != 0 ]]; then echo "== the rest skipped: the gates failed"; exit 0; fi
  echo "== run, run through the slot, replay, cuGraphLaunch"
  (cd bench && PYTHONSAFEPATH= timeout -k 5 120 python3 gpu_decode_graph_launch.py --shapes "${1:-1x65536,64xlognormal}" \
    --out "$OUT/decode-graph-launch-h200.json" 2>&1 | grep -v Warning | cut -c1-1200)
  echo "== decode table, defaults"
  timeout -k 5 240 python3 -m kdash.kernels.bench --sweep none --only decode --default-path-only \
    --out "$OUT/kernels-h200-decode-graph.json" > "$OUT/bench-graph.log" 2>&1
  echo "rc=$?"; grep -E "summary|Error|error" "$OUT/bench-graph.log" | cut -c1-300
} 2>&1 | tee "$log"
