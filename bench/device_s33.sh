#!/usr/bin/env bash
# Session 33's device call, any card: the DRAM bytes the default decode plans read and write
# after do_bench's zeroing flush, after a reading flush and with no flush, with the L2 hint and
# without (bench/gpu_decode_dram.py under Nsight Compute, each policy in its own process and
# Triton cache). ~3 min. Results: $OUT/decode-dram-$card-s33-{hint,plain}.json and the log.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s33}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
metrics=dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum
{
  echo "$name $(date +%T)"
  for pol in hint plain; do
    flag=()
    [[ $pol == plain ]] && flag=(--plain)
    echo "== ncu, L2 hint: $pol"
    TRITON_CACHE_DIR=/tmp/tc-$pol timeout -k 5 240 ncu --profile-from-start off \
      --cache-control none --clock-control none -k regex:^_decode --metrics "$metrics" \
      -f -o "/tmp/dram-$pol" python3 bench/gpu_decode_dram.py --labels "/tmp/labels-$pol.json" \
      "${flag[@]}" > "/tmp/ncu-$pol.log" 2>&1
    echo "rc=$? $(date +%T)"
    grep -E "==PROF==|==ERROR==|==WARNING==|Error" "/tmp/ncu-$pol.log" | sed 's/[0-9]\+ - //' \
      | sort | uniq -c | head -12
    ncu --import "/tmp/dram-$pol.ncu-rep" --csv --page raw --print-units base \
      > "/tmp/dram-$pol.csv" 2> /dev/null
    python3 bench/gpu_decode_dram.py --join "/tmp/labels-$pol.json" "/tmp/dram-$pol.csv" \
      --out "$OUT/decode-dram-$card-$SESSION-$pol.json"
  done
  cp /tmp/dram-hint.csv "$OUT/decode-dram-$card-$SESSION-hint.csv" 2> /dev/null
} 2>&1 | tee "$OUT/$SESSION-dram.log"
