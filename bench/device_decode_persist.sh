#!/usr/bin/env bash
# Device-tool calls for the persistent one-launch decode (kernels/decode_persist.py) on the H200;
# the steps, by name, as arguments. All three pass the 10-minute limit of one call, so: `gates
# timing` in one call (~7 min at most), `table` in the next (~6):
#   gates   its GPU gates (pytest -m gpu tests/test_kernels_decode_persist.py: many waves against
#           two launches, 200 graph replays with the counters back at zero), then the plan's and
#           the decode gates on the persistent path (-k persistent). A bug in its take/publish
#           protocol would hang rather than fail: each step has a timeout, and a failure skips
#           the later steps;
#   timing  bench/gpu_decode_persist.py: two launches, fused, persistent (and bf16 under a
#           128-register cap) at 1x64k, 8x16k, 32x4k, 128x1k, 64 lognormal, bf16 and fp8 ->
#           $OUT/decode-persist-h200.json;
#   table   the decode table with --persistent (default plans take it where the fused launch
#           does not pay; every shape also times all three paths) -> $OUT/kernels-h200-decode-
#           persist.json, its summary lines in the log: decode_host_us and the per-path figures
#           say whether PERSISTENT_DEFAULT should be on (the bench saves after every row, so a
#           timeout keeps the rows done). A `table` run alone assumes the gates passed earlier.
# Log: $OUT/persist.log. Before the call, rebuild the kdash wheel from the tree and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Run: bash bench/device_decode_persist.sh [gates] [timing] [table]
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
steps=" ${*:-gates timing} "
log=$OUT/persist.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  ok=1
  if [[ $steps == *" gates "* ]]; then
    echo "== GPU gates: persistent decode (many waves, graph replays)"
    timeout -k 5 100 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_kernels_decode_persist.py > "$OUT/persist-gates.log" 2>&1
    rc=$?; echo "rc=$rc"; grep -E "passed|failed|FAILED|Error" "$OUT/persist-gates.log" | tail -8
    [[ $rc == 0 ]] || ok=0
    echo "== GPU gates: plan and decode on the persistent path"
    timeout -k 5 90 python3 -m pytest -q -rs -m gpu -p no:cacheprovider -k persistent \
      tests/test_kernels_plan.py tests/test_kernels_decode.py > "$OUT/persist-plan.log" 2>&1
    rc=$?; echo "rc=$rc"; grep -E "passed|failed|FAILED|Error" "$OUT/persist-plan.log" | tail -8
    [[ $rc == 0 ]] || ok=0
  fi
  if [[ $steps == *" timing "* && $ok == 0 ]]; then
    echo "== timing skipped: the persistent gates failed"
  elif [[ $steps == *" timing "* ]]; then
    echo "== persistent against the other paths"
    timeout -k 5 220 python3 bench/gpu_decode_persist.py 2>&1 | grep -v Warning | cut -c1-400
    echo "rc=$?"
  fi
  if [[ $steps == *" table "* && $ok == 0 ]]; then
    echo "== table skipped: the persistent gates failed"
  elif [[ $steps == *" table "* ]]; then
    echo "== decode table, --persistent"
    timeout -k 5 340 python3 -m kdash.kernels.bench --sweep none --only decode --persistent \
      --out "$OUT/kernels-h200-decode-persist.json" > "$OUT/bench-persist.log" 2>&1
    echo "rc=$?"; grep -E "summary|Error|error" "$OUT/bench-persist.log" | cut -c1-300
  fi
} 2>&1 | tee "$log"
