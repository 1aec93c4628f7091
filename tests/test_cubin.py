"""PC -> source mapping on real cubins: the project's own decode kernels compiled here for sm_90.

The cubins are real (Triton 3.9's pipeline and its bundled ptxas, no GPU needed; see
tests/cubin_fixtures.py). The mapping is checked against CUPTI's own
`cuptiGetSassToSourceCorrelation` (libcupti from the nvidia-cuda-cupti wheel runs it without a
GPU or driver). The PC samples are a seeded fixture over the cubin's real PC offsets: no
recording from the GPU exists yet.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from cubin_fixtures import compile_kernels, fixture_samples
from kdash.collectors.agent import pcsampling as pcs

from kdash import cubin, schema
from kdash import triton_index as ti
from kdash.capture import load_capture, write_capture

REPO = Path(__file__).resolve().parents[1]
# Where the kernels are imported from (the checkout, or site-packages when installed); found
# without importing the module, which would import triton at collection time.
DECODE = Path(importlib.util.find_spec("kdash.kernels.decode_attention").origin).resolve()

NVDISASM, WHY_NO_NVDISASM = cubin.find_nvdisasm()
needs_nvdisasm = pytest.mark.skipif(NVDISASM is None, reason=WHY_NO_NVDISASM)
LIBCUPTI, WHY_NO_CUPTI = cubin.find_libcupti()
needs_cupti = pytest.mark.skipif(LIBCUPTI is None, reason=WHY_NO_CUPTI)


def _triton_ok() -> bool:
    # find_spec, not import: the kernel tests set TRITON_INTERPRET=1 before triton's first
    # import in this process, and an import here at collection would come first.
    return importlib.util.find_spec("triton") is not None


pytestmark = pytest.mark.skipif(not _triton_ok(), reason="triton not installed")


@pytest.fixture(scope="session")
def triton_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("triton-cache")


@pytest.fixture(scope="session")
def cubins(triton_cache) -> dict[str, bytes]:
    specs = [("_decode_stage1", True), ("_decode_stage2", True), ("_decode_stage2", False)]
    s1, s2, s2n = compile_kernels(specs, triton_cache)
    return {"stage1": s1, "stage2": s2, "stage2_nolines": s2n}


@pytest.fixture(scope="session")
def stage1(cubins) -> cubin.LineTable:
    return cubin.line_table(cubins["stage1"])


@needs_nvdisasm
def test_real_cubin_maps_every_instruction_to_the_kernel_file(stage1):
    assert stage1.why == ""
    assert stage1.functions == ["_decode_stage1"]
    assert len(stage1.instrs) > 1000
    assert stage1.has_lines
    # Outermost frames: every instruction sits on a line of the @triton.jit body in our file.
    assert {i.file for i in stage1.instrs} == {str(DECODE)}
    fn = ti.scan(DECODE).by_name["_decode_stage1"][0]
    lines = {i.line for i in stage1.instrs}
    assert min(lines) == fn.line  # the prologue is charged to the `def` line
    assert max(lines) <= fn.end_line
    assert stage1.definition_line("_decode_stage1") == (str(DECODE), fn.line)
    # PCs are 16-byte SASS slots, increasing, from 0.
    pcs_ = [i.pc_offset for i in stage1.instrs]
    assert pcs_[0] == 0 and all(b - a == 16 for a, b in zip(pcs_, pcs_[1:], strict=False))


@needs_nvdisasm
def test_inlined_helpers_keep_their_chain(stage1):
    """`mma` and the other kernels/_common.py helpers, and tl.* helpers, are inlined: the
    chain names them, the line charged is the caller's line in the kernel."""
    chains = [i for i in stage1.instrs if i.inlined]
    assert chains
    mma = [i for i in chains if "_common.py" in i.inlined]
    assert mma, "no instruction inlined from kernels/_common.py (mma)"
    src = DECODE.read_text().splitlines()
    for i in mma:
        calls = ("mma(", "to_bf16(", "_common.rows(", "_common.store(", "_common.opaque_i32(")
        assert any(c in src[i.line - 1] for c in calls), src[i.line - 1]
        assert i.inlined.endswith(f"decode_attention.py:{i.line}")


