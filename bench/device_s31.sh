#!/usr/bin/env bash
# Session 31's device call: the one-launch decode with programmatic dependent launch (gates and
# an A/B in turns), the stamps with every program's raw rows (without and with PDL), then the
# whole bench twice each way, alternating (without PDL first).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s31
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  timeout -k 5 300 python3 bench/gpu_decode_pdl_fused.py --rounds "${ROUNDS:-3}" 2>&1 | tail -n 40
  echo "pdl rc=$? $(date +%T)"
  st="$OUT/stamps-$card-$SESSION.jsonl"
  timeout -k 5 200 python3 bench/gpu_decode_stamps.py --waves 1 --out "$st" \
    --raw "$OUT/stamps-raw-$card-$SESSION.jsonl" > /tmp/stamps.log 2>&1
  echo "stamps rc=$? $(date +%T)"
  timeout -k 5 200 python3 bench/gpu_decode_stamps.py --waves 1 --pdl --out "$st" \
    > /tmp/stamps-pdl.log 2>&1
  echo "stamps pdl rc=$? $(date +%T)"
  for n in $(seq 1 "${BENCHES:-2}"); do
    bench "full-${CALLN:-1}-$n-plain" --no-pdl
    bench "full-${CALLN:-1}-$n-pdl" --pdl
  done
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
