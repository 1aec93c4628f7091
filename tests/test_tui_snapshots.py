"""Snapshots of the dashboard replaying real captures from tests/data: the H200 matmul load
(GPU clocks held back by the power cap, the band full of `P`) and the CPU-only local capture.

Deterministic by construction: replay only (no live data), fixed terminal sizes, the config in
a private XDG folder (theme "dark" unless the test picks one), and no wall-clock text — the
axis and the status bar count seconds from the capture's start and the title's date is the
capture's own, printed in UTC. Regenerate after an intended change with
`pytest tests/test_tui_snapshots.py --snapshot-update` and review the SVGs under
tests/__snapshots__/.
"""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_replay_layout(snap_compare, replay_app, size):
    assert snap_compare(replay_app, terminal_size=size)


def test_replay_help_80x24(snap_compare, replay_app):
    assert snap_compare(replay_app, terminal_size=(80, 24), press=["question_mark"])


def test_replay_mono_cpu_maximised_120x40(snap_compare, make_app, capture_store, local_capture):
    app = make_app(store=capture_store, meta=dict(local_capture.meta), theme="mono")
    assert snap_compare(app, terminal_size=(120, 40), press=["3"])


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_replay_h200_power_capped(snap_compare, replay_of, size):
    assert snap_compare(replay_of("h200-matmul.kdash"), terminal_size=size)


def test_replay_h200_contended_light_clocks_maximised_80x24(snap_compare, replay_of):
    app = replay_of("h200-contended.kdash", theme="light")
    assert snap_compare(app, terminal_size=(80, 24), press=["2"])


# -- the status bar and the toasts (the bundled demo capture, kdash/data) ----------------------
@pytest.fixture
def demo_replay(make_app):
    from conftest import store_from_capture

    from kdash.capture import load_capture
    from kdash.commands import bundled_demo

    path = bundled_demo()
    cap = load_capture(path)
    meta = dict(cap.meta)
    meta["capture_path"] = path.name  # not the install's folder: the snapshot stays the same
    title = f"replay (no GPU here) — {meta['title']}"  # as `kdash demo` opens it
    return make_app(store=store_from_capture(cap), meta=meta, mode="replay", title=title)


# The clocks pane maximised (key 2): it draws the capture alone, while the source pane would
# also read the demo kernel's file in this tree, whose edits are not the bar's business.
@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_status_bar_after_c_in_the_demo_replay(snap_compare, demo_replay, size):
    """`c` in a replay: the bar stays one line with `? keys` at its end, the toast above it."""
    assert snap_compare(demo_replay, terminal_size=size, press=["2", "c"])


def test_status_bar_long_note_mono_80x24(snap_compare, demo_replay):
    """A long note is cut with an ellipsis in the one line; mono theme."""

    def long_note(pilot):
        pilot.app.set_theme("mono")
        pilot.app.note = "recorder stopped: " + "a long reason " * 20
        pilot.app._update_status()

    assert snap_compare(demo_replay, terminal_size=(80, 24), press=["2"], run_before=long_note)


# -- the kernel pane: the table fitted to the pane, the window view under a duty cycle ---------
async def _kernels_ready(pilot) -> None:
    from kdash.tui.panes.kernels import KernelPane

    pane = pilot.app.query_one(KernelPane)
    for _ in range(200):
        await pilot.pause(0.05)
        if pane.analyses_applied > 0 and pane.table.row_count:
            break
    await pilot.pause(0.2)


def test_kernel_table_fitted_maximised_80x24(snap_compare, demo_replay):
    """Key 1 at 80x24: the name column takes what the share, total, calls, mean and p99 columns
    leave; the rest are out of view to the right (the scrollbar says so)."""
    assert snap_compare(demo_replay, terminal_size=(80, 24), press=["1"], run_before=_kernels_ready)


def test_kernel_window_view_maximised_120x40(snap_compare, make_app):
    """The demo under its own recording windows (the agent's default duty cycle): the last
    recorded windows side by side, each slice labelled with its start."""
    from test_window_view import DEMO, duty_cycled

    from kdash.capture import load_capture

    cap = load_capture(DEMO)
    store, _, _ = duty_cycled(cap)
    meta = dict(cap.meta)
    meta["capture_path"] = DEMO.name
    app = make_app(store=store, meta=meta, mode="replay")
    assert snap_compare(app, terminal_size=(120, 40), press=["1"], run_before=_kernels_ready)
