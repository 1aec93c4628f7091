"""Pilot tests that drive the real dashboard: every key of the help, a live capture with a real
Recorder over the real scheduler source on a real child process, the replay of a real capture,
themes, layouts and the redraw budget.

Panes with no real data source on a CI machine (kernels: the agent; clocks: NVML without a
GPU) are also fed small hand-made tables in two tests, marked as such, to check that their
drawing code runs and says the right things; everything else reads real data.
"""

from __future__ import annotations

import io
import re
import time
import tomllib

import numpy as np
import pytest
from conftest import store_from_capture
from kdash.tui.app import KdashApp, available_themes, resolve_theme
from kdash.tui.panes.base import Pane
from kdash.tui.panes.clocks import ClockPane
from kdash.tui.panes.kernels import NO_KERNELS, KernelPane
from kdash.tui.panes.source import NO_SAMPLES
from kdash.tui.widgets.help import HelpScreen, key_label
from kdash.tui.widgets.status import StatusBar
from rich.console import Console
from textual.filter import Monochrome, NoColor
from textual.widgets import DataTable

from kdash import schema
from kdash.capture import load_capture
from kdash.errors import UserError
from kdash.store import Store


def plain(static) -> str:
    """What a Static shows, as plain text (Rich renderables rendered at 200 columns)."""
    content = static.content
    if isinstance(content, str):
        return content
    console = Console(width=200, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(content)
    return cap.get()


def status_text(app: KdashApp) -> str:
    return plain(app.query_one(StatusBar))


def empty_line(app: KdashApp, pane_id: str) -> str:
    pane = app.query_one(f"#{pane_id}", Pane)
    return plain(pane.empty_line) if pane.has_class("-empty") else ""


async def wait_for(pilot, cond, timeout: float = 10.0, step: float = 0.1) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await pilot.pause(step)
    return cond()


# -- themes -------------------------------------------------------------------------------------
def test_resolve_theme_names_and_unknown():
    assert available_themes() == ["dark", "light", "mono"]
    assert resolve_theme("Light") == "light"
    with pytest.raises(UserError) as e:
        resolve_theme("neon")
    assert str(e.value) == "unknown theme neon (have: dark, light, mono)"


async def test_theme_cycling_persists_to_config(replay_app, kdash_env, make_app, capture_store):
    async with replay_app.run_test(size=(100, 30)) as pilot:
        assert replay_app.kd_theme == "dark" and replay_app.has_class("theme-dark")
        seen = []
        for _ in range(3):
            await pilot.press("t")
            await pilot.pause()
            seen.append(replay_app.kd_theme)
            assert replay_app.has_class(f"theme-{replay_app.kd_theme}")
            assert replay_app.theme == f"kdash-{replay_app.kd_theme}"
            saved = tomllib.loads(kdash_env.read_text())
            assert saved["theme"] == replay_app.kd_theme
        assert seen == ["light", "mono", "dark"]
        await pilot.press("t")
        await pilot.pause()
    # A new app with no --theme starts with the saved choice.
    again = make_app(store=capture_store, meta={}, theme=None)
    assert again.kd_theme == "light"


async def test_theme_changes_semantic_colours(replay_app):
    async with replay_app.run_test(size=(100, 30)) as pilot:
        bar = replay_app.query_one(StatusBar)
        dark = bar.get_component_rich_style("status-bar--mode")
        replay_app.set_theme("light")
        await pilot.pause()
        await pilot.pause()
        light = bar.get_component_rich_style("status-bar--mode")
        assert dark.color != light.color
        replay_app.set_theme("mono")
        await pilot.pause()
        await pilot.pause()
        mono = bar.get_component_rich_style("status-bar--mode")
        assert mono.bold and (mono.color is None or mono.color.is_default)


def test_no_color_defaults_to_mono(make_app, capture_store, monkeypatch):
    monkeypatch.setenv("NO_COLOR", "1")
    app = make_app(store=capture_store, meta={}, theme=None)
    assert app.kd_theme == "mono"
    # Textual's own filter strips colour to the terminal's defaults (NoColor); its Monochrome
    # filter would turn the mono theme's default colours into black on black.
    assert app.no_color
    assert any(isinstance(f, NoColor) for f in app._filters)
    assert not any(isinstance(f, Monochrome) for f in app._filters)


# -- replay ---------------------------------------------------------------------------------------
async def test_replay_of_real_capture(replay_app, local_capture):
    threads = local_capture.tables["threads"]
    async with replay_app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert "replay" in replay_app.title.lower()
        assert "local-cpu.kdash" in replay_app.sub_title
        assert "recorded " in replay_app.sub_title and "UTC" in replay_app.sub_title
        # Kernel and source panes: one line each, saying what fills them and how.
        assert empty_line(replay_app, "kernels") == NO_KERNELS
        assert empty_line(replay_app, "source") == NO_SAMPLES
        # No GPU on the recording machine: the clocks pane says why, from the capture's health.
        clocks = empty_line(replay_app, "clocks")
        assert clocks.startswith("Clocks & thermal: no GPU data — nvml unavailable")
        # The CPU pane has the capture's findings first, then every thread.
        cpu = replay_app.query_one("#cpu", Pane)
        assert not cpu.has_class("-empty")
        findings = plain(cpu.findings)
        for kind in set(local_capture.tables["findings"]["kind"]):
            assert kind in findings
        table = cpu.query_one(DataTable)
        assert table.row_count == threads[["pid", "tid"]].drop_duplicates().shape[0]
        # Sorted by cpu%: the first row is the busiest thread at the window's end.
        first = table.get_row_at(0)
        last = threads.sort_values("t_ns").groupby("tid").tail(1)
        assert int(first[1]) == int(last.sort_values("cpu_pct").iloc[-1]["tid"])
        # The capture's findings cover its whole window: still listed after zoom and pan.
        await pilot.press("plus", "plus", "left", "left")
        await pilot.pause()
        for kind in set(local_capture.tables["findings"]["kind"]):
            assert kind in plain(cpu.findings)
        await pilot.press("r")
        status = status_text(replay_app)
        assert "REPLAY" in status and "t 0.0–" in status
        assert "nvml unavailable" in status and "sched degraded" in status


async def test_replay_of_real_h200_capture_clock_pane(replay_of):
    """The H200 matmul capture: power-capped at 700 W, SM clock held at 1470 of 1980 MHz."""
    app = replay_of("h200-matmul.kdash")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        pane = app.query_one(ClockPane)
        assert not pane.has_class("-empty")
        text = plain(pane.body)
        assert "GPU0 NVIDIA H200" in text
        assert "1470/1980 MHz" in text and "/700 W" in text
        assert "util = a kernel ran, not occupancy" in text
        band = next(ln for ln in text.splitlines() if ln.startswith("thrtl"))
        assert band.split()[1] == "sw-power"
        # The load starts a moment into the window: free clocks first, then the power cap.
        cells = band[22:]
        assert cells.count("P") > 0.8 * len(cells.strip())
        assert cells.index("─") < cells.index("P")
        assert "pid 636" in text  # the target's process on the GPU (gpu_procs)
        status = status_text(app)
        assert "nvml ok" in status


async def test_thread_table_cursor_follows_its_thread(replay_app):
    async with replay_app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        table = replay_app.query_one("#cpu", Pane).query_one(DataTable)
        table.move_cursor(row=table.row_count - 1)
        tid = table.get_row_at(table.cursor_row)[1]
        orders = set()
        for key in ("plus", "plus", "left", "left", "left"):
            await pilot.press(key)
            await pilot.pause()
            orders.add(tuple(table.get_row_at(i)[1] for i in range(table.row_count)))
            assert table.get_row_at(table.cursor_row)[1] == tid
        assert len(orders) > 1  # the rows did re-sort under the cursor


async def test_help_screen_blocks_view_keys(replay_app):
    async with replay_app.run_test(size=(100, 30)) as pilot:
        await pilot.press("plus", "question_mark")
        before = replay_app.offset_s, replay_app.window_s
        await pilot.press("left", "minus", "tab")
        assert (replay_app.offset_s, replay_app.window_s) == before
        await pilot.press("q")  # closes the help, does not quit
        await pilot.pause()
        assert not isinstance(replay_app.screen, HelpScreen) and replay_app.is_running


async def test_replay_capture_key_says_replay(replay_app):
    async with replay_app.run_test(size=(100, 30)) as pilot:
        await pilot.press("c")
        await pilot.pause()
        assert "replay" in status_text(replay_app)
        assert any("replay" in n.message for n in replay_app._notifications)


async def test_every_key_of_the_help(replay_app):
    """Each binding the help lists is pressed and its effect checked."""
    app = replay_app
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        # ? opens the help, which lists every binding of the app.
        await pilot.press("question_mark")
        await pilot.pause()
        assert isinstance(app.screen, HelpScreen)
        listed = plain(app.screen.query_one("#help-table"))
        for b in app.BINDINGS:
            assert key_label(b.key) in listed, b.key
            # Each binding's own words are in its (possibly shared) row.
            assert b.description.split(":")[-1].strip() in listed, b.key
        assert "1 2 3 4" in listed and "maximise a pane: 1 kernels" in listed
        assert "sched" in plain(app.screen.query_one("#help-sources"))
        await pilot.press("escape")
        await pilot.pause()
        assert not isinstance(app.screen, HelpScreen)

        # + / = zoom in, - zooms out, capped at the capture's length.
        full = app.window_s
        await pilot.press("plus")
        assert app.window_s == pytest.approx(full / 2)
        await pilot.press("equals_sign")
        assert app.window_s == pytest.approx(full / 4)
        label_before = app.window_label()
        # ← pans earlier, → later, clamped to the capture.
        await pilot.press("left")
        assert app.offset_s == pytest.approx(full / 16)
        assert app.window_label() != label_before
        await pilot.press("right")
        assert app.offset_s == 0
        await pilot.press("right")
        assert app.offset_s == 0  # cannot pan past the end
        await pilot.press("minus")
        assert app.window_s == pytest.approx(full / 2)
        await pilot.press("minus", "minus")
        assert app.window_s == pytest.approx(full)  # not beyond the capture
        await pilot.press("plus", "left")
        assert app.offset_s > 0
        # r resets to the whole capture.
        await pilot.press("r")
        assert (app.window_s, app.offset_s) == (pytest.approx(full), 0)

        # 1-4 maximise one pane; escape restores.
        for key, pane_id in zip("1234", app.PANE_IDS, strict=True):
            await pilot.press(key)
            await pilot.pause()
            assert app.maximized == pane_id
            # regions follow a layout refresh: waited for (a loaded machine lags a pause)
            assert await wait_for(
                pilot, lambda want=pane_id: [p.id for p in app.panes if p.region.height] == [want]
            ), [(p.id, p.region) for p in app.panes]
        await pilot.press("escape")
        await pilot.pause()
        assert app.maximized is None
        assert await wait_for(pilot, lambda: sum(p.region.height > 0 for p in app.panes) == 4)

        # tab / shift+tab move between panes.
        start = app._focused_pane_id()
        ids = list(app.PANE_IDS)
        await pilot.press("tab")
        assert app._focused_pane_id() == ids[(ids.index(start) + 1) % 4]
        await pilot.press("shift+tab")
        assert app._focused_pane_id() == start
        # ...and with a pane maximised, tab maximises the next one.
        await pilot.press("2", "tab")
        assert app.maximized == "cpu"
        await pilot.press("escape")

        # p freezes the view; p again resumes.
        await pilot.press("p")
        await pilot.pause()
        assert app.paused and "PAUSED" in status_text(app)
        await pilot.press("p")
        await pilot.pause()
        assert not app.paused and "PAUSED" not in status_text(app)

        # g flips the clock pane between dense-when-many and full detail per GPU.
        clocks = app.query_one(ClockPane)
        await pilot.press("g")
        assert clocks.full_detail
        await pilot.press("g")
        assert not clocks.full_detail

        # t: covered in test_theme_cycling_persists_to_config; c: in the capture tests.
        # q quits.
        await pilot.press("q")
        await pilot.pause()
    assert app.return_code == 0


async def test_compact_layout_at_80x24(replay_app):
    async with replay_app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert replay_app.has_class("-compact") and replay_app.has_class("-stacked")
        cpu = replay_app.query_one("#cpu", Pane)
        # The one-liners take little room: the CPU pane gets most of the 24 rows (regions
        # follow a layout refresh: waited for).
        assert await wait_for(
            pilot,
            lambda: cpu.region.height >= 12 and all(p.region.width == 80 for p in replay_app.panes),
        ), [(p.id, p.region) for p in replay_app.panes]
        # Resizing to a big terminal leaves the compact layout.
        await pilot.resize_terminal(200, 50)
        await pilot.pause()
        assert not replay_app.has_class("-compact")


# -- hand-made data for the panes whose sources need hardware (marked as such) -----------------
def _gpu_store(t0: int, seconds: float = 10.0, hz: float = 4.0, gpus: int = 2) -> Store:
    """Made-up GPU samples: `gpus` GPUs, a power cap on GPU 0 in the second half, NaN
    temperature on GPU 1 (its sensor "n/a")."""
    n = int(seconds * hz)
    t = t0 + (np.arange(n) * 1e9 / hz).astype(np.int64)
    rows = []
    for gpu in range(gpus):
        for i, ts in enumerate(t):
            capped = gpu == 0 and i >= n // 2
            rows.append(
                {
                    "t_ns": int(ts),
                    "gpu": gpu,
                    "sm_clock_mhz": 1500.0 if capped else 1980.0,
                    "mem_clock_mhz": 2619.0,
                    "sm_clock_max_mhz": 1980.0,
                    "mem_clock_max_mhz": 2619.0,
                    "temp_c": float("nan") if gpu == 1 else 60.0,
                    "power_w": 700.0 if capped else 400.0,
                    "power_limit_w": 700.0,
                    "util_gpu_pct": 99.0,
                    "pstate": 0,
                    "throttle_reasons": 0x4 if capped else 0,
                }
            )
    store = Store(retention_s=10**6)
    store.append("gpu_samples", schema.make_batch("gpu_samples", rows))
    return store, int(t[-1])


async def test_clock_pane_draws_gpus_made_up_data(make_app, local_capture, capture_store):
    """Made-up GPU samples (no GPU on CI): values, n/a, sparklines and the throttle band."""
    t0 = local_capture.meta["window"]["start_ns"]
    gstore, _ = _gpu_store(t0, seconds=local_capture.meta["window"]["seconds"])
    for t in schema.TABLES:
        capture_store_batch = capture_store.get(t)
        if t != "gpu_samples":
            gstore.append(t, capture_store_batch)
    meta = dict(local_capture.meta)
    meta["gpus"] = [{"index": 0, "name": "H200"}, {"index": 1, "name": "H200"}]
    app = make_app(store=gstore, meta=meta)
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        pane = app.query_one(ClockPane)
        assert not pane.has_class("-empty")
        text = plain(pane.body)
        assert "GPU0 H200" in text and "GPU1 H200" in text
        assert "1500/1980 MHz" in text and "700/700 W" in text
        assert "n/a" in text  # GPU 1's temperature
        assert "util = a kernel ran, not occupancy" in text
        band = [ln for ln in text.splitlines() if ln.startswith("thrtl")]
        assert band[0].split()[1] == "sw-power"
        assert "P" in band[0] and "─" in band[0]  # capped in the 2nd half, free in the 1st
        assert band[0].index("─") < band[0].rindex("P")
        assert "P power cap" in text
        # Both columns have data: the wide 2x2 layout, panes side by side. The layout follows
        # the panes' content a refresh later (a loaded CI machine has shown it still
        # collapsed after one pause), so it is waited for, not read at once.
        cpu = app.query_one("#cpu", Pane)

        def side_by_side() -> bool:
            return (
                not app.has_class("-stacked")
                and cpu.region.x > pane.region.x
                and cpu.region.y < pane.region.bottom
            )

        assert await wait_for(pilot, side_by_side, timeout=30.0), (cpu.region, pane.region)


async def test_clock_pane_eight_gpus_dense_and_g_for_detail_made_up_data(make_app):
    """Made-up samples of an 8-GPU box: dense (3 lines a GPU) when they do not fit; `g` full."""
    t0 = 10**12
    gstore, t_end = _gpu_store(t0, seconds=8, gpus=8)
    app = make_app(store=gstore, meta={"window": {"start_ns": t0, "end_ns": t_end}})
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        pane = app.query_one(ClockPane)
        text = plain(pane.body)
        assert pane.dense and "vram" not in text
        assert sum(ln.startswith("GPU") for ln in text.splitlines()) == 8
        assert text.count("SM clock") == 8 and text.count("thrtl") == 8
        assert "1500/1980 MHz" in text and "P power cap" in text
        await pilot.press("g")
        await pilot.pause()
        assert not pane.dense and plain(pane.body).count("vram") == 8
        await pilot.press("g")
        await pilot.pause()
        assert pane.dense


async def test_kernel_pane_draws_kernels_made_up_data(make_app):
    """Made-up kernel rows (the agent is a later issue): top-kernels table and lanes."""
    t0 = 10**12
    n = 200
    starts = t0 + np.arange(n, dtype=np.int64) * 50_000
    starts[100:] += 2_000_000  # one 2 ms hole: an idle gap
    names = np.where(np.arange(n) % 4 == 0, "void attn<float>(int)", "gemm_kernel")
    batch = schema.make_batch(
        "kernels",
        start_ns=starts,
        end_ns=starts + np.where(names == "gemm_kernel", 30_000, 10_000),
        name=list(names),
        device=np.zeros(n, dtype=np.int16),
        stream=np.where(np.arange(n) % 2 == 0, 7, -1),  # -1: stream n/a
    )
    store = Store(retention_s=10**6)
    store.append("kernels", batch)
    meta = {"window": {"start_ns": int(t0), "end_ns": int(starts[-1] + 50_000)}}
    app = make_app(store=store, meta=meta)
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        pane = app.query_one(KernelPane)
        assert not pane.has_class("-empty")
        # The analyses run in a worker thread and post their result back.
        assert await wait_for(pilot, lambda: pane.analyses_applied > 0)
        await pilot.pause()
        table = pane.query_one(DataTable)
        assert table.row_count == 2
        assert table.get_row_at(0)[0] == "gemm_kernel"  # most total time first
        assert table.get_row_at(1)[0] == "attn<…>"
        lanes = plain(pane.lanes)
        assert "GPU0 s7" in lanes and "GPU0 s-1" in lanes
        # 5 ms of kernels in ~12 ms recorded; idle: 198 short gaps between kernels and the
        # 2.02 ms hole, whose cause is unknown (no API rows here)
        assert (
            "GPU0 busy 42% (kernels 42%, copies 0%) · idle 58%: 41% in 198 gaps <100 µs, 17% "
            "longer (unknown 100%)"
        ) in lanes


# -- live -----------------------------------------------------------------------------------------
def _live_recorder(busy_child, tmp_path, pre: float = 1.0, post: float = 1.0):
    from kdash.collectors.sched import SchedSource

    from kdash.session import Recorder, RecorderOptions
    from kdash.target import Target

    target = Target.from_pid(busy_child.pid)
    store = Store(retention_s=30)
    opts = RecorderOptions(
        interval_s=0.1, fast_interval_s=0.1, pre_s=pre, post_s=post, capture_dir=tmp_path
    )
    rec = Recorder([SchedSource(target, interval_s=0.1)], store, target, opts)
    return rec, store, {"target": target.describe()}


@pytest.mark.slow
async def test_live_capture_saves_a_loadable_file(busy_child, tmp_path, make_app):
    """`c` in live mode: countdown in the status bar, then the saved path; the file loads."""
    # post=3 s: long enough that the countdown is still on when the key's redraw is read,
    # even on a loaded 2-core CI machine.
    rec, store, meta = _live_recorder(busy_child, tmp_path, pre=1.0, post=3.0)
    app = make_app(store=store, meta=meta, mode="live", recorder=rec, redraw_hz=10)
    async with app.run_test(size=(120, 40)) as pilot:
        # The poll worker fills the store; the CPU pane shows the child's threads.
        assert await wait_for(pilot, lambda: store.stats()["threads"]["rows"] > 20)
        assert await wait_for(pilot, lambda: not app.query_one("#cpu", Pane).has_class("-empty"))
        table = app.query_one("#cpu", Pane).query_one(DataTable)
        assert await wait_for(pilot, lambda: table.row_count >= 5)
        names = {str(table.get_row_at(i)[2]) for i in range(table.row_count)}
        assert {"launch-0", "sched-loop", "worker-1"} <= names
        # The action updates the status bar itself, so the countdown is there right away;
        # a second press while recording is refused, not queued.
        await pilot.press("c")
        m = re.search(r"capturing… (\d+\.\d) s", status_text(app))
        assert m and 0 < float(m.group(1)) <= 3.0
        await pilot.press("c")
        assert any("already" in n.message for n in app._notifications)
        assert rec.capture.seq == 1
        assert await wait_for(pilot, lambda: rec.capture.phase in ("saved", "failed"), timeout=15)
        assert rec.capture.phase == "saved", rec.capture.error
        assert await wait_for(pilot, lambda: "saved: " in status_text(app), timeout=2)
        path = rec.capture.path
        assert str(path) in status_text(app).replace("\n", "")
        assert any("capture saved" in n.message for n in app._notifications)
        await pilot.press("q")
        await pilot.pause()
    assert rec._stop.is_set()  # quitting stops the poll loop
    cap = load_capture(path)
    assert cap.meta["target"]["pid"] == busy_child.pid
    assert cap.meta["window"]["seconds"] == pytest.approx(4.0, abs=0.5)
    assert len(cap.tables["threads"]) > 0
    assert set(cap.tables["threads"]["pid"]) == {busy_child.pid}


@pytest.mark.slow
async def test_live_pause_freezes_view_and_redraws_at_most_redraw_hz(
    busy_child, tmp_path, make_app
):
    rec, store, meta = _live_recorder(busy_child, tmp_path)
    app = make_app(store=store, meta=meta, mode="live", recorder=rec, redraw_hz=2)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause(0.3)
        r0, t0 = app.redraws, time.monotonic()
        await pilot.pause(2.0)
        rate = (app.redraws - r0) / (time.monotonic() - t0)
        assert 0.5 <= rate <= 2.6, rate  # the 2 Hz timer, not the 10 Hz poll
        await pilot.press("p")
        # A layout change from the last live redraw may still resize a pane and redraw it
        # once (a frozen view must fit its size); after that, nothing redraws.
        await pilot.pause(0.3)
        frozen = app.redraws
        until = app.view_range()[1]
        rows = store.stats()["threads"]["total"]
        await pilot.pause(1.2)
        assert app.redraws == frozen  # no redraw while paused...
        assert app.view_range()[1] == until  # ...the window stands still...
        assert store.stats()["threads"]["total"] > rows  # ...but collection goes on
        assert "PAUSED" in status_text(app)
        # Zooming while paused redraws the frozen window.
        await pilot.press("plus")
        assert app.redraws == frozen + 1
        await pilot.press("p")
        await pilot.pause(0.1)
        assert app.view_range()[1] > until
        assert "poll " in status_text(app) and "sched" in status_text(app)


async def test_live_target_exit_is_shown(tmp_path, make_app):
    """A target that exits: the status bar says so and the dashboard keeps running."""
    import subprocess
    import sys

    from kdash.collectors.sched import SchedSource

    from kdash.session import Recorder, RecorderOptions
    from kdash.target import Target

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.8)"])
    target = Target.from_pid(child.pid)
    store = Store(retention_s=30)
    rec = Recorder(
        [SchedSource(target, interval_s=0.1)],
        store,
        target,
        RecorderOptions(interval_s=0.1, capture_dir=tmp_path),
    )
    app = make_app(store=store, meta={"target": target.describe()}, mode="live", recorder=rec)
    async with app.run_test(size=(100, 30)) as pilot:
        child.wait(timeout=5)
        assert await wait_for(pilot, lambda: f"target {child.pid} exited" in status_text(app))
        assert app.is_running


