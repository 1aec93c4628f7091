#!/usr/bin/env bash
# Session 29's device calls. Each part on or off by its variable:
#   BENCH=1 (default): on an H200 only, the whole bench first (the table of record);
#   AB=1: the Gluon prefill gated at full size and timed in turns against the module before
#     (prefill_gluon_s28.py, an untracked copy at the checkout's root:
#     `git show 7118a46:kernels/prefill_gluon.py > prefill_gluon_s28.py`) and SDPA;
#   TESTS=1: the prefill GPU tests;
#   PROBE=1 (default): bench/gpu_prefill_probe.py, ours and cuDNN at 16/16/128 non-causal
#     S = 2k-16k, flushed and back to back, with the SM clock and power (PROBE_ARGS=--energy:
#     also joules a call);
#   NCU=1 (default): Nsight Compute on both kernels at S = 4k and 16k (speed of light, launch,
#     warp states; ours at 4k also its source counters, stall samples per SASS instruction);
#   BENCHES=N: the whole bench N more times on any card.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=${SESSION:-s29}
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  [[ $card == h200 && ${BENCH:-1} == 1 ]] && bench full-1
  if [[ ${AB:-0} == 1 ]]; then
    # shellcheck disable=SC2086 # AB_ARGS is meant to split
    timeout -k 5 "${ALIMIT:-200}" python3 bench/gpu_prefill_gluon.py --dims 128 \
      ${AB_ARGS:---against prefill_gluon_s28.py} --seqs 4096,8192,16384 --budget-s 180 \
      --out "$OUT/prefill-ab-$card-$SESSION-${CALLN:-1}.json" 2>&1 | grep -v Warning \
      | grep -E '"gate"|rounds|summary|Error' | python3 bench/prefill_ab_lines.py
    echo "ab rc=$? $(date +%T)"
  fi
  [[ ${TESTS:-0} == 1 ]] && timeout -k 5 "${TLIMIT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kernels_prefill.py tests/test_kernels_prefill_gluon.py \
    --junitxml "$OUT/gpu-gates-prefill-$card-$SESSION-${CALLN:-1}.xml" 2>&1 | tail -3
  # shellcheck disable=SC2086 # PROBE_ARGS is meant to split
  [[ ${PROBE:-1} == 1 ]] && timeout -k 5 "${PLIMIT:-240}" python3 bench/gpu_prefill_probe.py ${PROBE_ARGS:-} \
    --out "$OUT/prefill-probe-$card-$SESSION-${CALLN:-1}.json" 2>&1 | grep -v Warning | python3 -c 'import sys, json
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()[:300]); continue
    print(r["seq"], "b%d" % r["batch"], "ours", r["ours_us"], r["ours_us_per_key_tile"], r["ours_TFLOPs"],
          "cudnn", r["cudnn_us"], r["cudnn_us_per_key_tile"], r["cudnn_TFLOPs"], "ratio", r["ratio_flush"],
          "b2b", r["ratio_b2b"], "mhz", r["rounds"]["ours"]["mhz"], r["rounds"]["cudnn"]["mhz"],
          "W", r["rounds"]["ours"]["watts"], r["rounds"]["cudnn"]["watts"])
    print("   cudnn kernels:", [k[:110] for k in r["cudnn_kernels"]])
    if "energy" in r:
        print("   J/call ours", r["ours_j_per_call"], "cudnn", r["cudnn_j_per_call"], "windows",
              {k: [(w["j_per_call"], w["us_per_call"], w["watts"], w["mhz"]) for w in v] for k, v in r["energy"].items()})'
  echo "probe rc=$? $(date +%T)"
  for n in $(seq 1 "${BENCHES:-0}"); do bench "full-${CALLN:-1}-$n"; done
  if [[ ${NCU:-1} == 1 ]]; then
    base="--section SpeedOfLight --section LaunchStats --section WarpStateStats"
    for seq in ${NCU_SEQS:-4096 16384}; do
      for kern in _prefill_ws_kernel cudnn; do
        extra=""
        [[ $seq == 4096 ]] && extra="--section MemoryWorkloadAnalysis_Tables"
        [[ $seq == 4096 && $kern == _prefill_ws_kernel ]] && extra="$extra --section SourceCounters --section InstructionStats"
        rep="/tmp/ncu-$seq-$kern"
        # shellcheck disable=SC2086 # the section lists are meant to split
        timeout 120 ncu --clock-control none -k "regex:$kern" --launch-skip 3 --launch-count 1 \
          $base $extra -f -o "$rep" python3 bench/gpu_prefill_profile.py h2048 "$seq" > "$rep.log" 2>&1
        echo "ncu $seq $kern rc=$? $(date +%T)"
        ncu --import "$rep.ncu-rep" --page details --csv > "$rep-details.csv" 2> /dev/null
        ncu --import "$rep.ncu-rep" --page raw --csv > "$rep-raw.csv" 2> /dev/null
        python3 -c "import csv, sys
keep = ('Duration', 'SM Frequency', 'Elapsed Cycles', 'SM Active Cycles', 'Compute (SM) Throughput',
        'L2 Cache Throughput', 'Grid Size', 'Block Size', 'Registers Per Thread',
        'Dynamic Shared Memory Per Block', 'Warp Cycles Per Issued Instruction', 'Issued Instructions')
for r in csv.DictReader(open(sys.argv[1])):
    if r['Metric Name'] in keep:
        print('  ', r['Kernel Name'][:60], '|', r['Metric Name'], r['Metric Value'], r['Metric Unit'])
rows = list(csv.reader(open(sys.argv[2])))
stalls = []
for n, v in zip(rows[0], rows[-1]):
    if 'issue_stalled' in n and 'not_issued' not in n and n.endswith('.ratio'):
        try:
            stalls.append((float(v.replace(',', '')), n.split('issue_stalled_')[1]))
        except ValueError:
            continue
print('   stalls', [(s, round(v, 2)) for v, s in sorted(stalls, reverse=True)[:8]])
" "$rep-details.csv" "$rep-raw.csv"
      done
    done
    rep=/tmp/ncu-4096-_prefill_ws_kernel
    ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep-source.csv" 2> "$rep-source.err" \
      || ncu --import "$rep.ncu-rep" --page source --csv > "$rep-source.csv" 2>> "$rep-source.err"
    echo "source page: $(wc -l < "$rep-source.csv") lines; $(head -c 300 "$rep-source.err")"
    tar czf "$OUT/ncu-prefill-$SESSION-${CALLN:-1}.tgz" -C /tmp $(cd /tmp && ls ncu-*-details.csv ncu-*-raw.csv ncu-*-source.csv ncu-*.log)
  fi
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
