#!/usr/bin/env bash
# Session 27's second device call: on an H200 the whole bench first (the table of record, unmeasured
# there since session 22), then on any card the stamps in one wave, their loop now queued behind a
# spin as do_bench's launches are (bench/gpu_decode_stamps.py).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s27
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  [[ $card == h200 ]] && bench full-1
  timeout -k 5 "${SLIMIT:-120}" python3 bench/gpu_decode_stamps.py --waves 1 \
    --out "$OUT/stamps-$card-s27-spin.jsonl" 2>&1 | grep -v Warning | cut -c1-400
  echo "stamps rc=$? $(date +%T)"
} 2>&1 | tee "$OUT/s27-call3.log"