async def test_recorder_crash_is_shown_not_fatal(make_app, tmp_path):
    """A recorder whose poll loop dies (stand-in: run_forever raises) leaves the dashboard up
    with the reason in the status bar: the worker runs with exit_on_error=False."""
    from kdash.session import Recorder, RecorderOptions

    class Broken(Recorder):
        def run_forever(self) -> None:
            raise RuntimeError("boom in the poll loop")

    store = Store(retention_s=30)
    rec = Broken([], store, None, RecorderOptions(capture_dir=tmp_path))
    app = make_app(store=store, meta={"target": {"pid": 1}}, mode="live", recorder=rec)
    async with app.run_test(size=(100, 30)) as pilot:
        assert await wait_for(pilot, lambda: "recorder stopped" in status_text(app))
        assert "boom in the poll loop" in status_text(app)
        assert app.is_running
        await pilot.press("ctrl+c")
        await pilot.pause()
    assert app.return_code == 0


async def test_live_capture_failure_is_shown(make_app, tmp_path):
    """A capture that cannot be written (the capture folder is a file) says why, in the status
    bar and a notification; the dashboard goes on. A real Recorder, with no sources."""
    from kdash.session import Recorder, RecorderOptions

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    opts = RecorderOptions(interval_s=0.05, pre_s=0.1, post_s=0.2, capture_dir=not_a_dir)
    store = Store(retention_s=30)
    rec = Recorder([], store, None, opts)
    app = make_app(store=store, meta={"target": {"pid": 1}}, mode="live", recorder=rec)
    async with app.run_test(size=(100, 30)) as pilot:
        await pilot.press("c")
        assert await wait_for(pilot, lambda: "capture failed: " in status_text(app))
        assert any(n.severity == "error" for n in app._notifications)
        assert app.is_running


