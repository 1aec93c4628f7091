"""The SGLang server pane: mounted only for an SGLang target, its key and help rows, what it
shows of a MADE-UP TP=8 server (tests/sglang_fixtures.py: server rows from the real metrics
source scraping the stand-in, hand-made GPU samples), and `c` through the stand-in's profiler
in a live dashboard, the result in the status bar."""

from __future__ import annotations

import io
import os
import time

import pytest
from kdash.tui.panes.server import METRICS_OFF, ServerPane
from kdash.tui.widgets.help import HelpScreen
from kdash.tui.widgets.status import StatusBar
from rich.console import Console
from sglang_fixtures import tp8_capture
from test_sglang_attach import _recorder, _server
from test_sglang_http import StandIn

from kdash.capture import load_capture


def plain(static) -> str:
    content = static.content
    if isinstance(content, str):
        return content
    console = Console(width=300, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(content)
    return cap.get()


PATIENCE_S = 60.0  # a safety net for a hung test; a loaded machine passes long before it


async def wait_for(pilot, cond, timeout: float = PATIENCE_S) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await pilot.pause(0.1)
    return cond()


@pytest.fixture(scope="module")
def tp8():
    return tp8_capture()


@pytest.fixture
def tp8_app(make_app, tp8):
    store, meta = tp8
    return make_app(store=store, meta=dict(meta), mode="replay")


async def test_server_pane_only_for_sglang_targets(tp8_app, replay_app):
    async with replay_app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert not replay_app.query(ServerPane)
        assert replay_app.PANE_IDS == ("kernels", "clocks", "cpu", "source")
        await pilot.press("5")  # no such pane: nothing happens
        assert replay_app.maximized is None
    async with tp8_app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert tp8_app.PANE_IDS[-1] == "server" and len(tp8_app.panes) == 5
        await pilot.press("5")
        await pilot.pause()
        assert tp8_app.maximized == "server"
        assert [p.id for p in tp8_app.panes if p.region.height > 0] == ["server"]
        await pilot.press("C")  # capture through the server: a replay says it cannot
        await pilot.pause()
        assert any("replay" in n.message for n in tp8_app._notifications)
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(tp8_app.screen, HelpScreen)
        listed = plain(tp8_app.screen.query_one("#help-table"))
        assert "1 2 3 4 5" in listed and "5 SGLang server" in listed
        assert "capture through the server's profiler" in listed


async def test_server_pane_shows_load_latency_and_ranks(tp8_app):
    async with tp8_app.run_test(size=(80, 24)) as pilot:
        await pilot.press("5")
        await pilot.pause(0.2)
        text = plain(tp8_app.query_one(ServerPane).body)
    lines = text.splitlines()
    assert lines[0].startswith("SGLang http://127.0.0.1:30000 · TP 8 · fa3 · cuda graph on")
    # the last scrape: 8 + 24 * (0.5 + 0.5 sin(30/4)) running, usage 0.2 + 30/60
    assert any(ln.split()[:2] == ["running", "31"] for ln in lines)
    assert any(ln.split()[:3] == ["token", "usage", "70%"] for ln in lines)
    # TTFT over the window: most requests at 0.15-0.23 s, one per second at +0.6 s
    ttft = next(ln for ln in lines if ln.startswith("TTFT p50/p99"))
    p50, p99 = (float(x) for x in ttft.split()[2].split("/"))
    assert 150 <= p50 <= 240 and 600 <= p99 <= 800 and ttft.split()[3] == "ms"
    ranks = [ln for ln in lines if ln.startswith("TP")]
    assert [ln.split()[0] for ln in ranks] == [f"TP{r}" for r in range(8)]
    assert all(len(ln.rstrip()) <= 80 for ln in lines)  # one line per rank, at 80 columns
    tp3 = ranks[3].split()
    assert tp3[1:4] == ["4104", "3", "1755/1980"] and tp3[-1] == "held"  # the power-capped GPU
    assert "held" not in ranks[0]
    assert "root 4100 · detokenizer 4110" in text


async def test_metrics_off_says_so_and_shows_get_load(make_app):
    store, meta = tp8_capture(seconds=5, metrics=False)
    app = make_app(store=store, meta=meta, mode="replay")
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("5")
        await pilot.pause(0.2)
        text = plain(app.query_one(ServerPane).body)
    assert METRICS_OFF in text
    assert "tokens used" in text and "TTFT" not in text
    assert any(ln.split()[:2] == ["running", "3"] for ln in text.splitlines())  # /get_load


@pytest.mark.slow
async def test_live_c_captures_through_the_server(make_app, tmp_path):
    """`c` in a live SGLang dashboard with no agent: /start_profile from a thread worker; the
    status bar says the server is profiling, then says honestly that no GPU kernel came (the
    stand-in's profiler records CPU only); the saved window holds both ranks' step markers."""
    with StandIn(tp_size=2) as srv:
        rec = _recorder(tmp_path, _server(srv.url), num_steps=3)
        rec.opt.post_s = 1.0
        meta = {"target": {"pid": os.getpid()}, "sglang": rec.sglang_meta()}
        app = make_app(store=rec.store, meta=meta, mode="live", recorder=rec, redraw_hz=10)
        async with app.run_test(size=(120, 40)) as pilot:
            await pilot.pause(0.2)
            await pilot.press("c")
            bar = app.query_one(StatusBar)
            # the countdown or, once the window closed, the wait for the server's traces (the
            # bar may be redrawn a moment after the key on a loaded machine: waited for)
            profiling = "(server profiling 3 steps, 2 rank(s))"
            assert await wait_for(pilot, lambda: profiling in plain(bar)), plain(bar)
            shown = plain(bar)
            assert "capturing…" in shown or "writing capture…" in shown
            assert "(server profiling 3 steps, 2 rank(s))" in shown, shown
            assert await wait_for(pilot, lambda: rec.capture.phase in ("saved", "failed"))
            assert await wait_for(pilot, lambda: "capture failed:" in plain(bar))
            status = plain(bar).replace("\n", "")
            assert "no GPU kernels in the server's traces" in status
            assert any(n.severity == "error" for n in app._notifications)
            assert app.is_running
            assert [w.name for w in app.workers if w.name == "server-capture"] == []
    starts = [r for r in srv.requests if r[1] == "/start_profile"]
    # CPU activity too (stacks and shapes off): without it 0.5.10's traces hold no step markers
    assert len(starts) == 1 and starts[0][2]["activities"] == ["CPU", "GPU"]
    assert starts[0][2].get("with_stack") is False and starts[0][2].get("record_shapes") is False
    cap = load_capture(rec.capture.path)
    steps = cap.tables["markers"][cap.tables["markers"]["domain"] != "cpu_op"]  # not CPU ops
    assert sorted(set(steps["name"])) == [f"forward_step_{i}" for i in range(3)]
    assert len(steps) == 6 and len(cap.tables["kernels"]) == 0
    assert cap.meta["sglang"]["capture"]["note"].startswith("no GPU kernels")


# -- snapshots (the made-up TP=8 server; deterministic: replay, fixed sizes and numbers) -------
@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_snapshot_tp8_layout(snap_compare, tp8_app, size):
    assert snap_compare(tp8_app, terminal_size=size)


def test_snapshot_tp8_server_maximised_80x24(snap_compare, tp8_app):
    assert snap_compare(tp8_app, terminal_size=(80, 24), press=["5"])


def test_snapshot_tp8_help_80x24(snap_compare, tp8_app):
    assert snap_compare(tp8_app, terminal_size=(80, 24), press=["question_mark"])
