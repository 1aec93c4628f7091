"""PC-sampled captures recorded on the H200 through `kdash attach`, for tests/data and for the
source pane's walk-through (GPU machine):

1. the demo workload (eager decode: kdash's own Triton kernels, stage 1 included, beside
   cuBLAS and ATen), `kdash attach --pid P --headless --pc-sampling --duration 8`;
2. a torch.compile'd block (bench/compile_target.py: inductor's Triton kernels, cuBLAS),
   the same attach;
3. when tmux is there, `kdash attach --pid P --pc-sampling` on (2) at 80x24, then 120x40,
   with `4` (the source pane maximised): the screens.
Writes $OUT/demo-pcs.kdash, $OUT/compile-pcs.kdash, $OUT/pcs-record.json (each capture's
report: hot_lines[0], which top kernels have source, the agent's PC figures) and
$OUT/tmux-pcs-compile.txt. Run from bench/ with kdash installed: `python gpu_pcs_record.py`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
HERE = Path(__file__).resolve().parent
KDASH = [sys.executable, "-m", "kdash"]


def start(cmd: list[str], ready: str | None, wait_s: float) -> subprocess.Popen:
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert p.stdout is not None
    end = time.monotonic() + 240
    if ready is not None:
        while time.monotonic() < end:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{cmd} ended before {ready!r}")
            if ready in line:
                break
    time.sleep(wait_s)
    return p


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(20)
    except subprocess.TimeoutExpired:
        p.kill()


def record(res: dict, name: str, target: subprocess.Popen, hot: int = 3) -> None:
    cap = OUT / f"{name}.kdash"
    cap.unlink(missing_ok=True)
    r = subprocess.run(
        [*KDASH, "attach", "--pid", str(target.pid), "--headless", "--pc-sampling"]
        + ["--duration", "8", "-o", str(cap)],
        capture_output=True,
        text=True,
        timeout=150,
    )
    out: dict = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-1200:]}
    if cap.exists():
        rep = subprocess.run(
            [*KDASH, "report", str(cap), "--json"], capture_output=True, text=True, timeout=120
        )
        try:
            doc = json.loads(rep.stdout)
            out["hot_lines_head"] = (doc.get("hot_lines") or [])[:hot]
            out["top_kernels"] = [
                {k: t.get(k) for k in ("name", "share", "pct", "has_source")}
                for t in (doc.get("top_kernels") or [])[:8]
            ]
            out["size_bytes"] = cap.stat().st_size
        except ValueError:
            out["report_error"] = (rep.stdout + rep.stderr)[-800:]
    res[name] = out


def process_tree(pid: int) -> list[dict]:
    """The target and its children: which map libcuda (kdash injects into those)."""
    out = []
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            maps = Path(f"/proc/{p}/maps").read_text()
            cmd = Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120]
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError as e:
            out.append({"pid": p, "error": str(e)})
            continue
        out.append({"pid": p, "cmd": cmd, "libcuda": "libcuda.so" in maps})
        todo += [int(k) for k in kids]
    return out


def tmux_walk(res: dict) -> None:
    if shutil.which("tmux") is None:
        res["tmux"] = "no tmux on this machine"
        return
    t = start([sys.executable, str(HERE / "compile_target.py"), "90"], "ready", 1)
    screens = []
    try:
        res["tree"] = process_tree(t.pid)
        cmd = " ".join([*KDASH, "attach", "--pid", str(t.pid), "--pc-sampling"])
        subprocess.run(["tmux", "new", "-d", "-s", "k", "-x", "80", "-y", "24", cmd], check=True)
        time.sleep(16)
        subprocess.run(["tmux", "send-keys", "-t", "k", "4"])
        time.sleep(3)
        screens.append(
            (
                "80x24",
                subprocess.run(
                    ["tmux", "capture-pane", "-p", "-t", "k"], capture_output=True, text=True
                ).stdout,
            )
        )
        subprocess.run(["tmux", "resize-window", "-t", "k", "-x", "120", "-y", "40"])
        time.sleep(4)
        screens.append(
            (
                "120x40",
                subprocess.run(
                    ["tmux", "capture-pane", "-p", "-t", "k"], capture_output=True, text=True
                ).stdout,
            )
        )
        subprocess.run(["tmux", "send-keys", "-t", "k", "q"])
        time.sleep(3)
    finally:
        subprocess.run(["tmux", "kill-server"], capture_output=True)
        stop(t)
    (OUT / "tmux-pcs-compile.txt").write_text(
        "".join(f"== kdash attach --pid P --pc-sampling, 4, at {s}\n{txt}\n" for s, txt in screens)
    )
    res["tmux"] = "ok"


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_pcs_record.py"}
    only_tmux = "--tmux-only" in sys.argv
    for name, cmd, ready in (
        ()
        if only_tmux
        else (
            (
                "demo-pcs",
                [
                    *KDASH[:1],
                    "-m",
                    "kdash.kernels",
                    "--rate",
                    "400",
                    "--eager-decode",
                    "--report-every",
                    "2",
                ],
                "tok/s",
            ),
            ("compile-pcs", [sys.executable, str(HERE / "compile_target.py"), "60"], "ready"),
        )
    ):
        try:
            t = start(cmd, ready, 4)
            try:
                record(res, name, t)
            finally:
                stop(t)
        except Exception as e:  # noqa: BLE001 - keep what was recorded
            res[name] = {"error": f"{type(e).__name__}: {e}", "tb": traceback.format_exc()[-1500:]}
        (OUT / "pcs-record.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    try:
        tmux_walk(res)
    except Exception as e:  # noqa: BLE001
        res["tmux"] = f"{type(e).__name__}: {e}"
    (OUT / "pcs-record.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "demo-pcs"}, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