def test_replay_title_always_says_replay(make_app, capture_store, local_capture):
    meta = dict(local_capture.meta)
    meta["title"] = "replay of the kdash demo workload recorded on an H200"
    title, sub = make_app(store=capture_store, meta=meta)._titles()
    assert title == meta["title"]
    assert "python busy.py on vm" in sub
    title, _ = make_app(store=capture_store, meta=meta, title="attention demo")._titles()
    assert title == "kdash replay — attention demo"


def test_live_mode_needs_a_recorder(make_app):
    with pytest.raises(ValueError):
        make_app(store=Store(), meta={}, mode="live", recorder=None)
    with pytest.raises(ValueError):
        make_app(store=Store(), meta={}, mode="demo")


# -- the shared time axis (sparklines, band, lanes) ---------------------------------------------
def test_busy_fraction_matches_brute_force():
    from kdash.tui.widgets.spark import busy_fraction

    rng = np.random.default_rng(7)
    starts = rng.integers(0, 1_000_000, 300)
    ends = starts + rng.integers(0, 50_000, 300)
    width, since, until = 40, 100_000, 900_000
    got = busy_fraction(starts, ends, since, until, width)
    edges = np.linspace(since, until, width + 1)
    want = np.zeros(width)
    for s, e in zip(starts, ends, strict=True):
        for i in range(width):
            want[i] += max(0.0, min(e, edges[i + 1]) - max(s, edges[i])) / (edges[1] - edges[0])
    assert np.allclose(got, np.clip(want, 0, 1), atol=1e-6)


