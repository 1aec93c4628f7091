#!/usr/bin/env bash
# Session 30's device calls: on an H200 the whole bench first (BENCH=1, the default: the table
# of record), then BENCHES=N more on any card. (The split tail's A/B and Nsight Compute runs of
# this session ran from this script at commit 81356bf.)
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s30
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  [[ $card == h200 && ${BENCH:-1} == 1 ]] && bench "full-${CALLN:-1}-0"
  for n in $(seq 1 "${BENCHES:-0}"); do bench "full-${CALLN:-1}-$n"; done
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
