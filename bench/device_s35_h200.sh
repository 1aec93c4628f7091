#!/usr/bin/env bash
# Session 35's H200 call (~6 min): the table of record's whole benches at today's defaults,
# the bf16 prefetch A/B (off and 2 tiles; bench/gpu_decode_warm.py) and the opaque head mask's
# decode A/B between them; the fp8 prefetch A/B last, while the call has time. On another card
# only the opaque mask's decode A/B, twice (~2 min).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s35}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
shapes=1x65536:32/8,1x65536:64/8,1x131072:32/8
{
  echo "$name $(date +%T)"
  if [[ $card != h200 ]]; then  # the opaque mask's decode A/B with the prefetch on, then stop
    for n in 1 2; do
      bench "opaque-$n" --only decode --opaque-heads
      bench "known-$n" --only decode --no-opaque-heads
    done
    exit 0
  fi
  bench full-1
  echo "== warm A/B, bf16"
  timeout -k 5 150 python3 bench/gpu_decode_warm.py --warm 0,2 --shapes "$shapes" \
    --rounds 3 --out "$OUT/warm-$card-$SESSION.jsonl" 2>&1 | grep -E "^r|DIFF|rror" | tail -20
  echo "rc=${PIPESTATUS[0]} $(date +%T)"
  bench opaque --only decode --opaque-heads
  bench known --only decode --no-opaque-heads
  for n in 2 3; do
    if ((SECONDS < 470)); then bench "full-$n"
    else echo "== no time left for a whole bench ($SECONDS s)"; fi
  done
  if ((SECONDS < 500)); then
    echo "== warm A/B, fp8 pairs"
    timeout -k 5 $((580 - SECONDS)) python3 bench/gpu_decode_warm.py --fp8 --warm 0,2 \
      --shapes "$shapes" --rounds 3 --out "$OUT/warm-$card-$SESSION.jsonl" 2>&1 |
      grep -E "^r|DIFF|rror" | tail -20
    echo "rc=${PIPESTATUS[0]} $(date +%T)"
  fi
} 2>&1 | tee "$OUT/$SESSION-h200-call.log"