def test_bins_hold_short_gaps_but_not_a_stalled_source():
    from kdash.tui.widgets.spark import bin_mean, bin_or, fmt, spark

    t = np.array([0, 1, 2, 3, 10, 11], dtype=np.int64) * 1_000_000_000  # a 6 s stall
    v = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    bins = bin_mean(t, v, 0, 12_000_000_000, 48)  # 4 bins per second, samples at 1 Hz
    assert np.isfinite(bins[:16]).all()  # held between 1 Hz samples
    assert np.isnan(bins[24:36]).all()  # blank in the stall
    assert bins[5] == 2.0
    line = spark(bins, 0, 6)
    assert len(line) == 48 and line[30] == " " and line[44] == "█"
    bits = bin_or(t, np.array([0, 4, 4, -1, 1, 4]), 0, 12_000_000_000, 12)
    assert list(bits[:4]) == [0, 4, 4, 4]  # -1 (n/a) holds the previous bits
    assert bits[11] == 4 and bits[10] == 1
    assert fmt(float("nan")) == "n/a" and fmt(-1) == "n/a" and fmt(3.14159, ".1f", " W") == "3.1 W"


class _FakeAgents:
    """Stands in for `AgentTreeSource` (a real one needs an agent with CUPTI, i.e. a GPU): it
    records each `set_continuous` call and whether it came on the UI (main) thread."""

    name = "agent"

    def __init__(self, pids: list[int]) -> None:
        import threading

        from kdash.collectors.base import Health

        self._main = threading.main_thread()
        self._health_cls = Health
        self.pids = pids
        self.continuous = False
        self.calls: list[tuple[bool, bool]] = []
        self.health = Health("ok", "sampling 10% (100 ms/s)") if pids else Health("starting", "")

    def start(self) -> None:
        pass

    def poll(self, now_ns: int) -> dict:
        return {}

    def stop(self) -> None:
        pass

    def active_pids(self) -> list[int]:
        return list(self.pids)

    def set_continuous(self, on: bool) -> None:
        import threading

        self.calls.append((on, threading.current_thread() is self._main))
        self.continuous = on
        self.health = self._health_cls("ok", "continuous" if on else "sampling 10% (100 ms/s)")

    def cost_estimate(self) -> float | None:
        return 0.2916 if self.continuous else 0.02916

    def cost_detail(self) -> dict[str, dict]:
        return {}

    # PC sampling, as AgentTreeSource has it (the `L` key and the source pane's line)
    pc_sampling = False
    pc_calls: list[bool] = []

    def set_pc_sampling(self, on: bool) -> None:
        self.pc_calls = [*self.pc_calls, on]
        self.pc_sampling = on

    def extra_health(self) -> dict[str, str]:
        if not self.pids:
            return {}
        return {"pc sampling": "starting" if self.pc_sampling else "off"}


