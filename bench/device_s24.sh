#!/usr/bin/env bash
# Session 24's device calls: the keys of record on whichever card is lent, in one command.
#   H200: the whole bench (decode and prefill) under the defaults, the decode table in the
#         fenced form (session 23's A/B on this card), both twice, in turn;
#   H100: the whole bench (STEP=1: twice, the kernels' GPU gates; later: once), and
#         `kdash demo` in tmux, the first screen taken 8 s after start (the kernel pane while the
#         workload still compiles) and again at 25 s.
# Files: $OUT/kernels-<card>-s24-*.json, gpu-gates-<card>-s24.xml, tmux-demo-*.txt, s24.log.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s24
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  if [[ $card == h200 ]]; then
    bench full-1
    bench fenced-1 --only decode --fenced-merge
    bench full-2
    bench fenced-2 --only decode --fenced-merge
  else
    bench full-${STEP:-1}
    if [[ ${STEP:-1} == 1 ]]; then
      bench full-2
      echo "== GPU gates: decode, plan, fused publish, prefill, L2 hint"
      timeout -k 5 240 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
        tests/test_kernels_plan.py tests/test_kernels_decode.py tests/test_kernels_prefill.py \
        tests/test_kernels_fused_publish.py tests/test_kernels_graph_launch.py \
        tests/test_kernels_l2_hint.py --junitxml "$OUT/gpu-gates-$card-s24.xml" > /tmp/gates.log 2>&1
      echo "rc=$? $(date +%T)"; grep -E "passed|failed|FAILED|Error" /tmp/gates.log | tail -8
    fi
    if command -v tmux > /dev/null; then
      for size in "200 50" "80 24"; do
        set -- $size
        f="$OUT/tmux-demo-$1x$2-s24.txt"
        tmux new -d -s d -x "$1" -y "$2" "python3 -m kdash.cli demo"
        sleep 8; tmux capture-pane -p -t d > "$f"; echo "---- 25 s" >> "$f"
        sleep 17; tmux capture-pane -p -t d >> "$f"
        tmux send-keys -t d '?'; sleep 1; tmux capture-pane -p -t d >> "$f"
        tmux send-keys -t d Escape q; sleep 3; tmux kill-server 2> /dev/null
      done
      echo "== demo captured $(date +%T)"
    fi
  fi
} 2>&1 | tee "$OUT/s24.log"
