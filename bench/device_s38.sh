#!/usr/bin/env bash
# Session 38. On an H200: session 36's plan (bench/device_s36.sh, SECONDS_CAP=330). On another
# card, #17's evidence at today's defaults from one machine in one call (~8 min): the decode GPU
# gates and the prefill GPU tests, up to three whole benches, then `kdash demo` (decode replayed
# from CUDA graphs, its default) in tmux at 80x24 and 200x50.
# Files: gpu-gates-{decode,prefill}-<card>-s38*.xml, kernels-<card>-s38-full-N.json,
# tmux-demo-WxH-<card>-s38.txt, s38-<card>-call.log (eight at most come back).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
export SESSION=${SESSION:-s38}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  SECONDS_CAP=${SECONDS_CAP:-330} exec bash bench/device_s36.sh
fi
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.max.sm,clocks.max.mem,power.limit --format=csv
  gates all
  echo "== GPU tests: prefill"
  timeout -k 5 150 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels_prefill*.py \
    --junitxml "$OUT/gpu-gates-prefill-$card-$SESSION.xml" > /tmp/prefill.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "passed|failed|FAILED|Error" /tmp/prefill.log | tail -5
  for n in 1 2 3; do
    if ((SECONDS < 400)); then bench "full-$n"
    else echo "== no time left for whole bench $n ($SECONDS s)"; fi
  done
  if command -v tmux > /dev/null && ((SECONDS < 500)); then
    for size in "80 24" "200 50"; do
      set -- $size
      f="$OUT/tmux-demo-$1x$2-$card-$SESSION.txt"
      tmux new -d -s d -x "$1" -y "$2" "python3 -m kdash.cli demo"
      sleep 25; tmux capture-pane -p -t d > "$f"
      tmux send-keys -t d '?'; sleep 1; echo "---- ? (help)" >> "$f"
      tmux capture-pane -p -t d >> "$f"
      tmux send-keys -t d Escape q; sleep 3; tmux kill-server 2> /dev/null
    done
    echo "== demo captured $(date +%T)"
  fi
} 2>&1 | tee "$OUT/$SESSION-$card-call.log"