async def test_activity_key_switches_every_agent_off_the_ui_thread(make_app, tmp_path):
    """`a`: continuous and back, through the agent source, in a worker; the status bar says
    the mode and the cost estimate of each."""
    from kdash.session import Recorder, RecorderOptions

    agents = _FakeAgents([11, 12])
    rec = Recorder([agents], Store(retention_s=30), None, RecorderOptions(capture_dir=tmp_path))
    app = make_app(store=rec.store, meta={}, mode="live", recorder=rec, redraw_hz=10)
    async with app.run_test(size=(160, 40)) as pilot:
        assert await wait_for(
            pilot, lambda: "activity sampled, kdash cost ≈ 3%" in status_text(app)
        )
        await pilot.press("question_mark")
        await pilot.pause()
        assert "kernel activity" in plain(app.screen.query_one("#help-table"))
        await pilot.press("escape")
        await pilot.pause()
        await pilot.press("a")
        assert await wait_for(pilot, lambda: agents.calls == [(True, False)]), agents.calls
        assert await wait_for(
            pilot, lambda: "activity continuous, kdash cost ≈ 29%" in status_text(app)
        )
        assert any("continuous" in n.message for n in app._notifications)
        await pilot.press("a")
        assert await wait_for(pilot, lambda: agents.calls == [(True, False), (False, False)])
        assert await wait_for(pilot, lambda: "activity sampled" in status_text(app))


