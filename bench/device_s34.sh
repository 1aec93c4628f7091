#!/usr/bin/env bash
# Session 34, whichever card comes (~6 min): the one-launch kernel's L2 prefetch of each
# split's first tiles (decode_fused.WARM_TILES) off, 1 and 2 tiles, in turns
# (bench/gpu_decode_warm.py; outputs checked bit for bit); then, on an H100, the decode GPU
# gates at one tile; on an H200, bench/device_s32.sh's opaque-mask decode A/B and whole benches
# (NEW, FULL as there) while the call has time. Results in $OUT.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s34}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  echo "== warm A/B"
  timeout -k 5 "${WARM_S:-240}" python3 bench/gpu_decode_warm.py --warm "${WARMS:-0,1,2}" \
    --rounds "${ROUNDS:-3}" --out "$OUT/warm-$card-$SESSION.jsonl" 2>&1 | tail -60
  echo "rc=${PIPESTATUS[0]} $(date +%T)"
  if [[ $card != h200 ]]; then
    WARM=1 gates "${CALLN:-1}-warm1"
  fi
} 2>&1 | tee "$OUT/$SESSION-warm.log"
if [[ $card == h200 ]]; then
  SESSION=$SESSION GATES=0 TAGGED=0 CALLN=3 NEW=${NEW:-1} FULL=${FULL:-1} bash bench/device_s32.sh
fi