@needs_nvdisasm
@needs_cupti
def test_mapping_agrees_with_cuptis_correlation(cubins, stage1):
    """CUPTI reports the innermost frame; kdash's chain starts with that same frame, and for
    non-inlined instructions kdash's line is CUPTI's line."""
    data = cubins["stage1"]
    lib = ctypes.CDLL(LIBCUPTI)
    libc = ctypes.CDLL(None)
    buf = ctypes.create_string_buffer(data, len(data))
    checked = inlined = 0
    for ins in stage1.instrs[::5]:
        p = pcs.CUpti_GetSassToSourceCorrelationParams()
        p.size = pcs.params_size(pcs.CUpti_GetSassToSourceCorrelationParams, "dirName")
        p.cubin = ctypes.cast(buf, ctypes.c_void_p)
        p.functionName = ins.function.encode()
        p.cubinSize = len(data)
        p.pcOffset = ins.pc_offset
        assert lib.cuptiGetSassToSourceCorrelation(ctypes.byref(p)) == 0
        name = Path(ctypes.string_at(p.fileName).decode()).name
        libc.free(ctypes.c_void_p(p.fileName))
        libc.free(ctypes.c_void_p(p.dirName))
        innermost = ins.inlined.split(" <- ")[0] if ins.inlined else f"{DECODE.name}:{ins.line}"
        assert f"{name}:{p.lineNumber}" == innermost, hex(ins.pc_offset)
        checked += 1
        inlined += bool(ins.inlined)
    assert checked > 300 and inlined > 10


