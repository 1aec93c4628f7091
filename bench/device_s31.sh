#!/usr/bin/env bash
# Session 31's device calls: the decode GPU gates (GATES=0 skips them), then NEW rounds of the
# decode table with the one-launch kernel's opaque head mask (--opaque-heads) each followed by
# the decode table without it (--no-opaque-heads, today's default); on an H200 a whole bench
# with the opaque mask at the end. AB=tagged: the tagged merge's GPU tests and its A/B
# (bench/gpu_decode_tagged.py) instead.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
# (Earlier calls of this session ran this script at e8e9c35 (PDL), d4979d5 (the token-even
# cut, against a wheel of 5554f7b) and 0a35608 (the opaque mask as a default, likewise; the
# whole bench each round).)
set -uo pipefail
SESSION=s31
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  if [[ ${GATES:-1} == 1 ]]; then
    gates "${CALLN:-1}"
  fi
  if [[ ${AB:-opaque} == tagged ]]; then
    echo "== tagged merge: GPU tests, then the A/B"
    timeout -k 5 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_kernels_decode_tagged.py > /tmp/tagged.log 2>&1
    echo "rc=$? $(date +%T)"; grep -E "passed|failed|FAILED|Error" /tmp/tagged.log | tail -4
    timeout -k 5 300 python3 bench/gpu_decode_tagged.py --rounds "${ROUNDS:-3}"
    echo "rc=$? $(date +%T)"
  else
    for n in $(seq 1 "${NEW:-2}"); do
      bench "${CALLN:-1}-$n-opaque" --only decode --opaque-heads
      bench "${CALLN:-1}-$n-known" --only decode --no-opaque-heads
    done
    [[ $card == h200 ]] && bench "full-${CALLN:-1}-3-opaque" --opaque-heads
  fi
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
