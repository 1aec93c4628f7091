"""PC sampling kept enabled for a whole session, after a fresh CUPTI (GPU machine, one process).

bench/results/pcs-modules-h200.json: once PC sampling has been enabled on a context, a module
loaded while it is disabled is never attributed again (its samples go to CUPTI's non-user
bucket); modules present at the first enable, and modules loaded while it is enabled, are.
The demo workload compiles Triton variants as its batch changes, so the agent's
enable-range-disable cycle loses them. This run puts the remedy to the test on the demo
workload itself (kdash.kernels.workload, in this process's main thread), from a second thread:

  t=8 s   activity window: CONCURRENT_KERNEL for 1 s (each kernel's share of GPU time)
  t=10 s  `alternating`: 3 ranges, each enable / Start / 200 ms / Stop / disable (the old way)
  t=14 s  `finalize`: cuptiFinalize at the exit of the workload's next CUDA call (detach.py)
  t=15 s  `persistent`: enable once, 8 ranges of Start / 200 ms / Stop 1 s apart, kept enabled
  then    `after`: disabled; 2 ranges the old way again
Per range: totals, non-user share, each kernel's share of samples; the workload's own tok/s
per segment. Writes $OUT/pcs-session-h200.json. Run from bench/: `python gpu_pcs_session.py`.
"""

from __future__ import annotations

import io
import json
import os
import re
import sys
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
REPORT = re.compile(r"decode\s+(\d+) tok/s\s+prefill\s+(\d+) tok/s")


class Lines(io.TextIOBase):
    """stdout of the workload, with the time each report line came."""

    def __init__(self) -> None:
        self.reports: list[tuple[float, float]] = []
        self.buf = ""

    def write(self, s: str) -> int:
        self.buf += s
        while "\n" in self.buf:
            line, self.buf = self.buf.split("\n", 1)
            m = REPORT.search(line)
            if m:
                self.reports.append((time.monotonic(), float(m.group(1)) + float(m.group(2))))
        return len(s)

    def mean(self, t0: float, t1: float) -> float | None:
        v = [x for t, x in self.reports if t0 < t <= t1]
        return round(sum(v) / len(v), 1) if v else None


def shares(cols) -> dict[str, float]:
    by = defaultdict(int)
    for k, r, c in zip(cols["kernel"], cols["stall_reason"], cols["count"], strict=True):
        if not str(r).endswith("_not_issued"):
            by[str(k)] += int(c)
    s = sum(by.values()) or 1
    return {k: v / s for k, v in by.items()}


