#!/usr/bin/env bash
# Session 25's device calls, on whichever card is lent (CALL picks):
#   CALL=l2frac: how much of the K/V stream the L2 evict-first hint should cover
#     (bench/gpu_decode_l2frac.py), each policy in its own process and Triton cache (Triton 3.6
#     does not key its cache on the hook), two cycles; -> l2frac-<card>-s25.jsonl;
#   CALL=clocks (default): SM clock, power and throttle reasons under each decode workload
#     (bench/gpu_decode_clocks.py) -> clocks-<card>-s25.jsonl; then the whole bench (H200: twice
#     and the decode table in the fenced form; H100: once) -> kernels-<card>-s25-full-<STEP>.json;
#   CALL=gluon: the Gluon TMA stage 1 with a page a warp (bench/gpu_decode_gluon_w.py: gates,
#     then 1 x 64k beside the Triton stage 1 and TMA's copies) -> gluon-p-<card>-s25.jsonl;
#   CALL=bench: the whole bench twice (STEP, STEP+1); on an H200 the clocks and the fenced table
#     as well; CALL=once: the whole bench once (and the clocks first on an H200).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s25
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  if [[ ${CALL:-clocks} == gluon ]]; then
    timeout -k 5 "${LIMIT:-230}" python3 bench/gpu_decode_gluon_w.py \
      --out "$OUT/gluon-p-$card-s25.jsonl" 2>&1 | grep -v Warning | cut -c1-400
    echo "gluon rc=$? $(date +%T)"
  elif [[ ${CALL:-clocks} == l2frac ]]; then
    out="$OUT/l2frac-$card-s25.jsonl"
    copy=$(python3 -c "from kdash.kernels import bench; print(bench.ceilings()['copy_GBps'])")
    echo "copy $copy GB/s"
    for cycle in 1 2; do
      for pol in plain first:1.0 first:0.5 first:0.25 first:0.75 normal:1.0; do
        [[ $cycle == 2 && $pol == normal:1.0 ]] && continue
        TRITON_CACHE_DIR="/tmp/tc-${pol/:/-}" timeout -k 5 150 python3 bench/gpu_decode_l2frac.py \
          --policy "$pol" --copy-gbs "$copy" --rounds 1 --out "$out" 2>&1 | grep -v Warning
        echo "rc=$? cycle $cycle $pol $(date +%T)"
      done
    done
  else
    if [[ ${CALL:-clocks} == clocks || $card == h200 ]]; then
      timeout -k 5 120 python3 bench/gpu_decode_clocks.py --out "$OUT/clocks-$card-s25.jsonl" \
        2>&1 | grep -v Warning | cut -c1-600
      echo "clocks rc=$? $(date +%T)"
    fi
    bench "full-${STEP:-1}"
    if [[ $card == h200 && ${CALL:-clocks} != once ]]; then
      bench fenced-1 --only decode --fenced-merge
    fi
    if [[ ${CALL:-clocks} == bench || ($card == h200 && ${CALL:-clocks} != once) ]]; then
      bench "full-$((${STEP:-1} + 1))"
    fi
  fi
} 2>&1 | tee "$OUT/s25-${CALL:-clocks}.log"
