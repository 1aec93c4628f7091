"""PC sampling through the agent, under the demo workload (issue 5 evidence; GPU machine).

The target is kdash's demo workload (`python -m kdash.kernels`, eager: paged decode + prefill
with the project's Triton kernels and a transformer-shaped stack), started with the `kdash run`
hook and kept saturated (`--rate 400`: more arrivals than it serves). Its own per-second report
lines give the rate (decode + prefill tokens/s, steps/s). Segments of 10 s, in one run:

1. `before`: no client;  2. `activity`: attached, kdash's default activity duty cycle;
3. `pc_sampling`: the same plus PC sampling (200 ms ranges every 2 s);
4. `activity_again`: PC sampling switched off (SET);  5. `after`: detached.

Kept: rates and their ratios (the floor: sampling on within 5% of off), the agent's PC state,
per-range costs (enable/start/stop wall ms, CPU ms of stop + reads), samples per range, and
the hot lines per kernel from the samples and the line tables kdash made from the target's
Triton cache (collectors/agent/lines.py). Writes $OUT/pcs-agent-h200.json, with `attribution`
(also alone as $OUT/pcs-attribution-h200.json: `summary` non_user_sample_share,
max_share_gap_points).
Run from the repository root: `python bench/gpu_pcs_agent.py`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
HERE = Path(__file__).resolve().parent
# PCS_STEADY=1: the target is one decode step of the demo model launched eagerly over and over
# (bench/ab_target.py decode_eager), so the kernel mix in the activity windows is the one the
# PC ranges between them sampled; the demo workload's mix moves with its batch.
STEADY = os.environ.get("PCS_STEADY") == "1"
# PCS_TARGET=compile: the target is bench/compile_target.py (a torch.compile'd block: inductor's
# Triton kernels beside a cuBLAS GEMM, every one of them filling the GPU), the second
# case; its `steps/s` lines give the rate.
COMPILE = os.environ.get("PCS_TARGET") == "compile"
STEPS = re.compile(r"^steps/s ([\d.]+)")
REPORT = re.compile(
    r"\[\s*([\d.]+)s\] decode\s+(\d+) tok/s\s+prefill\s+(\d+) tok/s\s+steps/s\s+([\d.]+)\s+"
    r"running\s+(\d+) waiting\s+(\d+)"
)


class Workload:
    def __init__(self, env: dict) -> None:
        # eager decode: a graph-replaying process gets no kernel records by default, and the
        # attribution is judged against them
        cmd = [sys.executable, "-m", "kdash.kernels", "--eager-decode", "--rate", "400"]
        cmd += ["--report-every", "1"]
        if STEADY:
            cmd = [sys.executable, "-u", str(HERE / "ab_target.py"), "decode_eager", "400"]
        if COMPILE:
            cmd = [sys.executable, "-u", str(HERE / "compile_target.py"), "400"]
        self._last_tick: tuple[int, int] | None = None
        self.proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        self.reports: list[tuple[int, float, float, int]] = []  # (t_ns, tok/s, steps/s, waiting)
        self.lines: list[str] = []
        self.err: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if parts[:1] == ["tick"] and len(parts) == 4:  # ab_target: cumulative iterations
                t, n = int(parts[1]), int(parts[2])
                if self._last_tick is None or t - self._last_tick[0] >= 1e9:
                    if self._last_tick is not None:
                        rate = (n - self._last_tick[1]) / ((t - self._last_tick[0]) / 1e9)
                        self.reports.append((time.monotonic_ns(), rate, rate, 0))
                    self._last_tick = (t, n)
                continue
            m2 = STEPS.match(line)
            if m2:
                rate = float(m2.group(1))
                self.reports.append((time.monotonic_ns(), rate, rate, 0))
                continue
            m = REPORT.search(line)
            if m:
                tok = float(m.group(2)) + float(m.group(3))
                self.reports.append((time.monotonic_ns(), tok, float(m.group(4)), int(m.group(6))))
            else:
                self.lines.append(line.rstrip())

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.rstrip())

    def window(self, t0: int, t1: int) -> dict:
        inside = [r for r in self.reports if t0 < r[0] <= t1]
        if not inside:
            return {"reports": 0}
        return {
            "reports": len(inside),
            "tok_s": statistics.fmean(r[1] for r in inside),
            "steps_s": statistics.fmean(r[2] for r in inside),
            "min_waiting": min(r[3] for r in inside),
        }


def attribution(got: dict, ranges: list[dict]) -> dict:
    """Within each PC range: each kernel's share of the range's PC samples (issued + stalled,
    the `_not_issued` duplicates left out) against its share of GPU time in the kernel records
    of the same process around it (the activity windows within RANGE_NEAR_S); and how much of
    the sampled time CUPTI put in its non-user bucket, over all ranges.

    `coverage` also weighs each kernel's time by the share of the GPU's SM sub-partitions its
    grid can occupy (CTAs x warps / (SMs x 4), at most 1): a sampler that reads every SM
    sub-partition at a fixed period sees a kernel that fills a quarter of the GPU a quarter as
    often, so that comparison says whether a gap is the sampler's nature or lost samples."""
    import numpy as np

    from kdash import schema

    out: dict = {}
    tot = sum(int(r.get("total_samples", 0)) for r in ranges)
    nu = sum(int(r.get("non_user_samples", 0)) for r in ranges)
    out["total_samples"], out["non_user_samples"] = tot, nu
    out["non_user_sample_share"] = round(nu / tot, 4) if tot else None
    out["per_range_non_user_share"] = [r.get("non_user_share") for r in ranges]
    if not got.get("kernels") or not got.get("pc_samples"):
        return out
    k = schema.to_frame("kernels", schema.concat("kernels", got["kernels"]))
    k["dur"] = (k["end_ns"] - k["start_ns"]).clip(lower=0)
    warps = np.ceil(k["block_x"] * k["block_y"] * k["block_z"] / 32).clip(lower=1)
    ctas = (k["grid_x"] * k["grid_y"] * k["grid_z"]).clip(lower=1)
    k["cov_dur"] = k["dur"] * np.minimum(1.0, ctas * np.minimum(warps, 4) / (SMS * 4))
    pcs = schema.to_frame("pc_samples", schema.concat("pc_samples", got["pc_samples"]))
    pcs = pcs[~pcs["stall_reason"].str.endswith("_not_issued")]
    per = []
    for t_end, rs in pcs.groupby("t_ns"):
        near = k[(k["start_ns"] >= t_end - RANGE_NEAR_S * 1e9) & (k["end_ns"] <= t_end + 1e9 * 1.5)]
        if near.empty:
            continue
        t_sh = near.groupby("name")["dur"].sum()
        t_sh = t_sh / t_sh.sum()
        c_sh = near.groupby("name")["cov_dur"].sum()
        c_sh = c_sh / c_sh.sum()
        s_sh = rs.groupby("kernel")["count"].sum()
        s_sh = s_sh / s_sh.sum()
        big = [n for n, v in t_sh.items() if v > 0.05]
        rows = [
            {
                "kernel": n[:80],
                "gpu_time_share": round(float(t_sh[n]), 4),
                "coverage_share": round(float(c_sh.get(n, 0.0)), 4),
                "sample_share": round(float(s_sh.get(n, 0.0)), 4),
            }
            for n in sorted(big, key=lambda n: -t_sh[n])
        ]
        gaps = [abs(r["gpu_time_share"] - r["sample_share"]) for r in rows]
        cgaps = [abs(r["coverage_share"] - r["sample_share"]) for r in rows]
        per.append(
            {
                "t_ns": int(t_end),
                "kernels": rows,
                "max_gap_points": round(100 * max(gaps), 2) if gaps else None,
                "max_gap_points_coverage": round(100 * max(cgaps), 2) if cgaps else None,
            }
        )
    out["ranges"] = per
    g = [r["max_gap_points"] for r in per if r["max_gap_points"] is not None]
    cg = [r["max_gap_points_coverage"] for r in per if r["max_gap_points_coverage"] is not None]
    out["max_share_gap_points"] = max(g) if g else None
    out["max_share_gap_points_coverage"] = max(cg) if cg else None
    return out


