#!/usr/bin/env bash
# Session 30's device calls: the split tail's A/B call by call (bench/gpu_prefill_tail_ab.py),
# NCU=1: Nsight Compute on a split call's two kernels (NCU_SEQ, default 4096); then BENCHES=N whole benches (on any card; BENCH=1, the default, runs one first on an H200).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s30
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  [[ $card == h200 && ${BENCH:-1} == 1 ]] && bench "full-${CALLN:-1}-0"
  if [[ ${TAIL_AB:-1} == 1 ]]; then
    timeout -k 5 "${ALIMIT:-200}" python3 bench/gpu_prefill_tail_ab.py --iters "${ITERS:-40}" \
      --out "$OUT/prefill-tail-ab-$card-$SESSION-${CALLN:-1}.json" 2>&1 | grep -v Warning \
      | python3 -c 'import sys, json
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()[:300]); continue
    m = {k: round(r[k]["median"], 1) for k in ("split", "whole", "cudnn")}
    print(r["heads"], r["seq"], "x%d" % r["batch"], m, "whole/split %.3f cudnn/split %.3f cudnn/whole %.3f"
          % (r["whole_over_split"], r["cudnn_over_split"], r["cudnn_over_whole"]), r.get("kernels"))'
    echo "tail ab rc=$? $(date +%T)"
  fi
  if [[ ${NCU:-0} == 1 ]]; then
    # Nsight Compute on both launches of a split call at S = ${NCU_SEQ:-4096}: their length, clocks,
    # warp states and, for the tail kernel, stall samples per SASS instruction.
    base="--section SpeedOfLight --section LaunchStats --section WarpStateStats"
    for kern in _prefill_ws_kernel _prefill_tail_kernel; do
      extra=""
      [[ $kern == _prefill_tail_kernel ]] && extra="--section SourceCounters --section InstructionStats"
      rep="/tmp/ncu-${NCU_SEQ:-4096}-$kern"
      # shellcheck disable=SC2086 # the section lists are meant to split
      timeout 120 ncu --clock-control none -k "regex:$kern" --launch-skip 3 --launch-count 1 \
        $base $extra -f -o "$rep" python3 bench/gpu_prefill_profile.py h2048 "${NCU_SEQ:-4096}" > "$rep.log" 2>&1
      echo "ncu $kern rc=$? $(date +%T)"
      ncu --import "$rep.ncu-rep" --page details --csv > "$rep-details.csv" 2> /dev/null
      ncu --import "$rep.ncu-rep" --page raw --csv > "$rep-raw.csv" 2> /dev/null
      python3 -c "import csv, sys
keep = ('Duration', 'SM Frequency', 'Elapsed Cycles', 'SM Active Cycles', 'Compute (SM) Throughput',
        'L2 Cache Throughput', 'Grid Size', 'Registers Per Thread', 'Warp Cycles Per Issued Instruction',
        'Issued Instructions')
for r in csv.DictReader(open(sys.argv[1])):
    if r['Metric Name'] in keep:
        print('  ', r['Kernel Name'][:30], '|', r['Metric Name'], r['Metric Value'], r['Metric Unit'])
" "$rep-details.csv"
    done
    rep=/tmp/ncu-${NCU_SEQ:-4096}-_prefill_tail_kernel
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-source.csv" 2> /dev/null
    echo "source page: $(wc -l < "$rep-source.csv") lines"
    tar czf "$OUT/ncu-tail-$SESSION-${CALLN:-1}.tgz" -C /tmp $(cd /tmp && ls ncu-*-details.csv ncu-*-raw.csv ncu-*-source.csv ncu-*.log)
  fi
  for n in $(seq 1 "${BENCHES:-0}"); do bench "full-${CALLN:-1}-$n"; done
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
