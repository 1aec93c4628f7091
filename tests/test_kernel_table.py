"""The kernel table's columns fitted to the pane: the name takes the free width, the other
columns go out of view by priority, and `←`/`→` scroll the table to them while it has focus.

Data: the real H200 demo capture (`kdash/data/demo-h200.kdash`); the fitting itself on
hand-picked widths.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import store_from_capture
from kdash.tui.columns import KERNEL_COLUMNS, NAME_MIN, PAD, fit_columns
from kdash.tui.panes.kernels import KernelPane
from kdash.tui.widgets.help import HelpScreen
from test_tui import plain

from kdash.capture import load_capture
from kdash.names import short_names

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "kdash" / "data" / "demo-h200.kdash"
PRIO = [c.priority for c in KERNEL_COLUMNS]
KEYS = [c.key for c in KERNEL_COLUMNS]
# content widths of the demo's columns: calls .. smem
WIDTHS = [5, 8, 4, 7, 6, 6, 9, 7, 4, 5]


def _keys(fit) -> list[str]:
    return [KEYS[i] for i in fit.shown]


def test_fit_keeps_share_and_total_and_drops_low_priority_first():
    fit = fit_columns(54, 46, WIDTHS, PRIO)
    assert {"pct", "total_ms", "calls"} <= set(_keys(fit))
    assert fit.name_width >= NAME_MIN
    # what is shown and what is hidden never cross in priority
    shown = max(PRIO[i] for i in fit.shown)
    assert all(PRIO[i] > shown for i in fit.hidden)
    # everything in view fits the width exactly or with room to spare
    used = fit.name_width + PAD + sum(WIDTHS[i] + PAD for i in fit.shown)
    assert used <= 54
    # in table order, the hidden ones after them
    assert list(fit.shown) == sorted(fit.shown) and fit.order == fit.shown + fit.hidden


def test_fit_gives_the_name_what_is_free_up_to_its_need():
    everything = sum(w + PAD for w in WIDTHS)
    wide = fit_columns(200, 46, WIDTHS, PRIO)
    assert wide.hidden == () and wide.name_width == 46
    # 80 columns free for the name: it takes what it needs, not a fixed 40
    roomy = fit_columns(everything + PAD + 80, 70, WIDTHS, PRIO)
    assert roomy.hidden == () and roomy.name_width == 70
    # a short name leaves room, it does not pad the other columns out of view
    short = fit_columns(everything + PAD + 12, 12, WIDTHS, PRIO)
    assert short.hidden == () and short.name_width == 12
    # at 200x50 in two columns the table has ~92: grid is in view, whole
    half = fit_columns(92, 46, WIDTHS, PRIO)
    assert "grid" in _keys(half) and half.name_width >= NAME_MIN


def test_fit_in_a_very_narrow_table():
    fit = fit_columns(12, 46, WIDTHS, PRIO)
    assert fit.shown == () and 1 <= fit.name_width <= 12


def _demo_app(make_app, demo):
    meta = dict(demo.meta)
    meta["capture_path"] = str(DEMO)
    return make_app(store=store_from_capture(demo), meta=meta, mode="replay")


@pytest.fixture(scope="module")
def demo():
    return load_capture(DEMO)


async def _ready(pilot, pane: KernelPane) -> None:
    for _ in range(200):
        await pilot.pause(0.05)
        if pane.analyses_applied > 0 and pane.table.row_count:
            await pilot.pause()
            return
    raise AssertionError("the kernel analysis never arrived")


def _header(table) -> list[str]:
    return [str(c.label) for c in table.ordered_columns]


def _in_view(table) -> list[str]:
    """Column keys wholly in view at the table's scroll position (the name is fixed)."""
    cols = table.ordered_columns
    width = table.scrollable_content_region.width
    x = cols[0].get_render_width(table)
    seen, at = [], -round(table.scroll_x)
    for c in cols[1:]:
        w = c.get_render_width(table)
        if at >= 0 and x + at + w <= width:
            seen.append(str(c.key.value))
        at += w
    return seen