SEG_S = float(os.environ.get("PCS_SEG_S", "10"))  # each segment but PC sampling's
PC_SEG_S = float(os.environ.get("PCS_PC_SEG_S", "24"))
RANGE_NEAR_S = 3.0  # kernel records this long before a range's end count as "around it"
SMS = 132  # H200


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_pcs_agent.py", "segments": {}}
    out = OUT / "pcs-agent-h200.json"

    def save() -> None:
        out.write_text(json.dumps(res, indent=2, default=str) + "\n")

    wl = None
    try:
        import pandas as pd
        from kdash.collectors.agent import bootstrap
        from kdash.collectors.agent.client import AgentSource, find_agent_socket

        from kdash import cubin, schema

        wl = Workload(bootstrap.run_env(dict(os.environ)))
        end = time.monotonic() + 180
        while time.monotonic() < end and len(wl.reports) < (3 if COMPILE else 8):
            if wl.proc.poll() is not None:
                raise RuntimeError("workload exited: " + "\n".join(wl.err[-20:]))
            time.sleep(0.5)
        res["workload_banner"] = wl.lines[:3]
        pid = wl.proc.pid
        res["socket"] = find_agent_socket(pid)

        def seg(name: str, seconds: float = SEG_S) -> tuple[int, int]:
            t0 = time.monotonic_ns()
            time.sleep(seconds)
            t1 = time.monotonic_ns()
            res["segments"][name] = wl.window(t0, t1)
            save()
            return t0, t1

        seg("before")
        src = AgentSource(pid)
        src.start()
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end and not src.health.ok:
            time.sleep(0.05)
        res["health"] = str(src.health)
        got: dict[str, list] = {}
        stop = threading.Event()

        per_range: dict[int, dict] = {}

        def drain() -> None:
            while not stop.is_set():
                for t, b in src.poll(time.monotonic_ns()).items():
                    got.setdefault(t, []).append(b)
                last = src.stats.get("agent_pc_last") or {}
                n_ranges = src.stats.get("agent_pc_ranges") or 0
                if last and n_ranges:
                    tot = int(last.get("total_samples", 0))
                    share = int(last.get("non_user_samples", 0)) / tot if tot else None
                    per_range[int(n_ranges)] = dict(last, non_user_share=share)
                    per_range[int(n_ranges)]["refreshes"] = src.stats.get("agent_pc_refreshes")
                time.sleep(0.1)

        th = threading.Thread(target=drain, daemon=True)
        th.start()
        seg("activity")
        src.set_pc_sampling(True)
        seg("pc_sampling", PC_SEG_S)
        res["pc_status_during"] = src.pc_status()
        res["agent_pc"] = {k: v for k, v in src.stats.items() if k.startswith("agent_pc")}
        src.set_pc_sampling(False)
        seg("activity_again")
        if src.lines is not None:
            src.lines.wait_idle(60)
            for t, b in src.poll(time.monotonic_ns()).items():
                got.setdefault(t, []).append(b)
            res["line_outcomes"] = {
                f"{k[:60]} {c & 0xFFFFFFFFFFFFFFFF:x}": v
                for (k, c), v in src.lines.outcomes.items()
            }
        stop.set()
        th.join()
        res["agent_stats"] = {k: v for k, v in src.stats.items() if k.startswith("agent_")}
        src.stop()
        seg("after")
        s = res["segments"]
        off = [s[k]["tok_s"] for k in ("activity", "activity_again") if "tok_s" in s[k]]
        if off and "tok_s" in s["pc_sampling"]:
            res["pc_on_vs_off_pct"] = round(
                100 * (s["pc_sampling"]["tok_s"] - statistics.fmean(off)) / statistics.fmean(off),
                2,
            )
        if "tok_s" in s["before"] and "tok_s" in s["activity"]:
            res["activity_vs_before_pct"] = round(
                100 * (s["activity"]["tok_s"] - s["before"]["tok_s"]) / s["before"]["tok_s"], 2
            )
        res["pc_ranges"] = [per_range[k] for k in sorted(per_range)]
        res["attribution"] = attribution(got, res["pc_ranges"])
        a = res["attribution"]
        name = "pcs-attribution-h200-steady.json" if STEADY else "pcs-attribution-h200.json"
        what = (
            "PCS_STEADY=1 (ab_target.py decode_eager)"
            if STEADY
            else "(demo workload, --eager-decode)"
        )
        if COMPILE:
            name = "pcs-attribution-h200-compile.json"
            what = "PCS_TARGET=compile (compile_target.py)"
        (OUT / name).write_text(
            json.dumps(
                {
                    "command": f"python bench/gpu_pcs_agent.py {what}",
                    "summary": {
                        k: a.get(k)
                        for k in (
                            "non_user_sample_share",
                            "max_share_gap_points",
                            "max_share_gap_points_coverage",
                            "total_samples",
                        )
                    },
                    "ranges": res["pc_ranges"],
                    "attribution": a,
                },
                indent=2,
                default=str,
            )
            + "\n"
        )
        res["rows"] = {t: sum(len(b[next(iter(b))]) for b in bs) for t, bs in got.items()}
        if got.get("pc_samples"):
            pcs = schema.to_frame("pc_samples", schema.concat("pc_samples", got["pc_samples"]))
            sl = None
            if got.get("source_lines"):
                sl = schema.to_frame(
                    "source_lines", schema.concat("source_lines", got["source_lines"])
                )
            res["ranges_seen"] = int(pcs["t_ns"].nunique())
            by = pcs[~pcs["stall_reason"].str.endswith("_not_issued")]
            res["top_kernels_by_samples"] = (
                by.groupby("kernel")["count"].sum().sort_values(ascending=False).head(8).to_dict()
            )
            res["hot_lines"] = [
                r
                for r in cubin.hot_lines_by_kernel(pcs, sl, per_kernel=6)
                if r["file"] or r["kernel"].startswith("_")
            ][:40]
            del pd
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    finally:
        if wl is not None and wl.proc.poll() is None:
            wl.proc.send_signal(signal.SIGINT)
            try:
                wl.proc.wait(30)
            except subprocess.TimeoutExpired:
                wl.proc.kill()
            res["workload_tail"] = wl.lines[-2:]
            res["workload_exit"] = wl.proc.returncode
    save()
    print(
        json.dumps(
            {k: res.get(k) for k in ("segments", "pc_on_vs_off_pct", "agent_pc")}, default=str
        )[:3000]
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
