"""`kdash attach --pid` on a Python process started without kdash (issue 3, evidence (b)).

The target (torch matmul + a Triton kernel + a sync per iteration, the eager loop of
bench/gpu_agent_cost.py) is started with NO kdash hook. Then, as a user would:
`kdash attach --pid PID --headless --duration 6 --output X.kdash`. Kept: the target's rate
before, during and after; the seconds from starting `kdash attach` to the first kernel in the
capture (kernel start times are on the same monotonic clock); the capture's kernel count and
agent health line; the target's exit. Writes $OUT/attach-inject-h200.json.
Run from the repository root on the GPU machine (kdash installed):
`python bench/gpu_attach_inject.py`.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_agent_check as gac  # noqa: E402
import gpu_agent_cost as cost  # noqa: E402

OUT = gac.OUT


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_attach_inject.py"}
    out = OUT / "attach-inject-h200.json"
    tgt = None
    try:
        from kdash.collectors.agent import bootstrap

        from kdash.capture import load_capture

        script = Path(tempfile.mkdtemp(prefix="kdash-inj-")) / "target.py"
        script.write_text(cost.TARGET)
        tgt = gac.Target("eager", 120.0, bootstrap.disarmed_env(dict(os.environ)), script)
        end = time.monotonic() + 180
        while not tgt.ready.wait(0.2):
            if tgt.proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError("target never became ready: " + tgt.stderr_tail())
        pid = tgt.proc.pid
        before = cost.measure(tgt, settle=2.0)
        cap = Path(tempfile.mkdtemp(prefix="kdash-cap-")) / "inject.kdash"
        t_attach = time.monotonic_ns()
        r = subprocess.run(
            [sys.executable, "-m", "kdash.cli", "attach", "--pid", str(pid), "--headless",
             "--duration", "6", "--output", str(cap)],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        t_done = time.monotonic_ns()
        res["attach"] = {
            "rc": r.returncode,
            "stderr_tail": r.stderr.strip().splitlines()[-5:],
            "seconds": round((t_done - t_attach) / 1e9, 2),
        }
        after = cost.measure(tgt)
        if r.returncode == 0:
            c = load_capture(cap)
            k = c.tables["kernels"]
            res["capture"] = {
                "kernels": int(len(k)),
                "distinct_names": int(k["name"].nunique()) if len(k) else 0,
                "agent_health": c.meta.get("sources", {}).get("agent"),
                "first_kernel_s_after_attach": round((int(k["start_ns"].min()) - t_attach) / 1e9, 3)
                if len(k)
                else None,
                "bytes": cap.stat().st_size,
            }
        b, a = tgt.rate(*before), tgt.rate(*after)
        during = tgt.rate(t_attach + int(2e9), t_done - int(0.5e9))
        res["rate_it_s"] = {"before": b, "during_attach": during, "after_detach": a}
        res["after_vs_before_pct"] = gac.pct(b, a)
        res["during_vs_before_pct"] = gac.pct(b, during)
        tgt.proc.send_signal(signal.SIGTERM)
        res["target_exit"] = tgt.finish(30)
        res["target_lines"] = tgt.lines[-3:]
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-2000:]
        if tgt is not None and tgt.proc.poll() is None:
            tgt.proc.kill()
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps(res, default=str)[:2000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
