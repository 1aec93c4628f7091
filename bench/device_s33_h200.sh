#!/usr/bin/env bash
# Session 33 on an H200 only (~7 min): the L2 hint on and off at 1 x 64k, alternating, each
# policy in its own process and Triton cache (bench/gpu_decode_l2frac.py: do_bench, replayed and
# read-flushed us; on an H100 the hinted stream ran 4-7% slower while L2 stayed dirty, session
# 33), then the opaque head mask's A/B and whole benches with it (bench/device_s32.sh, NEW and
# FULL as there; L2N: the hint's alternations, 2). Results in $OUT: l2frac-h200-s33.jsonl,
# kernels-h200-s33-*.json, the logs.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s33}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
if [[ $card != h200 ]]; then
  echo "$name: not an H200, nothing run"
  exit 0
fi
{
  echo "$name $(date +%T)"
  n=0
  pols=()
  for _ in $(seq 1 "${L2N:-2}"); do pols+=(plain first:1.0); done
  for pol in "${pols[@]}"; do
    n=$((n + 1))
    TRITON_CACHE_DIR=/tmp/tc-l2-$n timeout -k 5 120 python3 bench/gpu_decode_l2frac.py \
      --policy "$pol" --rounds 1 --copy-gbs 4282 --out "$OUT/l2frac-h200-$SESSION.jsonl" \
      --shapes 1x65536:64/8:bf16,1x65536:32/8:bf16
    echo "rc=$? $(date +%T)"
  done
} 2>&1 | tee "$OUT/$SESSION-l2.log"
SESSION=$SESSION GATES=0 TAGGED=0 CALLN=3 NEW=${NEW:-1} FULL=${FULL:-2} bash bench/device_s32.sh
