"""A replay of an imported REAL Kineto trace (tests/data/kdash-h200-TP-0-DECODE.trace.json.gz,
SGLang on the H200) in the dashboard: its CPU ops are a lane of the kernel pane, over the
kernels they launched, next to the trace's annotations."""

from __future__ import annotations

import io
from pathlib import Path

from conftest import store_from_capture
from kdash.tui.panes.kernels import KernelPane
from rich.console import Console

from kdash import kineto
from kdash.capture import load_capture

TRACE = Path(__file__).parent / "data" / "kdash-h200-TP-0-DECODE.trace.json.gz"


def _plain(static) -> str:
    console = Console(width=200, file=io.StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(static.content)
    return cap.get()


async def test_replay_of_an_imported_trace_draws_its_cpu_ops(make_app, tmp_path):
    cap = load_capture(kineto.import_traces([TRACE], tmp_path / "decode.kdash").path)
    assert (cap.tables["markers"]["domain"] == "cpu_op").sum() > 0
    meta = dict(cap.meta, capture_path=str(cap.path))
    app = make_app(store=store_from_capture(cap), meta=meta, mode="replay")
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        pane = app.query_one(KernelPane)
        assert not pane.has_class("-empty")
        lines = _plain(pane.lanes).splitlines()
        ops = [ln for ln in lines if ln.startswith("nvtx cpu_op")]
        assert len(ops) == 1 and set(ops[0][12:]) - {" "}  # a lane that covers some columns
        assert any(ln.startswith("nvtx user_an") for ln in lines)
        assert any(ln.startswith("GPU0 s7") for ln in lines)


CPU_TRACE = Path(__file__).parent / "data" / "cpu-mlp.trace.json.gz"


async def test_replay_of_a_cpu_only_trace_draws_its_cpu_ops(make_app, tmp_path):
    """The REAL CPU-only trace has no kernel: the pane still draws its CPU ops and annotations
    on the time axis instead of collapsing to "no kernel data"."""
    cap = load_capture(kineto.import_traces([CPU_TRACE], tmp_path / "cpu.kdash").path)
    assert len(cap.tables["kernels"]) == 0
    meta = dict(cap.meta, capture_path=str(cap.path))
    app = make_app(store=store_from_capture(cap), meta=meta, mode="replay")
    async with app.run_test(size=(200, 50)) as pilot:
        await pilot.pause()
        pane = app.query_one(KernelPane)
        assert not pane.has_class("-empty")
        lines = _plain(pane.lanes).splitlines()
        ops = [ln for ln in lines if ln.startswith("nvtx cpu_op")]
        assert len(ops) == 1 and set(ops[0][12:]) - {" "}
        assert any(ln.startswith("nvtx user_an") for ln in lines)
        assert not any(ln.startswith("GPU") for ln in lines)
