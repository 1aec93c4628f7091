"""CPU ops (torch.profiler's `cpu_op` ranges, markers rows of domain "cpu_op"): which ops the
host threads spent their time in, and how busy each thread was with them.

An op's *total* time is its range; its *self* time is the part no other CPU op of its thread
ran inside it (`aten::linear` minus its `aten::addmm`), so self times add up, over a thread,
to the time the thread spent in ops at all — what `busy_ms` per thread is, from the outermost
ops. Ops on one thread nest (torch records them as a call stack); a range that would overlap
its parent's end is cut there when its parent's self time is made (damaged or hand-made
traces only). Only CPU ops take part: user annotations and CUDA calls inside
an op stay in its self time. Pure functions over pandas frames.
"""

from __future__ import annotations

import numpy as np
import pandas as pd

CPU_OP_DOMAIN = "cpu_op"
TOP_COLUMNS = [
    "name", "calls", "self_ms", "self_pct", "total_ms", "mean_us", "max_us", "threads",
]  # fmt: skip
THREAD_COLUMNS = ["pid", "tid", "ops", "busy_ms", "top_op", "top_op_self_ms"]


def has_host_ranges(markers: dict[str, np.ndarray] | None) -> bool:
    """Whether a markers batch holds ranges to draw on the time axis (CPU ops, annotations,
    NVTX), not only the agent's recording windows: a trace without kernels still has them."""
    from kdash.analyses.kernels import ACTIVITY_DOMAIN

    if markers is None or not len(markers["start_ns"]):
        return False
    return bool((markers["domain"] != ACTIVITY_DOMAIN).any())


def cpu_ops(markers: pd.DataFrame | None) -> pd.DataFrame:
    """The CPU-op rows of a markers table (empty frame when there are none)."""
    if markers is None or markers.empty or "domain" not in markers:
        return pd.DataFrame(columns=["start_ns", "end_ns", "name", "domain", "pid", "tid"])
    return markers[markers["domain"] == CPU_OP_DOMAIN]


def self_and_depth(
    pid: np.ndarray, tid: np.ndarray, start: np.ndarray, end: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(self ns, nesting depth) per row: depth 0 is an outermost op of its thread."""
    n = len(start)
    start = np.asarray(start, dtype=np.int64)
    end = np.maximum(np.asarray(end, dtype=np.int64), start)
    own = end - start
    depth = np.zeros(n, dtype=np.int64)
    if n == 0:
        return own, depth
    # per thread, by start; the longer first on a tie, so a parent precedes its first child
    order = np.lexsort((start - end, start, np.asarray(tid), np.asarray(pid)))
    p, t, s, e = (np.asarray(a)[order].tolist() for a in (pid, tid, start, end))
    rows = order.tolist()
    own_l = own.tolist()
    depth_l = [0] * n
    stack: list[tuple[int, int]] = []  # (end, row) of the open ops of the current thread
    thread = None
    for i in range(n):
        key = (p[i], t[i])
        if key != thread:
            stack.clear()
            thread = key
        si, ei = s[i], e[i]
        while stack and stack[-1][0] <= si:
            stack.pop()
        row = rows[i]
        if stack:
            parent_end, parent = stack[-1]
            ei = min(ei, parent_end)
            own_l[parent] -= ei - si
        depth_l[row] = len(stack)
        stack.append((ei, row))
    return np.asarray(own_l, dtype=np.int64), np.asarray(depth_l, dtype=np.int64)


def _with_self(ops: pd.DataFrame) -> pd.DataFrame:
    self_ns, depth = self_and_depth(
        ops["pid"].to_numpy(np.int64),
        ops["tid"].to_numpy(np.int64),
        ops["start_ns"].to_numpy(np.int64),
        ops["end_ns"].to_numpy(np.int64),
    )
    dur = np.maximum(ops["end_ns"].to_numpy(np.int64) - ops["start_ns"].to_numpy(np.int64), 0)
    return pd.DataFrame(
        {
            "name": ops["name"].astype(str).to_numpy(),
            "pid": ops["pid"].to_numpy(np.int64),
            "tid": ops["tid"].to_numpy(np.int64),
            "dur": dur,
            "self": self_ns,
            "depth": depth,
        }
    )


def top_cpu_ops(markers: pd.DataFrame | None, limit: int | None = None) -> pd.DataFrame:
    """Per op name, most self time first: calls, self and total time, self time's share of
    all CPU ops' self time, mean and longest call, threads it ran on."""
    ops = cpu_ops(markers)
    if ops.empty:
        return pd.DataFrame(columns=TOP_COLUMNS)
    w = _with_self(ops)
    all_self = float(w["self"].sum()) or 1.0
    g = w.groupby("name", sort=False)
    out = pd.DataFrame(
        {
            "calls": g.size(),
            "self_ms": g["self"].sum() / 1e6,
            "total_ms": g["dur"].sum() / 1e6,
            "mean_us": g["dur"].mean() / 1e3,
            "max_us": g["dur"].max() / 1e3,
            "threads": g[["pid", "tid"]].apply(lambda x: len(x.drop_duplicates())),
        }
    )
    out["self_pct"] = out["self_ms"] * 1e6 / all_self * 100
    out = out.reset_index().sort_values(["self_ms", "name"], ascending=[False, True])
    if limit is not None:
        out = out.head(limit)
    return out[TOP_COLUMNS].reset_index(drop=True)


def cpu_op_threads(markers: pd.DataFrame | None) -> pd.DataFrame:
    """Per thread, busiest first: how many ops, the time in ops (its outermost ops' ranges),
    and the op with the most self time there."""
    ops = cpu_ops(markers)
    if ops.empty:
        return pd.DataFrame(columns=THREAD_COLUMNS)
    w = _with_self(ops)
    rows = []
    for (pid, tid), g in w.groupby(["pid", "tid"], sort=True):
        by = g.groupby("name")["self"].sum().sort_values(ascending=False, kind="stable")
        rows.append(
            {
                "pid": int(pid),
                "tid": int(tid),
                "ops": len(g),
                "busy_ms": float(g.loc[g["depth"] == 0, "dur"].sum()) / 1e6,
                "top_op": str(by.index[0]),
                "top_op_self_ms": float(by.iloc[0]) / 1e6,
            }
        )
    out = pd.DataFrame(rows, columns=THREAD_COLUMNS)
    return out.sort_values(["busy_ms", "tid"], ascending=[False, True]).reset_index(drop=True)
