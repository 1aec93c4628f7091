#!/usr/bin/env bash
# Session 36 (~6 min). The prefill rows now take their contenders in balanced orders over six
# rounds (kernels/bench_timing.turn_orders). On an H200, the table of record: whole benches at
# today's defaults with the bf16 prefetch A/B and the opaque head mask's decode A/B between
# them, then the fp8 prefetch A/B (bench/device_s35_h200.sh's plan). On another card: three
# whole benches (the cuDNN key under the balanced orders), then the opaque mask's decode A/B.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s36}
if [[ $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) == *H200* ]]; then
  SESSION=$SESSION exec bash bench/device_s35_h200.sh
fi
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
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
