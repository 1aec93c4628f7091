#!/usr/bin/env bash
# Session 35, on an H200 (~7 min): the table of record's whole bench at today's defaults first;
# then the one-launch prefetch A/B for bf16 (off and 2 tiles) and fp8 pairs (off, 1, 2;
# bench/gpu_decode_warm.py, outputs checked bit for bit) and the prefetch's tests on the GPU;
# then (an H200 only) the opaque head mask's decode A/B, and two more whole benches while the
# call has time: with --warm-tiles-fp8 $FP8WARM (default 2), then as the first. Results in $OUT.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s35}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
shapes=1x65536:32/8,1x65536:64/8,1x131072:32/8
{
  echo "$name $(date +%T)"
  bench full-1
  echo "== warm A/B, bf16"
  timeout -k 5 150 python3 bench/gpu_decode_warm.py --warm 0,2 --shapes "$shapes" \
    --rounds 3 --out "$OUT/warm-$card-$SESSION.jsonl" 2>&1 | grep -E "^r|DIFF|rror" | tail -20
  echo "rc=${PIPESTATUS[0]} $(date +%T)"
  echo "== warm A/B, fp8 pairs"
  timeout -k 5 150 python3 bench/gpu_decode_warm.py --fp8 --warm 0,1,2 --shapes "$shapes" \
    --rounds 3 --out "$OUT/warm-$card-$SESSION.jsonl" 2>&1 | grep -vE "^r[12] " | tail -40
  echo "rc=${PIPESTATUS[0]} $(date +%T)"
  echo "== the prefetch's GPU tests"
  timeout -k 5 120 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels_decode_warm.py 2>&1 | tail -4
  echo "rc=${PIPESTATUS[0]} $(date +%T)"
  if [[ $card == h200 ]] && ((SECONDS < 400)); then
    bench opaque --only decode --opaque-heads
    bench known --only decode --no-opaque-heads
  fi
  if ((SECONDS < 480)); then bench full-2-fp8warm "--warm-tiles-fp8=${FP8WARM:-2}"
  else echo "== no time left for a whole bench ($SECONDS s)"; fi
  if ((SECONDS < 480)); then bench full-3
  else echo "== no time left for a whole bench ($SECONDS s)"; fi
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
