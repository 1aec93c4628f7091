"""Kernel-table analyses: top kernels, GPU idle gaps, launch-to-start latency.

Pure functions over the `kernels` and `api` tables (pandas DataFrames in the schema's columns),
shared by the kernel pane and `kdash report`. Names arrive demangled (kdash.names, at ingest).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kdash.names import short_name as _short_name

TOP_COLUMNS = [
    "name",  # demangled at ingest (kdash.names)
    "calls",
    "total_ms",
    "pct",
    "mean_us",
    "p50_us",
    "p99_us",
    "grid",
    "block",
    "registers",
    "smem",
]


def short_name(name: str, width: int = 48) -> str:
    """One kernel name's label (kdash.names.short_name); tables use `short_names`, which
    tells the rows apart."""
    return _short_name(name, width)


def _smem(static: int, dynamic: int) -> int:
    """Static + dynamic shared memory; -1 (n/a) only when neither is known."""
    if static < 0 and dynamic < 0:
        return -1
    return max(static, 0) + max(dynamic, 0)


def _group_percentile(sorted_vals: np.ndarray, starts: np.ndarray, counts: np.ndarray, q: float):
    """np.percentile's linear interpolation, for every group of a value array sorted within
    contiguous groups (`starts`, `counts`) at once."""
    pos = q / 100.0 * (counts - 1)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, counts - 1)
    v_lo, v_hi = sorted_vals[starts + lo], sorted_vals[starts + hi]
    return v_lo + (v_hi - v_lo) * (pos - lo)


def top_kernels(kernels: pd.DataFrame, limit: int | None = None) -> pd.DataFrame:
    """Per kernel name: calls, total GPU time and its share, mean/p50/p99, launch shape.

    Shares are of the summed kernel time in the table (concurrent kernels on several streams
    can add up to more than the wall window, so wall time would mislead). The launch shape is
    the name's last launch. Vectorised over all names at once: the pane runs this every
    second on the whole window (bench/kernel_analysis_cost.py).
    """
    if kernels.empty:
        return pd.DataFrame(columns=TOP_COLUMNS)
    dur = np.clip(
        kernels["end_ns"].to_numpy(np.int64) - kernels["start_ns"].to_numpy(np.int64), 0, None
    ).astype(np.float64)
    codes, names = pd.factorize(kernels["name"], sort=False)
    names = np.asarray(names, dtype=object)
    n_names = len(names)
    total = float(dur.sum()) or 1.0
    counts = np.bincount(codes, minlength=n_names)
    sums = np.bincount(codes, weights=dur, minlength=n_names)
    order = np.lexsort((dur, codes))  # by name, then duration
    sorted_dur = dur[order]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    p50 = _group_percentile(sorted_dur, starts, counts, 50)
    p99 = _group_percentile(sorted_dur, starts, counts, 99)
    _u, first_from_end = np.unique(codes[::-1], return_index=True)  # codes 0..n-1, in order
    last = len(codes) - 1 - first_from_end  # each name's last launch
    lk = kernels.iloc[last]

    def col(c: str) -> np.ndarray:
        return lk[c].to_numpy()

    grid = [
        f"{x},{y},{z}" for x, y, z in zip(col("grid_x"), col("grid_y"), col("grid_z"), strict=True)
    ]
    block = [
        f"{x},{y},{z}"
        for x, y, z in zip(col("block_x"), col("block_y"), col("block_z"), strict=True)
    ]
    smem = [
        _smem(int(a), int(b)) for a, b in zip(col("static_smem"), col("dynamic_smem"), strict=True)
    ]
    out = pd.DataFrame(
        {
            "name": names,
            "calls": counts,
            "total_ms": sums / 1e6,
            "pct": 100.0 * sums / total,
            "mean_us": sums / counts / 1e3,
            "p50_us": p50 / 1e3,
            "p99_us": p99 / 1e3,
            "grid": grid,
            "block": block,
            "registers": col("registers").astype(np.int64),
            "smem": smem,
        },
        columns=TOP_COLUMNS,
    )
    out = out.sort_values("total_ms", ascending=False, kind="stable").reset_index(drop=True)
    return out.head(limit) if limit else out


ACTIVITY_DOMAIN = "kdash"  # markers rows the agent writes for its recording windows
ACTIVITY_NAME = "activity on"


def recorded_windows(markers: pd.DataFrame) -> pd.DataFrame | None:
    """The agent's sampling windows (start_ns, end_ns), or None when activity was continuous
    or the capture predates the duty cycle (then everything between kernels was recorded)."""
    if markers is None or markers.empty or "domain" not in markers:
        return None
    w = markers[(markers["domain"] == ACTIVITY_DOMAIN) & (markers["name"] == ACTIVITY_NAME)]
    if w.empty:
        return None
    return w[["start_ns", "end_ns"]].sort_values("start_ns").reset_index(drop=True)


def idle_gaps(
    kernels: pd.DataFrame, min_gap_us: float = 100.0, windows: pd.DataFrame | None = None
) -> pd.DataFrame:
    """Intervals on each device where no kernel ran for at least `min_gap_us`.

    With the agent's sampling `windows` (see `recorded_windows`), only the part of a gap that
    lies inside a window counts: time between windows was not recorded, so calling it idle
    would be a false finding.
    """
    cols = ["device", "start_ns", "end_ns", "gap_us"]
    if kernels.empty:
        return pd.DataFrame(columns=cols)
    rows = []
    for dev, g in kernels.groupby("device"):
        g = g.sort_values("start_ns")
        starts = g["start_ns"].to_numpy()
        ends = np.maximum.accumulate(g["end_ns"].to_numpy())
        gap = starts[1:] - ends[:-1]
        idx = np.nonzero(gap >= min_gap_us * 1e3)[0]
        for i in idx:
            a, b = int(ends[i]), int(starts[i + 1])
            if windows is None:
                rows.append((int(dev), a, b, (b - a) / 1e3))
                continue
            for ws, we in windows.itertuples(index=False):
                lo, hi = max(a, int(ws)), min(b, int(we))
                if hi - lo >= min_gap_us * 1e3:
                    rows.append((int(dev), lo, hi, (hi - lo) / 1e3))
    return pd.DataFrame(rows, columns=cols)


def launch_latency(kernels: pd.DataFrame, api: pd.DataFrame) -> pd.DataFrame:
    """Launch-to-start latency per kernel: kernel start minus the end of its launch API call.

    Matched on correlation id. Graph launches share one correlation id across their kernels;
    each kernel then measures from the graph launch call, which is what the user waits on.
    """
    cols = ["name", "correlation_id", "api_end_ns", "start_ns", "latency_us", "tid"]
    if kernels.empty or api.empty:
        return pd.DataFrame(columns=cols)
    a = api[["correlation_id", "end_ns", "tid"]].rename(columns={"end_ns": "api_end_ns"})
    m = kernels[["name", "correlation_id", "start_ns"]].merge(a, on="correlation_id", how="inner")
    m["latency_us"] = (m["start_ns"] - m["api_end_ns"]) / 1e3
    return m[cols]
