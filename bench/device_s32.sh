#!/usr/bin/env bash
# Session 32's device calls, whichever card comes: the decode GPU gates on today's tree (GATES=0
# skips them); on an H200 only, NEW rounds of the decode table with the one-launch kernel's
# opaque head mask (--opaque-heads) each followed by one without it, and FULL whole benches with
# it while the call has time left; then (while the call is under TAGGED_BY s) what the tagged
# merge's buffers hold after a run (--probe), its GPU tests and its A/B
# (bench/gpu_decode_tagged.py).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s32}  # later sessions name theirs
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  if [[ ${GATES:-1} == 1 ]]; then
    gates "${CALLN:-1}"
  fi
  if [[ $card == h200 || ${FORCE:-0} == 1 ]]; then
    for n in $(seq 1 "${NEW:-2}"); do
      bench "${CALLN:-1}-$n-opaque" --only decode --opaque-heads
      bench "${CALLN:-1}-$n-known" --only decode --no-opaque-heads
    done
    # a whole bench takes ~90 s once compiled; the call's limit is 600 s
    for n in $(seq 1 "${FULL:-1}"); do
      if ((SECONDS < 470)); then bench "full-${CALLN:-1}-$n-opaque" --opaque-heads
      else echo "== no time left for a whole bench ($SECONDS s)"; fi
    done
  fi
  if [[ ${TAGGED:-1} == 1 ]] && ((SECONDS < ${TAGGED_BY:-600})); then
    # apart from the gates, with their own reports
    echo "== tagged merge: what its buffers hold (--probe), GPU tests, then the A/B"
    timeout -k 5 150 python3 bench/gpu_decode_tagged.py --probe
    echo "rc=$? $(date +%T)"
    timeout -k 5 150 python3 -m pytest -v -rs -m gpu -p no:cacheprovider \
      -o faulthandler_timeout=60 tests/test_kernels_decode_tagged.py > /tmp/tagged.log 2>&1
    rc=$?; echo "rc=$rc $(date +%T)"; grep -E "passed|failed|FAILED|PASSED|Error|^E |Timeout|File " /tmp/tagged.log | tail -30
    if ((rc == 0)); then
      timeout -k 5 200 python3 bench/gpu_decode_tagged.py --rounds "${ROUNDS:-3}"
      echo "rc=$? $(date +%T)"
    fi
  fi
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
