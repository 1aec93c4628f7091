"""A cap on the stage-1 programs an SM holds (``DecodeConfig.max_resident_per_sm``).

The plan cuts its splits for the capped residency and its launches ask for the shared memory
that leaves room for no more programs (:func:`kdash.kernels.residency.shared_for_cap`). CPU CI
runs the plans in Triton's interpreter, which compiles nothing: there the cap sets the waves
and no launch is padded. The launcher's padding is checked against stand-ins for Triton's
compiled kernel and for the CUDA driver, which this machine does not have (each test says so);
the ``gpu`` test runs a capped plan on a real kernel and reads its residency back.
"""

from __future__ import annotations

import os
from dataclasses import replace
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import decode_cases  # noqa: E402
from decode_cases import check, make_case  # noqa: E402
from kdash.kernels import launch, residency  # noqa: E402
from kdash.kernels.decode_attention import DecodeConfig, DecodePlan  # noqa: E402
from kdash.kernels.launch import BoundKernel  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SMALL = DecodeConfig(block_n=64)


def plan_for(pt, sl, q, kc, config: DecodeConfig, **kw) -> DecodePlan:
    return decode_cases.plan_for(pt, sl, q, kc, config=config, **kw)


@pytest.mark.parametrize("smem_sm", [233472, 167936, 102400], ids=["h100", "a100", "sm86"])
@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5])
def test_the_padded_shared_memory_leaves_room_for_exactly_the_cap(smem_sm, cap) -> None:
    """By the occupancy rule (1 KB kept per block), the padded figure lets ``cap`` programs fit
    an SM's shared memory and not one more; a kernel whose own shared memory already keeps it
    at the cap or below is left as it is."""
    own = 8192
    asked = residency.shared_for_cap(cap, own, smem_sm)
    _, by = residency.programs_per_sm(32, asked, 4, shared_per_sm=smem_sm)
    assert by["shared_memory"] == cap
    big = smem_sm // cap - residency.SHARED_RESERVED_PER_BLOCK  # fits cap on its own
    assert residency.shared_for_cap(cap, big, smem_sm) == big


def compiled_stand_in(shared: int = 38912) -> SimpleNamespace:
    """What BoundKernel reads of Triton's CompiledKernel to pad its launches (a stand-in: no
    kernel is compiled on this machine)."""
    return SimpleNamespace(metadata=SimpleNamespace(shared=shared), function=0x1234)


def test_launches_ask_for_the_padded_shared_memory_once_the_driver_allows(monkeypatch) -> None:
    """The launch metadata's shared bytes become the bound kernel's figure after the driver
    (a stand-in here: no libcuda on this machine) allowed that much for the function."""
    calls: list[tuple[int, int]] = []

    def allow(function, nbytes):
        calls.append((function, nbytes))
        return None

    monkeypatch.setattr(launch, "allow_dynamic_shared", allow)
    bk = BoundKernel(None, (1,), {}, shared=57345)
    assert bk._padded(compiled_stand_in(), (4, 1, 38912)) == (4, 1, 57345)
    assert calls == [(0x1234, 57345)] and bk.shared_refused is None
    # no padding asked, or less than the kernel's own: no driver call, the metadata as it is
    for shared in (0, 38912):
        calls.clear()
        plain = BoundKernel(None, (1,), {}, shared=shared)
        assert plain._padded(compiled_stand_in(), (4, 1, 38912)) == (4, 1, 38912)
        assert calls == [] and plain.shared_refused is None


def test_a_refused_padding_keeps_the_kernels_own_figure_and_says_why(monkeypatch) -> None:
    monkeypatch.setattr(launch, "allow_dynamic_shared", lambda f, n: "error 1")
    bk = BoundKernel(None, (1,), {}, shared=57345)
    assert bk._padded(compiled_stand_in(), (4, 1, 38912)) == (4, 1, 38912)
    assert bk.shared_refused == "error 1"
    other = BoundKernel(None, (1,), {}, shared=57345)  # a Triton whose metadata is not 3 fields
    assert other._padded(compiled_stand_in(), (4, 1, 38912, 0)) == (4, 1, 38912, 0)
    assert "not 3" in other.shared_refused


