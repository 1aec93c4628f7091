"""Why does a live `kdash attach --pc-sampling` on a torch.compile target stay at "PC sampling is
starting" when CUPTI is refreshed before the first range? (GPU machine, tmux.)

For each variant (the first-range refresh on, then off through the target's environment,
KDASH_AGENT_PC_FIRST_REFRESH=0) the torch.compile target (bench/compile_target.py) runs with
faulthandler registered on SIGUSR1; `kdash attach --pid P --pc-sampling` runs in tmux at
80x24; after 20 s the source pane (key 4) is captured, the target is sent SIGUSR1 (every
thread's Python stack, the agent's threads included, to its stderr), and the target's own
steps/s lines show whether it still makes progress. Writes $OUT/pcs-live-diag.json.
Run from the repository root: `python bench/gpu_pcs_live_diag.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT") or ".")
HERE = Path(__file__).resolve().parent
WRAP = (
    "import faulthandler, runpy, signal, sys; "
    "faulthandler.register(signal.SIGUSR1, all_threads=True); "
    f"sys.argv = ['compile_target.py', '70']; runpy.run_path({str(HERE / 'compile_target.py')!r},"
    " run_name='__main__')"
)


def capture() -> str:
    return subprocess.run(
        ["tmux", "capture-pane", "-p", "-t", "k"], capture_output=True, text=True
    ).stdout


def variant(first_refresh: bool) -> dict:
    env = dict(os.environ)
    if not first_refresh:
        env["KDASH_AGENT_PC_FIRST_REFRESH"] = "0"
    err_path = OUT / f"diag-stderr-{'on' if first_refresh else 'off'}.txt"
    err = open(err_path, "w")  # noqa: SIM115 - the child writes to it until it is stopped
    t = subprocess.Popen(
        [sys.executable, "-c", WRAP], env=env, stdout=subprocess.PIPE, stderr=err, text=True
    )
    lines: list[tuple[float, str]] = []
    t0 = time.monotonic()

    def read() -> None:
        assert t.stdout is not None
        for line in t.stdout:
            lines.append((round(time.monotonic() - t0, 1), line.strip()))

    threading.Thread(target=read, daemon=True).start()
    res: dict = {"first_refresh": first_refresh}
    try:
        end = time.monotonic() + 180
        while not any(x == "ready" for _, x in lines) and time.monotonic() < end:
            time.sleep(0.5)
        res["ready_s"] = round(time.monotonic() - t0, 1)
        cmd = f"{sys.executable} -m kdash attach --pid {t.pid} --pc-sampling"
        subprocess.run(["tmux", "new", "-d", "-s", "k", "-x", "80", "-y", "24", cmd], check=True)
        res["attach_s"] = round(time.monotonic() - t0, 1)
        time.sleep(8)
        subprocess.run(["tmux", "send-keys", "-t", "k", "4"])
        time.sleep(12)
        res["screen_20s"] = capture()
        os.kill(t.pid, signal.SIGUSR1)
        res["sigusr1_s"] = round(time.monotonic() - t0, 1)
        time.sleep(6)
        res["screen_26s"] = capture()
        subprocess.run(["tmux", "send-keys", "-t", "k", "q"])
        time.sleep(4)
    finally:
        subprocess.run(["tmux", "kill-server"], capture_output=True)
        t.send_signal(signal.SIGINT)
        try:
            t.wait(10)
        except subprocess.TimeoutExpired:
            t.kill()
            res["killed"] = True
        err.close()
    res["target_lines"] = lines[-40:]
    res["stacks"] = err_path.read_text(errors="replace")[-12000:]
    return res


def main() -> int:
    out = {"command": "python bench/gpu_pcs_live_diag.py", "variants": []}
    # DIAG_VARIANTS: which runs, in order ("on": the defaults; "off": no first-range refresh)
    for first in (v == "on" for v in os.environ.get("DIAG_VARIANTS", "on,off").split(",")):
        try:
            out["variants"].append(variant(first))
        except Exception as e:  # noqa: BLE001 - keep what the other variant gave
            out["variants"].append({"first_refresh": first, "error": f"{type(e).__name__}: {e}"})
        (OUT / "pcs-live-diag.json").write_text(json.dumps(out, indent=1))
    for v in out["variants"]:
        print("== first_refresh", v.get("first_refresh"), v.get("error", ""))
        print(v.get("screen_20s", "")[:600])
        print("target:", v.get("target_lines", [])[-8:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
