"""The source pane on the bundled demo capture (real H200 kernels, no PC samples) and on the
same capture with PC samples added.

The samples are a FIXTURE (tests/cubin_fixtures.py): `_decode_stage1` compiled here for sm_90
(a real cubin, its line table from nvdisasm), with seeded counts over its real PC offsets and
real H200 stall-reason names. They drive the pane's keys on a cubin built here; the same
pane on PC samples recorded on the H200 (and the cubins they came from) is tested in
tests/test_h200_pcsamples.py.

Snapshots show kernels/decode_attention.py as it is in the checkout and a cubin compiled by the
installed Triton: an edit to that file (or a Triton upgrade) is an intended change that needs
`pytest tests/test_source_pane.py --snapshot-update`.
"""

from __future__ import annotations

import importlib.util
import io
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import store_from_capture
from cubin_fixtures import compile_kernel, fixture_samples
from kdash.tui.panes.kernels import KernelPane
from kdash.tui.panes.source import NO_SAMPLES, SourcePane, why_no_samples
from rich.console import Console

from kdash import cubin, schema
from kdash.capture import load_capture

DEMO = Path(__file__).resolve().parents[1] / "kdash" / "data" / "demo-h200.kdash"
# The installed or checked-out copy, found without importing it (that would import triton).
DECODE = Path(importlib.util.find_spec("kdash.kernels.decode_attention").origin).resolve()
NVDISASM, WHY = cubin.find_nvdisasm()