def _cells_fit(table) -> None:
    """No cell of any column is wider than its column (nothing cut)."""
    for c in table.ordered_columns[1:]:
        widest = max(len(str(table.get_cell(r, c.key))) for r in table.rows)
        assert widest <= c.width, (c.key.value, widest, c.width)


@pytest.mark.parametrize(
    "size,must", [((120, 40), {"calls", "total_ms", "pct"}), ((200, 50), {"pct", "grid"})]
)
async def test_table_in_the_pane(make_app, demo, size, must):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=size) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.pause()
        table = pane.table
        assert must <= set(_in_view(table)), (_in_view(table), _header(table))
        _cells_fit(table)
        cols = table.ordered_columns
        name = cols[0]
        full = short_names(pane._top["name"].astype(str), 200)
        need = max(len(full[str(k.value)]) for k in table.rows)
        # the name column takes what the columns in view leave (all of it, short of its need)
        used = sum(c.get_render_width(table) for c in cols[: len(_in_view(table)) + 1])
        assert used == table.scrollable_content_region.width or name.width == need
        assert name.width >= NAME_MIN
        # labels fit their column; the full name is under the table
        labels = [str(table.get_row_at(r)[0]) for r in range(table.row_count)]
        assert max(len(s) for s in labels) <= name.width
        table.focus()
        await pilot.press("down")
        await pilot.pause()
        key = table.coordinate_to_cell_key((table.cursor_row, 0)).row_key.value
        assert plain(pane.name_line) == key
        assert "more)" in plain(pane.table_line)


async def test_maximised_at_200_all_columns_and_long_names(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(200, 50)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.press("1")
        await pilot.pause(0.3)
        table = pane.table
        assert set(_in_view(table)) == set(KEYS) and table.max_scroll_x == 0
        _cells_fit(table)
        full = short_names(pane._top["name"].astype(str), 200)
        need = max(len(full[str(k.value)]) for k in table.rows)  # of the rows in the table
        cols = table.ordered_columns
        used = sum(c.get_render_width(table) for c in cols)
        assert cols[0].width > 40
        assert cols[0].width == need or used == table.scrollable_content_region.width
        labels = {str(table.get_row_at(r)[0]) for r in range(table.row_count)}
        assert any(len(s) > 40 for s in labels)  # not clipped at 40 with the room there
        # nothing to scroll: ← → pan the time window as everywhere
        table.focus()
        await pilot.press("plus", "left")
        await pilot.pause()
        assert app.offset_s > 0 and table.scroll_x == 0


async def test_left_right_scroll_the_focused_table_sideways(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one(KernelPane)
        await _ready(pilot, pane)
        await pilot.press("plus")  # half the capture: panning has room
        await pilot.pause()
        table = pane.table
        assert table.max_scroll_x > 0
        # not focused: ← pans the time window
        await pilot.press("left")
        await pilot.pause()
        assert app.offset_s > 0 and table.scroll_x == 0
        offset = app.offset_s
        table.focus()
        await pilot.pause()
        before = _in_view(table)
        await pilot.press("right")
        await pilot.pause()
        first = table.ordered_columns[1]
        assert table.scroll_x == first.get_render_width(table)
        after = _in_view(table)
        assert after != before and str(first.key.value) not in after
        assert app.offset_s == offset  # the window did not move
        for _ in range(20):
            await pilot.press("right")
        await pilot.pause()
        assert table.scroll_x == table.max_scroll_x
        assert str(table.ordered_columns[-1].key.value) in _in_view(table)
        for _ in range(20):
            await pilot.press("left")
        await pilot.pause()
        assert table.scroll_x == 0 and app.offset_s == offset
        # the name stays in view while scrolled (fixed column), re-sorting keeps the offset
        await pilot.press("right", "o")
        await pilot.pause()
        assert table.fixed_columns == 1 and table.scroll_x > 0


async def test_help_says_left_right_scroll_the_table(make_app, demo):
    app = _demo_app(make_app, demo)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        text = plain(app.screen.query_one("#help-table"))
        assert "focused kernel table: scroll to the columns out of view" in text
        assert "pan the time window" in text
