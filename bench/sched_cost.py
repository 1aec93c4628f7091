"""What the scheduler source costs: CPU time of `SchedSource.poll` at 4 Hz on a 200-thread target.

The target is a child Python process with 200 threads: most block on an Event (like the idle
workers of a server's thread pools), a few spin. The benchmark polls it at 4 Hz for `--seconds`
(default 20) and measures the collector's own CPU time with `time.process_time()` (user +
system: the kernel's work of generating the /proc text is charged to the reader, so it counts)
as a percentage of one core over the wall time of the run, sleeps included. The budget in
DESIGN/issue #2 is under 5% of one core.

A second, shorter run with descriptor keeping off (`fd_budget=0`: open/read/close per file)
shows what the kept descriptors buy.

    python bench/sched_cost.py [--seconds 20] [--threads 200] [--busy 3]

writes bench/results/sched-cost-cpu.json: {command, machine, figures}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kdash.collectors.sched import SchedSource

from kdash.target import Target

TARGET = r"""
import sys, threading, time
n, busy = int(sys.argv[1]), int(sys.argv[2])
stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        x += 1
for i in range(n - 1):  # the main thread is the n-th
    threading.Thread(target=spin if i < busy else stop.wait, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
stop.set()
"""


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def run(target: Target, seconds: float, hz: float, fd_budget: int | None) -> dict:
    """Poll at `hz` for `seconds`; the collector's CPU figures."""
    src = SchedSource(target, interval_s=1.0 / hz, fd_budget=fd_budget)
    c0 = time.process_time()
    w0 = time.monotonic()
    src.start()
    polls: list[float] = []
    poll_cpu: list[float] = []
    rows: list[int] = []
    period = 1.0 / hz
    next_t = w0
    while True:
        now = time.monotonic()
        if now - w0 >= seconds:
            break
        if now < next_t:
            time.sleep(next_t - now)
        next_t += period
        pc = time.process_time()
        pw = time.perf_counter()
        out = src.poll(time.monotonic_ns())
        polls.append((time.perf_counter() - pw) * 1e3)
        poll_cpu.append((time.process_time() - pc) * 1e3)
        rows.append(len(out["threads"]["tid"]))
    fds = src._fds_open
    src.stop()
    wall = time.monotonic() - w0
    cpu = time.process_time() - c0
    polls_sorted = sorted(polls)
    return {
        "seconds": round(wall, 2),
        "polls": len(polls),
        "poll_hz": round(len(polls) / wall, 2),
        "threads_per_poll_median": int(statistics.median(rows)),
        "collector_cpu_s": round(cpu, 4),
        "collector_cpu_pct_of_one_core": round(100.0 * cpu / wall, 3),
        "poll_cpu_ms_mean": round(statistics.fmean(poll_cpu), 3),
        "poll_wall_ms_p50": round(polls_sorted[len(polls) // 2], 3),
        "poll_wall_ms_p99": round(polls_sorted[min(len(polls) - 1, int(len(polls) * 0.99))], 3),
        "descriptors_kept": fds,
        "health": str(src.health),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--threads", type=int, default=200)
    ap.add_argument("--busy", type=int, default=3)
    ap.add_argument("--hz", type=float, default=4.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "sched-cost-cpu.json"))
    args = ap.parse_args()

    p = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(args.threads), str(args.busy)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        n_tasks = len(os.listdir(f"/proc/{p.pid}/task"))
        target = Target.from_pid(p.pid)
        kept = run(target, args.seconds, args.hz, fd_budget=None)
        plain = run(target, max(5.0, args.seconds / 2), args.hz, fd_budget=0)
    finally:
        if p.stdin:
            p.stdin.close()
        p.wait(timeout=10)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "machine": {
            "hostname": socket.gethostname(),
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "target": {"threads": n_tasks, "busy_threads": args.busy},
        "figures": {
            "budget_pct_of_one_core": 5.0,
            "kept_descriptors": kept,
            "open_read_close": plain,
        },
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
