"""`ThreadView`: the `threads` table as sorted numpy arrays, shared by the thread findings."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pandas as pd

from kdash import schema
from kdash.analyses.finding_rules import poll_interval, subject_label, table_frame
from kdash.config import Thresholds


class ThreadView:
    """The `threads` table as numpy arrays sorted by (pid, tid, t_ns), with per-thread slices.

    Built once per `find_all` and shared by the thread findings: conditions are computed over
    the whole table in one vectorised step and only threads where a condition holds at all are
    visited one by one, so a 200-thread, 10 s window is judged in a few milliseconds.

    `demand` is the CPU demand in % (on-CPU % + run-queue wait as %; NaN when both rates are
    n/a, i.e. a thread's first sample), `hot` is `demand >= hot_thread_cpu_pct`.
    """

    def __init__(self, threads: pd.DataFrame, th: Thresholds) -> None:
        df = table_frame({"threads": threads}, "threads")
        pid = df["pid"].to_numpy(dtype=np.int64)
        tid = df["tid"].to_numpy(dtype=np.int64)
        t = df["t_ns"].to_numpy(dtype=np.int64)
        order = np.lexsort((t, tid, pid))
        self.t = t[order]
        self.pid = pid[order]
        self.tid = tid[order]
        self.name = df["name"].to_numpy(dtype=object)[order]
        self.allowed = df["allowed_cpus"].to_numpy(dtype=object)[order]
        self.cpu = df["cpu"].to_numpy(dtype=np.int64)[order]
        self.cpu_pct = df["cpu_pct"].to_numpy(dtype=float)[order]
        self.runq = np.minimum(
            df["runq_ms_per_s"].to_numpy(dtype=float)[order], schema.RUNQ_MAX_MS_PER_S
        )
        self.invol = df["invol_switches"].to_numpy(dtype=np.int64)[order]
        self.mig = df["migrations"].to_numpy(dtype=np.int64)[order]
        both_nan = np.isnan(self.cpu_pct) & np.isnan(self.runq)
        demand = np.nan_to_num(self.cpu_pct) + np.nan_to_num(self.runq) / 10.0
        demand[both_nan] = np.nan
        self.demand = demand
        with np.errstate(invalid="ignore"):
            self.hot = np.nan_to_num(demand >= th.hot_thread_cpu_pct, nan=False).astype(bool)
        n = len(self.t)
        change = np.ones(n, dtype=bool)
        if n > 1:
            change[1:] = (self.pid[1:] != self.pid[:-1]) | (self.tid[1:] != self.tid[:-1])
        self.starts = np.flatnonzero(change)
        self.ends = np.append(self.starts[1:], n)
        self.gid = np.cumsum(change) - 1  # thread index of each row
        self.interval = poll_interval(self.t)  # every thread of a poll shares its t_ns

    def __len__(self) -> int:
        return len(self.t)

    def threads_where(self, cond: np.ndarray) -> Iterable[tuple[int, int, slice]]:
        """(pid, tid, rows) of each thread with at least one row where `cond` holds."""
        for g in np.unique(self.gid[cond]):
            a, b = int(self.starts[g]), int(self.ends[g])
            yield int(self.pid[a]), int(self.tid[a]), slice(a, b)

    def label(self, rows: slice) -> str:
        last = rows.stop - 1
        return subject_label(str(self.name[last]), int(self.tid[last]), int(self.pid[last]))


def as_view(t: pd.DataFrame | ThreadView, th: Thresholds) -> ThreadView:
    return t if isinstance(t, ThreadView) else ThreadView(t, th)