def test_the_driver_call_names_the_attribute_and_reports_an_error() -> None:
    """``cuFuncSetAttribute(function, MAX_DYNAMIC_SHARED_SIZE_BYTES, n)`` through a stand-in
    driver library: its arguments, success, and an error code turned into a reason."""
    seen: list = []

    def set_attribute(function, attribute, value, rc):
        seen.append((function.value, attribute.value, value.value))
        return rc

    ok = SimpleNamespace(cuFuncSetAttribute=lambda f, a, v: set_attribute(f, a, v, 0))
    assert launch.allow_dynamic_shared(0x1234, 57345, ok) is None
    assert seen == [(0x1234, 8, 57345)]
    bad = SimpleNamespace(cuFuncSetAttribute=lambda f, a, v: set_attribute(f, a, v, 1))
    assert "error 1" in launch.allow_dynamic_shared(0x1234, 57345, bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no driver is")
def test_without_a_driver_the_reason_names_libcuda() -> None:
    why = launch.allow_dynamic_shared(0x1234, 57345)
    assert why is not None and why.startswith("libcuda")


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's plan (8 SMs, nothing compiled)")
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_a_capped_plan_cuts_its_waves_at_the_cap(fused, residency_entry) -> None:
    """Two near-equal requests at 2 KV heads on the interpreter's 8 SMs: the config's 4 an SM
    give 8 splits (32 programs, one wave); capped at 1 an SM a wave is 8 programs, so 2 splits.
    A kernel the cache says fits 4 is still planned at the cap, and the output passes the gate.
    Nothing is compiled here, so no launch is padded."""
    lens = [1999, 1873]
    q, kc, vc, pt, sl, sc = make_case(lens, 8, 2, 64, 16, seed=41)
    kw = dict(max_seq_len=max(lens), total_tokens=sum(lens), fused=fused)
    free = plan_for(pt, sl, q, kc, SMALL, **kw)
    assert free.resident_per_sm == 4 and free.num_splits == 8
    capped = plan_for(pt, sl, q, kc, replace(SMALL, max_resident_per_sm=1), **kw)
    assert capped.resident_per_sm == 1 and capped.capacity == 8 and capped.num_splits == 2
    check(capped.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert capped._s1.shared == 0
    residency_entry(capped.variant_key(capped.num_splits), 4)
    again = plan_for(pt, sl, q, kc, replace(SMALL, max_resident_per_sm=1), **kw)
    assert again.residency_source == "cache" and again.resident_per_sm == 1
    assert again.num_splits == 2 and again._shared == 0  # padding is for a CUDA device


@pytest.mark.gpu
@pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and TRITON_INTERPRET=0)"
)
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_gpu_a_capped_plan_holds_at_most_its_cap(fused) -> None:
    """bf16 at 16k tokens, 8 KV heads: the compiled kernel fits more than 2 an SM; capped at 2
    the plan cuts for 2, its launches ask for the padded shared memory (the driver allowed it),
    the residency read back from the launch figures is 2 by shared memory, and the output
    passes the gate and matches the uncapped plan's."""
    from kdash.kernels.bench_occupancy import stage1_occupancy

    lens = [16384]
    q, kc, vc, pt, sl, sc = make_case(lens, 32, 8, 128, 16, seed=42)
    kw = dict(max_seq_len=max(lens), total_tokens=sum(lens), fused=fused)
    free = plan_for(pt, sl, q, kc, DecodeConfig(), **kw)
    want = free.run(q, kc, vc).float().clone()
    assert free.resident_per_sm > 2
    capped = plan_for(pt, sl, q, kc, DecodeConfig(max_resident_per_sm=2), **kw)
    assert capped.resident_per_sm == 2 and capped._shared > capped.residency.shared_bytes
    for _ in range(3):  # the first through Triton, then the armed launcher, then its graph
        got = capped.run(q, kc, vc)
    torch.cuda.synchronize()
    assert capped._s1.shared_refused is None
    occ = stage1_occupancy(capped)
    assert occ["shared_asked"] == capped._shared and occ["resident_per_sm_by"]["shared_memory"] == 2
    check(got, q, kc, vc, pt, sl, sc)
    assert (got.float() - want).abs().max().item() < 2e-2
