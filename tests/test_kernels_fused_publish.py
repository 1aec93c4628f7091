"""The one-launch decode's publish and poll (kernels/decode_fused.py), compiled for sm_90.

The partials are published by a CTA barrier and a GPU-scope release exchange of the flags, and
the merge polls them with GPU-scope acquire loads: no fence on either side. The form before
(a fence in every stage-1 thread, volatile polls and a fence after them) stays behind
``PUBLISH_FENCE`` / ``ACQUIRE_POLL`` for the A/B in bench/gpu_decode_publish.py, which timed the
new form 0.8-1.5 us a step faster on an H100 and gated both (bench/NOTES-kernels.md, session
23). Triton's real compiler runs for sm_90 in a child process (no GPU needed).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_cases  # noqa: E402
from kdash.kernels.decode_attention import DecodeConfig  # noqa: E402
from sm90_compile import compile_sm90, cuobjdump  # noqa: E402

WHERE = "kdash.kernels.decode_fused:_decode_fused"
PTRS = ["*bf16", "*bf16", "*bf16", "*i32", "*i32"] + ["*fp32"] * 4 + ["*bf16", "*fp32", "*i32"]


def _registers(cubin: Path) -> int | None:
    """Registers a thread of the cubin's kernel, from ``cuobjdump -res-usage`` (None where no
    cuobjdump is found)."""
    exe = cuobjdump()
    if exe is None:
        return None
    out = subprocess.run([exe, "-res-usage", str(cubin)], capture_output=True, text=True)
    found = re.search(r"REG:(\d+)", out.stdout)
    return int(found.group(1)) if found else None


def test_the_default_publishes_and_polls_without_a_fence_and_keeps_its_registers(tmp_path):
    """The fused plan's own compile-time values (GPU ones), at its defaults and in the fenced
    form: the default carries no ``fence.acq_rel.gpu`` and no volatile poll, only the release
    exchange and acquire loads; the fenced form has both fences and volatile polls; and both
    take as many registers (the flags' addresses are kept out of stage 1's live range, which
    without an opaque value took 118 -> 154-157 registers on Triton 3.6)."""
    q, kc, _, pt, sl, _ = decode_cases.make_case([1000], 32, 8, 128, 16, device="cpu")
    plan = decode_cases.plan_for(pt, sl, q, kc, config=DecodeConfig(), fused=True, max_seq_len=1000)
    assert plan.fused
    meta = {k: v for k, v in plan._meta1.items() if k != "EVICT"}
    meta.update(UPCAST=False, EVICT="")
    new = compile_sm90(WHERE, meta, PTRS, tmp_path / "a", cubin=tmp_path / "new.cubin")["ptx"]
    old_meta = dict(meta, PUBLISH_FENCE=True, ACQUIRE_POLL=False)
    old = compile_sm90(WHERE, old_meta, PTRS, tmp_path / "b", cubin=tmp_path / "old.cubin")["ptx"]
    assert "fence.acq_rel.gpu" not in new and "ld.volatile" not in new
    assert "ld.acquire.gpu" in new and re.search(r"atom\.global\.gpu\.release\.exch", new)
    assert old.count("fence.acq_rel.gpu") == 2 and "ld.volatile" in old
    assert "ld.acquire.gpu" not in old
    regs_new, regs_old = _registers(tmp_path / "new.cubin"), _registers(tmp_path / "old.cubin")
    if regs_new is None:
        pytest.skip("no cuobjdump to read the registers with (the PTX checks above passed)")
    assert regs_new == regs_old


def test_the_bench_switch_reaches_one_launch_plans_only(monkeypatch) -> None:
    """decode_fused.FENCED_MERGE (the bench's --fenced-merge) gives plans made after it the
    fenced form; two-launch plans have no merge protocol and take neither value."""
    from kdash.kernels import decode_fused

    q, kc, _, pt, sl, _ = decode_cases.make_case([1000], 32, 8, 128, 16, device="cpu")

    def meta(fused: bool) -> dict:
        plan = decode_cases.plan_for(
            pt, sl, q, kc, config=DecodeConfig(), fused=fused, max_seq_len=1000
        )
        return plan._meta1

    got = meta(True)
    assert (got["PUBLISH_FENCE"], got["ACQUIRE_POLL"]) == (False, True)
    monkeypatch.setattr(decode_fused, "FENCED_MERGE", True)
    got = meta(True)
    assert (got["PUBLISH_FENCE"], got["ACQUIRE_POLL"]) == (True, False)
    assert "PUBLISH_FENCE" not in meta(False) and "ACQUIRE_POLL" not in meta(False)


def test_stamps_are_compiled_only_when_asked(tmp_path) -> None:
    """STAMP (bench/gpu_decode_stamps.py's diagnostic) reads the global timer three times a
    program and the SM id once, and stores 4 int64 a program; without it the kernel reads no
    clock and its PTX is the same as before the switch existed (no ``globaltimer``)."""
    q, kc, _, pt, sl, _ = decode_cases.make_case([1000], 32, 8, 128, 16, device="cpu")
    plan = decode_cases.plan_for(pt, sl, q, kc, config=DecodeConfig(), fused=True, max_seq_len=1000)
    meta = {k: v for k, v in plan._meta1.items() if k != "EVICT"}
    meta.update(UPCAST=False, EVICT="")
    plain = compile_sm90(WHERE, meta, PTRS, tmp_path / "a")["ptx"]
    stamped = compile_sm90(WHERE, dict(meta, STAMP=True), PTRS, tmp_path / "b")["ptx"]
    assert "globaltimer" not in plain and "%smid" not in plain
    assert stamped.count("%globaltimer") == 3 and stamped.count("%smid") == 1
    assert re.search(r"st\.global(\.v2)?\.b64", stamped)


def test_the_opaque_head_switch_reaches_one_launch_bf16_plans_only(monkeypatch) -> None:
    """decode_fused.OPAQUE_HEADS (the bench's --opaque-heads) reaches the one-launch bf16
    plans made after it; two-launch and fp8 pair plans never carry it; the bench's flags set
    it, and leave it as it is when neither is given."""
    from kdash.kernels import bench_configs, decode_fused
    from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG

    q, kc, _, pt, sl, _ = decode_cases.make_case([1000], 32, 8, 128, 16, device="cpu")
    q8, kc8, _, pt8, sl8, sc8 = decode_cases.make_case([1000], 32, 8, 128, 16, True, device="cpu")

    def meta(fused: bool, fp8: bool = False) -> dict:
        if fp8:
            plan = decode_cases.plan_for(
                pt8, sl8, q8, kc8, config=DEFAULT_FP8_CONFIG, fused=fused, max_seq_len=1000, **sc8
            )
        else:
            plan = decode_cases.plan_for(
                pt, sl, q, kc, config=DecodeConfig(), fused=fused, max_seq_len=1000
            )
        return plan._meta1

    assert meta(True)["OPAQUE_HEADS"] is decode_fused.OPAQUE_HEADS is False
    monkeypatch.setattr(decode_fused, "OPAQUE_HEADS", True)
    assert meta(True)["OPAQUE_HEADS"] is True
    assert "OPAQUE_HEADS" not in meta(False) and "OPAQUE_HEADS" not in meta(True, fp8=True)
    ap = argparse.ArgumentParser()
    bench_configs.add_switches(ap)
    bench_configs.apply_switches(ap.parse_args(["--no-opaque-heads"]))
    assert decode_fused.OPAQUE_HEADS is False
    bench_configs.apply_switches(ap.parse_args(["--opaque-heads"]))
    assert decode_fused.OPAQUE_HEADS is True
    bench_configs.apply_switches(ap.parse_args([]))
    assert decode_fused.OPAQUE_HEADS is True
    with pytest.raises(SystemExit):
        ap.parse_args(["--opaque-heads", "--no-opaque-heads"])
