#!/usr/bin/env bash
# Session 38, call 2. The first call's demo ran without the demangle wheel (the recorder
# stopped: "No module named 'demangle'"), so its panes showed no kernels. With it carried:
# on an H200 first session 36's plan (SECONDS_CAP=330), then on any card `kdash demo` (decode
# replayed from CUDA graphs, its default) in tmux at 80x24 and 200x50 (the layout after 25 s,
# 1 kernels maximised, ? help), and `kdash demo --headless` for 15 s with its report.
# Files: tmux-demo-WxH-<card>-s38-2.txt, s38-<card>-demo.log (+ session 36's on an H200).
set -uo pipefail
export SESSION=${SESSION:-s38}
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  SECONDS_CAP=${SECONDS_CAP:-330} bash bench/device_s36.sh
fi
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
snap() { echo "---- $2"; sleep "$3"; tmux capture-pane -p -t d; }
{
  echo "$name $(date +%T)"
  for size in "80 24" "200 50"; do
    set -- $size
    tmux new -d -s d -x "$1" -y "$2" "python3 -m kdash.cli demo"
    {
      snap d "kdash demo at $1x$2, 25 s in" 25
      tmux send-keys -t d 1; snap d "1: kernels maximised" 2
      tmux send-keys -t d Escape; sleep 1
      tmux send-keys -t d '?'; snap d "?: the help" 1
    } > "$OUT/tmux-demo-$1x$2-$card-$SESSION-2.txt" 2>&1
    tmux send-keys -t d Escape q; sleep 3; tmux kill-server 2> /dev/null
    grep -c "recorder stopped" "$OUT/tmux-demo-$1x$2-$card-$SESSION-2.txt"
  done
  echo "== demo captured $(date +%T)"
  echo "== kdash demo --headless (15 s), then its report"
  timeout -k 5 120 python3 -m kdash.cli demo --headless --duration 15 --output /tmp/demo-s38.kdash
  echo "rc=$? $(date +%T)"
  timeout -k 5 60 python3 -m kdash.cli report /tmp/demo-s38.kdash | head -60
} 2>&1 | tee "$OUT/$SESSION-$card-demo.log"
