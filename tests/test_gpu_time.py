"""GPU time accounting (kdash.analyses.gpu_time): busy, kernel, copy and idle time per GPU.

Two kinds of data: MADE-UP interval sets (built below, each said to be one) for the cases the
accounting has to get right, and every shipped capture and trace (real CUPTI and Kineto
records from the H200), checked against a union computed another way: a sweep over +1/-1
events instead of sorting and merging intervals.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kdash import kineto, schema
from kdash.analyses.gpu_time import account, complement, gpu_time_text, merge
from kdash.analyses.kernel_findings import ADVICE, SHORT, idle_findings, idle_summaries
from kdash.capture import load_capture

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = sorted((ROOT / "tests" / "data").glob("*.kdash")) + [
    ROOT / "kdash" / "data" / "demo-h200.kdash"
]
TRACES = sorted((ROOT / "tests" / "data").glob("*.trace.json.gz"))
US = 1_000


def _kernels(rows, device: int = 0, pid: int = 100):
    """MADE-UP kernels: (start_us, end_us, correlation_id)."""
    return schema.to_frame(
        "kernels",
        schema.make_batch(
            "kernels",
            start_ns=np.array([r[0] * US for r in rows], dtype=np.int64),
            end_ns=np.array([r[1] * US for r in rows], dtype=np.int64),
            name=[f"k{r[2]}" for r in rows],
            device=np.full(len(rows), device, dtype=np.int16),
            stream=np.full(len(rows), 7),
            pid=np.full(len(rows), pid),
            correlation_id=np.array([r[2] for r in rows], dtype=np.int64),
        ),
    )


def _copies(rows, device: int = 0):
    """MADE-UP copies: (start_us, end_us, correlation_id, kind)."""
    return schema.to_frame(
        "memcpy",
        schema.make_batch(
            "memcpy",
            start_ns=np.array([r[0] * US for r in rows], dtype=np.int64),
            end_ns=np.array([r[1] * US for r in rows], dtype=np.int64),
            kind=[r[3] for r in rows],
            bytes=np.full(len(rows), 8 << 20),
            device=np.full(len(rows), device, dtype=np.int16),
            stream=np.full(len(rows), 9),
            pid=np.full(len(rows), 100),
            correlation_id=np.array([r[2] for r in rows], dtype=np.int64),
        ),
    )


def _api(rows):
    """MADE-UP API calls: (start_us, end_us, name, tid, correlation_id)."""
    return schema.to_frame(
        "api",
        schema.make_batch(
            "api",
            start_ns=np.array([r[0] * US for r in rows], dtype=np.int64),
            end_ns=np.array([r[1] * US for r in rows], dtype=np.int64),
            name=[r[2] for r in rows],
            pid=np.full(len(rows), 100),
            tid=np.array([r[3] for r in rows], dtype=np.int64),
            correlation_id=np.array([r[4] for r in rows], dtype=np.int64),
        ),
    )


def _windows(rows, pid: int = 100):
    """MADE-UP "activity on" rows of a duty-cycled agent: (start_us, end_us)."""
    return schema.to_frame(
        "markers",
        schema.make_batch(
            "markers",
            start_ns=np.array([r[0] * US for r in rows], dtype=np.int64),
            end_ns=np.array([r[1] * US for r in rows], dtype=np.int64),
            name=["activity on"] * len(rows),
            domain=["kdash"] * len(rows),
            pid=np.full(len(rows), pid),
            tid=np.full(len(rows), -1),
        ),
    )


# -- interval arithmetic --------------------------------------------------------------------------
def test_merge_and_complement():
    s, e = merge(np.array([5, 0, 2, 20, 10]), np.array([8, 3, 4, 25, 10]))
    # [0,3) and [2,4) overlap; [5,8); [10,10) is a zero-length record; [20,25)
    assert s.tolist() == [0, 5, 10, 20] and e.tolist() == [4, 8, 10, 25]
    s, e = merge(np.array([0, 3]), np.array([3, 6]))  # touching: one interval, no empty gap
    assert s.tolist() == [0] and e.tolist() == [6]
    gs, ge = complement((np.array([0, 100]), np.array([50, 200])), (np.array([0, 10, 120]),
                        np.array([5, 20, 200])))  # fmt: skip
    assert list(zip(gs.tolist(), ge.tolist(), strict=True)) == [(5, 10), (20, 50), (100, 120)]


# -- made-up interval sets ------------------------------------------------------------------------
def test_overlapping_kernels_count_once_and_gaps_split_short_and_long():
    """MADE-UP: two streams' kernels overlap (0-100 and 50-150), then a 30 µs gap, a kernel,
    a 300 µs gap and a last kernel."""
    k = _kernels([(0, 100, 1), (50, 150, 2), (180, 200, 3), (500, 600, 4)])
    (t,) = account(k).gpus
    assert t.recorded_ns == 600 * US  # no windows: the span of the records
    assert t.kernel_ns == t.busy_ns == (150 + 20 + 100) * US
    assert t.copy_ns == 0
    assert t.idle_ns == 330 * US
    assert (t.short_gaps, t.short_gap_idle_ns, t.short_gap_median_us) == (1, 30 * US, 30.0)
    assert (t.long_gaps, t.long_gap_idle_ns) == (1, 300 * US)
    assert t.idle_by_cause_ns == {"unknown": 300 * US}  # no API rows
    assert gpu_time_text(t, with_copies=False) == (
        "GPU0 busy 45% (kernels 45%) · idle 55%: 5% in 1 gaps <100 µs, 50% longer (unknown 100%)"
    )


def test_copies_are_busy_never_idle_nor_host():
    """MADE-UP, the shape of the shipped EXTEND trace: the host launches k2 late, but an 8 MiB
    host-to-device copy runs on the GPU for most of that time. Without the copy the whole
    gap would be charged to `host`; with it only what is left around the copy is idle, and a
    copy that runs beside a kernel adds copy time but no busy time."""
    k = _kernels([(0, 100, 1), (1000, 1100, 2)])
    api = _api([(0, 5, "cudaLaunchKernel", 42, 1), (150, 160, "cudaMemcpyAsync", 42, 3),
                (990, 995, "cudaLaunchKernel", 42, 2)])  # fmt: skip
    (alone,) = account(k, None, None, api).gpus
    assert alone.idle_by_cause_ns == {"host": 900 * US}
    copies = _copies([(170, 870, 3, "HtoD"), (20, 60, 5, "DtoD")])  # the second beside k1
    acc = account(k, copies, None, api)
    (t,) = acc.gpus
    assert t.kernel_ns == 200 * US and t.copy_ns == (700 + 40) * US
    assert t.busy_ns == (200 + 700) * US  # the DtoD copy ran under k1
    assert t.idle_ns == t.recorded_ns - t.busy_ns == (70 + 130) * US
    # 100-170 µs ended by the copy (its own call explains it), 870-1000 µs by k2's launch
    assert (t.short_gaps, t.short_gap_idle_ns) == (1, 70 * US)
    assert t.long_gaps == 1 and sum(t.idle_by_cause_ns.values()) == 130 * US
    (g,) = acc.gaps.itertuples()
    assert (g.start_ns, g.end_ns, g.next_name) == (870 * US, 1000 * US, "k2")
    assert "busy 82% (kernels 18%, copies 67%)" in gpu_time_text(t)


def test_a_gap_ended_by_a_copy_is_explained_by_the_copys_call():
    """MADE-UP: the GPU waits 400 µs, then a copy starts: its launch call explains the gap."""
    k = _kernels([(0, 100, 1), (900, 950, 2)])
    copies = _copies([(500, 800, 3, "HtoD")])
    api = _api([(0, 5, "cudaLaunchKernel", 42, 1), (480, 490, "cudaMemcpyAsync", 42, 3),
                (850, 855, "cudaLaunchKernel", 42, 2)])  # fmt: skip
    acc = account(k, copies, None, api)
    g, after = acc.gaps.itertuples()
    assert (g.start_ns, g.end_ns, g.next_name, g.cause) == (100 * US, 500 * US, "HtoD copy", "host")
    assert g.prev_call == "cudaLaunchKernel" and g.launch_us == pytest.approx(380.0)
    assert (after.start_ns, after.next_name) == (800 * US, "k2")


def test_windows_bound_the_recorded_time_and_per_agent():
    """MADE-UP: a duty-cycled agent recorded 0-1 ms and 10-11 ms. Idle runs from each window's
    start to its first record and from its last record to its end; the 9 ms between windows
    is not recorded. Another agent's windows (pid 200) do not count for this GPU."""
    k = _kernels([(100, 200, 1), (700, 950, 2), (10_000, 10_300, 3), (10_800, 11_000, 4)])
    w = pd.concat([_windows([(0, 1000), (10_000, 11_000)]), _windows([(3000, 4000)], pid=200)])
    (t,) = account(k, None, w).gpus
    assert t.duty_cycled and t.recorded_ns == 2000 * US
    assert t.busy_ns == (100 + 250 + 300 + 200) * US
    assert t.idle_ns == 1150 * US
    # short: 950-1000 µs; long (>= 100 µs): 0-100, 200-700, 10300-10800
    assert (t.short_gaps, t.short_gap_idle_ns) == (1, 50 * US)
    assert (t.long_gaps, t.long_gap_idle_ns) == (3, 1100 * US)
    # a kernel outside every window (the live tail) is still recorded, as busy time
    k2 = pd.concat([k, _kernels([(20_000, 20_100, 5)])], ignore_index=True)
    (t2,) = account(k2, None, w).gpus
    assert t2.recorded_ns == 2100 * US and t2.idle_ns == t.idle_ns


