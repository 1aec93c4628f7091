"""The persistence rules every finding shares, and the helpers its evidence is worded with.

A condition is judged per sample; `stretches` finds the longest run of consecutive samples where
it holds, with a late poll not breaking a run and a gap longer than both 2.5 poll intervals and
`MAX_GAP_S` ending one. `covered_s` and `span_words` say how much of the window that was, for
the evidence. `kdash.analyses.findings` describes the rules in full; `kdash.analyses.finding`
holds the `Finding` every rule gives.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from kdash import schema

# A gap between two samples of a subject longer than this (and than 2.5 poll intervals) ends a
# stretch: below it, a late poll on a loaded machine; above it, data is missing.
MAX_GAP_S = 2.0


def table_frame(tables: Mapping[str, pd.DataFrame], name: str) -> pd.DataFrame:
    """The table in full schema columns (old captures may lack some), or an empty frame."""
    df = tables.get(name)
    if df is None or len(df) == 0:
        return schema.to_frame(name, schema.empty(name))
    if all(c in df.columns for c in schema.columns(name)):
        return df
    return schema.to_frame(name, schema.from_frame(name, df))


def poll_interval(t_ns: np.ndarray) -> float:
    """The typical poll interval (ns) of a table: median step between its distinct times."""
    u = np.unique(np.asarray(t_ns, dtype=np.int64))
    return float(np.median(np.diff(u))) if len(u) > 1 else 0.0


def stretches(
    t: np.ndarray, cond: np.ndarray, interval: float | None = None
) -> tuple[float, int, float]:
    """(longest stretch in s, t_ns of its last sample, total s where cond held) for one subject.

    `t` sorted ascending. A stretch of consecutive true samples lasts from one poll interval
    (`interval` in ns: the table's, else this subject's median step) before its first sample
    to its last; a gap longer than both 2.5 intervals and `MAX_GAP_S` breaks it.
    """
    n = len(t)
    if n == 0 or not cond.any():
        return 0.0, -1, 0.0
    t = np.asarray(t, dtype=np.int64)
    dts = np.diff(t)
    if interval is None:
        interval = float(np.median(dts)) if n > 1 else 0.0
    starts = cond.copy()
    starts[1:] &= ~cond[:-1] | (dts > max(2.5 * interval, MAX_GAP_S * 1e9))
    run_id = np.cumsum(starts) - 1
    start_t = t[np.flatnonzero(starts)]
    idx = np.flatnonzero(cond)
    durs = t[idx] - start_t[run_id[idx]] + interval
    k = int(np.argmax(durs))
    return float(durs[k]) / 1e9, int(t[idx[k]]), len(idx) * interval / 1e9


def covered_s(t_ns: np.ndarray, now_ns: int | None) -> float:
    """Seconds the samples cover: first sample to `now_ns` (or the last one), plus the typical
    poll interval (the first sample stands for the interval before it too)."""
    if len(t_ns) == 0:
        return 0.0
    t_ns = np.asarray(t_ns, dtype=np.int64)
    t0, tn = int(t_ns.min()), int(t_ns.max())
    t1 = int(now_ns) if now_ns is not None else tn
    return max(0.0, (t1 - t0 + poll_interval(t_ns)) / 1e9)


def span_words(run_s: float, window_s: float) -> str:
    return f"for {run_s:.1f} s of the {max(window_s, run_s):.1f} s window"


def subject_label(name: str, tid: int, pid: int) -> str:
    return f"{name or '?'} (tid {tid}, pid {pid})" if tid != pid else f"{name or '?'} (pid {pid})"
