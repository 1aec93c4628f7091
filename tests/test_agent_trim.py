"""Records cut by a window's end (collectors/agent/trim.py): on the real duty-cycled demo
recorded on the H200, and on hand-made rows for each rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kdash.collectors.agent.trim import trim_to_windows

# the demo recorded on the H200 at the default duty cycle before trimming existed (raw; the
# bundled demo is this recording trimmed)
DUTY = Path(__file__).resolve().parent / "data" / "h200-demo-duty-untrimmed.kdash"


def arr(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def test_each_rule_on_hand_made_rows() -> None:
    windows = [(100, 200, True), (300, 400, False), (500, 600, True)]
    start = arr(50, 110, 150, 250, 350, 390, 610, 700)
    end = arr(60, 120, 900, 260, 360, 450, 620, 710)
    keep, new_end, clipped, dropped = trim_to_windows(start, end, windows, open_since=700)
    # before any window: kept; inside, ends in time: kept; inside a cut window, past its end:
    # clipped; in the off time after a cut window: dropped; inside / past a continuous
    # period row: kept as is; after the last cut window, before recording opened: dropped;
    # in the open window: kept
    assert keep.tolist() == [True, True, True, False, True, True, False, True]
    assert new_end.tolist() == [60, 120, 200, 260, 360, 450, 620, 710]
    assert (clipped, dropped) == (1, 2)


def test_nothing_known_changes_nothing() -> None:
    keep, new_end, clipped, dropped = trim_to_windows(arr(1, 2), arr(3, 4), [], None)
    assert keep.all() and new_end.tolist() == [3, 4] and (clipped, dropped) == (0, 0)


def test_the_h200_duty_cycled_demo_loses_its_impossible_durations() -> None:
    """The real capture (recorded before this trimming existed): 188 kernel records longer than
    1 ms, all around window ends, made kernels of ~2 µs average 200 µs. Trimmed against the
    capture's own windows (all ended by a switch-off at this duty cycle), no record is longer
    than its window, none lies outside every window, and the typical kernel is unchanged."""
    import kdash

    t = kdash.read_capture(DUTY)
    k, m = t["kernels"], t["markers"]
    w = m[m["name"] == "activity on"]
    if len(w) == 0:
        pytest.skip("the bundled demo has no recording windows (an older capture)")
    windows = [(int(s), int(e), True) for s, e in zip(w["start_ns"], w["end_ns"], strict=True)]
    s, e = k["start_ns"].to_numpy(), k["end_ns"].to_numpy()
    assert ((e - s) > 1_000_000).sum() > 100  # the problem is in the data
    keep, new_end, clipped, dropped = trim_to_windows(s, e, windows, None)
    assert clipped > 0 and dropped > 0 and keep.sum() > 0.99 * len(s)
    d = new_end[keep] - s[keep]
    longest_window = max(we - ws for ws, we, _ in windows)
    assert d.max() <= longest_window
    ws = np.array(sorted(x[0] for x in windows))
    we = np.array(sorted(x[1] for x in windows))
    i = np.searchsorted(ws, s[keep], side="right") - 1
    assert (i >= 0).all() and (s[keep] <= we[i]).all() and (new_end[keep] <= we[i]).all()
    assert np.median(d) == pytest.approx(np.median(e - s), rel=0.05)
    rsqrt = k["name"].str.contains("rsqrt").to_numpy()
    before, after = (e - s)[rsqrt].mean(), d[rsqrt[keep]].mean()
    assert before > 50_000 and after < 20_000  # 200 µs on average before; a few µs after
    # with the streams: near a switch-off no kernel outlasts the next one on its stream
    dev, st = k["device"].to_numpy(), k["stream"].to_numpy()

    def overlap_ns(end_: np.ndarray) -> int:
        o = np.lexsort((s[keep], st[keep], dev[keep]))
        ss, ee, dd, tt = s[keep][o], end_[o], dev[keep][o], st[keep][o]
        same = (dd[1:] == dd[:-1]) & (tt[1:] == tt[:-1])
        return int(np.clip(ee[:-1] - ss[1:], 0, None)[same].sum())

    assert overlap_ns(new_end[keep]) > 100_000_000  # 161 ms of overlap with the windows alone
    keep2, end2, clipped2, dropped2 = trim_to_windows(s, e, windows, None, (dev, st))
    assert (keep2 == keep).all() and dropped2 == dropped and clipped2 > clipped
    assert overlap_ns(end2[keep]) < 1_000_000
    assert np.median(end2[keep] - s[keep]) == pytest.approx(np.median(d), rel=0.01)


def test_the_next_kernel_on_a_stream_bounds_an_end_near_a_switch_off() -> None:
    windows = [(0, 100_000_000, True)]
    start = arr(99_000_000, 99_100_000, 10, 20)
    end = arr(100_000_000, 99_200_000, 30, 40)  # the first overlaps the second (same stream)
    dev = arr(0, 0, 0, 0)
    st = arr(7, 7, 9, 9)  # far from the switch-off, stream 9's overlap is left as recorded
    keep, new_end, clipped, dropped = trim_to_windows(start, end, windows, None, (dev, st))
    assert keep.all() and new_end.tolist() == [99_100_000, 99_200_000, 30, 40]
    assert (clipped, dropped) == (1, 0)


def test_the_outbox_trims_what_it_sends_to_the_windows_it_sent() -> None:
    """The agent's outbox end to end (in-process, numpy rows as CUPTI's decoder gives them): a
    kernel cut by a window's switch-off reaches the client clipped, one that began while off
    never reaches it, and a continuous period row cuts nothing."""
    from kdash.collectors.agent import wire
    from kdash.collectors.agent.outbox import Outbox

    from kdash.schema import TABLES

    def rows(starts, ends):
        n = len(starts)
        cols = {c: np.zeros(n, dtype=object if t == "str" else t) for c, t in TABLES["kernels"]}
        cols["name"][:] = "k"
        cols["start_ns"], cols["end_ns"] = arr(*starts), arr(*ends)
        return {"kernels": cols}

    box = Outbox(pid=1)  # the rows as the agent decodes them: every schema column
    frames: list[bytes] = []
    strings = wire.StringEncoder(1000, 1 << 20, 200)
    box.sink(rows([110, 150], [120, 900]))
    box.add_window(100, 200)  # a duty-cycle window, switched off at 200
    box.sink(rows([250, 310], [1300, 320]))  # began while off; then inside a continuous row
    box.add_window(300, 400, False)
    box.send(frames.append, strings, offset_ns=0, open_since=None)
    dec = wire.Decoder()
    got = [dec.decode(f) for data in frames for f in wire.split_frames(data)]
    k = [m for m in got if m.type == wire.MsgType.BATCH and m.table == "kernels"]
    assert len(k) == 1
    assert k[0].body["start_ns"].tolist() == [110, 150, 310]
    assert k[0].body["end_ns"].tolist() == [120, 200, 320]
    assert (box.trimmed_rows, box.dropped_off_rows) == (1, 1)


def test_a_graph_launch_in_a_windows_api_records_forbids_the_next_release() -> None:
    """The controller's buffer callback: an API record of a graph launch marks the process as
    replaying graphs (its kernels' records may not have come yet), so no finalize follows the
    window; other API records do not. Real controller, no CUPTI needed for this part."""
    from kdash.collectors.agent.controller import CuptiActivity

    c = CuptiActivity(1)
    c._note_graphs({"api": {"name": np.array(["cudaLaunchKernel"] * 3, dtype=object)}})
    assert not c.graphs_seen
    assert c.release_between_windows(0.0) != "finalized"  # no CUPTI here: nothing to finalize
    names = np.array(["cudaLaunchKernel", "cuGraphLaunch"], dtype=object)
    c._note_graphs({"api": {"name": names}})
    assert c.graphs_seen and not c.graph_kernels_recorded
    assert c.release_between_windows(0.0) == "the target replays CUDA graphs"
