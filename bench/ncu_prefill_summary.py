"""The figures kept from bench/device_s29.sh's Nsight Compute run (its tarball unpacked into DIR):
per length and kernel the launch, clock, time, tensor-pipe and L2 figures and the largest stall
reasons; for our kernel's source page, the warp samples by how often an instruction ran (once
a key tile, once a query tile, ...) and the per-query-tile waits by the barrier they poll.

Run: python bench/ncu_prefill_summary.py DIR [--out summary.json]   (no GPU needed)
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

RAW = (
    "gpu__time_duration.sum",
    "gpc__cycles_elapsed.max",
    "gpc__cycles_elapsed.max.per_second",
    "sm__cycles_active.avg",
    "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "sm__inst_executed.avg.pct_of_peak_sustained_elapsed",
    "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "lts__t_sectors.avg.pct_of_peak_sustained_elapsed",
    "lts__t_tag_requests.avg.pct_of_peak_sustained_elapsed",
    "l1tex__m_xbar2l1tex_read_sectors.avg.pct_of_peak_sustained_elapsed",
    "dram__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "launch__grid_size",
    "launch__block_size",
    "launch__registers_per_thread",
)


def _num(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def raw_figures(path: Path) -> dict[str, Any]:
    rows = list(csv.reader(path.open()))
    names, units, values = rows[0], rows[1], rows[-1]
    got = dict(zip(names, values, strict=False))
    unit = dict(zip(names, units, strict=False))
    out: dict[str, Any] = {k: _num(got[k]) for k in RAW if k in got}
    scale = {"ns": 1e-3, "us": 1.0, "ms": 1e3}
    dur = out.pop("gpu__time_duration.sum", None)
    if dur is not None:
        out["duration_us"] = round(dur * scale.get(unit["gpu__time_duration.sum"], 1.0), 2)
    # The L2 tables (MemoryWorkloadAnalysis_Tables), where collected: requests and sectors
    # by source unit and operation.
    for name, value in got.items():
        if name.startswith(("lts__t_requests_srcunit", "lts__t_sectors_srcunit")) and name.endswith(
            ".sum"
        ):
            v = _num(value)
            if v:
                out[name] = v
    stalls = []
    for name, value in got.items():
        if "issue_stalled" in name and "not_issued" not in name and name.endswith(".ratio"):
            v = _num(value)
            if v:
                stalls.append((round(v, 2), name.split("issue_stalled_")[1].split("_per")[0]))
    out["stalls_per_issue"] = dict((s, v) for v, s in sorted(stalls, reverse=True)[:8])
    return out


def source_figures(path: Path) -> dict[str, Any]:
    """Warp samples of the source page grouped by execution count, and the polls of mbarriers
    (``@!P BRA`` after a ``SYNCS.PHASECHK`` try-wait) that ran once a query tile."""
    rows = list(csv.reader(path.open()))
    head = rows[1]
    col = {h: i for i, h in enumerate(head)}
    data = rows[2:]
    samples_col, runs_col = (
        col["Warp Stall Sampling (All Samples)"],
        col["Instructions Executed"],
    )
    total = sum(_num(r[samples_col]) or 0 for r in data)
    by_runs: dict[int, float] = defaultdict(float)
    for r in data:
        by_runs[int(_num(r[runs_col]) or 0)] += _num(r[samples_col]) or 0
    top = sorted(by_runs.items(), key=lambda kv: -kv[1])[:8]
    per_tile_runs = Counter(int(_num(r[runs_col]) or 0) for r in data).most_common()
    polls = []
    for i, r in enumerate(data):
        text = r[1].strip()
        if "BRA" in text and i and "SYNCS.PHASECHK" in " ".join(x[1] for x in data[i - 10 : i]):
            s = _num(r[samples_col]) or 0
            if s / total > 0.001:
                polls.append({"index": i, "runs": int(_num(r[runs_col]) or 0),
                              "share": round(s / total, 4)})  # fmt: skip
    return {
        "samples": total,
        "instructions": len(data),
        "share_by_runs": {str(k): round(v / total, 4) for k, v in top},
        "most_common_runs": per_tile_runs[:4],
        "polls": polls,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    raws = sorted(args.dir.glob("ncu-*-raw.csv"))
    if not raws:
        print(f"ncu_prefill_summary: no ncu-*-raw.csv in {args.dir}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {}
    for raw in raws:
        key = raw.name[len("ncu-") : -len("-raw.csv")]
        out[key] = raw_figures(raw)
        src = raw.with_name(raw.name.replace("-raw.csv", "-source.csv"))
        if src.exists() and src.stat().st_size > 0:
            out[key]["source"] = source_figures(src)
    text = json.dumps(out, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
