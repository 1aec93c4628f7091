"""The source pane and `kdash report` on PC samples recorded on the H200 through `kdash attach`
(tests/data/h200-pcs-captures.meta.json says how): the demo workload, whose hottest kernel is
kdash's own `_decode_stage1`, and a torch.compile'd block, whose hottest kernel is a cuBLAS GEMM
without source and whose Triton kernels are inductor's generated modules (their files are not on
this machine: the captures carry their text)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import store_from_capture
from kdash.tui.panes.kernels import KernelPane
from kdash.tui.panes.source import SourcePane

from kdash.capture import load_capture

DATA = Path(__file__).parent / "data"
DEMO = DATA / "h200-demo-pcs.kdash"
COMPILE = DATA / "h200-compile-pcs.kdash"


def report(path: Path) -> dict:
    r = subprocess.run(
        [sys.executable, "-m", "kdash", "report", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_demo_report_hot_lines_start_with_decode_stage1():
    doc = report(DEMO)
    top = doc["top_kernels"][0]
    assert top["name"] == "_decode_stage1" and top["has_source"]
    h = doc["hot_lines"][0]
    assert h["kernel"] == "_decode_stage1" and h["file"].endswith("decode_attention.py")
    assert h["line"] > 0 and h["samples"] > 1000


def test_compile_report_names_the_gemm_without_source_and_starts_hot_lines_with_inductor():
    doc = report(COMPILE)
    top = doc["top_kernels"][0]
    assert top["name"].startswith("nvjet") and not top["has_source"]
    with_src = [k for k in doc["top_kernels"] if k["has_source"]]
    assert with_src and all(k["name"].startswith("triton_") for k in with_src)
    h = doc["hot_lines"][0]
    assert h["kernel"] == with_src[0]["name"] or h["kernel"].startswith("triton_")
    assert "/torchinductor_" in h["file"] and h["line"] > 0


def test_captures_carry_the_text_of_files_missing_here():
    for path in (DEMO, COMPILE):
        cap = load_capture(path)
        sf = cap.batch("source_files")
        sl = cap.batch("source_lines")
        files = {f for f in sl["file"] if f}
        assert files and files <= set(sf["file"])
        assert not any(Path(f).exists() for f in files if "/tmp/" in f)


@pytest.fixture
def replay(make_app):
    def build(path: Path):
        cap = load_capture(path)
        meta = dict(cap.meta)
        meta["capture_path"] = str(path)
        return make_app(store=store_from_capture(cap), meta=meta, mode="replay")

    return build


async def _settle(pilot) -> None:
    app = pilot.app
    kp = app.query_one(KernelPane)
    pane = app.query_one("#source", SourcePane)
    for _ in range(300):
        if kp.analyses_applied > 0 and pane.kernel is not None:
            break
        await pilot.pause(0.05)
    await pilot.press("4")
    await pilot.pause()


def _text(pane: SourcePane) -> str:
    return str(pane.body.render())


async def test_compile_capture_at_80x24_follows_to_inductors_kernel_with_its_hot_line(replay):
    app = replay(COMPILE)
    async with app.run_test(size=(80, 24)) as pilot:
        await _settle(pilot)
        pane = app.query_one("#source", SourcePane)
        assert pane.skipped is not None and pane.skipped[0].startswith("nvjet")
        assert pane.kernel.startswith("triton_")
        text = _text(pane)
        head = text.splitlines()[0]
        assert "(no source) · showing triton_" in head
        sel = [s for s in text.splitlines() if " ▶ " in s]
        assert sel and "%" in sel[0].split("▶")[0]  # the selected line is a hot one
        assert "samples," in text and "long_scoreboard" in text


@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
@pytest.mark.parametrize("path", [DEMO, COMPILE], ids=["demo", "compile"])
def test_snapshot_h200_pcs_source_maximised(snap_compare, replay, path, size):
    assert snap_compare(replay(path), terminal_size=size, run_before=_settle)


async def test_a_pinned_aten_kernel_finds_its_samples_under_the_symbol_cupti_recorded(replay):
    """Kernel records carry demangled names (`void at::native::elementwise_kernel<...>`), the
    PC samples the mangled symbol: pinning the ATen kernel shows its hottest PCs."""
    app = replay(DEMO)
    async with app.run_test(size=(120, 40)) as pilot:
        await _settle(pilot)
        pane = app.query_one("#source", SourcePane)
        aten = next(n for n in pane.window_names if n.startswith("void at::native::"))
        pane.toggle_pin(aten)
        await pilot.pause()
        assert pane.kernel == aten and pane._pc_view
        text = _text(pane)
        assert "samples" in text and "+0x" in text
        assert "no line samples for this kernel" not in str(pane.empty_line.render())