def plain(static) -> str:
    console = Console(width=300, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(static.content)
    return cap.get()


async def wait_for(pilot, cond, timeout: float = 15.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        await pilot.pause(0.05)
    return cond()


@pytest.fixture(scope="module")
def demo():
    return load_capture(DEMO)


@pytest.fixture
def demo_app(make_app, demo):
    meta = dict(demo.meta)
    meta["capture_path"] = str(DEMO)
    return make_app(store=store_from_capture(demo), meta=meta, mode="replay")


@pytest.fixture(scope="module")
def stage1_table(tmp_path_factory) -> cubin.LineTable:
    if NVDISASM is None:
        pytest.skip(WHY)
    lt = cubin.line_table(compile_kernel("_decode_stage1", tmp_path_factory.mktemp("tc")))
    assert lt.has_lines
    return lt


@pytest.fixture
def sampled_app(make_app, demo, stage1_table):
    """The demo capture plus a line table and fixture PC samples for `_decode_stage1`."""
    store = store_from_capture(demo)
    win = demo.meta["window"]
    rows = cubin.to_rows(stage1_table, t_ns=int(win["start_ns"]))
    store.append(
        "source_lines",
        schema.make_batch("source_lines", **{k: np.asarray(v) for k, v in rows.items()}),
    )
    crc = cubin.crc_to_i8(stage1_table.crc)
    s = fixture_samples(
        [i.pc_offset for i in stage1_table.instrs], "_decode_stage1", crc, t0=int(win["start_ns"])
    )
    store.append("pc_samples", schema.from_frame("pc_samples", s))
    meta = dict(demo.meta)
    meta["capture_path"] = str(DEMO)
    app = make_app(store=store, meta=meta, mode="replay")
    app.fixture_samples = s  # for the assertions
    return app


def source(app) -> SourcePane:
    return app.query_one("#source", SourcePane)


# -- without samples: the definition line ---------------------------------------------------------
async def test_demo_shows_the_hottest_triton_kernels_definition(demo_app):
    async with demo_app.run_test(size=(120, 40)) as pilot:
        pane = source(demo_app)
        assert await wait_for(pilot, lambda: pane.kernel is not None)
        assert not pane.has_class("-empty")
        assert pane.kernel == "_decode_stage1"  # 10.6% of the demo's recorded GPU time, the most
        text = plain(pane.body)
        head = text.splitlines()[0]
        assert head.startswith("_decode_stage1 · 10.6% GPU · decode_attention.py:")
        def_line = next(
            i + 1
            for i, s in enumerate(DECODE.read_text().splitlines())
            if s.startswith("def _decode_stage1(")
        )
        assert f"{def_line} ▶ def _decode_stage1(" in text
        assert "definition line" in text and "found by name in decode_attention" in text
        # the demo's agent was on: the reason is that PC sampling was off
        assert "no line samples: PC sampling was off" in text


async def test_no_kernels_is_one_line(replay_app):
    async with replay_app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        pane = source(replay_app)
        assert pane.has_class("-empty")
        assert plain(pane.empty_line).strip() == NO_SAMPLES


def test_why_no_samples_from_health():
    assert "no in-process agent" in why_no_samples({})
    assert "kdash run" in why_no_samples({"agent": "unavailable: no socket"})
    assert "PC sampling was off" in why_no_samples({"agent": "ok"})
    perm = why_no_samples({"agent": "ok", "pcsampling": "unavailable: CUPTI_ERROR_NVGPUCTRPERM"})
    assert "ERR_NVGPUCTRPERM" in perm and "NVreg_RestrictProfilingToAdminUsers=0" in perm
    other = why_no_samples({"agent": "ok", "pc_sampling": "unavailable: in use by another client"})
    assert "another profiler" in other
    assert "window yet" in why_no_samples({"agent": "ok", "pcsampling": "ok"})


# -- with samples ------------------------------------------------------------------------------
async def test_samples_give_heat_hot_line_and_stalls(sampled_app, stage1_table):
    samples = sampled_app.fixture_samples
    hot = cubin.hot_lines(samples, stage1_table)
    top_line, second = int(hot["line"].iloc[0]), int(hot["line"].iloc[1])
    code = DECODE.read_text().splitlines()
    async with sampled_app.run_test(size=(120, 40)) as pilot:
        pane = source(sampled_app)
        assert await wait_for(pilot, lambda: pane.kernel is not None)
        await pilot.press("4")  # maximised: room for the bars
        await pilot.pause()
        text = plain(pane.body)
        lines = text.splitlines()
        assert f"decode_attention.py:{top_line}" in lines[0]
        row = next(s for s in lines if f"{top_line:5d} ▶ " in s)
        share = f"{100 * hot['share'].iloc[0]:.1f}%"
        assert row.lstrip().startswith(share)  # the heat gutter
        assert code[top_line - 1].strip() in row
        assert f"line {top_line}: {int(hot['samples'].iloc[0])} samples, {share}" in text
        st = cubin.line_stalls(samples, stage1_table, str(DECODE), top_line)
        first_bar = next(s for s in lines if s.startswith("  ") and "█" in s)
        assert first_bar.split()[0] == st["reason"].iloc[0]
        assert cubin.STALL_MEANINGS[st["reason"].iloc[0]] in first_bar
        assert "_not_issued" not in text
        # n: the next hot line becomes the selected one
        await pilot.press("n")
        await pilot.pause()
        assert f"decode_attention.py:{second}" in plain(pane.body).splitlines()[0]
        # down: one line further
        await pilot.press("down")
        await pilot.pause()
        assert f"decode_attention.py:{second + 1}" in plain(pane.body).splitlines()[0]
        # s: SASS view, centred on the hottest instruction
        await pilot.press("s")
        await pilot.pause()
        heat = cubin.sass_heat(samples, stage1_table)
        top = heat.sort_values("samples", ascending=False, kind="stable").iloc[0]
        sass = plain(pane.body)
        assert f"SASS +0x{int(top['pc_offset']):x}" in sass.splitlines()[0]
        assert f"{int(top['pc_offset']):05x} ▶ {top['sass']}" in sass
        assert f"{100 * top['share']:.1f}%" in sass.splitlines()[-1]
        await pilot.press("s")
        await pilot.pause()
        assert "SASS" not in plain(pane.body).splitlines()[0]


async def test_pin_the_kernel_selected_in_the_table(sampled_app):
    async with sampled_app.run_test(size=(120, 40)) as pilot:
        kp = sampled_app.query_one(KernelPane)
        pane = source(sampled_app)
        assert await wait_for(pilot, lambda: kp.analyses_applied > 0 and pane.kernel is not None)
        kp.table.focus()
        await pilot.press("down")  # second row: an ATen elementwise kernel
        await pilot.press("f")
        await pilot.pause()
        second = pane.window_names[1]
        assert pane.pinned == second and pane.kernel == second
        # not a Triton kernel and no line table: the pane says so in one line
        assert pane.has_class("-empty")
        assert "no source here" in plain(pane.empty_line)
        await pilot.press("f")  # same row again: follow the hottest
        await pilot.pause()
        assert pane.pinned is None and pane.kernel == "_decode_stage1"
        assert not pane.has_class("-empty")


async def test_changed_source_is_flagged(make_app, demo, stage1_table, tmp_path):
    copy = tmp_path / "decode_attention.py"
    copy.write_text(DECODE.read_text())
    from dataclasses import replace

    lt = cubin.LineTable(
        instrs=[replace(i, file=str(copy)) for i in stage1_table.instrs],
        crc=stage1_table.crc,
        sha256=stage1_table.sha256,
    )
    lt.file_sha256[str(copy)], lt.file_mtime_ns[str(copy)] = cubin._stamp(str(copy))
    copy.write_text(DECODE.read_text() + "\n# edited after the capture\n")
    store = store_from_capture(demo)
    rows = cubin.to_rows(lt, t_ns=int(demo.meta["window"]["start_ns"]))
    store.append(
        "source_lines",
        schema.make_batch("source_lines", **{k: np.asarray(v) for k, v in rows.items()}),
    )
    app = make_app(store=store, meta=dict(demo.meta), mode="replay")
    async with app.run_test(size=(160, 40)) as pilot:
        pane = source(app)
        assert await wait_for(pilot, lambda: pane.kernel is not None)
        head = plain(pane.body).splitlines()[0]
        assert "source changed since capture" in head
        assert "line table" in plain(pane.body)


# -- snapshots ------------------------------------------------------------------------------------
async def _settle(pilot) -> None:
    app = pilot.app
    kp = app.query_one(KernelPane)
    await wait_for(pilot, lambda: kp.analyses_applied > 0 and source(app).kernel is not None)
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_snapshot_demo_definition_line(snap_compare, demo_app, size):
    assert snap_compare(demo_app, terminal_size=size, run_before=_settle)


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_snapshot_fixture_samples_maximised(snap_compare, sampled_app, size):
    async def run_before(pilot) -> None:
        await _settle(pilot)
        await pilot.press("4")
        await pilot.pause()

    assert snap_compare(sampled_app, terminal_size=size, run_before=run_before)


# -- kdash report ---------------------------------------------------------------------------------
def test_report_lists_hot_lines_per_kernel(demo, stage1_table, tmp_path):
    """A capture written with the line table and the fixture samples: `report --json` gains
    `hot_lines`, the text report a table of them; the demo capture itself says why none."""
    from kdash.capture import write_capture
    from kdash.report import render, summarize

    win = demo.meta["window"]
    tables = {t: demo.batch(t) for t in schema.TABLES}
    rows = cubin.to_rows(stage1_table, t_ns=int(win["start_ns"]) - 10**9)  # before the window
    tables["source_lines"] = schema.make_batch(
        "source_lines", **{k: np.asarray(v) for k, v in rows.items()}
    )
    s = fixture_samples(
        [i.pc_offset for i in stage1_table.instrs],
        "_decode_stage1",
        cubin.crc_to_i8(stage1_table.crc),
        t0=int(win["start_ns"]),
    )
    orphan = s.head(3).assign(kernel="_extend_kernel", cubin_crc=-1)
    tables["pc_samples"] = schema.from_frame("pc_samples", pd.concat([s, orphan]))
    path = write_capture(tmp_path / "sampled.kdash", dict(demo.meta), tables)
    summary = summarize(load_capture(path))
    hot = [h for h in summary["hot_lines"] if h["kernel"] == "_decode_stage1"]
    expect = cubin.hot_lines(s, stage1_table).head(10)
    assert [h["line"] for h in hot] == [int(x) for x in expect["line"]]
    assert hot[0]["samples"] == int(expect["samples"].iloc[0])
    assert hot[0]["file"].endswith("decode_attention.py")
    lone = [h for h in summary["hot_lines"] if h["kernel"] == "_extend_kernel"]
    assert lone and lone[0]["note"] == "no line table for this kernel in the capture"
    console = Console(width=160, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        render(summary, console)
    out = cap.get()
    assert "Hot source lines" in out and f"decode_attention.py:{hot[0]['line']}" in out
    assert summarize(demo)["hot_lines"] == []


# -- keys that cannot act say why; the hottest kernel without source is followed past ------------
async def test_keys_without_samples_or_sass_say_why_and_leave_the_view_working(demo_app):
    async with demo_app.run_test(size=(80, 24)) as pilot:
        pane = source(demo_app)
        assert await wait_for(pilot, lambda: pane.kernel is not None)
        await pilot.press("4")
        await pilot.pause()
        await pilot.press("s")  # the demo capture holds no line table: no SASS to show
        await pilot.pause()
        assert not pane.sass_mode
        msgs = [n.message for n in demo_app._notifications]
        assert any(m.startswith("no SASS for _decode_stage1") for m in msgs), msgs
        await pilot.press("n")
        await pilot.pause()
        msgs = [n.message for n in demo_app._notifications]
        assert any(
            "no hot lines for _decode_stage1" in m and "PC sampling was off" in m for m in msgs
        )
        key = ("_decode_stage1", False)
        start = pane._selected[key]
        await pilot.press("down")  # still moves: `s` did not switch to an empty SASS view
        await pilot.pause()
        assert pane._selected[key] == start + 1
        await pilot.press("pagedown")
        await pilot.pause()
        moved = pane._selected[key] - (start + 1)
        assert moved >= 1
        await pilot.press("pageup")
        await pilot.pause()
        assert pane._selected[key] == start + 1
        assert f"decode_attention.py:{start + 1}" in plain(pane.body).splitlines()[0]


@pytest.fixture
def gemm_first_app(make_app, demo):
    """The demo capture with one cuBLAS GEMM's kernels made 40x longer, so the hottest kernel
    is one without source (an edit of real records, for the following rule only)."""
    k = demo.batch("kernels")
    names = pd.Series(k["name"])
    gemm = names[names.str.startswith("nvjet")].value_counts().index[0]
    sel = names.to_numpy() == gemm
    k = {c: np.array(v, copy=True) for c, v in k.items()}
    k["end_ns"][sel] = k["start_ns"][sel] + 40 * (k["end_ns"][sel] - k["start_ns"][sel])
    from kdash.store import Store

    store = Store(retention_s=10**7, max_rows=10**9)
    for t in schema.TABLES:
        store.append(t, k if t == "kernels" else demo.batch(t))
    meta = dict(demo.meta)
    meta["capture_path"] = str(DEMO)
    app = make_app(store=store, meta=meta, mode="replay")
    app.gemm = gemm
    return app


async def test_the_hottest_kernel_without_source_is_named_and_the_next_readable_one_shown(
    gemm_first_app,
):
    app = gemm_first_app
    async with app.run_test(size=(120, 40)) as pilot:
        pane = source(app)
        assert await wait_for(pilot, lambda: pane.kernel is not None)
        assert pane.window_names[0] == app.gemm  # the GEMM is the hottest now
        assert pane.kernel == "_decode_stage1" and pane.skipped is not None
        head = plain(pane.body).splitlines()[0]
        assert "(no source) · showing _decode_stage1" in head, head
        assert "hottest with source (f: pin)" in head


# -- the code that ran, carried in the data -----------------------------------------------------
@pytest.fixture
def carried_app(make_app, demo, stage1_table):
    """As `sampled_app`, but the line table points at a file that does not exist here (as a
    capture from another machine does: torch.compile's modules live in its /tmp) and the data
    carries that file's text in `source_files`, with one line edited so the test can tell the
    carried text from the checkout's."""
    store = store_from_capture(demo)
    win = demo.meta["window"]
    gone = "/nonexistent/elsewhere/decode_attention.py"
    rows = cubin.to_rows(stage1_table, t_ns=int(win["start_ns"]))
    rows["file"] = [gone if f else f for f in rows["file"]]
    text = DECODE.read_text().replace("def _decode_stage1(", "def _decode_stage1(  # as run", 1)
    import hashlib

    sha = hashlib.sha256(text.encode()).hexdigest()
    rows["file_sha256"] = [sha if f else "" for f in rows["file"]]
    store.append(
        "source_lines",
        schema.make_batch("source_lines", **{k: np.asarray(v) for k, v in rows.items()}),
    )
    store.append(
        "source_files",
        schema.make_batch(
            "source_files",
            t_ns=np.array([int(win["start_ns"])], dtype=np.int64),
            file=np.array([gone], dtype=object),
            sha256=np.array([sha], dtype=object),
            text=np.array([text], dtype=object),
        ),
    )
    crc = cubin.crc_to_i8(stage1_table.crc)
    s = fixture_samples(
        [i.pc_offset for i in stage1_table.instrs], "_decode_stage1", crc, t0=int(win["start_ns"])
    )
    store.append("pc_samples", schema.from_frame("pc_samples", s))
    return make_app(store=store, meta=dict(demo.meta), mode="replay")


async def test_a_file_missing_here_is_shown_from_the_text_the_data_carries(carried_app):
    async with carried_app.run_test(size=(120, 40)) as pilot:
        pane = source(carried_app)
        assert await wait_for(pilot, lambda: pane.kernel is not None)
        await pilot.press("4")
        await pilot.pause()
        await pilot.press("n")  # the hottest line, then around the definition
        text = plain(pane.body)
        assert "not readable here" not in text and "lines may not match" not in text
        assert "(source not available on this machine)" not in text
        key = ("_decode_stage1", False)
        def_line = next(
            i + 1
            for i, s in enumerate(DECODE.read_text().splitlines())
            if s.startswith("def _decode_stage1(")
        )
        pane._selected[key] = def_line
        pane._redraw()
        await pilot.pause()
        assert "def _decode_stage1(  # as run" in plain(pane.body)