async def test_pc_sampling_key_switches_every_agent_and_the_source_pane_says_so(make_app, tmp_path):
    """`L`: PC sampling on and off through the agent source, in a worker; the health the
    source pane reads (`extra_health` in the view) follows; the help lists the key live."""
    from kdash.tui.panes.source import why_no_samples

    from kdash.session import Recorder, RecorderOptions

    agents = _FakeAgents([11])
    rec = Recorder([agents], Store(retention_s=30), None, RecorderOptions(capture_dir=tmp_path))
    app = make_app(store=rec.store, meta={}, mode="live", recorder=rec, redraw_hz=10)
    async with app.run_test(size=(160, 40)) as pilot:
        await pilot.pause()
        assert app.build_view().health["pc sampling"] == "off"
        assert "press L" in why_no_samples(app.build_view().health)
        await pilot.press("question_mark")
        await pilot.pause()
        assert "PC sampling" in plain(app.screen.query_one("#help-table"))
        await pilot.press("escape")
        await pilot.press("L")
        assert await wait_for(pilot, lambda: agents.pc_calls == [True]), agents.pc_calls
        assert any("PC sampling: on" in n.message for n in app._notifications)
        assert app.build_view().health["pc sampling"] == "starting"
        assert "starting" in why_no_samples(app.build_view().health)
        await pilot.press("L")
        assert await wait_for(pilot, lambda: agents.pc_calls == [True, False])


async def test_activity_key_without_an_agent_says_so(make_app, tmp_path):
    from kdash.session import Recorder, RecorderOptions

    agents = _FakeAgents([])
    rec = Recorder([agents], Store(retention_s=30), None, RecorderOptions(capture_dir=tmp_path))
    app = make_app(store=rec.store, meta={}, mode="live", recorder=rec)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("a")
        await pilot.pause(0.3)
        assert agents.calls == []
        notes = [n.message for n in app._notifications]
        assert any("no kdash agent attached" in m for m in notes), notes
        assert "activity" not in status_text(app) and "kdash cost" not in status_text(app)


async def test_activity_key_in_a_replay_says_there_is_no_agent(replay_app):
    async with replay_app.run_test(size=(100, 30)) as pilot:
        await pilot.press("a")
        await pilot.pause()
        notes = [n.message for n in replay_app._notifications]
        assert any("no kdash agent attached" in m for m in notes), notes


def test_kernel_pane_line_under_no_inject():
    from kdash.tui.panes.kernels import empty_line as kernel_empty_line

    health = "unavailable: no agent in pid 42 (injection off: --no-inject); start the target"
    line = kernel_empty_line(health)
    assert line.startswith("Kernel timeline: no agent in pid 42 (injection off: --no-inject)")
    assert "\n" not in line
    assert kernel_empty_line("unavailable: no kdash agent in pid 42") == NO_KERNELS
    why = "pid 42 runs as uid 7 and kdash as uid 0: run kdash as that user"
    line = kernel_empty_line(f"unavailable: no kdash agent in pid 42 or its children: {why}")
    assert line == f"Kernel timeline: no agent — {why}"
    # an agent that is there but cannot record says why (under `kdash run` the generic advice
    # to use `kdash run` would be wrong)
    why = "pid 42: no NVIDIA driver here (no /dev/nvidiactl, no /proc/driver/nvidia)"
    line = kernel_empty_line(f"unavailable: {why}")
    assert line == f"Kernel timeline: no kernels yet — agent {why}"
    line = kernel_empty_line("starting: waiting for CUDA in pid 42")
    assert line == "Kernel timeline: no kernels yet — agent waiting for CUDA in pid 42"
    assert kernel_empty_line("starting: looking for kdash agents in the target") == NO_KERNELS


# -- the status bar, toasts, the cursor and the title at any size -------------------------------
SIZES = [(80, 24), (120, 40), (200, 50)]
SIZE_IDS = ["80x24", "120x40", "200x50"]


def drawn(widget) -> list:
    """The strips a widget draws, through its styles and the app's filters (NO_COLOR's too)."""
    from textual.geometry import Region

    width, height = widget.region.size  # padding and border included
    return widget.render_lines(Region(0, 0, width, height))


def bar_line(app: KdashApp) -> str:
    bar = app.query_one(StatusBar)
    assert bar.outer_size.height == 1 and bar.region.bottom == app.size.height
    (strip,) = drawn(bar)
    return strip.text.strip()


