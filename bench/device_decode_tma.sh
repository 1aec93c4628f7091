#!/usr/bin/env bash
# Device-tool calls for the TMA decode kernels (kernels/decode_gluon.py) on the H200; the steps,
# by name, as arguments. Every step has its own timeout; all three can pass the 10-minute limit
# of one call, so: `gates timing` in one call (~8 min at most), `table` in the next (~3.5); a
# `table` run alone assumes the one-launch gates passed in the earlier call:
#   gates   its GPU gates and graph replays, bf16 and fp8 (pytest -m gpu
#           tests/test_kernels_decode_gluon.py), two launches with the plan's GPU tests (the
#           launcher and the plan changed with it), then the one-launch form on its own;
#   timing  bench/gpu_decode_gluon.py: the gates of bench/ (NaN-filled slots, host-cut splits),
#           then the Gluon stage 1 + merge against the plan's kernels at the long shapes, ring
#           depths 4, 3 and 6, split counts x1, x1.5 and x2 of the plan's, the plan's TMA paths
#           (bf16 and fp8) -> $OUT/decode-gluon-h200.json;
#   table   the decode table through the plans with --decode-tma (bf16 and fp8 on the TMA
#           kernels) -> $OUT/kernels-h200-decode-tma.json, its summary lines in the log.
# Log: $OUT/tma.log. Before the call, rebuild the kdash wheel from the tree and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Run: bash bench/device_decode_tma.sh [gates] [timing] [table]
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
steps=" ${*:-gates timing table} "
log=$OUT/tma.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

  # The one-launch form polls flags: a bug there hangs rather than fails, so it is gated on its
  # own (after everything else), and a failure keeps it out of the later steps.
  fused_ok=1
  if [[ $steps == *" gates "* ]]; then
    echo "== GPU gates: TMA decode (two launches), plan"
    timeout -k 5 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider -k "not fused" \
      tests/test_kernels_decode_gluon.py tests/test_kernels_plan.py > "$OUT/tma-gates.log" 2>&1
    echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/tma-gates.log" | tail -12
    echo "== GPU gates: one launch (TMA decode, plan)"
    timeout -k 5 100 python3 -m pytest -q -rs -m gpu -p no:cacheprovider -k "fused" \
      tests/test_kernels_decode_gluon.py tests/test_kernels_plan.py > "$OUT/tma-gates-fused.log" 2>&1
    rc=$?; echo "rc=$rc"; grep -E "passed|failed|FAILED|Error" "$OUT/tma-gates-fused.log" | tail -8
    [[ $rc == 0 ]] || fused_ok=0
  fi

  if [[ $steps == *" timing "* ]]; then
    echo "== Gluon stage 1 against the plan's kernels (one launch: $fused_ok)"
    nofused=""; [[ $fused_ok == 1 ]] || nofused="--no-fused"
    (cd bench && timeout -k 5 200 python3 gpu_decode_gluon.py --stages 4 --variants 3,6 \
      --factors 1,1.5,2 $nofused 2>&1 | grep -v Warning | python3 decode_gluon_summary.py)
    echo "rc=$?"
  fi

  if [[ $steps == *" table "* && $fused_ok == 0 ]]; then
    echo "== decode table skipped: the one-launch gates failed (the table times both paths)"
  elif [[ $steps == *" table "* ]]; then
    echo "== decode table, bf16 and fp8 on the TMA kernels"
    timeout -k 5 250 python3 -m kdash.kernels.bench --sweep none --only decode --decode-tma \
      --out "$OUT/kernels-h200-decode-tma.json" > "$OUT/bench-tma.log" 2>&1
    echo "rc=$?"; grep -E "summary|Error|error" "$OUT/bench-tma.log" | cut -c1-300
  fi
} 2>&1 | tee "$log"
