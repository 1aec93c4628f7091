"""PC samples recorded on the H200 and the cubins they came from (tests/data, real data).

`tests/data/h200-pcsamples.json.gz`: one 200 ms PC-sampling range taken by kdash's own ctypes
layer (collectors/agent/pcsampling.py) on an NVIDIA H200 while the demo model's decode step
and a causal prefill ran (`python bench/gpu_pcsampling.py`, figures in
bench/results/pcsampling-h200.json); rows of kdash's three Triton attention kernels and of the
two hottest kernels without line info. `tests/data/h200-cubins/`: those three kernels' cubins
as Triton 3.6 built them there. `h200-pcsamples.meta.json` says how, and the sha256 of the
kernel sources at the time.

The line tables point at the machine's install path (/tmp/site/kdash/kernels/...); the tests
map them onto the source the cubins were built from: `tests/data/h200-cubins/src/` keeps the
kernel files that have changed in `kernels/` since the recording (byte-identical to the
recorded version, whose sha256 the meta holds), the others are this checkout's `kernels/`
files. The assertions about what a line *says* are skipped if a mapped file's sha256 does not
match the meta. After re-recording (bench/gpu_pcsampling.py, samples and cubins into
tests/data, the meta's sha256 updated, the stale copies in `src/` removed), remake the
snapshots with `pytest tests/test_h200_pcsamples.py --snapshot-update` (a skipped snapshot
test would leave its file unused, which fails the run).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from conftest import store_from_capture
from kdash.tui.panes.source import SourcePane
from rich.console import Console

from kdash import cubin, schema
from kdash.capture import load_capture

DATA = Path(__file__).parent / "data"
ROOT = Path(__file__).resolve().parents[1]
META = json.loads((DATA / "h200-pcsamples.meta.json").read_text())
NVDISASM, WHY = cubin.find_nvdisasm()
LIBCUPTI, WHY_CUPTI = cubin.find_libcupti()
TRITON_KERNELS = ("_decode_stage1", "_decode_stage2", "_extend_kernel")
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason=WHY)


RECORDED_SRC = DATA / "h200-cubins" / "src"


def source_path(rel: str) -> Path:
    """Where the recorded version of `kernels/NAME` lies: its kept copy if the checkout's has
    changed since, else the checkout's."""
    kept = RECORDED_SRC / Path(rel).name
    return kept if kept.exists() else ROOT / rel


