#!/usr/bin/env bash
# One device-tool call for the attention kernels on the H200 machine (bench/device_setup.sh has
# run, or runs here when /tmp/site lacks kdash):
#   1. the kernel gates: pytest -m gpu on the decode, plan/run and prefill kernel tests;
#   2. the kernel bench -> $OUT/kernels-h200.json (decode sweep; summary keys pass/miss; every
#      decode shape timed with both launch paths, two launches and one fused: summary.by_path);
#   3. the demo workload with graph-replayed decode (--graph-decode), then 10 s eager
#      for comparison; each must finish and report decode tokens;
#   4. (NCU=1; the default NCU=0 skips) Nsight Compute on the fp8 and bf16 stage-1 decode
#      kernels at 8 x 16k tokens: one launch each, key sections only;
#   5. (when tmux is there) `kdash demo` at 200x50 for 25 s, its screen in $OUT.
# Worst case (every timeout hit) stays under the device tool's 10-minute limit; typical ~6 min.
# Run: bash bench/device_kernels.sh   (results under $OUT; the log is $OUT/kernels.log)
#
# DECODE_ONLY=1 bash bench/device_kernels.sh: only what decides the decode launch path, worst
# case ~8 min, typical ~5: the decode and plan/run GPU gates (both paths), the decode table of
# the bench for both paths without the sweep (--sweep none --only decode ->
# $OUT/kernels-h200-decode.json), and bench/gpu_decode_host.py's host-time profile.
#
# DEFAULTS=1 bash bench/device_kernels.sh: the defaults as they are, worst case ~9.5 min, typical
# ~5: every kernel GPU gate (decode and plan/run on both paths, the fp8 conversion kernel, prefill
# default/pointer/variants; each gate's path in $OUT/gates.xml), then the whole bench table at
# the defaults, no sweep (--sweep none -> $OUT/kernels-h200.json: decode both paths, prefill).
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
[ -d /tmp/site/kdash ] || bash bench/device_setup.sh || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
log=$OUT/kernels.log
if [ "${DEFAULTS:-0}" = 1 ]; then
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "== kernel gates at the defaults (pytest -m gpu)"
    timeout 300 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_decode.py \
      tests/test_kernels_plan.py tests/test_kernels_fp8_variants.py tests/test_kernels_prefill.py \
      --junitxml="$OUT/gates.xml" > "$OUT/gates.log" 2>&1
    echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gates.log" | tail -12
    echo "== bench at the defaults (no sweep), decode both paths and prefill"
    timeout 260 python3 -m kdash.kernels.bench --sweep none --out "$OUT/kernels-h200.json" \
      > "$OUT/bench.log" 2>&1
    echo "rc=$?"; grep -E "^(summary|configs|wrote)" "$OUT/bench.log" | cut -c1-400
  } 2>&1 | tee "$log"
  exit 0
fi
if [ "${DECODE_ONLY:-0}" = 1 ]; then
  {
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
    python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    echo "== decode gates, both launch paths (pytest -m gpu)"
    timeout 270 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_decode.py \
      tests/test_kernels_plan.py > "$OUT/gates.log" 2>&1
    echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/gates.log" | tail -12
    echo "== bench, decode table only, both paths"
    timeout 180 python3 -m kdash.kernels.bench --sweep none --only decode \
      --out "$OUT/kernels-h200-decode.json" > "$OUT/bench.log" 2>&1
    echo "rc=$?"; grep -E "^(decode|summary|configs|wrote)" "$OUT/bench.log" | cut -c1-300
    echo "== host time of DecodePlan.run (two-launch default path), cProfile"
    timeout 120 python3 bench/gpu_decode_host.py > "$OUT/decode-host.log" 2>&1
    echo "rc=$?"; python3 -c "import json,os; d=json.load(open(os.environ['OUT']+'/decode-host-h200.json')); print('empty', d['empty_launch']); print('parts', d['parts_1x64k']); [print(k, {x: v[x] for x in v if x != 'profile'}) for k, v in d['cases'].items()]"
  } 2>&1 | tee "$log"
  exit 0
