#!/usr/bin/env bash
# One device-tool call for the TMA decode stage 1 (kernels/decode_gluon.py) on the H200:
#   1. its GPU gates and graph replay (pytest -m gpu tests/test_kernels_decode_gluon.py), and
#      the decode/plan gates that a change to the plan or the launcher could break;
#   2. bench/gpu_decode_gluon.py: the gates of bench/ (NaN-filled slots, host-cut splits), then
#      the Gluon stage 1 + merge against the plan's kernels at the long shapes, ring depths 3,
#      4 and 6, split counts x1, x1.5 and x2 of the plan's -> $OUT/decode-gluon-h200.json;
#   3. the decode table through the plans with --decode-tma (bf16 on the TMA kernel; fp8
#      unchanged) -> $OUT/kernels-h200-decode-tma.json, its summary lines in the log.
# Typical ~6 min (first compiles included); every step has its own timeout. Log: $OUT/tma.log.
# Before the call, rebuild the kdash wheel from the tree and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Run: bash bench/device_decode_tma.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
log=$OUT/tma.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

  echo "== GPU gates: TMA decode, decode, plan"
  timeout -k 5 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels_decode_gluon.py tests/test_kernels_plan.py > "$OUT/tma-gates.log" 2>&1
  echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/tma-gates.log" | tail -12

  echo "== Gluon stage 1 against the plan's kernels"
  (cd bench && timeout -k 5 200 python3 gpu_decode_gluon.py --stages 4 --variants 3,6 \
    --factors 1,1.5,2 2>&1 | grep -v Warning | python3 decode_gluon_summary.py)
  echo "rc=$?"

  echo "== decode table, bf16 on the TMA kernel"
  timeout -k 5 200 python3 -m kdash.kernels.bench --sweep none --only decode --decode-tma \
    --out "$OUT/kernels-h200-decode-tma.json" > "$OUT/bench-tma.log" 2>&1
  echo "rc=$?"; grep -E "summary|Error|error" "$OUT/bench-tma.log" | cut -c1-300
} 2>&1 | tee "$log"
