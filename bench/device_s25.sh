#!/usr/bin/env bash
# Session 25's device call: how much of the K/V stream the L2 evict-first hint should cover
# (bench/gpu_decode_l2frac.py), on whichever card is lent. Each policy runs in its own process
# and Triton cache (Triton 3.6 does not key its cache on the hook); two cycles over the
# policies, the kernels compiled in the first. Files: $OUT/l2frac-<card>-s25.jsonl, s25.log.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $name in *H200*) card=h200 ;; *H100*) card=h100 ;; *) card=gpu ;; esac
out="$OUT/l2frac-$card-s25.jsonl"
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  copy=$(python3 -c "from kdash.kernels import bench; print(bench.ceilings()['copy_GBps'])")
  echo "copy $copy GB/s"
  for cycle in 1 2; do
    for pol in ${POLICIES:-plain first:1.0 first:0.5 first:0.25 first:0.75 normal:1.0}; do
      [[ $cycle == 2 && $pol == normal:1.0 ]] && continue
      TRITON_CACHE_DIR="/tmp/tc-${pol/:/-}" timeout -k 5 150 python3 bench/gpu_decode_l2frac.py \
        --policy "$pol" --copy-gbs "$copy" --rounds 1 --out "$out" 2>&1 | grep -v Warning
      echo "rc=$? cycle $cycle $pol $(date +%T)"
    done
  done
} 2>&1 | tee "$OUT/s25.log"
