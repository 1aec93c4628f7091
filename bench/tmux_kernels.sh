#!/usr/bin/env bash
# The kernel pane walked through in tmux as a user would: the demo's table (columns fitted,
# ←/→ sideways once the table has focus), the help, and the window view on a duty-cycled
# capture. That capture is MADE UP from the real demo (bench/duty_demo_capture.py: 100 ms
# windows every 3 s, only the rows inside them kept), because no shipped capture has the
# agent's "activity on" windows yet.
# Run: bash bench/tmux_kernels.sh [OUTDIR]   (writes tmux-s5-kernels-WxH.txt for 80x24, 120x40, 200x50)
set -uo pipefail
out=${1:-bench/results}
kdash=${KDASH:-.venv/bin/kdash}
py=${PYTHON:-.venv/bin/python}
duty=$(mktemp -d)/duty.kdash
"$py" bench/duty_demo_capture.py "$duty" 3 100 >/dev/null || exit 1
snap() { echo "== $2"; sleep "${3:-1.5}"; tmux capture-pane -p -t "$1"; }
for size in "80 24" "120 40" "200 50"; do
  set -- $size
  f=$out/tmux-s5-kernels-$1x$2.txt
  {
    tmux new -d -s ks -x "$1" -y "$2" "$kdash demo"
    snap ks "kdash demo at $1x$2: the layout" 9
    tmux send-keys -t ks 1; snap ks "1: kernels maximised (the table has focus)"
    tmux send-keys -t ks Escape; snap ks "esc: the layout, the table keeps focus"
    sleep 0.5
    tmux send-keys -t ks Right Right; snap ks "→ →: the table two columns sideways (the time window stays)"
    tmux send-keys -t ks '?'; snap ks "?: the help"
    tmux send-keys -t ks Escape; sleep 1; tmux send-keys -t ks q; sleep 2; tmux kill-session -t ks 2>/dev/null
    tmux new -d -s ks -x "$1" -y "$2" "$kdash open $duty"
    snap ks "kdash open duty.kdash (MADE-UP 100 ms windows every 3 s over the demo): window view by default" 9
    tmux send-keys -t ks 1; snap ks "1: kernels maximised, the window view"
    tmux send-keys -t ks w; snap ks "w: continuous time, mostly not recorded"
    tmux send-keys -t ks w + +; snap ks "w + +: the window view again, zoomed to the last 5 s"
    tmux send-keys -t ks Escape; sleep 1  # a key right after esc would read as alt+key
    tmux send-keys -t ks Tab; sleep 0.5; tmux send-keys -t ks Left Left Left Left; snap ks "tab, ← ×4 (another pane has focus): panned 5 s earlier"
    tmux send-keys -t ks q; sleep 2; tmux kill-session -t ks 2>/dev/null
  } > "$f" 2>&1
  echo "wrote $f"
done
