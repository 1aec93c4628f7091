#!/usr/bin/env bash
# Nsight Compute on decode's stage 1 at 1 x 64k bf16 (GPU machine, one device call, ~3 min):
# the Triton kernel, the Gluon TMA kernel and the copy-only TMA reader on the same cache
# (bench/gpu_decode_tma_profile.py), the 4th launch of each; key sections; the details page as
# CSV into $OUT, and the lines that say where each kernel waits.
# Run: HEADS=32/8 bash bench/device_decode_tma_ncu.sh   (carry .whl; $OUT/ncu-decode-*.csv)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
[ -d /tmp/site/kdash ] || bash bench/device_setup.sh > /dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
heads=${HEADS:-32/8}
sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
  --section SchedulerStats --section Occupancy --section LaunchStats"
for kernel in _decode_stage1 _decode_stage1_gluon _stream; do
  # shellcheck disable=SC2086 # the section list is meant to split
  timeout 150 ncu --clock-control none -k "regex:^${kernel}\$" --launch-skip 3 --launch-count 1 \
    $sections -f -o "/tmp/ncu-$kernel" python3 bench/gpu_decode_tma_profile.py "$heads" \
    > "/tmp/ncu-$kernel.log" 2>&1
  echo "$kernel rc=$? $(grep -c '==PROF==' "/tmp/ncu-$kernel.log") prof lines"
  ncu --import "/tmp/ncu-$kernel.ncu-rep" --page details --csv \
    > "$OUT/ncu-decode-$kernel.csv" 2> /dev/null
  python3 -c "import csv, sys
keep = ('Duration', 'DRAM Throughput', 'Memory Throughput', 'Registers Per Thread',
        'Achieved Occupancy', 'Issue Slots Busy', 'No Eligible',
        'Warp Cycles Per Issued Instruction', 'Shared Memory Configuration Size')
for r in csv.DictReader(open(sys.argv[1])):
    if r['Metric Name'] in keep:
        print(r['Kernel Name'][:28], '|', r['Metric Name'], r['Metric Value'], r['Metric Unit'])
" "$OUT/ncu-decode-$kernel.csv"
  # The raw page holds the stall reasons behind WarpStateStats' chart: the largest eight.
  ncu --import "/tmp/ncu-$kernel.ncu-rep" --page raw --csv > "/tmp/ncu-raw-$kernel.csv" 2> /dev/null
  python3 -c "import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
head, val = rows[0], rows[-1]
stalls = []
for name, v in zip(head, val):
    if 'issue_stalled' in name and 'not_issued' not in name and name.endswith(('.ratio', '.pct')):
        try:
            stalls.append((float(v.replace(',', '')), name))
        except ValueError:
            continue
for v, name in sorted(stalls, reverse=True)[:8]:
    print(sys.argv[2], '| stall', name.split('issue_stalled_')[1], round(v, 2))
" "/tmp/ncu-raw-$kernel.csv" "$kernel"
done
tar czf "$OUT/ncu-decode-raw.tgz" -C /tmp ncu-raw-_decode_stage1.csv ncu-raw-_decode_stage1_gluon.csv \
  ncu-raw-_stream.csv 2> /dev/null
