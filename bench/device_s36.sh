#!/usr/bin/env bash
# Session 36. The prefill rows now take their contenders in balanced orders over six rounds
# (kernels/bench_timing.turn_orders). On an H200 (~5 min, SECONDS_CAP caps it, default 330),
# the table of record: a whole bench at today's defaults, the bf16 prefetch A/B
# (bench/gpu_decode_warm.py), the opaque head mask's decode A/B, then whole benches while the cap
# allows. On another card (~7 min): three whole benches (the cuDNN key under the balanced
# orders), then the opaque mask's decode A/B twice; with SHORT=1 only the decode GPU gates.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s36}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
cap=${SECONDS_CAP:-330}
{
  echo "$name $(date +%T)"
  if [[ $card == h200 ]]; then
    bench full-1
    echo "== warm A/B, bf16"
    timeout -k 5 100 python3 bench/gpu_decode_warm.py --warm 0,2 \
      --shapes 1x65536:32/8,1x65536:64/8,1x131072:32/8 --rounds 3 \
      --out "$OUT/warm-$card-$SESSION.jsonl" 2>&1 | grep -E "^r|DIFF|rror" | tail -20
    echo "rc=${PIPESTATUS[0]} $(date +%T)"
    bench opaque --only decode --opaque-heads
    bench known --only decode --no-opaque-heads
    for n in 2 3 4; do
      if ((SECONDS < cap - 80)); then bench "full-$n"; fi
    done
    exit 0
  fi
  if [[ -n ${SHORT:-} ]]; then  # a second call on another card: the decode GPU gates only
    gates short
    exit 0
  fi
  for n in 1 2 3; do
    if ((SECONDS < 400)); then bench "full-$n"
    else echo "== no time left for a whole bench ($SECONDS s)"; fi
  done
  for n in 1 2; do
    if ((SECONDS < 520)); then
      bench "opaque-$n" --only decode --opaque-heads
      bench "known-$n" --only decode --no-opaque-heads
    fi
  done
} 2>&1 | tee "$OUT/$SESSION-$card-call.log"
