"""Kernel timeline redraw time with 100,000 kernels in the window (DESIGN: under 20 ms).

GENERATED FIXTURE, not a capture: 100,000 kernel rows over 8 streams on 2 GPUs (4 streams each)
in a 20 s window, with random gaps and durations, plus markers: the agent's "activity on"
windows (100 ms of every 1 s, domain "kdash") and 2,000 NVTX ranges in two domains. No GPU is
needed; the point is the cost of the code the pane runs on the UI thread.

Timed, median of `--runs` runs at widths 80 and 200 (the pane's content width):
* `render_lanes`: the lane strip the kernel pane draws (`tui/panes/kernels.py`), binning
  included — what a redraw costs when the window moved;
* `render_lanes + rich render`: the same plus Rich turning the Text into the segments the
  Static paints (so the widget's own cost is seen, to choose between a Static and a line API);
* `store.get` of the window's kernels (the pane's query, before any drawing);
* `baseline_per_lane_mask`: the previous implementation's binning (a boolean mask, a sort and a
  `busy_fraction` per lane, np.unique on the keys), for comparison.

Writes bench/results/timeline-redraw-cpu.json. Run: `python bench/timeline_redraw.py`.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from kdash.tui.panes.kernels import render_lanes
from kdash.tui.widgets.spark import busy_fraction, shade
from rich.console import Console

from kdash import schema
from kdash.store import Store

T0 = 1_000_000_000_000
SPAN_NS = 20_000_000_000


def fixture(n: int = 100_000, seed: int = 0) -> tuple[dict, dict]:
    """Generated kernels (8 streams on 2 GPUs) and markers (recording windows, NVTX)."""
    rng = np.random.default_rng(seed)
    lane = rng.integers(0, 8, n)
    starts = np.sort(rng.integers(T0, T0 + SPAN_NS, n)).astype(np.int64)
    durs = rng.integers(2_000, 400_000, n).astype(np.int64)  # 2-400 µs
    kernels = schema.make_batch(
        "kernels",
        start_ns=starts,
        end_ns=starts + durs,
        name=[f"kernel_{i % 37}" for i in range(n)],
        device=(lane // 4).astype(np.int16),
        stream=(7 + lane % 4).astype(np.int64),
    )
    ws = np.arange(T0, T0 + SPAN_NS, 1_000_000_000, dtype=np.int64)
    ns = np.sort(rng.integers(T0, T0 + SPAN_NS, 2_000)).astype(np.int64)
    m_start = np.concatenate([ws, ns])
    m_end = np.concatenate([ws + 100_000_000, ns + rng.integers(10_000, 5_000_000, len(ns))])
    k = len(ws)
    markers = schema.make_batch(
        "markers",
        start_ns=m_start,
        end_ns=m_end,
        name=["activity on"] * k + ["forward"] * len(ns),
        domain=["kdash"] * k + [("nccl", "sglang")[i % 2] for i in range(len(ns))],
        pid=np.zeros(len(m_start), dtype=np.int64),
        tid=np.full(len(m_start), -1, dtype=np.int64),
    )
    return kernels, markers


def axis(bins: int) -> str:
    return ("0.0s" + "─" * bins)[: bins - 5] + "20.0s"


def baseline_per_lane_mask(batch: dict, since: int, until: int, width: int) -> list[str]:
    """The binning the pane did before (one mask + busy_fraction per lane), for comparison."""
    bins = max(1, width - 12)
    dev, stream = batch["device"].astype(np.int64), batch["stream"].astype(np.int64)
    keys, inverse = np.unique((dev << 40) + (stream + 1), return_inverse=True)
    inverse = inverse.reshape(-1)
    out = []
    for n in range(min(len(keys), 8)):
        sel = inverse == n
        frac = busy_fraction(batch["start_ns"][sel], batch["end_ns"][sel], since, until, bins)
        out.append(shade(frac))
    return out


def median_ms(fn, runs: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(times), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--kernels", type=int, default=100_000)
    ap.add_argument(
        "--output", default=str(Path(__file__).parent / "results/timeline-redraw-cpu.json")
    )
    args = ap.parse_args()

    kernels, markers = fixture(args.kernels)
    store = Store(retention_s=10**6, max_rows=10**9)
    store.append("kernels", kernels)
    store.append("markers", markers)
    since, until = T0, T0 + SPAN_NS
    figures: dict[str, dict[str, float]] = {}
    for width in (80, 200):
        console = Console(width=width, color_system="truecolor", file=io.StringIO())

        def lanes(width=width):
            return render_lanes(kernels, markers, since, until, width, axis, notes="x")

        def lanes_and_rich(width=width, console=console):
            text = lanes()
            return console.render_lines(text, console.options.update_width(width), pad=False)

        text = lanes()
        figures[f"width_{width}"] = {
            "render_lanes_ms": median_ms(lanes, args.runs),
            "render_lanes_plus_rich_render_ms": median_ms(lanes_and_rich, args.runs),
            "baseline_per_lane_mask_ms": median_ms(
                lambda width=width: baseline_per_lane_mask(kernels, since, until, width), args.runs
            ),
            "lines": len(text.plain.splitlines()),
        }
    figures["store_get_kernels_ms"] = median_ms(
        lambda: store.get("kernels", since, until), args.runs
    )
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "fixture": (
            f"GENERATED: {args.kernels} kernel rows over 8 streams on 2 GPUs in a 20 s window, "
            "20 'activity on' windows (100 ms / 1 s), 2000 NVTX ranges in 2 domains"
        ),
        "runs": args.runs,
        "statistic": "median ms",
        "target_ms": 20.0,
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "numpy": np.__version__,
        },
        "figures": figures,
    }
    out = Path(args.output)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