def test_two_gpus_are_accounted_apart():
    k = pd.concat([_kernels([(0, 100, 1), (150, 250, 2)]), _kernels([(0, 500, 3)], device=1)])
    a, b = account(k).gpus
    assert (a.gpu, a.busy_ns, a.idle_ns, a.short_gaps) == (0, 200 * US, 50 * US, 1)
    assert (b.gpu, b.busy_ns, b.idle_ns) == (1, 500 * US, 0)


def test_a_launch_bound_loop_reads_launch_bound():
    """MADE-UP, the shape of the issue's unprepared generate loop: 5 µs kernels every 40 µs
    from one thread. The old line counted only gaps >= 100 µs and said the GPU was nearly
    never idle; the accounting says 12% busy, and the finding's advice is the launch-bound
    one, naming the launching thread."""
    n = 2000
    ks = [(i * 40, i * 40 + 5, i + 1) for i in range(n)]
    calls = [(i * 40 - 8, i * 40 - 3, "cudaLaunchKernel", 4242, i + 1) for i in range(n)]
    k, api = _kernels(ks), _api(calls)
    (t,) = account(k, None, None, api).gpus
    assert t.share(t.busy_ns) == pytest.approx(5 / 40, abs=1e-3)
    assert t.short_gaps == n - 1 and t.long_gaps == 0
    (d,) = idle_summaries(k, api)
    assert d.top == SHORT and d.feeder == 4242 and d.severity == "warning"
    (f,) = idle_findings(k, api)
    assert f.advice == ADVICE[SHORT]
    assert "in 2.0k gaps <100 µs" in f.evidence and "median 35.0 µs" in f.evidence
    assert "thread 4242 launched most of its kernels" in f.evidence
    assert f.data["about"] == SHORT and f.data["gpu_time"]["short_gaps"] == n - 1


