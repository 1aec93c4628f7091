#!/usr/bin/env bash
# Device-tool calls prepared in session 19 (which had no device) for the H200; the steps, by
# name, as arguments, each with its own timeout (at most 8 files come back from a call; these
# calls return 7, 5 and 5). Three calls of under 10 minutes each, on one warm machine:
#   bash bench/device_s19.sh gates fp8     (~7-9 min)
#   bash bench/device_s19.sh tma pcs probe (~6-8 min)
#   bash bench/device_s19.sh table demo    (~5-6 min)
#   gates  the plans' graph launch with a graph per layer, the plan's graph/host/capture tests,
#          the workload's GPU tests, and fp8_compute="kmma" (K's bytes to the fp8 tensor cores)
#          through the fp8-variant and decode gates (pytest -m gpu); a failure skips the rest;
#   fp8    bench/gpu_fp8_variants.py: the default cvt (V's addresses from K's row offsets, new)
#          against cvt_vstrides (as before), and kmma (two launches, fused, 128/3 and 64/3
#          stages) -> $OUT/fp8-variants-kmma.json;
#   pcs    kdash's own PC sampling on the fp8 stage 1, cvt and kmma, at 1 x 64k
#          (bench/gpu_fp8_pcs.py: hot lines in $OUT/fp8-pcs.json, captures fp8-*-pcs.kdash);
#   probe  bench/gpu_decode_graph_launch.py at 1 x 64k and 64 lognormal
#          -> $OUT/decode-graph-launch-h200.json;
#   tma    bench/gpu_decode_gluon.py, bf16 and fp8, ring depth 4, the plan's split count (the
#          Gluon stage 1 with its page indices read ahead, never timed before), with and without
#          the L2 evict-first hint on its copies (kernels/l2_hint.py), read-flushed figures too
#          -> $OUT/decode-gluon-h200.json;
#   demo   `kdash demo` in tmux at 200x50 and 80x24 (graph-replayed decode; the help on `?`)
#          -> $OUT/tmux-demo-*.txt;
#   table  the decode table under the defaults, each shape's default path
#          -> $OUT/kernels-h200-decode.json.
# Log: $OUT/s19.log. Before the call, rebuild the kdash wheel and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
steps=" $* "
log=$OUT/s19.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  if [[ $steps == *" gates "* ]]; then
    echo "== GPU gates: graph launch, plan (graph, capture, host), workload"
    timeout -k 5 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_kernels_graph_launch.py tests/test_kernels_plan.py tests/test_workload.py \
      --junitxml "$OUT/gpu-gates-s19.xml" > /tmp/gates.log 2>&1
    rc=$?; echo "rc=$rc"; grep -E "passed|failed|FAILED|Error" /tmp/gates.log | tail -12
    # the fp8 variants' and decode's gates run on the GPU wherever CUDA is (no gpu marker)
    timeout -k 5 150 python3 -m pytest -q -rs -p no:cacheprovider -k "kmma or e4m3 or q_split" \
      tests/test_kernels_fp8_variants.py tests/test_kernels_decode.py \
      --junitxml "$OUT/gpu-gates-kmma.xml" > /tmp/gates-kmma.log 2>&1
    echo "kmma gates rc=$?"; grep -E "passed|failed|FAILED|Error" /tmp/gates-kmma.log | tail -8
    if [[ $rc != 0 ]]; then echo "== the rest skipped: the gates failed"; exit 0; fi
  fi
  if [[ $steps == *" fp8 "* ]]; then
    echo "== fp8: kmma against cvt"
    (cd bench && PYTHONSAFEPATH= timeout -k 5 240 python3 gpu_fp8_variants.py --budget 190 \
      --only cvt,cvt_vstrides,kmma,kmma_fused,cvt_fused,kmma_3stages,kmma_64_3stages \
      --no-lognormal \
      --out "$OUT/fp8-variants-kmma.json" 2>&1 | grep -v Warning | tail -30)
  fi
  if [[ $steps == *" pcs "* ]]; then
    echo "== PC sampling: fp8 stage 1, cvt and kmma"
    (cd bench && PYTHONSAFEPATH= timeout -k 5 150 python3 gpu_fp8_pcs.py 2>&1 | cut -c1-1500)
  fi
  if [[ $steps == *" probe "* ]]; then
    echo "== run, run through the slot, replay, cuGraphLaunch"
    (cd bench && PYTHONSAFEPATH= timeout -k 5 120 python3 gpu_decode_graph_launch.py \
      --shapes 1x65536,64xlognormal --out "$OUT/decode-graph-launch-h200.json" 2>&1 |
      grep -v Warning | cut -c1-1200)
  fi
  if [[ $steps == *" tma "* ]]; then
    echo "== Gluon stage 1 (page indices read ahead) against the plan's kernels"
    (cd bench && PYTHONSAFEPATH= timeout -k 5 260 python3 gpu_decode_gluon.py --stages 4 \
      --factors 1 2>&1 | grep -v Warning | python3 decode_gluon_summary.py)
    echo "rc=$?"
  fi
  if [[ $steps == *" demo "* ]] && command -v tmux > /dev/null; then
    for size in "200 50" "80 24"; do
      set -- $size
      tmux new -d -s d -x "$1" -y "$2" "python3 -m kdash.cli demo"
      sleep 25; tmux capture-pane -p -t d > "$OUT/tmux-demo-$1x$2.txt"
      tmux send-keys -t d '?'; sleep 1; tmux capture-pane -p -t d >> "$OUT/tmux-demo-$1x$2.txt"
      tmux send-keys -t d Escape q; sleep 3; tmux kill-server 2> /dev/null
    done
    echo "== demo captured: $(wc -l "$OUT"/tmux-demo-*.txt | tail -1)"
  fi
  if [[ $steps == *" table "* ]]; then
    echo "== decode table, defaults"
    timeout -k 5 300 python3 -m kdash.kernels.bench --sweep none --only decode \
      --default-path-only --out "$OUT/kernels-h200-decode.json" > /tmp/bench.log 2>&1
    echo "rc=$?"; grep -E "summary|Error|error" /tmp/bench.log | cut -c1-300
  fi
} 2>&1 | tee "$log"