@needs_nvdisasm
@needs_cupti
def test_crc_from_libcupti(cubins, stage1):
    crc1, why = cubin.cubin_crc(cubins["stage1"])
    assert why == "" and crc1 == stage1.crc
    crc2, _ = cubin.cubin_crc(cubins["stage2"])
    assert crc2 is not None and crc2 != crc1
    flipped = bytearray(cubins["stage1"])
    flipped[len(flipped) // 2] ^= 0xFF
    assert cubin.cubin_crc(bytes(flipped))[0] != crc1
    assert stage1.match_note == ""


def test_crc_without_libcupti_says_why(cubins):
    crc, why = cubin.cubin_crc(cubins["stage2"], libcupti="/nonexistent/libcupti.so")
    assert crc is None and "/nonexistent/libcupti.so" in why


@needs_nvdisasm
def test_no_line_info_gives_sass_heat_and_the_hint(cubins):
    lt = cubin.line_table(cubins["stage2_nolines"])
    assert lt.why == "" and lt.instrs and not lt.has_lines
    assert "-lineinfo" in lt.no_lines_hint
    pcs_ = [i.pc_offset for i in lt.instrs]
    samples = fixture_samples(pcs_, "_decode_stage2", lt.crc if lt.crc is not None else -1)
    heat = cubin.sass_heat(samples, lt)
    assert len(heat) == len(lt.instrs)
    assert heat["share"].sum() == pytest.approx(1.0)
    hot = cubin.hot_lines(samples, lt)
    assert list(hot["line"]) == [-1]  # everything on "no line"


def test_no_nvdisasm_says_why(cubins, monkeypatch):
    monkeypatch.delenv("KDASH_NVDISASM", raising=False)
    monkeypatch.setattr(cubin, "_spec_dir", lambda pkg: None)
    monkeypatch.setattr(cubin, "CUDA_NVDISASM", Path("/nonexistent/cuda/bin/nvdisasm"))
    monkeypatch.setenv("PATH", "/nonexistent")
    lt = cubin.line_table(cubins["stage2"])
    assert lt.instrs == [] and "nvdisasm not found" in lt.why and "triton" in lt.why


def test_not_a_cubin():
    lt = cubin.line_table(b"#!/bin/sh\n")
    assert lt.why.startswith("not a cubin")


@needs_nvdisasm
def test_hot_lines_and_stalls_from_fixture_samples(stage1):
    pcs_ = [i.pc_offset for i in stage1.instrs]
    crc = stage1.crc if stage1.crc is not None else -1
    s = fixture_samples(pcs_, "_decode_stage1", crc)
    other = fixture_samples(pcs_[:50], "_decode_stage1", (crc + 1) if crc >= 0 else -1, seed=9)
    hot = cubin.hot_lines(pd.concat([s, other]) if crc >= 0 else s, stage1)
    real = s[~s["stall_reason"].str.endswith("_not_issued")]
    assert hot["samples"].sum() == real["count"].sum()  # other cubin's CRC and _not_issued out
    assert hot["share"].sum() == pytest.approx(1.0)
    assert hot["samples"].is_monotonic_decreasing
    # The top line's count, by hand from the line table.
    pc_line = {i.pc_offset: i.line for i in stage1.instrs}
    by_line = real.assign(line=real["pc_offset"].map(pc_line)).groupby("line")["count"].sum()
    assert int(hot["line"].iloc[0]) == int(by_line.idxmax())
    assert int(hot["samples"].iloc[0]) == int(by_line.max())
    assert "long_scoreboard" in hot["top_stalls"].iloc[0]
    st = cubin.line_stalls(s, stage1, str(DECODE), int(hot["line"].iloc[0]))
    assert st["share"].sum() == pytest.approx(1.0)
    assert not st["reason"].str.endswith("_not_issued").any()
    assert st.loc[st["reason"] == "long_scoreboard", "meaning"].iloc[0].startswith("waiting")


@needs_nvdisasm
def test_matched_by_name_without_crc(stage1):
    lt = replace(stage1, crc=None, crc_note="libcupti not found")
    s = fixture_samples([i.pc_offset for i in lt.instrs][:100], "_decode_stage1", -1)
    assert cubin.hot_lines(s, lt)["samples"].sum() > 0
    assert "by kernel name" in lt.match_note
    wrong = s.assign(kernel="_decode_stage2")
    assert cubin.hot_lines(wrong, lt).empty


@needs_nvdisasm
def test_source_changed_is_flagged(stage1, tmp_path):
    copy = tmp_path / "decode_attention.py"
    shutil.copy(DECODE, copy)
    lt = cubin.LineTable(
        instrs=[replace(i, file=str(copy)) for i in stage1.instrs[:20]],
        crc=stage1.crc,
        sha256=stage1.sha256,
    )
    lt.file_sha256[str(copy)], lt.file_mtime_ns[str(copy)] = cubin._stamp(str(copy))
    assert cubin.source_status(lt) == {str(copy): "ok"}
    copy.write_text(copy.read_text() + "\n# edited\n")
    assert cubin.source_status(lt) == {str(copy): "changed since capture"}
    lt.compiled_ns = os.stat(copy).st_mtime_ns - 1_000_000_000
    assert cubin.source_status(lt) == {str(copy): "changed since compile"}
    copy.unlink()
    assert cubin.source_status(lt) == {str(copy): "missing"}


@needs_nvdisasm
def test_line_table_survives_a_capture(stage1, tmp_path):
    rows = cubin.to_rows(stage1, t_ns=5)
    batch = schema.make_batch("source_lines", **{k: np.asarray(v) for k, v in rows.items()})
    path = write_capture(tmp_path / "c.kdash", {"title": "t"}, {"source_lines": batch})
    back = cubin.from_frame(load_capture(path).tables["source_lines"])
    assert len(back) == 1
    lt = back[0]
    assert lt.crc == stage1.crc and lt.sha256 == stage1.sha256
    assert lt.instrs == stage1.instrs
    assert lt.file_sha256 == stage1.file_sha256
    assert cubin.table_for_kernel(back, "_decode_stage1") is lt
    assert cubin.table_for_kernel(back, "nope") is None


def test_store_never_ages_out_line_tables():
    """source_lines is descriptive (STATIC_TABLES): a table made long before the window still
    maps its samples, so time trimming skips it while event tables age out."""
    from kdash.store import Store

    st = Store(retention_s=1.0)
    st.append("source_lines", schema.make_batch("source_lines", t_ns=[0], kernel=["k"]))
    st.append("pc_samples", schema.make_batch("pc_samples", t_ns=[0], kernel=["k"]))
    st.append("kernels", schema.make_batch("kernels", start_ns=[10**12], end_ns=[10**12 + 5]))
    st.append("pc_samples", schema.make_batch("pc_samples", t_ns=[10**12], kernel=["k"]))
    assert len(st.get("source_lines")["t_ns"]) == 1
    assert list(st.get("pc_samples")["t_ns"]) == [10**12]


@needs_nvdisasm
def test_line_tables_from_triton_cache(cubins, triton_cache, tmp_path_factory):
    """The session's compile wrote Triton's cache into a private folder: the cubins found
    there are the very bytes `triton.compile` returned, with a compile time to check against."""
    cache = triton_cache
    found = cubin.triton_cached_cubins({"_decode_stage1"}, cache)
    assert found and {c.name for c in found} == {"_decode_stage1"} and found[0].arch == 90
    assert cubins["stage1"] in {Path(c.path).read_bytes() for c in found}
    tables = cubin.line_tables_from_triton_cache({"_decode_stage1"}, cache)
    assert tables and all(t.compiled_ns and t.has_lines for t in tables)
    assert cubin.source_status(tables[0]) == {str(DECODE): "ok"}
    assert cubin.triton_cached_cubins({"nope"}, cache) == []
    assert cubin.triton_cached_cubins(None, tmp_path_factory.mktemp("empty")) == []
