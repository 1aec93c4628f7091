"""GPU busy time, three ways, on one launch-bound loop (GPU machine): kdash's accounting
(`kdash report --json`'s gpu_time, from a headless attach), an independent union of the kernel,
memcpy and memset intervals of a torch.profiler trace of a twin process running the same loop,
and NVML's utilisation sampled meanwhile. The twins run one after the other.

Writes $OUT/gpu-time-h200.json with `summary`: kdash_busy_pct, trace_busy_pct, nvml_util_pct
(each twin), and whether kdash is within 2 points of the trace and 5 of NVML.
Run from bench/ with kdash installed: `python gpu_time_check.py`.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
HERE = Path(__file__).resolve().parent
TARGET = str(HERE / "gpu_time_target.py")


class NvmlSampler:
    def __init__(self) -> None:
        import pynvml

        pynvml.nvmlInit()
        self.nv = pynvml
        self.h = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.samples: list[tuple[float, int]] = []
        self.stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.stop.is_set():
            u = self.nv.nvmlDeviceGetUtilizationRates(self.h).gpu
            self.samples.append((time.monotonic(), int(u)))
            time.sleep(0.05)

    def mean(self, t0: float, t1: float) -> float | None:
        v = [u for t, u in self.samples if t0 <= t <= t1]
        return round(sum(v) / len(v), 2) if v else None


def wait_line(p: subprocess.Popen, word: str, timeout: float = 120) -> None:
    end = time.monotonic() + timeout
    assert p.stdout is not None
    while time.monotonic() < end:
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"target ended before {word!r}")
        if line.startswith(word):
            return
    raise RuntimeError(f"no {word!r} in {timeout} s")


def union_share(intervals: list[tuple[float, float]]) -> tuple[float, float]:
    """(busy, span) of the union of intervals, in the intervals' unit."""
    if not intervals:
        return 0.0, 0.0
    iv = sorted(intervals)
    busy, cs, ce = 0.0, iv[0][0], iv[0][1]
    for s, e in iv[1:]:
        if s > ce:
            busy += ce - cs
            cs, ce = s, e
        else:
            ce = max(ce, e)
    busy += ce - cs
    return busy, max(e for _, e in iv) - iv[0][0]


def trace_busy(path: Path) -> dict:
    data = json.loads(path.read_text())
    ev = data["traceEvents"] if isinstance(data, dict) else data
    gpu = [
        e
        for e in ev
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    ]
    allv = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in gpu]
    kern = [
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in gpu
        if e["cat"] == "kernel"
    ]
    busy, span = union_share(allv)
    kbusy, _ = union_share(kern)
    return {
        "events": len(gpu),
        "span_s": round(span / 1e6, 4),
        "busy_pct": round(100 * busy / span, 2) if span else None,
        "kernel_pct": round(100 * kbusy / span, 2) if span else None,
    }


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_time_check.py", "machine": {}}
    out = OUT / "gpu-time-h200.json"
    try:
        nv = NvmlSampler()
        res["machine"]["gpu"] = nv.nv.nvmlDeviceGetName(nv.h)
        # twin A: torch.profiler from 3 s to 7 s of its run
        trace = Path("/tmp/gpu_time_trace.json")
        a = subprocess.Popen(
            [sys.executable, TARGET, "9", "--profile", str(trace), "--from", "3", "--to", "7"],
            stdout=subprocess.PIPE,
            text=True,
        )
        wait_line(a, "ready")
        t_ready = time.monotonic()
        wait_line(a, "profiled", 60)
        t_done = time.monotonic()
        a.wait(60)
        res["trace"] = trace_busy(trace)
        res["nvml_twin_a_pct"] = nv.mean(t_ready + 3.2, t_done - 0.2)
        if trace.stat().st_size < 30 << 20:  # the trace itself, for a later look (gzipped)
            with gzip.open(OUT / "gpu-time-trace.json.gz", "wt") as f:
                f.write(trace.read_text())
        # twin B: kdash attach, headless, 6 s, at defaults
        b = subprocess.Popen([sys.executable, TARGET, "16"], stdout=subprocess.PIPE, text=True)
        wait_line(b, "ready")
        time.sleep(3)
        cap = Path("/tmp/gpu_time.kdash")
        cap.unlink(missing_ok=True)
        t0 = time.monotonic()
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "kdash",
                "attach",
                "--pid",
                str(b.pid),
                "--headless",
                "--duration",
                "6",
                "-o",
                str(cap),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        t1 = time.monotonic()
        res["attach"] = {"rc": r.returncode, "tail": (r.stdout + r.stderr)[-800:]}
        b.wait(60)
        rep = subprocess.run(
            [sys.executable, "-m", "kdash", "report", str(cap), "--json"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        doc = json.loads(rep.stdout)
        res["kdash_gpu_time"] = doc.get("gpu_time")
        res["nvml_twin_b_pct"] = nv.mean(t0 + 1.5, t1 - 0.5)
        import shutil

        shutil.copy(cap, OUT / "gpu-time-h200.kdash")
        g = (doc.get("gpu_time") or [{}])[0]
        kb = 100 * g["busy_s"] / g["recorded_s"] if g.get("recorded_s") else None
        tb = res["trace"]["busy_pct"]
        nvm = res["nvml_twin_b_pct"]
        res["summary"] = {
            "kdash_busy_pct": round(kb, 2) if kb is not None else None,
            "trace_busy_pct": tb,
            "nvml_util_pct_twin_a": res["nvml_twin_a_pct"],
            "nvml_util_pct_twin_b": nvm,
            "kdash_vs_trace_points": round(kb - tb, 2)
            if kb is not None and tb is not None
            else None,
            "kdash_vs_nvml_points": round(kb - nvm, 2)
            if kb is not None and nvm is not None
            else None,
        }
        s = res["summary"]
        s["within_2_of_trace"] = (
            s["kdash_vs_trace_points"] is not None and abs(s["kdash_vs_trace_points"]) <= 2
        )
        s["within_5_of_nvml"] = (
            s["kdash_vs_nvml_points"] is not None and abs(s["kdash_vs_nvml_points"]) <= 5
        )
    except Exception as e:  # noqa: BLE001 - keep what was measured
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-2000:]
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps({k: res.get(k) for k in ("summary", "error", "attach")}, default=str)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
