#!/usr/bin/env bash
# On the H200 machine: the kernel pane's window view live, at the agent's default duty cycle.
# `kdash demo` (the live workload with the agent armed) in tmux at 120x40 and 200x50: after 70 s
# (the 60 s view full of recording windows) the pane is captured, then `1` (kernels maximised),
# `w` (continuous time, expected mostly "·"), `w` again, `+` `+` (zoomed in), `tab` and `←`
# (panned earlier). `kdash demo --headless` records a capture with the windows too, the first
# shipped capture for tests/test_window_view.py's shipped-capture test.
# Run: bash bench/device_window_view.sh   (with .whl carried; results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
bash bench/device_setup.sh || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
snap() { echo "== $2"; sleep "${3:-2}"; tmux capture-pane -p -t "$1"; }
command -v tmux >/dev/null || { echo "no tmux on this machine"; exit 1; }
for size in "120 40" "200 50"; do
  set -- $size
  f=$OUT/tmux-window-view-live-$1x$2.txt
  {
    tmux new -d -s kw -x "$1" -y "$2" "python3 -m kdash.cli demo"
    snap kw "kdash demo live at $1x$2 after 70 s: the window view (default below 1/5 recorded)" 70
    tmux send-keys -t kw 1; snap kw "1: kernels maximised"
    tmux send-keys -t kw w; snap kw "w: continuous time"
    tmux send-keys -t kw w; snap kw "w: the window view again"
    tmux send-keys -t kw + +; snap kw "+ +: the last 15 s"
    tmux send-keys -t kw Escape; sleep 1
    tmux send-keys -t kw Tab; sleep 0.5; tmux send-keys -t kw p Left Left; snap kw "tab, p (pause), ← ←: 7.5 s earlier"
    tmux send-keys -t kw q; sleep 5; tmux kill-session -t kw 2>/dev/null
  } > "$f" 2>&1
  echo "wrote $f"
done
timeout 150 python3 -m kdash.cli demo --headless --duration 20 --output "$OUT/demo-h200-duty.kdash"
echo "rc=$?"
python3 -m kdash.cli report "$OUT/demo-h200-duty.kdash" | head -40
