"""CPU ops' self time and per-thread time (kdash.analyses.cpu_ops), on HAND-MADE nested ranges
and on the REAL CPU-only torch.profiler trace tests/data/cpu-mlp.trace.json.gz
(bench/kineto_cpu_trace.py), checked there against a brute-force computation made here."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kdash import kineto, schema
from kdash.analyses.cpu_ops import cpu_op_threads, has_host_ranges, self_and_depth, top_cpu_ops

TRACE = Path(__file__).parent / "data" / "cpu-mlp.trace.json.gz"


def _ops(rows: list[tuple[int, int, str, int]], domain: str = "cpu_op") -> pd.DataFrame:
    """HAND-MADE markers rows: (start, end, name, tid), pid 1."""
    return schema.to_frame(
        "markers",
        schema.make_batch(
            "markers",
            start_ns=[r[0] for r in rows],
            end_ns=[r[1] for r in rows],
            name=[r[2] for r in rows],
            domain=[domain] * len(rows),
            pid=[1] * len(rows),
            tid=[r[3] for r in rows],
        ),
    )


def test_self_time_of_nested_ops():
    m = _ops(
        [
            (0, 100, "aten::linear", 1),  # holds addmm (10..70) and t (75..80)
            (10, 70, "aten::addmm", 1),  # holds copy_ (20..30)
            (20, 30, "aten::copy_", 1),
            (75, 80, "aten::t", 1),
            (200, 250, "aten::linear", 1),  # no child
            (0, 40, "aten::add", 2),  # another thread: no parent of the ops above
            (30, 60, "aten::mul", 2),  # overlaps add's end: cut there (30..40 counts)
        ]
    )
    s, d = self_and_depth(m["pid"], m["tid"], m["start_ns"], m["end_ns"])
    assert s.tolist() == [35, 50, 10, 5, 50, 30, 30]
    assert d.tolist() == [0, 1, 2, 1, 0, 0, 1]
    top = top_cpu_ops(m)
    assert top["name"].tolist()[0] == "aten::linear"
    lin = top.set_index("name").loc["aten::linear"]
    assert lin["calls"] == 2 and lin["self_ms"] == pytest.approx(85e-6)
    assert lin["total_ms"] == pytest.approx(150e-6) and lin["max_us"] == pytest.approx(0.1)
    assert top["self_pct"].sum() == pytest.approx(100)
    th = cpu_op_threads(m).set_index("tid")
    assert th.loc[1, "busy_ms"] == pytest.approx(150e-6) and th.loc[1, "ops"] == 5
    assert th.loc[2, "busy_ms"] == pytest.approx(40e-6) and th.loc[2, "top_op"] == "aten::add"


def test_only_cpu_ops_count():
    """User annotations and NVTX ranges are markers rows too, but not CPU ops."""
    m = pd.concat(
        [_ops([(0, 100, "aten::mm", 1)]), _ops([(10, 20, "forward", 1)], "user_annotation")],
        ignore_index=True,
    )
    top = top_cpu_ops(m)
    assert top["name"].tolist() == ["aten::mm"] and top["self_ms"][0] == pytest.approx(100e-6)
    assert top_cpu_ops(None).empty and cpu_op_threads(_ops([], "nvtx")).empty


def _brute_force_self(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """One thread's self times the slow way: an op's direct children are the ops inside it
    with no other op between; self = duration - their durations."""
    n = len(starts)
    out = ends - starts
    for i in range(n):
        inside = (starts >= starts[i]) & (ends <= ends[i]) & (np.arange(n) != i)
        inside &= ~((starts == starts[i]) & (ends == ends[i]) & (np.arange(n) < i))
        for j in np.flatnonzero(inside):
            # j is a direct child when no other op inside i holds j
            holders = inside & (starts <= starts[j]) & (ends >= ends[j])
            holders[j] = False
            same = holders & (starts == starts[j]) & (ends == ends[j]) & (np.arange(n) > j)
            if not (holders & ~same).any():
                out[i] -= ends[j] - starts[j]
    return out


def test_real_trace_self_times_against_brute_force():
    tables, _ = kineto.read_traces([TRACE])
    m = schema.to_frame("markers", tables["markers"])
    ops = m[m["domain"] == "cpu_op"].reset_index(drop=True)
    s, d = self_and_depth(ops["pid"], ops["tid"], ops["start_ns"], ops["end_ns"])
    threads = cpu_op_threads(m).set_index("tid")
    assert len(threads) >= 2
    for tid, g in ops.groupby("tid"):
        idx = g.index.to_numpy()
        st, en = g["start_ns"].to_numpy(np.int64), g["end_ns"].to_numpy(np.int64)
        assert s[idx].tolist() == _brute_force_self(st, en).tolist()
        # a thread's self times add up to its time in ops: the union of its ranges
        order = np.argsort(st, kind="stable")
        union, reach = 0, None
        for a, b in zip(st[order].tolist(), en[order].tolist(), strict=True):
            if reach is None or a >= reach:
                union += b - a
                reach = b
            elif b > reach:
                union += b - reach
                reach = b
        assert int(s[idx].sum()) == union
        assert threads.loc[tid, "busy_ms"] == pytest.approx(union / 1e6)
        assert threads.loc[tid, "ops"] == len(g)
    assert (s >= 0).all() and (d.max() > 3)  # torch's call stacks are deep
    top = top_cpu_ops(m)
    assert top["calls"].sum() == len(ops)
    assert top["self_ms"].sum() == pytest.approx(s.sum() / 1e6)


def test_host_ranges_are_more_than_recording_windows():
    windows = schema.make_batch(
        "markers", start_ns=[0], end_ns=[10], name=["activity on"], domain=["kdash"]
    )
    assert not has_host_ranges(windows) and not has_host_ranges(schema.empty("markers"))
    tables, _ = kineto.read_traces([TRACE])
    assert has_host_ranges(tables["markers"])