# -- every shipped capture, against a union computed another way ---------------------------------
def _sweep_union(starts: np.ndarray, ends: np.ndarray) -> int:
    """Covered length of intervals by a sweep: +1 at each start, -1 at each end, length where
    the running count is positive."""
    if not len(starts):
        return 0
    ends = np.maximum(ends, starts)
    pos = np.concatenate([starts, ends])
    delta = np.concatenate([np.ones(len(starts), np.int64), -np.ones(len(ends), np.int64)])
    order = np.lexsort((-delta, pos))  # at one instant, starts before ends: touching joins
    pos, depth = pos[order], np.cumsum(delta[order])
    return int(((pos[1:] - pos[:-1]) * (depth[:-1] > 0)).sum())


def _shipped():
    for p in CAPTURES:
        yield p.name, load_capture(p).tables
    for p in TRACES:
        tables, _ = kineto.read_traces([p])
        yield p.name, {n: schema.to_frame(n, b) for n, b in tables.items()}


@pytest.mark.parametrize("name_tables", list(_shipped()), ids=lambda nt: nt[0])
def test_every_shipped_capture_against_a_sweep(name_tables):
    _name, t = name_tables
    k, m = t["kernels"], t["memcpy"]
    acc = account(k, m, t.get("markers"), t.get("api"))
    devices = sorted(set(k["device"].astype(int)) | set(m["device"].astype(int)))
    assert [g.gpu for g in acc.gpus] == devices
    for g in acc.gpus:
        kd, md = k[k["device"] == g.gpu], m[m["device"] == g.gpu]
        ks, ke = kd["start_ns"].to_numpy(np.int64), kd["end_ns"].to_numpy(np.int64)
        cs, ce = md["start_ns"].to_numpy(np.int64), md["end_ns"].to_numpy(np.int64)
        alls, alle = np.concatenate([ks, cs]), np.concatenate([ke, ce])
        assert g.kernel_ns == _sweep_union(ks, ke)
        assert g.copy_ns == _sweep_union(cs, ce)
        assert g.busy_ns == _sweep_union(alls, alle)
        assert g.kernel_ns <= g.busy_ns <= g.kernel_ns + g.copy_ns
        mk = t.get("markers")
        win = (
            mk[(mk["domain"] == "kdash") & (mk["name"] == "activity on")]
            if mk is not None and not mk.empty
            else None
        )
        if win is None or win.empty:
            # continuous (no windows): recorded is the records' span
            assert not g.duty_cycled
            assert g.recorded_ns == int(np.maximum(alle, alls).max() - alls.min())
        else:
            # the agent duty-cycled (the PC-sampled H200 captures): recorded is the union of
            # its "activity on" windows and the records (a record may start just before a
            # window opens), computed here by a sweep of its own
            assert g.duty_cycled
            ws = np.concatenate([win["start_ns"].to_numpy(np.int64), alls])
            we = np.concatenate([win["end_ns"].to_numpy(np.int64), alle])
            assert g.recorded_ns == _sweep_union(ws, we)
            assert g.recorded_ns < int(np.maximum(alle, alls).max() - alls.min())
        assert g.idle_ns == g.short_gap_idle_ns + sum(g.idle_by_cause_ns.values())
        gaps = acc.gaps[acc.gaps["device"] == g.gpu]
        assert len(gaps) == g.long_gaps and (gaps["gap_us"] >= 100).all()
        assert int((gaps["end_ns"] - gaps["start_ns"]).sum()) == g.long_gap_idle_ns
        # no long gap overlaps any kernel or copy of its GPU
        order = np.argsort(alls)
        s_sorted, reach = alls[order], np.maximum.accumulate(alle[order])
        i = np.searchsorted(s_sorted, gaps["end_ns"].to_numpy(np.int64), side="left") - 1
        ok = i < 0
        ok |= reach[np.maximum(i, 0)] <= gaps["start_ns"].to_numpy(np.int64)
        assert ok.all()
        assert 0 < g.share(g.busy_ns) <= 1


def test_shipped_figures():
    """The shipped captures, in the pane's words (the figures the issue is about)."""
    demo = load_capture(CAPTURES[-1]).tables
    (d,) = account(demo["kernels"], demo["memcpy"], demo["markers"], demo["api"]).gpus
    assert gpu_time_text(d).startswith(
        "GPU0 busy 19% (kernels 17%, copies 1%) · idle 81%: 7% in 113k gaps <100 µs, 74% longer"
    )
    tables, _ = kineto.read_traces([p for p in TRACES if "EXTEND" in p.name])
    t = {n: schema.to_frame(n, b) for n, b in tables.items()}
    (x,) = account(t["kernels"], t["memcpy"], None, t["api"]).gpus
    (no_copies,) = account(t["kernels"], None, None, t["api"]).gpus
    # the 8 MiB copies were ~0.5 ms of "host" idle time when only kernels were looked at
    assert no_copies.idle_by_cause_ns["host"] - x.idle_by_cause_ns.get("host", 0) > 300_000
    assert x.copy_ns > 0.3 * x.recorded_ns