@pytest.fixture
def demo_app(make_app):
    """Factory: the bundled demo capture replayed with the title `kdash demo` gives it."""
    from kdash.commands import bundled_demo

    def build(**kwargs):
        path = bundled_demo()
        cap = load_capture(path)
        meta = dict(cap.meta)
        meta["capture_path"] = str(path)
        return make_app(store=store_from_capture(cap), meta=meta, mode="replay", **kwargs)

    return build


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
async def test_status_bar_stays_one_line_after_c_in_a_replay(demo_app, size):
    app = demo_app()
    async with app.run_test(size=size) as pilot:
        await pilot.pause()
        before = bar_line(app)
        assert before.startswith("REPLAY pid 1239") and before.endswith("? keys")  # its target
        await pilot.press("c")
        await pilot.pause()
        line = bar_line(app)  # still one line, at the bottom
        assert "replay: nothing to capture (captures are taken live)" in line
        assert line.startswith("REPLAY") and line.endswith("│ ? keys")
        # the whole line is the bar's content (and its tooltip when the drawn one is cut)
        whole = status_text(app)
        assert "replay: nothing to capture" in whole and "dropped 0" in whole
        bar = app.query_one(StatusBar)
        assert (bar.tooltip is None) == (line == whole.strip())


async def test_replay_answer_to_c_leaves_the_bar_after_a_while(demo_app, monkeypatch):
    """The bar's "nothing to capture" is an answer, not a state: it goes (here after 2 s, by
    default 10 s) and the window label that it displaced at 80 columns comes back."""
    import kdash.tui.app as app_module

    monkeypatch.setattr(app_module, "REPLAY_NOTE_S", 2.0)
    app = demo_app()
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        assert "t 0.0–20.1 s of 20.1 s" in bar_line(app)
        await pilot.press("c")
        await pilot.pause()
        assert "nothing to capture" in bar_line(app)
        assert "t 0.0–20.1 s" not in bar_line(app)
        assert await wait_for(pilot, lambda: "nothing to capture" not in status_text(app), 10)
        await pilot.pause()
        assert "t 0.0–20.1 s of 20.1 s" in bar_line(app)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
async def test_status_bar_cuts_a_long_note_with_an_ellipsis(replay_app, size):
    async with replay_app.run_test(size=size) as pilot:
        await pilot.pause()
        replay_app.note = "recorder stopped: " + "a long reason " * 30
        replay_app._update_status()
        await pilot.pause()
        line = bar_line(replay_app)
        assert line.startswith("REPLAY") and line.endswith("? keys")
        assert "recorder stopped: a long reason" in line and "…" in line
        assert replay_app.query_one(StatusBar).tooltip.startswith("REPLAY")
        replay_app.note = ""
        replay_app._update_status()
        await pilot.pause()
        assert "recorder stopped" not in bar_line(replay_app)


def test_status_bar_fits_every_width_and_keeps_the_saved_file_name():
    """Pure: the fitted line never exceeds its width, ends with `? keys`, keeps the capture
    state; a saved path too long for the line is cut from its left, never mid-name."""
    from kdash.tui.widgets.status import StatusInfo, assemble, fit, segments
    from rich.cells import cell_len

    path = "/home/someone/.local/share/kdash/captures/run-1201.kdash"
    info = StatusInfo(
        mode="live",
        target="pid 1234 python -m sglang.launch_server --mod…",
        capture=f"saved: {path}",
        capture_phase="saved",
        capture_path=path,
        sources={"sched": "degraded: no cpufreq in sysfs", "nvml": "ok", "agent": "ok: sampling"},
        poll_ms=1.5,
        window="window 60 s",
        activity="sampled",
        cost=0.03,
    )
    segs = segments(info, lambda component: None)
    whole = assemble(segs, [s.forms[0] for s in segs]).plain
    assert path in whole and "poll 1.5 ms" in whole
    seen = set()
    for width in range(32, 260):
        line = assemble(segs, fit(segs, width)).plain
        assert cell_len(line) <= width, (width, line)
        assert line.startswith("LIVE ") and line.endswith(" │ ? keys"), line
        assert " │ saved: " in line, line
        if width < 40:  # "LIVE │ saved: …/run-1201.kdash │ ? keys" needs 39
            continue
        assert "run-1201.kdash" in line, line
        saved = line.split("saved: ", 1)[1].split(" │ ", 1)[0]
        assert saved == path or (saved.startswith("…/") and path.endswith(saved[1:])), saved
        if "kdash cost ≈ 3%" in line:  # the cost outlasts everything but the capture state
            seen.add("cost")
            assert "poll" not in line or "sched" in line
        seen.add(saved == path)
    assert seen == {True, False, "cost"}
    assert assemble(segs, fit(segs, 400)).plain == whole


@pytest.mark.slow
async def test_live_status_bar_at_120x40_keeps_the_keys_hint(busy_child, tmp_path, make_app):
    """Live on a real child with a real recorder: while capturing and once saved (a long
    folder), the bar is one line ending with `? keys`; the saved file's name is in it whole."""
    deep = tmp_path / ("a-rather-long-folder-name-" * 3) / "captures"
    deep.mkdir(parents=True)
    # post=3 s: the countdown is still on when the key's redraw is read on a loaded machine
    rec, store, meta = _live_recorder(busy_child, deep, pre=1.0, post=3.0)
    app = make_app(store=store, meta=meta, mode="live", recorder=rec, redraw_hz=10)

    def drawn_has(text: str):  # the drawn line (one line, `? keys` last) holds `text`
        return lambda: text in (line := bar_line(app)) and line.endswith("? keys")

    async with app.run_test(size=(120, 40)) as pilot:
        assert await wait_for(pilot, drawn_has(f"LIVE pid {busy_child.pid}"))
        await pilot.press("c")
        assert await wait_for(pilot, drawn_has("capturing… "), 5)
        assert await wait_for(pilot, lambda: rec.capture.phase in ("saved", "failed"), 20)
        assert rec.capture.phase == "saved", rec.capture.error
        assert await wait_for(pilot, drawn_has("saved: …/"), 5)
        assert rec.capture.path.name in bar_line(app)

        # the toast has the name whole too, with as much of the folder as fits its width
        def notes():
            return [n for n in app._notifications if "capture saved" in n.message]

        assert await wait_for(pilot, notes, 5)
        shown = notes()[0].message.split()[-1]
        assert shown.startswith("…/") and str(rec.capture.path).endswith(shown[1:])
        assert rec.capture.path.name in shown