def same_source(rel: str) -> bool:
    """Is the mapped file byte-identical to the one the cubins were built from?"""
    want = META["source_sha256_when_recorded"].get(rel)
    return want == hashlib.sha256(source_path(rel).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def samples() -> pd.DataFrame:
    with gzip.open(DATA / "h200-pcsamples.json.gz", "rt") as f:
        return pd.DataFrame(json.load(f))


@pytest.fixture(scope="module")
def tables() -> dict[str, cubin.LineTable]:
    """The three cubins' line tables, their files moved from the GPU machine's install path
    onto the recorded sources (the CRC comes from libcupti, which needs no GPU)."""
    if NVDISASM is None:
        pytest.skip(WHY)
    out = {}
    dev_root = META["device_source_root"]
    for name in TRITON_KERNELS:
        lt = cubin.line_table((DATA / "h200-cubins" / f"{name}.cubin").read_bytes())
        assert not lt.why, lt.why
        moved = [
            replace(i, file=str(source_path("kernels" + i.file[len(dev_root) :])))
            if i.file.startswith(dev_root + "/")
            else i
            for i in lt.instrs
        ]
        lt = replace(lt, instrs=moved, file_sha256={}, file_mtime_ns={})
        for f in lt.files:
            lt.file_sha256[f], lt.file_mtime_ns[f] = cubin._stamp(f)
        out[name] = lt
    return out


def test_not_issued_reasons_are_subsets_of_their_base_reason(samples):
    """The CUPTI fact the analyses rely on when they drop `_not_issued` rows."""
    s = samples.groupby(["kernel", "cubin_crc", "pc_offset", "stall_reason"])["count"].sum()
    pairs = 0
    for (k, crc, pc, reason), n in s.items():
        if reason.endswith("_not_issued"):
            base = s.get((k, crc, pc, reason[: -len("_not_issued")]))
            assert base is not None and n <= base, (k, pc, reason)
            pairs += 1
    assert pairs > 100


@pytest.mark.skipif(LIBCUPTI is None, reason=WHY_CUPTI)
def test_each_cubins_crc_is_the_one_in_its_samples(samples):
    for name in TRITON_KERNELS:
        crc, note = cubin.cubin_crc((DATA / "h200-cubins" / f"{name}.cubin").read_bytes())
        assert crc is not None, note
        got = set(samples.loc[samples["kernel"] == name, "cubin_crc"].astype(np.int64))
        assert got == {cubin.crc_to_i8(crc)}, (name, got, crc)


@needs_nvdisasm
def test_every_sampled_pc_of_a_triton_kernel_has_a_source_line(samples, tables):
    for name, lt in tables.items():
        pcs = set(samples.loc[samples["kernel"] == name, "pc_offset"])
        mapped = {i.pc_offset for i in lt.instrs if i.function == name and i.line > 0}
        assert pcs and pcs <= mapped, (name, sorted(pcs - mapped)[:5])


@needs_nvdisasm
def test_decode_stage1_waits_on_its_kv_load(samples, tables):
    """Decode attention is memory-bound: the hottest line should be where the K tile loaded
    from the paged cache is consumed, stalled on the long scoreboard (global memory)."""
    hot = cubin.hot_lines(samples, tables["_decode_stage1"])
    top = hot.iloc[0]
    assert Path(top["file"]).name == "decode_attention.py"
    assert top["share"] > 0.3
    assert top["top_stalls"].startswith("long_scoreboard")
    st = cubin.line_stalls(samples, tables["_decode_stage1"], top["file"], int(top["line"]))
    assert st["reason"].iloc[0] == "long_scoreboard" and st["share"].iloc[0] > 0.9
    if not same_source("kernels/decode_attention.py"):
        pytest.skip("kernels/decode_attention.py changed since the H200 recording")
    code = source_path("kernels/decode_attention.py").read_text().splitlines()
    line = int(top["line"])
    assert line == 198  # as recorded: the address expression of the K tile's load
    assert code[line - 2].strip() == "k = tl.load(" and code[line - 1].strip() == "K"


@needs_nvdisasm
def test_report_hot_lines_from_real_samples(samples, tables):
    sl = pd.concat([pd.DataFrame(cubin.to_rows(lt)) for lt in tables.values()])
    rows = cubin.hot_lines_by_kernel(samples, sl, per_kernel=3)
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    assert kernels[0] == "_decode_stage1"  # most samples of the range
    assert set(TRITON_KERNELS) <= set(kernels)
    no_lines = [r for r in rows if r["kernel"].startswith(("nvjet", "_ZN2at"))]
    assert no_lines and all(r["line"] == -1 and "no line table" in r["note"] for r in no_lines)
    # without lines, their hottest PCs: the same numbers pc_heat gives
    for kernel in {r["kernel"] for r in no_lines}:
        mine = [r for r in no_lines if r["kernel"] == kernel]
        heat = cubin.pc_heat(samples, kernel).sort_values(
            "samples", ascending=False, kind="stable"
        )[:3]
        assert [r["pc_offset"] for r in mine] == list(heat["pc_offset"])
        assert [r["samples"] for r in mine] == list(heat["samples"])
        assert all(r["top_stalls"] for r in mine)
    assert all(r["pc_offset"] == -1 for r in rows if r["line"] > 0)


def test_pc_heat_of_a_kernel_without_a_cubin(samples):
    """cuBLAS's kernel: no line table anywhere, but its sampled PCs still say where it waits."""
    kernel = next(k for k in samples["kernel"].unique() if k.startswith("nvjet"))
    h = cubin.pc_heat(samples, kernel)
    real = samples[(samples["kernel"] == kernel) & ~samples["stall_reason"].str.endswith(
        "_not_issued")]  # fmt: skip
    assert list(h["pc_offset"]) == sorted(set(real["pc_offset"]))
    assert h["samples"].sum() == real["count"].sum() and h["share"].sum() == pytest.approx(1.0)
    top = h.loc[h["samples"].idxmax()]
    assert top["top_stalls"].startswith("long_scoreboard")


async def test_source_pane_pcs_view_for_a_kernel_without_a_cubin(real_app, samples):
    """Pinned on the cuBLAS kernel, the pane lists its sampled PCs with heat and says why there
    is no instruction text or line; n walks the hottest PCs."""
    kernel = next(k for k in samples["kernel"].unique() if k.startswith("nvjet"))
    h = cubin.pc_heat(samples, kernel).sort_values("samples", ascending=False, kind="stable")
    app = real_app
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one("#source", SourcePane)
        await _maximised(pilot)
        pane.pinned = kernel
        pane._redraw()
        await pilot.pause()
        text = plain(pane.body)
        assert "no line table: kdash gets a cubin from Triton's cache only" in text
        first = int(h["pc_offset"].iloc[0])
        assert f"PC +0x{first:x}" in text.splitlines()[0]
        assert f"+0x{first:05x} ▶" in text
        pane.action_next_hot(1)
        await pilot.pause()
        second = int(h["pc_offset"].iloc[1])
        assert f"PC +0x{second:x}" in plain(pane.body).splitlines()[0]


def plain(static) -> str:
    console = Console(width=300, file=__import__("io").StringIO(), color_system=None)
    with console.capture() as cap:
        console.print(static.content)
    return cap.get()


@pytest.fixture
def real_app(make_app, samples, tables):
    """The bundled demo capture (real H200 kernels) plus the real samples and line tables,
    put inside its window."""
    demo = load_capture(ROOT / "kdash" / "data" / "demo-h200.kdash")
    store = store_from_capture(demo)
    t0 = int(demo.meta["window"]["start_ns"])
    for lt in tables.values():
        rows = cubin.to_rows(lt, t_ns=t0)
        store.append(
            "source_lines",
            schema.make_batch("source_lines", **{k: np.asarray(v) for k, v in rows.items()}),
        )
    s = samples.assign(t_ns=t0 + 1_000_000)
    store.append("pc_samples", schema.from_frame("pc_samples", s))
    return make_app(store=store, meta=dict(demo.meta), mode="replay")


@needs_nvdisasm
async def test_source_pane_on_real_samples(real_app, samples, tables):
    """The pane follows _decode_stage1 (the hottest Triton kernel) and shows its hot line."""
    app = real_app
    hot = cubin.hot_lines(samples, tables["_decode_stage1"]).iloc[0]
    async with app.run_test(size=(120, 40)) as pilot:
        pane = app.query_one("#source", SourcePane)
        end = time.monotonic() + 15
        while time.monotonic() < end and pane.kernel is None:
            await pilot.pause(0.05)
        assert pane.kernel == "_decode_stage1"
        await pilot.press("4")
        await pilot.pause()
        text = plain(pane.body)
        head = text.splitlines()[0]
        assert f"decode_attention.py:{int(hot['line'])}" in head
        assert any(s.startswith("  long_scoreboard") for s in text.splitlines())


async def _maximised(pilot) -> None:
    pane = pilot.app.query_one("#source", SourcePane)
    end = time.monotonic() + 15
    while time.monotonic() < end and pane.kernel is None:
        await pilot.pause(0.05)
    await pilot.press("4")
    await pilot.pause()


@needs_nvdisasm
@pytest.mark.skipif(
    not same_source("kernels/decode_attention.py"),
    reason="kernels/decode_attention.py changed since the H200 recording",
)
@pytest.mark.parametrize("size", [(80, 24), (120, 40)], ids=["80x24", "120x40"])
def test_snapshot_real_samples_maximised(snap_compare, real_app, size):
    assert snap_compare(real_app, terminal_size=size, run_before=_maximised)
