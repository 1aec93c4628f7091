"""kdash's own CPU while attached at defaults: `kdash attach --pid` in tmux and headless.

The target is a child Python process with `--busy` threads (default 3) that spin, like a
server's busy workers. kdash is started against it with its defaults (4 Hz host polls, the
agent source, which on a machine without a GPU injects an agent that then reports "no CUDA"),
once in a detached tmux session of `--size` (default 120x40) and once `--headless`. After a
warm-up (`--warmup`, default 6 s: start-up, imports, the injection), kdash's user + system CPU
time is read from /proc/<pid>/stat at the start and end of a `--seconds` window (default 20)
and given as a percentage of one core over that window's wall time. The target's CPU is read
the same way, to show it really was busy.

    python bench/self_cpu.py [--seconds 20] [--size 120x40] [--busy 3] [--label after]

writes bench/results/self-cpu-cpu.json ({command, machine, figures}); with `--label NAME` the
figures go under that name and the figures of other labels already in the file are kept, so
a "before" and an "after" run sit side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TARGET = r"""
import sys, threading
busy = int(sys.argv[1])
stop = threading.Event()
def spin():
    x = 0
    while not stop.is_set():
        x += 1
for _ in range(busy):
    threading.Thread(target=spin, daemon=True).start()
print("ready", flush=True)
sys.stdin.read()  # until the benchmark closes our stdin
stop.set()
"""

CLK_TCK = os.sysconf("SC_CLK_TCK")
RESULT = Path(__file__).resolve().parent / "results" / "self-cpu-cpu.json"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` so far, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    # after the comm: state is field 3, utime 14, stime 15 (1-based over the whole line)
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def start_target(busy: int) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", TARGET, str(busy)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert p.stdout is not None
    if p.stdout.readline().strip() != "ready":
        raise SystemExit("the target did not start")
    return p


def kdash_cmd(pid: int) -> list[str]:
    return [sys.executable, "-m", "kdash", "attach", "--pid", str(pid)]


def window(kdash_pid: int, target_pid: int, seconds: float) -> dict:
    """kdash's and the target's CPU over one window of `seconds`."""
    k0, t0, w0 = cpu_seconds(kdash_pid), cpu_seconds(target_pid), time.monotonic()
    samples = []
    last_k, last_w = k0, w0
    while time.monotonic() - w0 < seconds:
        time.sleep(1.0)
        k, w = cpu_seconds(kdash_pid), time.monotonic()
        samples.append(round(100 * (k - last_k) / (w - last_w), 2))
        last_k, last_w = k, w
    k1, t1, w1 = cpu_seconds(kdash_pid), cpu_seconds(target_pid), time.monotonic()
    wall = w1 - w0
    samples.sort()
    return {
        "seconds": round(wall, 2),
        "kdash_cpu_s": round(k1 - k0, 3),
        "kdash_cpu_pct_of_one_core": round(100 * (k1 - k0) / wall, 2),
        "kdash_cpu_pct_per_second_p50": samples[len(samples) // 2] if samples else None,
        "kdash_cpu_pct_per_second_max": samples[-1] if samples else None,
        "target_cpu_pct_of_one_core": round(100 * (t1 - t0) / wall, 1),
    }


def run_tmux(target_pid: int, size: str, warmup: float, seconds: float) -> dict:
    cols, rows = size.split("x")
    name = f"kdash-self-cpu-{os.getpid()}"
    cmd = "exec " + shlex.join(kdash_cmd(target_pid))
    subprocess.run(
        ["tmux", "new-session", "-d", "-s", name, "-x", cols, "-y", rows, cmd], check=True
    )
    try:
        pane_pid = int(
            subprocess.run(
                ["tmux", "display-message", "-p", "-t", name, "#{pane_pid}"],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
        )
        time.sleep(warmup)
        fig = window(pane_pid, target_pid, seconds)
        screen = subprocess.run(
            ["tmux", "capture-pane", "-p", "-t", name], capture_output=True, text=True
        ).stdout
        fig["screen_last_line"] = screen.rstrip("\n").splitlines()[-1] if screen else ""
        fig["size"] = size
        return fig
    finally:
        subprocess.run(["tmux", "kill-session", "-t", name], capture_output=True)


def run_headless(target_pid: int, warmup: float, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "self-cpu.kdash"
        cmd = kdash_cmd(target_pid) + [
            "--headless",
            "--duration",
            str(warmup + seconds + 5),
            "-o",
            str(out),
        ]
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        try:
            time.sleep(warmup)
            fig = window(p.pid, target_pid, seconds)
        finally:
            p.terminate()
            _, err = p.communicate(timeout=30)
        fig["exit_status"] = p.returncode
        if p.returncode not in (0, -15) and err:
            fig["stderr_tail"] = err.strip()[-300:]
        return fig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=6.0)
    ap.add_argument("--size", default="120x40")
    ap.add_argument("--busy", type=int, default=3)
    ap.add_argument("--label", default="after")
    ap.add_argument("--modes", default="tmux,headless")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args()
    modes = args.modes.split(",")
    if "tmux" in modes and shutil.which("tmux") is None:
        raise SystemExit("tmux is not installed")
    target = start_target(args.busy)
    figures: dict = {}
    try:
        if "tmux" in modes:
            figures[f"tui_{args.size}"] = run_tmux(target.pid, args.size, args.warmup, args.seconds)
        if "headless" in modes:
            figures["headless"] = run_headless(target.pid, args.warmup, args.seconds)
    finally:
        assert target.stdin is not None
        target.stdin.close()
        target.wait(timeout=30)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    run = {
        "command": shlex.join([Path(sys.executable).name, *sys.argv]),
        "kdash_commit": commit,
        "target": {"busy_threads": args.busy},
        "machine": {
            "hostname": socket.gethostname(),
            "cpu_model": cpu_model(),
            "cores": os.cpu_count(),
            "kernel": platform.release(),
            "python": platform.python_version(),
            "load_average_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "figures": figures,
    }
    print(json.dumps(run, indent=2))
    if not args.no_write:
        doc = {}
        if RESULT.exists():
            doc = json.loads(RESULT.read_text())
        doc.setdefault("budget_pct_of_one_core", 3.0)
        doc.setdefault("runs", {})[args.label] = run
        RESULT.parent.mkdir(parents=True, exist_ok=True)
        RESULT.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
