"""A cap on the stage-1 programs an SM holds (``DecodeConfig.max_resident_per_sm``).

The plan cuts its splits for the capped residency and its launches ask for the shared memory
that leaves room for no more programs (:func:`kdash.kernels.residency.shared_for_cap`). CPU CI
runs the plans in Triton's interpreter, which compiles nothing: there the cap sets the waves
and no launch is padded. The launcher's padding is checked against stand-ins for Triton's
compiled kernel and for the CUDA driver (bench/decode_host_cpu.py's libcuda, compiled here),
which this machine does not have (each test says so);
the ``gpu`` test runs a capped plan on a real kernel and reads its residency back.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import replace
from types import SimpleNamespace

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import decode_cases  # noqa: E402
from decode_cases import check, make_case  # noqa: E402
from kdash.kernels import graph_launch, residency  # noqa: E402
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


@pytest.fixture
def driver(stand_in_libcuda, monkeypatch):
    """The process's ctypes driver on the stand-in libcuda (this machine has no CUDA driver)."""
    drv = graph_launch.Driver(stand_in_libcuda)
    monkeypatch.setattr(graph_launch, "_driver", drv)
    stand_in_libcuda.attr_call.restype = ctypes.c_longlong
    stand_in_libcuda.set_attr_rc(0)
    return stand_in_libcuda


def attr_call(lib) -> tuple[int, int, int]:
    """The last ``cuFuncSetAttribute(function, attribute, value)`` the stand-in saw."""
    return tuple(lib.attr_call(i) for i in range(3))


def test_launches_ask_for_the_padded_shared_memory_once_the_driver_allows(driver) -> None:
    """The launch metadata's shared bytes become the bound kernel's figure after the driver
    allowed that much for the function (MAX_DYNAMIC_SHARED_SIZE_BYTES is attribute 8)."""
    bk = BoundKernel(None, (1,), {}, shared=57345)
    assert bk._padded(compiled_stand_in(), (4, 1, 38912)) == (4, 1, 57345)
    assert attr_call(driver) == (0x1234, 8, 57345) and bk.shared_refused is None
    # no padding asked, or less than the kernel's own: no driver call, the metadata as it is
    for shared in (0, 38912):
        plain = BoundKernel(None, (1,), {}, shared=shared)
        kernel = compiled_stand_in()
        kernel.function = 0x5678
        assert plain._padded(kernel, (4, 1, 38912)) == (4, 1, 38912)
        assert attr_call(driver)[0] == 0x1234 and plain.shared_refused is None


def test_a_refused_padding_keeps_the_kernels_own_figure_and_says_why(driver) -> None:
    driver.set_attr_rc(1)
    bk = BoundKernel(None, (1,), {}, shared=57345)
    assert bk._padded(compiled_stand_in(), (4, 1, 38912)) == (4, 1, 38912)
    assert bk.shared_refused == (
        "cuFuncSetAttribute(57345 bytes of shared memory) returned CUDA error 1"
    )
    other = BoundKernel(None, (1,), {}, shared=57345)  # a Triton whose metadata is not 3 fields
    assert other._padded(compiled_stand_in(), (4, 1, 38912, 0)) == (4, 1, 38912, 0)
    assert "not 3" in other.shared_refused


def test_without_a_driver_the_reason_is_the_drivers(monkeypatch) -> None:
    monkeypatch.setattr(graph_launch, "_driver", None)
    monkeypatch.setattr(graph_launch, "_driver_refused", "libcuda: not found")
    bk = BoundKernel(None, (1,), {}, shared=57345)
    assert bk._padded(compiled_stand_in(), (4, 1, 38912)) == (4, 1, 38912)
    assert bk.shared_refused == "libcuda: not found"


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


def test_the_bench_reads_a_capped_plans_residency_from_what_it_asks(monkeypatch) -> None:
    """stage1_occupancy on a plan whose bound kernel pads to 57345 bytes: 3 programs an SM by
    shared memory (4 by registers), the grid in waves of 3 x 132. The compiled kernel and the
    device's properties are stand-ins (no GPU here), with an H100's figures."""
    from kdash.kernels.bench_occupancy import stage1_occupancy

    props = SimpleNamespace(
        regs_per_multiprocessor=65536,
        shared_memory_per_multiprocessor=233472,
        max_threads_per_multi_processor=2048,
        multi_processor_count=132,
    )
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _i: props)
    kernel = compiled_stand_in()
    kernel.run, kernel.n_regs, kernel.n_spills = object(), 124, 0
    bound = BoundKernel(None, (1, 8, 57), {}, shared=57345)
    bound._compiled = kernel
    plan = SimpleNamespace(_s1=bound, _grid1=(1, 8, 57), config=DecodeConfig())
    occ = stage1_occupancy(plan)
    assert occ["shared_asked"] == 57345 and occ["shared_bytes"] == 38912
    assert occ["resident_per_sm_by"]["registers"] == 4
    assert occ["resident_per_sm_by"]["shared_memory"] == 3 and occ["resident_per_sm"] == 3
    assert occ["waves"] == pytest.approx(456 / 396)
    bound.shared_refused = "refused"  # the launches kept the kernel's own figure
    assert stage1_occupancy(plan)["resident_per_sm"] == 4
