#!/usr/bin/env bash
# The device-tool calls that decide what sessions 19 and 20 built without a device, for the
# H200; the steps, by name, as arguments, each with its own timeout (at most 8 files come back
# from a call). In order of what they can move (bench/NOTES-kernels.md, sessions 19 and 20):
#   bash bench/device_decode_next.sh gates evict        (~9 min)
#   bash bench/device_decode_next.sh fp8 tma            (~9 min)
#   bash bench/device_decode_next.sh table table-plain  (~3 min; demo, pcs, probe if time is left)
#   bash bench/device_decode_next.sh table table-fenced publish table  (~7 min: session 23's A/B)
#   gates  the plans' graph launch with a graph per layer, the plan's graph/host/capture tests,
#          the workload's GPU tests, and fp8_compute="kmma" (K's bytes to the fp8 tensor cores)
#          through the fp8-variant and decode gates (pytest -m gpu); a failure skips the rest;
#   evict  the L2 evict-first hint on the Triton kernels' cp.async (kernels/l2_hint.py), for
#          each ptxas in EVICT_PTXAS (default "128 134"): 128 is Triton's own (12.8 on the H200;
#          the rewrite makes the shared base opaque there, as ptxas before 13.4 misencodes the
#          other form: session 13's fault), 134 is ptxas 13.4.59 carried as
#          .whl/ptxas-13.4.59.xz (from NVIDIA's nvidia-cuda-nvcc 13.4.59 wheel,
#          nvidia/cu13/bin/ptxas, xz -9), unpacked to /tmp/ptxas134; the hinted plans' GPU
#          gates, then bench/gpu_decode_evict.py (hint off and on in one process;
#          EVICT_SHAPES="1x65536" times fewer shapes) -> $OUT/gpu-gates-evict-ptxas<v>.xml,
#          evict-ptxas<v>.json;
#   fp8    bench/gpu_fp8_variants.py: the default cvt (V's addresses from K's row offsets)
#          against cvt_vstrides (as before), and kmma (two launches, fused, 128/3 and 64/3
#          stages) -> $OUT/fp8-variants-kmma.json;
#   tma    bench/gpu_decode_gluon.py, bf16 and fp8, ring depth 4, the plan's split count (the
#          Gluon stage 1 with its page indices read ahead, never timed before), with and without
#          the L2 evict-first hint on its copies, read-flushed figures too
#          -> $OUT/decode-gluon-h200.json;
#   splits bench/gpu_decode_splits.py: the default plan at 1 x 64k against forced split counts
#          below its own (the fused grid's merge programs counted in the wave) and the
#          two-launch path -> $OUT/decode-splits.json;
#   table  the decode table under the defaults, each shape's default path
#          -> $OUT/kernels-h200-decode.json;
#   table-cap3  the same with --max-resident 3 (at most 3 stage-1 programs an SM)
#          -> $OUT/kernels-h200-decode-cap3.json;
#   table-plain  the same with --no-evict-first (the defaults ask for the L2 hint on both
#          dtypes' copies since session 21; this is the baseline without it)
#          -> $OUT/kernels-h200-decode-plain.json;
#   table-fenced  the same with --fenced-merge (one-launch plans publish and poll with fences,
#          the form before session 23) -> $OUT/kernels-h200-decode-fenced.json;
#   publish  bench/gpu_decode_publish.py: the one-launch decode's publish and poll four ways,
#          gates, 200 replays, timing -> $OUT/decode-publish.json;
#   pcs    kdash's own PC sampling on the fp8 stage 1, cvt and kmma, at 1 x 64k
#          (bench/gpu_fp8_pcs.py: hot lines in $OUT/fp8-pcs.json, captures fp8-*-pcs.kdash);
#   probe  bench/gpu_decode_graph_launch.py at 1 x 64k and 64 lognormal
#          -> $OUT/decode-graph-launch-h200.json;
#   demo   `kdash demo` in tmux at 200x50 and 80x24 (graph-replayed decode; the help on `?`)
#          -> $OUT/tmux-demo-*.txt.
# Log: $OUT/decode-next.log. Before the call, rebuild the kdash wheel and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
steps=" $* "
log=$OUT/decode-next.log
ptxas134() {  # the carried ptxas 13.4.59, unpacked once; prints its path
  if [[ ! -x /tmp/ptxas134 ]]; then
    python3 -c "import lzma, shutil, sys
shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      .whl/ptxas-13.4.59.xz /tmp/ptxas134 && chmod +x /tmp/ptxas134
  fi
  echo /tmp/ptxas134
}
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
  if [[ $steps == *" evict "* ]]; then
    for v in ${EVICT_PTXAS:-128 134}; do  # 128: Triton's own ptxas (the shared base made opaque)
      unset TRITON_PTXAS_PATH
      if [[ $v == 134 ]]; then export TRITON_PTXAS_PATH=$(ptxas134); fi
      echo "== hinted plans' GPU gates, ptxas $v"
      timeout -k 5 200 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
        tests/test_kernels_l2_hint.py --junitxml "$OUT/gpu-gates-evict-ptxas$v.xml" \
        > /tmp/gates-evict.log 2>&1
      rc=$?; echo "rc=$rc"; grep -E "passed|failed|FAILED|Error|SKIP" /tmp/gates-evict.log | tail -10
      if [[ $rc != 0 ]]; then
        echo "== evict timings skipped: the gates failed"
      else
        echo "== evict-first against none, ptxas $v"
        (cd bench && PYTHONSAFEPATH= timeout -k 5 200 python3 gpu_decode_evict.py \
          --shapes "${EVICT_SHAPES:-1x65536,1x131072,8x16384}" \
          --out "$OUT/evict-ptxas$v.json" 2>&1 | grep -v Warning | cut -c1-400)
      fi
    done
    unset TRITON_PTXAS_PATH
  fi
  if [[ $steps == *" splits "* ]]; then
    echo "== split counts and paths at 1 x 64k"
    (cd bench && PYTHONSAFEPATH= timeout -k 5 240 python3 gpu_decode_splits.py \
      --kv bf16 ${SPLITS_ARGS:---splits 48,49 --configs cap3,cap3_two,cap2} \
      --out "$OUT/decode-splits.json" 2>&1 | grep -v Warning | cut -c1-330)
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
  if [[ $steps == *" table-cap3 "* ]]; then
    echo "== decode table, the defaults at most 3 programs an SM"
    timeout -k 5 300 python3 -m kdash.kernels.bench --sweep none --only decode \
      --default-path-only --max-resident 3 \
      --out "$OUT/kernels-h200-decode-cap3.json" > /tmp/bench-cap3.log 2>&1
    echo "rc=$?"; grep -E "summary|Error|error" /tmp/bench-cap3.log | cut -c1-300
  fi
  if [[ $steps == *" table-plain "* ]]; then
    echo "== decode table, the defaults without the L2 hint"
    timeout -k 5 300 python3 -m kdash.kernels.bench --sweep none \
      --only decode --default-path-only --no-evict-first \
      --out "$OUT/kernels-h200-decode-plain.json" > /tmp/bench-plain.log 2>&1
    echo "rc=$?"; grep -E "summary|Error|error" /tmp/bench-plain.log | cut -c1-300
  fi
  if [[ $steps == *" table-fenced "* ]]; then
    echo "== decode table, one-launch plans in the fenced form"
    timeout -k 5 300 python3 -m kdash.kernels.bench --sweep none \
      --only decode --default-path-only --fenced-merge \
      --out "$OUT/kernels-h200-decode-fenced.json" > /tmp/bench-fenced.log 2>&1
    echo "rc=$?"; grep -E "summary|Error|error" /tmp/bench-fenced.log | cut -c1-300
  fi
  if [[ $steps == *" publish "* ]]; then
    echo "== the one-launch decode's publish and poll, four ways"
    timeout -k 5 420 python3 bench/gpu_decode_publish.py > /tmp/publish.log 2>&1
    echo "rc=$?"; grep -v '"pass": true' /tmp/publish.log | cut -c1-400
  fi
} 2>&1 | tee "$log"
