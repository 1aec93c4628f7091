"""The kernel timeline's window view: a duty-cycled agent's recording windows side by side.

Hand-built windows for the packing itself; the real demo capture (`kdash/data/demo-h200.kdash`:
the demo recorded on the H200 by the agent at its default duty cycle, 112k kernels in 16
"activity on" windows over 20 s) for the strip and the app; the old-agent demo
(`tests/data/h200-demo-old-agent.kdash`, recorded continuously, no windows) where a capture
without windows is needed.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from conftest import store_from_capture
from kdash.tui.lanes import CUT, LABEL_W, UNRECORDED, lane_chars, render_lanes
from kdash.tui.panes.kernels import KernelPane, use_window_view
from kdash.tui.widgets.help import HelpScreen
from kdash.tui.widgets.spark import busy_fraction
from test_tui import plain

from kdash import schema
from kdash.analyses.windows import (
    MIN_SLICE,
    PACK_BELOW,
    allot,
    merge,
    pack,
    packed_axis,
    recorded_share,
    window_rows,
    with_open_window,
)
from kdash.capture import load_capture
from kdash.store import Store

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "kdash" / "data" / "demo-h200.kdash"
OLD = ROOT / "tests" / "data" / "h200-demo-old-agent.kdash"
MS = 1_000_000


def a(*xs) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


# -- packing on hand-built windows ------------------------------------------------------------


def test_merge_sorts_joins_and_drops_empty_windows():
    s, e = merge(a(50, 0, 10, 30, 70, 90), a(60, 10, 20, 45, 70, 95))
    # 0-10 and 10-20 touch: one window; 70-70 is empty
    assert s.tolist() == [0, 30, 50, 90] and e.tolist() == [20, 45, 60, 95]
    s, e = merge(a(0, 5), a(100, 20))  # one inside another
    assert s.tolist() == [0] and e.tolist() == [100]
    assert len(merge(a(), a())[0]) == 0


def test_recorded_share_counts_overlaps_once_and_clips_to_the_range():
    s, e = a(0, 50, 900), a(100, 150, 1100)
    assert recorded_share(s, e, 0, 1000) == pytest.approx((150 + 100) / 1000)
    assert recorded_share(s, e, 200, 800) == 0.0
    assert recorded_share(a(), a(), 0, 10) == 0.0


def test_allot_shares_columns_by_duration_with_a_floor():
    got = allot(np.array([100, 100, 20]), 40, floor=4)
    assert got.sum() == 40 and got.min() >= 4
    assert got[0] == got[1] > got[2]  # equal windows, equal slices; a clipped one less
    assert allot(np.array([1, 1, 1]), 10).sum() == 10


def test_pack_keeps_the_last_windows_that_fit():
    # 10 windows of 100 ms, one a second; 40 columns at 12 each (and a cut) hold 3
    starts = np.arange(10, dtype=np.int64) * 1_000 * MS
    ends = starts + 100 * MS
    p = pack(starts, ends, 0, 10_000 * MS, 40)
    assert p is not None and p.in_range == 10 and len(p.starts) == 3
    assert p.starts.tolist() == starts[-3:].tolist()
    assert int(p.widths.sum()) + len(p.cuts) == 40 == p.bins
    assert p.first.tolist() == [0, int(p.widths[0]) + 1, int(p.widths[:2].sum()) + 2]
    assert p.in_range_ns == 10 * 100 * MS
    # a window's start lands on its slice's first column, its end on the slice's end, a time
    # between two windows on the cut between them
    pos = p.positions(np.array([p.starts[1], p.ends[1], (p.ends[1] + p.starts[2]) // 2]))
    assert pos[0] == p.first[1] and pos[1] == p.first[1] + p.widths[1]
    assert p.first[2] - 1 <= pos[2] <= p.first[2]
    mid = p.positions(np.array([p.starts[2] + 50 * MS]))[0]
    assert mid == pytest.approx(p.first[2] + p.widths[2] / 2)
    # the column map: slices and cuts
    assert p.slice_of(0) == 0 and p.slice_of(int(p.cuts[0])) == -1 and p.slice_of(39) == 2
    # zoomed in to two windows: both shown, each wider; none in a gap: nothing to pack
    z = pack(starts, ends, 7_000 * MS, 9_000 * MS, 40)
    assert z is not None and len(z.starts) == 2 and z.widths.min() > p.widths.max()
    assert pack(starts, ends, 150 * MS, 900 * MS, 40) is None


def test_pack_clips_windows_at_the_range_edges():
    starts, ends = a(0, 1_000 * MS), a(100 * MS, 1_100 * MS)
    p = pack(starts, ends, 50 * MS, 1_020 * MS, 60)
    assert p.starts.tolist() == [50 * MS, 1_000 * MS]
    assert p.ends.tolist() == [100 * MS, 1_020 * MS]
    assert p.widths[0] > p.widths[1]  # 50 ms against 20 ms


def test_open_window_from_kernels_after_the_last_window():
    # kernels at 150-160 and 170-180 after the window 0-100 closed: an open window 150-180
    s, e = with_open_window(a(0), a(100), a(10, 150, 170), a(20, 160, 180), 200)
    assert s.tolist() == [0, 150] and e.tolist() == [100, 180]
    s, e = with_open_window(a(), a(), a(40, 60), a(50, 130), 100)  # no window row yet at all
    assert s.tolist() == [40] and e.tolist() == [100]  # cut at the range's end
    s, e = with_open_window(a(0), a(100), a(10, 50), a(20, 60), 200)
    assert s.tolist() == [0] and e.tolist() == [100]


def test_packed_axis_labels_each_slice_and_marks_the_cuts():
    starts = a(0, 2_000 * MS, 5_000 * MS)
    p = pack(starts, starts + 100 * MS, 0, 6_000 * MS, 50)
    axis = packed_axis(p, lambda t: f"{t / 1e9:.1f}s")
    assert len(axis) == 50
    assert [axis[c] for c in p.cuts.tolist()] == ["┼", "┼"]
    for t, f in zip(p.starts.tolist(), p.first.tolist(), strict=True):
        label = f"{t / 1e9:.1f}s"
        assert axis[f : f + len(label)] == label


def test_use_window_view_default_and_choice():
    assert use_window_view(None, True, PACK_BELOW / 2)
    assert not use_window_view(None, True, PACK_BELOW)
    assert not use_window_view(None, False, 0.0)  # continuous activity: nothing to pack
    assert not use_window_view(False, True, 0.01)
    assert use_window_view(True, True, 0.9)
    assert not use_window_view(True, False, 0.0)


def test_packed_strip_on_hand_built_kernels():
    """Three windows; a kernel fills the middle one, nothing runs in the others: its slice is
    full, the others blank, the cuts drawn, no bin "not recorded"."""
    ws = a(0, 1_000 * MS, 2_000 * MS)
    we = ws + 100 * MS
    kernels = schema.make_batch(
        "kernels",
        start_ns=a(1_000 * MS),
        end_ns=a(1_100 * MS),
        name=["k"],
        device=np.zeros(1, dtype=np.int16),
        stream=a(7),
    )
    markers = schema.make_batch(
        "markers",
        start_ns=ws,
        end_ns=we,
        name=["activity on"] * 3,
        domain=["kdash"] * 3,
        pid=np.zeros(3, dtype=np.int64),
        tid=np.full(3, -1, dtype=np.int64),
    )
    width = 12 + 44
    p = pack(*window_rows(markers), 0, 2_100 * MS, width - LABEL_W)
    text = render_lanes(kernels, markers, 0, 2_100 * MS, width, None, packing=p).plain
    lines = text.splitlines()
    lane = lines[0][LABEL_W:]
    assert len(lane) == 44 and UNRECORDED not in lane
    assert [lane[c] for c in p.cuts.tolist()] == [CUT, CUT]
    first, mid, last = (lane[f : f + w] for f, w in zip(p.first, p.widths, strict=True))
    assert set(first) == {" "} and set(mid) == {"█"} and set(last) == {" "}
    assert lines[1][LABEL_W:].startswith("0.0s") and "1.0s" in lines[1]
    assert "3 recorded windows side by side" in text and "14.3% of 2.1 s recorded" in text


# -- the real demo and its recording windows ---------------------------------------------------


@pytest.fixture(scope="module")
def demo():
    return load_capture(DEMO)


def duty_cycled(cap) -> tuple[Store, int, int]:
    """The demo as recorded (its own windows): the store, and the capture's window."""
    t0, t1 = int(cap.meta["window"]["start_ns"]), int(cap.meta["window"]["end_ns"])
    return store_from_capture(cap), t0, t1