fi
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

  echo "== gates (pytest -m gpu)"
  timeout 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_decode.py \
    tests/test_kernels_plan.py tests/test_kernels_prefill.py tests/test_workload.py \
    > "$OUT/gates.log" 2>&1
  echo "rc=$?"; tail -6 "$OUT/gates.log"

  echo "== bench"
  timeout 230 python3 -m kdash.kernels.bench --sweep decode --out "$OUT/kernels-h200.json" \
    > "$OUT/bench.log" 2>&1
  echo "rc=$?"; grep -E "^(decode|summary|configs|wrote)" "$OUT/bench.log" | cut -c1-260

  echo "== demo workload, graph-replayed decode (20 s)"
  timeout 60 python3 -m kdash.kernels --duration 20 --report-every 4 --graph-decode \
    > "$OUT/demo-graphs.log" 2>&1
  echo "rc=$?"; cat "$OUT/demo-graphs.log"
  if tail -1 "$OUT/demo-graphs.log" | grep -q "decode graphs captured for batch sizes \[[0-9]"; then
    echo "graph demo: OK"
  else
    echo "graph demo: FAILED (no graphs captured or no final line)"
  fi
  echo "== demo workload, --eager-decode (10 s)"
  timeout 35 python3 -m kdash.kernels --duration 10 --report-every 5 --eager-decode \
    > "$OUT/demo-eager.log" 2>&1
  echo "rc=$?"; tail -3 "$OUT/demo-eager.log"

  if [ "${NCU:-0}" = 1 ] && command -v ncu > /dev/null; then
    echo "== ncu: stage-1 decode kernels, fp8 and bf16, 32/8/128 at 8 x 16k"
    cat > /tmp/kdash_decode_prof.py <<'EOF'
import sys
import torch
from kdash.kernels import bench
from kdash.kernels.decode_attention import default_config
fp8 = sys.argv[1] == "fp8"
case = bench.DecodeCase([16384] * 8, 32, 8, 128, fp8)
fn, splits = case.fn(default_config(case.k.dtype))
for _ in range(4):
    fn()
torch.cuda.synchronize()
print("splits", splits)
EOF
    sections="--section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats \
      --section ComputeWorkloadAnalysis"
    for kind in fp8 bf16; do
      if [ $kind = fp8 ]; then k="regex:^_decode_(stage1_fp8_cvt|stage1_fp8_pairs|fused)$"; else k="regex:^_decode_(stage1|fused)$"; fi
      # shellcheck disable=SC2086 # the section list is meant to split
      timeout 60 ncu --clock-control none --kernel-name "$k" --launch-skip 2 --launch-count 1 \
        $sections -f -o "$OUT/ncu-decode-$kind" python3 /tmp/kdash_decode_prof.py $kind \
        > "$OUT/ncu-decode-$kind.log" 2>&1
      echo "ncu $kind rc=$?"
      ncu --import "$OUT/ncu-decode-$kind.ncu-rep" --page details > "$OUT/ncu-decode-$kind.txt" 2>&1
      grep -E "Duration|Memory Throughput|DRAM Throughput|Compute \(SM\) Throughput|Achieved Occupancy|Registers Per|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Stall|L2 Hit|L1/TEX Hit" \
        "$OUT/ncu-decode-$kind.txt" | head -40
    done
  else
    echo "== ncu skipped (NCU=${NCU:-0}, ncu: $(command -v ncu || echo absent))"
  fi

  if command -v tmux > /dev/null; then
    echo "== kdash demo in tmux at 200x50 (graph-replayed decode)"
    tmux new -d -s kd -x 200 -y 50 "python3 -m kdash.cli demo"
    sleep 25; tmux capture-pane -p -t kd > "$OUT/tmux-demo-graphs-200x50.txt"
    tmux send-keys -t kd q; sleep 3; tmux kill-session -t kd 2> /dev/null
    head -12 "$OUT/tmux-demo-graphs-200x50.txt"
  else
    echo "no tmux on this machine"
  fi
} 2>&1 | tee "$log"
