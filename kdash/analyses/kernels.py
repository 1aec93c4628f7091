"""Kernel-table analyses: top kernels, GPU idle gaps, launch-to-start latency.

Pure functions over the `kernels` and `api` tables (pandas DataFrames in the schema's columns),
shared by the kernel pane and `kdash report`.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

TOP_COLUMNS = [
    "name",
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


_DEMANGLED: dict[str, str] = {}


def demangle_all(names) -> None:
    """Demangle the C++ names not seen before, in one batch (one c++filt run), into the cache.

    Called where a table of kernels is summarised, so `short_name` never spawns a process per row.
    """
    from kdash.triton_index import demangle_many

    todo = [n for n in dict.fromkeys(names) if n.startswith("_Z") and n not in _DEMANGLED]
    if todo:
        _DEMANGLED.update(demangle_many(todo))


def demangled(name: str) -> str:
    """The demangled name if known (see `demangle_all`), else the name as recorded."""
    return _DEMANGLED.get(name, name)


def short_name(name: str, width: int = 48) -> str:
    """A readable kernel name: demangled, templates and argument lists cut, middle elided if long.

    The full name stays in the table; this is for narrow columns.
    """
    s = demangled(name)
    if s.startswith("void "):
        s = s[5:]
    depth = 0
    out = []
    for ch in s:
        if ch in "<(":
            if depth == 0:
                out.append("<…>" if ch == "<" else "")
            depth += 1
        elif ch in ">)":
            depth = max(0, depth - 1)
        elif depth == 0:
            out.append(ch)
    s = "".join(out).strip() or name
    if len(s) > width:
        keep = width - 1
        s = s[: keep // 2] + "…" + s[-(keep - keep // 2) :]
    return s


def _smem(static: int, dynamic: int) -> int:
    """Static + dynamic shared memory; -1 (n/a) only when neither is known."""
    if static < 0 and dynamic < 0:
        return -1
    return max(static, 0) + max(dynamic, 0)


def top_kernels(kernels: pd.DataFrame, limit: int | None = None) -> pd.DataFrame:
    """Per kernel name: calls, total GPU time and its share, mean/p50/p99, launch shape.

    Shares are of the summed kernel time in the table (concurrent kernels on several streams
    can add up to more than the wall window, so wall time would mislead).
    """
    if kernels.empty:
        return pd.DataFrame(columns=TOP_COLUMNS)
    k = kernels.assign(dur_ns=(kernels["end_ns"] - kernels["start_ns"]).clip(lower=0))
    demangle_all(k["name"].unique().tolist())
    total = float(k["dur_ns"].sum()) or 1.0
    rows = []
    for name, g in k.groupby("name", sort=False):
        d = g["dur_ns"].to_numpy(dtype=np.float64)
        last = g.iloc[-1]
        rows.append(
            {
                "name": name,
                "calls": len(g),
                "total_ms": d.sum() / 1e6,
                "pct": 100.0 * d.sum() / total,
                "mean_us": d.mean() / 1e3,
                "p50_us": float(np.percentile(d, 50)) / 1e3,
                "p99_us": float(np.percentile(d, 99)) / 1e3,
                "grid": f"{last['grid_x']},{last['grid_y']},{last['grid_z']}",
                "block": f"{last['block_x']},{last['block_y']},{last['block_z']}",
                "registers": int(last["registers"]),
                "smem": _smem(int(last["static_smem"]), int(last["dynamic_smem"])),
            }
        )
    out = pd.DataFrame(rows, columns=TOP_COLUMNS).sort_values("total_ms", ascending=False)
    out = out.reset_index(drop=True)
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