def controller(res: dict, lines: Lines, t_start: float, done: threading.Event) -> None:
    try:
        from cupti import cupti
        from kdash.collectors.agent import detach
        from kdash.collectors.agent.pcsampling import SamplingRanges
        from kdash.collectors.agent.server import find_libcupti

        def at(t: float) -> None:
            time.sleep(max(0.0, t_start + t - time.monotonic()))

        seg: dict[str, tuple[float, float]] = {}
        at(8)
        recs: list = []

        def requested():
            return 8 * 1024 * 1024, 0

        def completed(acts):
            for a in acts:
                recs.append((a.name, int(a.end) - int(a.start)))

        cupti.activity_register_callbacks(requested, completed)
        cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
        time.sleep(1.0)
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
        cupti.activity_flush_all(1)
        tot = defaultdict(int)
        for n, d in recs:
            tot[n] += d
        s = sum(tot.values()) or 1
        gshare = {k: v / s for k, v in tot.items()}
        res["gpu_time_share"] = {
            k[:70]: round(v, 4) for k, v in sorted(gshare.items(), key=lambda kv: -kv[1])[:12]
        }
        lib_path, why = find_libcupti()
        if lib_path is None:
            raise RuntimeError(why)
        rng = SamplingRanges(lib_path, device=0)

        def record(label: str, cols, stats) -> None:
            sh = shares(cols)
            tot_s, nu = int(stats["total_samples"]), int(stats["non_user_samples"])
            big = [k for k, v in gshare.items() if v > 0.05]
            res.setdefault("ranges", []).append(
                {
                    "phase": label,
                    "total_samples": tot_s,
                    "non_user_samples": nu,
                    "non_user_share": round(nu / tot_s, 4) if tot_s else None,
                    "top": {
                        k[:60]: round(v, 4)
                        for k, v in sorted(sh.items(), key=lambda kv: -kv[1])[:6]
                    },
                    "gap_points_big_kernels": {
                        k[:60]: round(100 * (sh.get(k, 0.0) - gshare[k]), 1) for k in big
                    },
                    **{k: stats[k] for k in ("enable_ms", "start_ms", "stop_ms") if k in stats},
                }
            )

        at(10)
        t0 = time.monotonic()
        for _ in range(3):
            cols, stats = rng.run(0.2)
            record("alternating", cols, stats)
            time.sleep(0.8)
        seg["alternating"] = (t0, time.monotonic())
        at(14)
        hook = detach.finalize_at_next_call(rng.sampler.lib, cupti, 2.0)
        res["finalize"] = {"state": hook.state, "rc": hook.rc}
        at(15)
        t0 = time.monotonic()
        c, smp = rng.cuda, rng.sampler
        c.push()
        try:
            t_en = time.perf_counter()
            smp.enable()
            res["persistent_enable_ms"] = round((time.perf_counter() - t_en) * 1e3, 1)
            for _ in range(8):
                c.synchronize()
                t1 = time.perf_counter()
                smp.start()
                st = (time.perf_counter() - t1) * 1e3
                time.sleep(0.2)
                c.synchronize()
                t1 = time.perf_counter()
                cols, stats = smp.stop_columns()
                stats = {**stats, "start_ms": round(st, 1)}
                stats["stop_ms"] = round((time.perf_counter() - t1) * 1e3, 1)
                record("persistent", cols, stats)
                time.sleep(0.8)
            seg["persistent"] = (t0, time.monotonic())
            t0 = time.monotonic()
            time.sleep(3.0)  # enabled, not started: what does that cost?
            seg["enabled_idle"] = (t0, time.monotonic())
            smp.disable()
        finally:
            c.pop()
        t0 = time.monotonic()
        for _ in range(2):
            cols, stats = rng.run(0.2)
            record("after", cols, stats)
            time.sleep(0.8)
        seg["after"] = (t0, time.monotonic())
        t0 = time.monotonic()
        time.sleep(3.0)
        seg["plain_after"] = (t0, time.monotonic())
        res["tok_s"] = {k: lines.mean(a, b) for k, (a, b) in seg.items()}
        res["tok_s"]["before"] = lines.mean(t_start + 4, t_start + 8)
        rng.close()
    except Exception as e:  # noqa: BLE001 - keep what was measured
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-2500:]
    finally:
        done.set()


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_pcs_session.py"}
    from kdash.kernels import workload

    lines = Lines()
    done = threading.Event()
    t_start = time.monotonic() + 20  # the workload builds and compiles first
    real = sys.stdout

    def go() -> None:
        nonlocal t_start
        # wait for the first report: the controller's clock starts there
        while not lines.reports:
            time.sleep(0.1)
        t_start = lines.reports[0][0]
        controller(res, lines, t_start, done)

    threading.Thread(target=go, daemon=True).start()
    sys.stdout = lines
    try:
        workload.main(["--rate", "400", "--report-every", "1", "--duration", "45"])
    except BaseException as e:  # noqa: BLE001
        res["workload_error"] = f"{type(e).__name__}: {e}"
    finally:
        sys.stdout = real
    done.wait(30)
    (OUT / "pcs-session-h200.json").write_text(json.dumps(res, indent=2, default=str) + "\n")
    print(json.dumps({k: res.get(k) for k in ("tok_s", "finalize", "error")}, default=str))
    for r in res.get("ranges", []):
        print(r["phase"], r["non_user_share"], r["gap_points_big_kernels"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
