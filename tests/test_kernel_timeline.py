"""The kernel timeline pane on a real capture: NVTX lanes, "not recorded" bins, the redraw's
binning, and the top-kernels table's sort, filter and full-name line.

Data: `kdash/data/demo-h200.kdash` (a real H200 capture under the agent at its default duty
cycle: 112k kernels on one stream in 16 "activity on" windows), the same demo as an older agent
recorded it continuously (`tests/data/h200-demo-old-agent.kdash`, no windows) and the real Kineto
trace `tests/data/kdash-h200-TP-0-DECODE.trace.json.gz` (real user annotations -> markers).
Recording windows are MADE UP where a test needs them on the continuous capture:
`_with_windows` says so and builds them in the agent's row format (domain "kdash", name
"activity on", tid -1).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import store_from_capture
from kdash.tui.lanes import CUT
from kdash.tui.panes.kernels import (
    SORTS,
    UNRECORDED,
    KernelPane,
    coverage,
    render_lanes,
    sort_top,
    top_summary,
)
from kdash.tui.widgets.help import HelpScreen
from kdash.tui.widgets.spark import busy_fraction
from test_tui import plain

from kdash import kineto, schema
from kdash.analyses.kernels import top_kernels
from kdash.capture import load_capture
from kdash.names import short_names

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "kdash" / "data" / "demo-h200.kdash"
OLD = ROOT / "tests" / "data" / "h200-demo-old-agent.kdash"
TRACE = ROOT / "tests" / "data" / "kdash-h200-TP-0-DECODE.trace.json.gz"


@pytest.fixture(scope="module")
def demo():
    return load_capture(DEMO)


@pytest.fixture(scope="module")
def old():
    return load_capture(OLD)


def _with_windows(store, t0: int, t1: int, period_ns: int, on_ns: int) -> None:
    """MADE-UP recording windows ("activity on", domain "kdash") every `period_ns`."""
    ws = np.arange(t0, t1, period_ns, dtype=np.int64)
    store.append(
        "markers",
        schema.make_batch(
            "markers",
            start_ns=ws,
            end_ns=ws + on_ns,
            name=["activity on"] * len(ws),
            domain=["kdash"] * len(ws),
            pid=np.zeros(len(ws), dtype=np.int64),
            tid=np.full(len(ws), -1, dtype=np.int64),
        ),
    )


def _demo_app(make_app, demo, store=None):
    meta = dict(demo.meta)
    meta["capture_path"] = str(DEMO)
    return make_app(store=store or store_from_capture(demo), meta=meta, mode="replay")


async def _ready(pilot, pane: KernelPane) -> None:
    for _ in range(200):
        await pilot.pause(0.05)
        if pane.analyses_applied > 0 and pane.table.row_count:
            await pilot.pause()
            return
    raise AssertionError("the kernel analysis never arrived")


def test_one_pass_coverage_matches_busy_fraction_per_lane(demo):
    """The single bincount pass gives what the per-lane `busy_fraction` gave, on real kernels
    split into made-up lanes (the demo has one stream)."""
    k = demo.tables["kernels"]
    starts, ends = k["start_ns"].to_numpy(np.int64), k["end_ns"].to_numpy(np.int64)
    lane = np.arange(len(k)) % 3
    since = int(starts.min()) + 2_000_000_000
    until = since + 500_000_000  # a zoomed window: kernels cross both edges
    for bins in (1, 68, 188):
        got = coverage(lane, 3, starts, ends, since, until, bins)
        for n in range(3):
            want = busy_fraction(starts[lane == n], ends[lane == n], since, until, bins)
            np.testing.assert_allclose(got[n], want, atol=1e-6)
        assert got.max() > 0


def test_nvtx_lanes_from_real_kineto_annotations():
    tables, _ = kineto.read_traces([TRACE])
    k, m = tables["kernels"], tables["markers"]
    assert len(m["start_ns"]) and "kdash" not in set(m["domain"])
    since, until = int(min(k["start_ns"].min(), m["start_ns"].min())), int(m["end_ns"].max())
    text = render_lanes(k, m, since, until, 80, lambda b: "─" * b).plain
    lines = text.splitlines()
    nvtx = [ln for ln in lines if ln.startswith("nvtx ")]
    assert {ln[:12].strip() for ln in nvtx} == {"nvtx user_an", "nvtx gpu_use", "nvtx cpu_op"}
    assert all(set(ln[12:]) - {" "} for ln in nvtx)  # each covers some bins
    assert UNRECORDED not in text  # no recording windows: everything counts as recorded
    assert any(ln.startswith("GPU0 s7") for ln in lines)


def test_unrecorded_bins_are_dotted_not_blank(demo):
    """The demo's own recording windows over its kernels: bins outside every window and
    without a kernel are "·"; the legend says how much was recorded."""
    store = store_from_capture(demo)
    t0 = int(demo.meta["window"]["start_ns"])
    t1 = int(demo.meta["window"]["end_ns"])
    since, until = t0, t1
    kb = store.get("kernels", since, until)
    mb = store.get("markers", None, until)
    text = render_lanes(kb, mb, since, until, 200, lambda b: "─" * b).plain
    lane = next(ln for ln in text.splitlines() if ln.startswith("GPU0 s7"))[12:]
    assert UNRECORDED in lane
    # A dotted bin has no kernel and no window; a blank one was recorded and idle.
    busy = coverage(np.zeros(len(kb["start_ns"]), dtype=np.int64), 1, kb["start_ns"],
                    kb["end_ns"], since, until, len(lane))[0]  # fmt: skip
    dots = np.array([c == UNRECORDED for c in lane])
    assert not (busy[dots] > 0).any()
    windows = mb["end_ns"] - mb["start_ns"]
    share = round(
        100 * float(np.minimum(windows, np.maximum(0, t1 - mb["start_ns"])).sum()) / (t1 - t0)
    )
    assert f"not recorded (agent duty cycle: {share}% recorded)" in text
    # The view zoomed into the time before the first window: still "not recorded", not idle.
    assert int(mb["start_ns"].min()) > t0 + 500_000_000
    gap = render_lanes(
        store.get("kernels", t0 + 400_000_000, t0 + 500_000_000),
        {c: v[:0] for c, v in mb.items()},
        t0 + 400_000_000, t0 + 500_000_000, 80, lambda b: "─" * b, duty_cycled=True,
    ).plain  # fmt: skip
    assert "not recorded" in gap


async def test_pane_marks_unrecorded_time_in_the_app(make_app, old):
    """Made-up windows, 100 ms a second, over the continuously recorded old-agent demo."""
    store = store_from_capture(old)
    w = old.meta["window"]
    _with_windows(store, int(w["start_ns"]), int(w["end_ns"]), 1_000_000_000, 100_000_000)
    app = _demo_app(make_app, old, store)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        for _ in range(4):  # zoom to ~1.3 s: bins narrower than the 900 ms gaps
            await pilot.press("plus")
        await pilot.pause()
        # 10% recorded: the window view is the default; `w` gives the continuous axis
        assert pane.packed
        pane.table.focus()
        await pilot.press("w")
        await pilot.pause()
        assert not pane.packed
        text = pane.lanes.render().plain
        lane = next(ln for ln in text.splitlines() if ln.startswith("GPU0 s7"))
        assert UNRECORDED in lane[12:] and "not recorded" in text


async def test_a_continuous_capture_has_no_unrecorded_marks(make_app, old):
    app = _demo_app(make_app, old)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        text = pane.lanes.render().plain
        lane = next(ln for ln in text.splitlines() if ln.startswith("GPU0 s7"))
        assert UNRECORDED not in lane and "not recorded" not in text


def _column(table, i: int) -> list[str]:
    return [str(table.get_row_at(r)[i]) for r in range(table.row_count)]


async def test_sort_filter_and_full_name_line(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        table = pane.table
        table.focus()
        await pilot.pause()
        pct = [float(x) for x in _column(table, 3)]
        assert pct == sorted(pct, reverse=True) and "by total %" in pane.table_line.render().plain
        # o: calls, then mean, p99, name, and back to total %.
        await pilot.press("o")
        calls = [int(x) for x in _column(table, 1)]
        assert calls == sorted(calls, reverse=True) and calls != [int(x) for x in pct]
        assert "by calls" in pane.table_line.render().plain
        await pilot.press("o", "o", "o")
        labels = short_names(pane._top["name"], 200)
        names = [
            labels[table.coordinate_to_cell_key((r, 0)).row_key.value].lower()
            for r in range(table.row_count)
        ]  # the sort's key: the cell may elide the middle of a long name
        assert names == sorted(names) and "by name" in pane.table_line.render().plain
        await pilot.press("o")
        assert pane.sort == 0 and SORTS[0][0] == "total %"
        # The full demangled name of the row under the cursor, under the table.
        await pilot.press("down")
        await pilot.pause()
        key = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        assert pane.name_line.render().plain == key
        # /: a name filter, case-insensitive; the line above the table says it is on.
        total = table.row_count
        await pilot.press("slash")
        await pilot.pause()
        assert pane.filter_input.display and app.focused is pane.filter_input
        await pilot.press("D", "E", "C", "O", "D", "E", "enter")
        await pilot.pause()
        kept = _column(table, 0)
        assert 0 < len(kept) < total
        assert all("decode" in table.coordinate_to_cell_key((r, 0)).row_key.value.lower()
                   for r in range(table.row_count))  # fmt: skip
        line = pane.table_line.render().plain
        assert "filter 'DECODE'" in line and f"{len(kept)} of" in line
        assert not pane.filter_input.display and app.focused is table
        # Esc in the filter clears it (and does not restore/leave anything else).
        await pilot.press("slash")
        await pilot.pause()
        await pilot.press("escape")
        await pilot.pause()
        assert pane.name_filter == "" and table.row_count == total
        assert "filter" not in pane.table_line.render().plain.split("(")[0]
        # A filter that matches nothing says so.
        await pilot.press("slash", "z", "q", "x", "enter")
        await pilot.pause()
        assert table.row_count == 0
        assert pane.name_line.render().plain == "no kernel name matches the filter"


async def test_help_lists_the_table_keys(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = plain(app.screen.query_one("#help-table"))
        assert "kernel table: sort by total %" in text
        assert "kernel table: filter by name" in text


async def test_kernel_pane_at_80x24(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(80, 24)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        assert app.has_class("-compact")
        # The pane has 4 rows: lanes, axis, the findings cut to one line, and the table squeezed
        # into one line (a DataTable there would show its header and no row).
        assert pane.region.width == 80
        assert not pane.table.display or pane.table.region.height == 0
        top = pane.top_line
        assert top.region.height == 1 and top.region.y < pane.region.bottom
        leader = sort_top(pane._top, 0, "").iloc[0]
        assert f"{leader.pct:.1f}%" in plain(top)
        assert plain(top).startswith("top by total % (1: table): ")
        # The filter narrows the line as it would the table, and still shows in the title.
        pane.focus()
        await pilot.press("slash", *"stage", "enter")
        await pilot.pause()
        assert "filter 'stage'" in str(pane.border_title)
        names = [n for n in pane._top["name"] if "stage" in n.lower()]
        assert len(names) >= 2 and "elementwise" not in plain(top)
        assert all(short_names(names, 28)[n] in plain(top) for n in names)
        # Key 1 maximises the pane: the real table comes back, with rows.
        await pilot.press("1")
        await pilot.pause()
        assert app.has_class("-maximized")
        assert pane.table.region.height >= 5 and pane.table.row_count == len(names)
        assert top.region.height == 0


def test_top_summary_is_the_table_in_one_line(demo):
    top = top_kernels(schema.to_frame("kernels", store_from_capture(demo).get("kernels")))
    rows = sort_top(top, 0, "")
    line = top_summary(rows, "total %")
    first = rows.iloc[0]
    assert line.startswith("top by total % (1: table): ")
    assert line.split(": ", 1)[1].split(" · ")[0].endswith(f"{first.pct:.1f}%")
    assert line.count(" · ") == min(len(rows), 6) - 1
    # Namespaces go: the short name's last component is kept.
    assert "at::native::" not in line
    assert top_summary(rows.iloc[0:0], "total %") == "top: no kernel name matches the filter"


def test_idle_lane_letters_the_cause_that_idled_each_bin():
    """MADE-UP gaps on GPU 0 over a 10-bin window: host in bins 0-4, sync in bin 7, a gap too
    short to mark bin 9; GPU 1's gaps stay off GPU 0's lane."""
    from kdash.tui.panes.kernels import idle_chars

    idle = {
        "device": np.array([0, 0, 0, 1]),
        "start_ns": np.array([0, 700, 990, 0]),
        "end_ns": np.array([500, 800, 993, 1000]),
        "cause": np.array(["host", "sync", "gpu", "quiet"], dtype=object),
    }
    assert idle_chars(idle, 0, 0, 1000, 10) == "hhhhh  s  "
    assert idle_chars(idle, 1, 0, 1000, 10) == "q" * 10
    assert idle_chars(idle, 2, 0, 1000, 10) == " " * 10


async def test_idle_lane_in_the_app_not_at_80x24_but_maximised(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.pause()
        rows = plain(pane.lanes).splitlines()
        idle = [r for r in rows if r.startswith("GPU0 idle   ")]
        assert idle, rows
        # the window view (the demo's default): cause letters, and the cuts between windows
        letters = set(idle[0][12:].strip())
        assert letters and letters <= set("hsqgu ") | {CUT} and "h" in letters
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(80, 24)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.pause()
        assert not [r for r in plain(pane.lanes).splitlines() if r.startswith("GPU0 idle   ")]
        await pilot.press("1")
        await pilot.pause()
        assert [r for r in plain(pane.lanes).splitlines() if r.startswith("GPU0 idle   ")]
