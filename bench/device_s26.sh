#!/usr/bin/env bash
# Session 26's device call, in priority order so that a call cut at its limit keeps the most
# useful part: the whole bench (the table of record; prefill contenders timed in turn), the
# one-launch step's programs on the GPU's clock in one and two waves (bench/gpu_decode_stamps.py),
# the page-a-warp Gluon TMA stage 1 against the Triton stage 1 (bench/gpu_decode_gluon_w.py), the clocks under
# each decode workload, the fenced decode table, the whole bench again.
#   CALL=all (default) runs all of them; CALL=bench the two whole benches only; CALL=gluon the
#   page-a-warp run and its GPU test only; CALL=short the benches, the stamps and the page-a-warp run.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s26
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  [[ ${CALL:-all} != gluon ]] && bench "full-${STEP:-1}"
  if [[ ${CALL:-all} != bench ]]; then
    timeout -k 5 "${SLIMIT:-150}" python3 bench/gpu_decode_stamps.py --waves "${WAVES:-1,2}" \
      --out "$OUT/stamps-$card-s26.jsonl" 2>&1 \
      | grep -v Warning | cut -c1-700
    echo "stamps rc=$? $(date +%T)"
  fi
  if [[ ${CALL:-all} != bench ]]; then
    timeout -k 5 "${LIMIT:-200}" python3 bench/gpu_decode_gluon_w.py --variants ${VARIANTS:-w4_s2 w4_s2_r168 w1_s6} \
      --out "$OUT/gluon-p-$card-s26.jsonl" 2>&1 | grep -v Warning | cut -c1-300
    echo "gluon rc=$? $(date +%T)"
  fi
  if [[ ${CALL:-all} == all ]]; then
    timeout -k 5 90 python3 bench/gpu_decode_clocks.py --out "$OUT/clocks-$card-s26.jsonl" \
      2>&1 | grep -v Warning | cut -c1-400
    echo "clocks rc=$? $(date +%T)"
    bench fenced-1 --only decode --fenced-merge
  fi
  [[ ${CALL:-all} != gluon ]] && bench "full-$((${STEP:-1} + 1))"
  if [[ ${CALL:-all} == all || ${CALL:-all} == gluon ]]; then
    timeout -k 5 "${TLIMIT:-120}" python3 -m pytest -q -m gpu -p no:cacheprovider \
      tests/test_kernels_decode_gluon.py 2>&1 | tail -4
  fi
} 2>&1 | tee "$OUT/s26-${CALL:-all}.log"
