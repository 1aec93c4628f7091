#!/usr/bin/env bash
# Nsight Compute on prefill at D=128 (GPU machine, one device call, ~2-3 min): our default
# Hopper kernel and SDPA's cuDNN kernel on the same data (bench/gpu_prefill_profile.py), each the
# only launch of its NVTX range; key sections; the details page as CSV into $OUT.
# Run: bash bench/device_prefill_ncu.sh   (carry .whl; results $OUT/ncu-prefill-*.csv)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
[ -d /tmp/site/kdash ] || bash bench/device_setup.sh > /dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
sections="--section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
  --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats"
for which in h2048 gqa; do
  for range in ours cudnn; do
    # shellcheck disable=SC2086 # the section list is meant to split
    timeout 120 ncu --clock-control none --nvtx --nvtx-include "$range/" --launch-count 3 \
      $sections -f -o "/tmp/ncu-$which-$range" python3 bench/gpu_prefill_profile.py "$which" \
      > "/tmp/ncu-$which-$range.log" 2>&1
    echo "$which $range rc=$? $(grep -c '==PROF==' /tmp/ncu-$which-$range.log) prof lines"
    ncu --import "/tmp/ncu-$which-$range.ncu-rep" --page details --csv \
      > "$OUT/ncu-prefill-$which-$range.csv" 2>/dev/null
    python3 -c "import csv,sys; rows=list(csv.DictReader(open(sys.argv[1]))); keep=('Duration','Compute (SM) Throughput','Memory Throughput','Registers Per Thread','Achieved Occupancy','Issue Slots Busy','No Eligible','Warp Cycles Per Issued Instruction'); [print(r['Kernel Name'][:40], '|', r['Metric Name'], r['Metric Value'], r['Metric Unit']) for r in rows if r['Metric Name'] in keep]" "$OUT/ncu-prefill-$which-$range.csv"
  done
done
