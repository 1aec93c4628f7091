#!/usr/bin/env bash
# One device-tool call for the agent, the demo and the Kineto traces, on the H200 machine:
#   the agent check (bench/gpu_agent_check.py), the demo workload alone, `kdash demo --headless`
#   (the capture shipped as kdash/data/demo-h200.kdash), Kineto traces with SGLang's naming,
#   and `kdash demo` in tmux at 80x24 and 200x50 when tmux is there.
# Run: bash bench/device_demo.sh   (with .whl carried; results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
bash bench/device_setup.sh || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
log=$OUT/demo.log
{
  echo "== workload alone (8 s)"; timeout 120 python3 -m kdash.kernels --duration 8 --report-every 2; echo "rc=$?"
  echo "== agent check"; timeout 200 python3 bench/gpu_agent_check.py; echo "rc=$?"
  echo "== kdash demo --headless"
  timeout 150 python3 -m kdash.cli demo --headless --duration 20 --output $OUT/demo-h200.kdash; echo "rc=$?"
  ls -la $OUT/demo-h200.kdash && python3 -m kdash.cli report $OUT/demo-h200.kdash
  echo "== kineto"; timeout 120 python3 bench/gpu_kineto_record.py --out $OUT; echo "rc=$?"
  if command -v tmux >/dev/null; then
    for size in "80 24" "200 50"; do
      set -- $size
      tmux new -d -s d -x $1 -y $2 "python3 -m kdash.cli demo"
      sleep 25; tmux capture-pane -p -t d > $OUT/tmux-demo-$1x$2.txt
      tmux send-keys -t d '?'; sleep 1; tmux capture-pane -p -t d >> $OUT/tmux-demo-$1x$2.txt
      tmux send-keys -t d Escape q; sleep 3; tmux kill-server 2>/dev/null
    done
  else
    echo "no tmux on this machine"
  fi
} 2>&1 | tee $log