def window_starts(cap) -> np.ndarray:
    return window_rows(store_from_capture(cap).get("markers"))[0]


def test_packed_lane_matches_busy_fraction_per_window(demo):
    """Each slice of the packed lane is the real kernels' busy share over that window alone,
    binned at the slice's width (spark.busy_fraction, the reference binning)."""
    store, t0, t1 = duty_cycled(demo)
    kb = store.get("kernels", t0, t1)
    mb = store.get("markers", None, t1)
    ws, we = window_rows(mb)
    assert recorded_share(ws, we, t0, t1) < PACK_BELOW
    width = 200
    p = pack(ws, we, t0, t1, width - LABEL_W)
    assert len(p.starts) == min(p.in_range, (width - LABEL_W + 1) // (MIN_SLICE + 1)) > 1
    text = render_lanes(kb, mb, t0, t1, width, None, packing=p).plain
    lane = next(ln for ln in text.splitlines() if ln.startswith("GPU0 s7"))[LABEL_W:]
    assert UNRECORDED not in lane
    busy = 0
    for s, e, f, w in zip(p.starts, p.ends, p.first, p.widths, strict=True):
        frac = busy_fraction(kb["start_ns"], kb["end_ns"], int(s), int(e), int(w))
        frac[frac < 1e-9] = 0.0  # its float rounding leaves ~1e-14 in some empty bins
        want = lane_chars(frac, None)
        assert lane[f : f + w] == want
        busy += bool(want.strip())
    assert busy > len(p.starts) / 2  # the demo's kernels ran in most windows


def _demo_app(make_app, demo, store):
    meta = dict(demo.meta)
    meta["capture_path"] = str(DEMO)
    return make_app(store=store, meta=meta, mode="replay")


async def _ready(pilot, pane: KernelPane) -> None:
    for _ in range(200):
        await pilot.pause(0.05)
        if pane.analyses_applied > 0 and pane.table.row_count:
            await pilot.pause()
            return
    raise AssertionError("the kernel analysis never arrived")


def _lane(pane) -> str:
    return next(ln for ln in plain(pane.lanes).splitlines() if ln.startswith("GPU0 s7"))


@pytest.mark.parametrize("size", [(120, 40), (200, 50)], ids=["120x40", "200x50"])
async def test_window_view_is_the_default_under_a_duty_cycle(make_app, demo, size):
    store, t0, t1 = duty_cycled(demo)
    n_windows = len(window_starts(demo))
    assert n_windows == 16
    app = _demo_app(make_app, demo, store)
    async with app.run_test(size=size) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.pause()
        text = plain(pane.lanes)
        assert pane.packed and "recorded windows side by side" in text
        lane = _lane(pane)[LABEL_W:]
        assert CUT in lane and UNRECORDED not in lane
        shown = lane.count(CUT) + 1
        assert f"last {shown} of {n_windows}" in text or (shown == n_windows)
        axis = next(ln for ln in text.splitlines() if "┼" in ln)
        assert axis.count("┼") == shown - 1 and "s─" in axis
        # w: the continuous axis, almost all "not recorded"; w again: back
        pane.table.focus()
        await pilot.press("w")
        await pilot.pause()
        assert not pane.packed
        lane = _lane(pane)[LABEL_W:].rstrip()
        assert lane.count(UNRECORDED) > len(lane) / 2 and CUT not in lane
        assert "not recorded (agent duty cycle" in plain(pane.lanes)
        await pilot.press("w")
        await pilot.pause()
        assert pane.packed
        # zoom in on the end: fewer windows in the range, so each is wider; pan goes back
        before = _lane(pane).count(CUT)
        for _ in range(3):
            await pilot.press("plus")
        await pilot.pause()
        after = _lane(pane).count(CUT)
        assert pane.packed and after < before


def _axis_labels(pane) -> list[float]:
    """The slices' start times on the window view's axis (the line under the lanes)."""
    lines = plain(pane.lanes).splitlines()
    axis = next(ln for ln in lines if ln.startswith(" " * LABEL_W) and "─" in ln)
    return [float(x) for x in re.findall(r"(-?\d+\.\d)s", axis)]


async def test_zoom_and_pan_choose_the_windows_shown(make_app, demo):
    store, t0, t1 = duty_cycled(demo)
    app = _demo_app(make_app, demo, store)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        app.query_one("#cpu").focus()  # ← → pan (no table in focus)
        await pilot.pause()
        whole = _axis_labels(pane)
        for _ in range(3):  # 20 s -> 2.5 s at the end: one window in the range
            await pilot.press("plus")
        await pilot.pause()
        assert pane.packed
        end = _axis_labels(pane)
        assert len(end) < len(whole) and max(end) == max(whole)
        for _ in range(8):  # 8 quarter-windows earlier: 5 s
            await pilot.press("left")
        await pilot.pause()
        assert app.offset_s > 0 and pane.packed
        earlier = _axis_labels(pane)
        assert earlier and max(earlier) < max(end)
        # the labels are the starts of the last windows shown, as far apart as they were
        ws = window_starts(demo)[-len(whole) :] / 1e9
        assert len(whole) > 1
        assert np.allclose(np.diff(whole), np.diff(ws), atol=0.1)


async def test_w_says_so_when_there_are_no_windows(make_app):
    old = load_capture(OLD)  # recorded continuously: no windows
    app = _demo_app(make_app, old, store_from_capture(old))
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        assert not pane.packed
        pane.table.focus()
        await pilot.press("w")
        await pilot.pause()
        assert not pane.packed and pane.window_choice is None
        assert any("recorded continuously" in str(n.message) for n in app._notifications)


async def test_help_lists_w(make_app, demo):
    app = _demo_app(make_app, demo, store_from_capture(demo))
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = plain(app.screen.query_one("#help-table"))
        assert "kernel timeline: windows side by side / continuous time" in text


async def test_window_view_at_80x24_and_w_from_the_folded_pane(make_app, demo):
    """At 80x24 the table is folded into one line: the pane itself takes focus, so `w` works
    there, and ← → pan (there is no table in view to scroll)."""
    store, _, _ = duty_cycled(demo)
    app = _demo_app(make_app, demo, store)
    async with app.run_test(size=(80, 24)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.pause()
        assert app.has_class("-compact") and pane.packed
        lines = plain(pane.lanes).splitlines()
        assert CUT in _lane(pane) and any("┼" in ln for ln in lines)
        assert pane.focus_target() is pane
        pane.focus_target().focus()
        await pilot.press("w")
        await pilot.pause()
        assert not pane.packed and UNRECORDED in _lane(pane)
        await pilot.press("plus", "left")
        await pilot.pause()
        assert app.offset_s > 0


SHIPPED = sorted((ROOT / "tests" / "data").glob("*.kdash")) + sorted(
    (ROOT / "kdash" / "data").glob("*.kdash")
)


@pytest.mark.parametrize("path", SHIPPED, ids=[p.name for p in SHIPPED])
def test_shipped_captures_with_recording_windows(path):
    """Every shipped capture whose agent wrote "activity on" windows: its packed lanes are its
    kernels' busy share per window, and the legend's share is the windows' share of the
    capture (the bundled demo and h200-demo-duty-untrimmed.kdash have them: recorded on the
    H200 at the default duty cycle)."""
    cap = load_capture(path)
    store = store_from_capture(cap)
    t0, t1 = int(cap.meta["window"]["start_ns"]), int(cap.meta["window"]["end_ns"])
    mb = store.get("markers", None, t1)
    ws, we = window_rows(mb)
    kb = store.get("kernels", t0, t1)
    if len(ws) == 0 or len(kb["start_ns"]) == 0:
        pytest.skip(f"{path.name} has no recording windows with kernels")
    width = 200
    p = pack(ws, we, t0, t1, width - LABEL_W)
    assert p is not None and p.in_range_ns == pytest.approx(
        recorded_share(ws, we, t0, t1) * (t1 - t0)
    )
    text = render_lanes(kb, mb, t0, t1, width, None, packing=p).plain
    for line in (ln for ln in text.splitlines() if ln.startswith("GPU")):
        assert UNRECORDED not in line[LABEL_W:]
    one = (kb["device"] == kb["device"][0]) & (kb["stream"] == kb["stream"][0])
    label = f"GPU{int(kb['device'][0])} s{int(kb['stream'][0])}"
    lane = next(ln for ln in text.splitlines() if ln.startswith(label))[LABEL_W:]
    for s, e, f, w in zip(p.starts, p.ends, p.first, p.widths, strict=True):
        frac = busy_fraction(kb["start_ns"][one], kb["end_ns"][one], int(s), int(e), int(w))
        frac[frac < 1e-9] = 0.0
        assert lane[f : f + w] == lane_chars(frac, None)