async def test_toasts_never_cover_the_status_bar_nor_split_a_path(demo_app):
    from textual.widgets._toast import Toast, ToastRack

    path = "/home/someone/.local/share/kdash/captures/run-1201.kdash"
    app = demo_app()
    async with app.run_test(size=(80, 24), notifications=True) as pilot:
        await pilot.press("c")  # a real toast: "This is a replay: …"
        app.notify(f"capture saved: {path}", title="kdash")
        app.notify("a [bracketed] word is text, not markup", severity="warning")
        await pilot.pause()
        await pilot.pause()
        bar = app.query_one(StatusBar)
        toasts = list(app.screen.query(Toast))
        assert len(toasts) == 3
        rack = app.screen.query_one(ToastRack)
        assert not rack.region.overlaps(bar.region)
        for toast in toasts:
            # drawn whole (not clipped by the rack) and clear of the bar
            placed = app.screen.find_widget(toast)
            assert placed.region.intersection(placed.clip) == toast.region
            assert toast.region.height and not toast.region.overlaps(bar.region)
        assert toasts[-1].region.bottom == bar.region.y  # right above it
        assert {app.screen.get_widget_at(x, bar.region.y)[0] for x in range(80)} == {bar}
        assert bar_line(app).endswith("? keys")
        saved = next(t for t in toasts if "capture saved" in str(t.render()))
        lines = [s.text.strip(" ▌") for s in drawn(saved)]
        (shown,) = [ln for ln in lines if "run-1201.kdash" in ln]
        assert shown.startswith("…/") and path.endswith(shown[1:]), lines
        assert not any(ln.endswith(("/", "run-", "kdash/")) for ln in lines), lines
        warned = next(t for t in toasts if "bracketed" in str(t.render()))
        assert "a [bracketed] word" in " ".join(s.text for s in drawn(warned))


def _cursor_rows(table) -> tuple[list, list]:
    """The cursor row's segments and the next row's (row 0 is the header)."""
    strips = drawn(table)
    at = table.cursor_row - int(table.scroll_y) + 1

    def cells(strip):
        return [seg for seg in strip if seg.text.strip()]

    return cells(strips[at]), cells(strips[at + 1])


@pytest.mark.parametrize(
    ("theme", "no_color"),
    [("mono", False), ("mono", True), ("dark", True), ("light", True)],
    ids=["mono", "mono-NO_COLOR", "dark-NO_COLOR", "light-NO_COLOR"],
)
async def test_table_cursor_row_is_reverse_video_without_colour(
    demo_app, monkeypatch, theme, no_color
):
    """Without colour the cursor row must still show: reverse video, in the kernel and the CPU
    table, focused or not; the other rows are not reversed."""
    if no_color:
        monkeypatch.setenv("NO_COLOR", "1")
    app = demo_app(theme=theme)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        tables = {
            pid: app.query_one(f"#{pid}", Pane).query_one(DataTable) for pid in ("kernels", "cpu")
        }
        for pid, table in tables.items():
            assert await wait_for(pilot, lambda t=table: t.row_count >= 2), pid
            assert table.size.height > 3, pid
            for focus in (True, False):
                if focus:
                    table.focus()
                else:
                    tables["cpu" if pid == "kernels" else "kernels"].focus()
                await pilot.pause()
                assert table.has_focus == focus
                cursor, other = _cursor_rows(table)
                assert cursor and all(seg.style.reverse for seg in cursor), (pid, focus, cursor)
                assert other and not any(seg.style.reverse for seg in other), (pid, focus)
                if no_color:
                    assert all(
                        seg.style.color is None or seg.style.color.is_default for seg in cursor
                    )


async def test_demo_title_says_replay_at_80x24(demo_app, monkeypatch):
    """The title `kdash demo` gives its replay (no GPU here) shows "replay" in an 80-column
    header, and any replay title that says it only late gets it in front."""
    import argparse

    from textual.widgets._header import HeaderTitle

    from kdash import commands

    seen = {}
    monkeypatch.setattr(
        commands, "open_capture", lambda path, theme, title=None: seen.setdefault("t", title)
    )
    args = argparse.Namespace(replay=False, headless=False, theme=None, duration=None, output=None)
    commands.cmd_demo(args)
    app = demo_app(title=seen["t"])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        (strip,) = drawn(app.query_one(HeaderTitle))
        assert "replay" in strip.text, strip.text
    late = demo_app(title="kdash demo workload (paged decode + prefill), no GPU here: replay")
    assert late._titles()[0].startswith("kdash replay — kdash demo workload")


def test_fit_cuts_paths_from_the_left_and_other_words_at_the_end():
    from kdash.tui.widgets.fit import cut_end, cut_path, fit_words

    path = "/home/someone/.local/share/kdash/captures/run-1201.kdash"
    assert cut_path(path, 80) == path
    assert cut_path(path, 25) == "…/captures/run-1201.kdash"
    assert cut_path(path, 24) == "…/run-1201.kdash"  # whole components only
    assert cut_path(path, 10) == "…201.kdash"  # the name alone too wide: its end kept
    assert cut_path("run-1201.kdash", 10) == "…201.kdash"
    assert cut_end("abcdef", 4) == "abc…" and cut_end("abc", 3) == "abc"
    message = f"capture saved: {path}\nnext line with averyveryverylongword"
    fitted = fit_words(message, 20)
    assert fitted == "capture saved: …/run-1201.kdash\nnext line with averyveryverylongwo…"
    assert all(len(word) <= 20 for word in fitted.split())


@pytest.mark.parametrize("theme", ["dark", "light", "mono"])
async def test_focused_pane_frame_differs_without_colour(demo_app, monkeypatch, theme):
    """NO_COLOR strips the focus colour from the frames: the focused pane's frame is double,
    the others round, in every theme."""
    monkeypatch.setenv("NO_COLOR", "1")
    app = demo_app(theme=theme)
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        for focused in ("kernels", "cpu"):
            app.query_one(f"#{focused}", Pane).focus_target().focus()
            await pilot.pause()
            corners = {
                pid: drawn(app.query_one(f"#{pid}", Pane))[0].text[0]
                for pid in ("kernels", "clocks", "cpu", "source")
            }
            assert corners.pop(focused) == "╔", (focused, corners)
            assert set(corners.values()) == {"╭"}, (focused, corners)
