"""The driver launch path's parameter packing (kernels/driver_launch.py), on kernels compiled here.

The decode kernels are compiled for sm_90 on this CPU machine by Triton's real pipeline (PTX
comes out of LLVM with no GPU involved); the packing is checked against that PTX and against the
signature Triton records in the compiled kernel. Launching needs a GPU: where a test goes as far
as the driver call, that call is a recorder standing in for ``cuLaunchKernel``, and the test says
so. The launches themselves are checked on the H200 by the ``gpu`` tests of test_kernels_plan.py.
"""

from __future__ import annotations

import ctypes
import os
from types import SimpleNamespace

import pytest

triton = pytest.importorskip("triton")

from kdash.kernels import driver_launch as dl  # noqa: E402

STAGE2_SIG = {
    "OP": "*fp32",
    "LSEP": "*fp32",
    "Out": "*bf16",
    "LSE": "*fp32",
    "num_splits": "i32",
    "stride_outb": "i32",
    "stride_outh": "constexpr",  # an int 1: Triton specialises it into a constant
    "HEAD_DIM": "constexpr",
    "BLOCK_S": "constexpr",
    "EMULATE_RTNE": "constexpr",
}


@pytest.fixture(scope="module")
def stage2():
    """``_decode_stage2`` compiled for sm_90 by this machine's Triton, as a plan's merge with
    ``stride_outh == 1`` would be."""
    from kdash.kernels import decode_attention as da
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    const = {"stride_outh": 1, "HEAD_DIM": 128, "BLOCK_S": 64, "EMULATE_RTNE": False}
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        return triton.compile(
            ASTSource(da._decode_stage2, dict(STAGE2_SIG), const),
            target=GPUTarget("cuda", 90, 32),
            options={"num_warps": 4},
        )
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved


# the merge's runtime arguments: four buffers (as pointers), splits, two output strides
ARGS = (0x7F0000001000, 0x7F0000002000, 0x7F0000003000, 0x7F0000004000, 37, 4096, 1)


def test_the_ptx_entry_gives_the_kernel_parameters_and_trailing_scratch(stage2) -> None:
    params = dl.ptx_params(stage2.asm["ptx"], stage2.metadata.name)
    kinds = [(p.kind, p.bits) for p in params]
    # 4 buffers, 2 i32 (num_splits, stride_outb: stride_outh was specialised away), then
    # Triton's global and profile scratch pointers
    assert kinds == [("ptr", 64)] * 4 + [("int", 32)] * 2 + [("ptr", 64)] * 2
    assert dl.ptx_params(stage2.asm["ptx"], "no_such_kernel") is None


def test_the_packing_follows_the_compiled_signature(stage2) -> None:
    sig = dl.signature_of(stage2)
    assert sig == list(STAGE2_SIG.values())
    kept = dl.kept_arguments(sig, ARGS)
    assert kept == [0, 1, 2, 3, 4, 5]  # stride_outh (index 6) is a constant in the GPU code
    plan = dl.pack_plan(dl.ptx_params(stage2.asm["ptx"], stage2.metadata.name), ARGS, kept)
    assert plan == [
        ("u64", 0, ARGS[0]),
        ("u64", 1, ARGS[1]),
        ("u64", 2, ARGS[2]),
        ("u64", 3, ARGS[3]),
        ("i32", 4, 37),
        ("i32", 5, 4096),
        ("u64", 6, 0),
        ("u64", 7, 0),
    ]


def test_disagreements_make_no_plan() -> None:
    ptr, i32, f32 = dl.PtxParam("ptr", 64), dl.PtxParam("int", 32), dl.PtxParam("float", 32)
    assert dl.pack_plan([ptr, i32], (1 << 12, 5), [0, 1]) is not None
    assert dl.pack_plan([ptr, i32], (1 << 12, 1 << 31), [0, 1]) is None  # out of i32's range
    assert dl.pack_plan([ptr, i32], (1 << 12, 2.5), [0, 1]) is None  # float for an int
    assert dl.pack_plan([ptr, f32], (1 << 12, 3), [0, 1]) is None  # int for a float
    assert dl.pack_plan([ptr, i32], (object(), 3), [0, 1]) is None  # a pointer not as an int
    assert dl.pack_plan([ptr, i32], (1 << 12, True), [0, 1]) is None
    assert dl.pack_plan([ptr], (1 << 12, 3), [0, 1]) is None  # fewer parameters than arguments
    assert dl.pack_plan([ptr, i32, i32], (1 << 12, 3), [0, 1]) is None  # an extra is no pointer
    assert dl.pack_plan([ptr, i32, ptr, ptr, ptr], (1 << 12, 3), [0, 1]) is None  # > 2 extras
    assert dl.kept_arguments(None, (1,)) is None
    assert dl.kept_arguments(["i32"], (1, 2)) is None


def test_the_block_holds_each_value_where_its_pointer_points() -> None:
    block = dl.ParamBlock([("u64", 0, 0xABCDEF0123), ("i32", 1, -7), ("f32", 2, 0.5)])
    read = [
        ctypes.cast(block.array[0], ctypes.POINTER(ctypes.c_uint64))[0],
        ctypes.cast(block.array[1], ctypes.POINTER(ctypes.c_int32))[0],
        ctypes.cast(block.array[2], ctypes.POINTER(ctypes.c_float))[0],
    ]
    assert read == [0xABCDEF0123, -7, 0.5]
    block.slot(0).value = 0x1000
    assert ctypes.cast(block.array[0], ctypes.POINTER(ctypes.c_uint64))[0] == 0x1000


def _as_gpu_kernel(compiled, **metadata):
    """The CPU-compiled kernel with what loading it on a GPU would add (a CUfunction handle):
    a stand-in, since there is no GPU to load it on."""
    md = compiled.metadata._replace(**metadata) if metadata else None
    return SimpleNamespace(
        metadata=md or compiled.metadata, asm=compiled.asm, src=compiled.src, function=0xF00D
    )


def test_a_launch_writes_the_live_pointers_and_calls_the_driver_once(stage2, monkeypatch):
    """The driver call is a recorder standing in for cuLaunchKernel (no GPU here)."""
    calls: list = []

    def recorder(fn, gx, gy, gz, bx, by, bz, shared, stream, params, extra) -> int:
        words = [ctypes.cast(params[i], ctypes.POINTER(ctypes.c_uint64))[0] for i in range(4)]
        n = ctypes.cast(params[4], ctypes.POINTER(ctypes.c_int32))[0]
        calls.append((fn.value, (gx, gy, gz), (bx, by, bz), shared, stream, words, n, extra))
        return 0

    monkeypatch.setattr(dl, "_LAUNCH", [recorder])
    kernel = _as_gpu_kernel(stage2)
    fire = dl.launcher_for(kernel, (3, 32, 1), ARGS, (0, 2))
    assert fire is not None
    fire(99, 0x5000, 0x6000)
    fire(98, 0x7000, 0x8000)
    threads, shared = stage2.metadata.num_warps * 32, stage2.metadata.shared
    launch = (0xF00D, (3, 32, 1), (threads, 1, 1), shared)
    assert calls == [
        (*launch, 99, [0x5000, ARGS[1], 0x6000, ARGS[3]], 37, None),
        (*launch, 98, [0x7000, ARGS[1], 0x8000, ARGS[3]], 37, None),
    ]
    with pytest.raises(ValueError):
        fire(97, 0x5000)  # every live pointer, every time


def test_a_refused_launch_raises_with_the_drivers_code(stage2, monkeypatch) -> None:
    monkeypatch.setattr(dl, "_LAUNCH", [lambda *a: 201])  # stands in: CUDA_ERROR_INVALID_CONTEXT
    fire = dl.launcher_for(_as_gpu_kernel(stage2), (1, 1, 1), ARGS, ())
    with pytest.raises(dl.DriverLaunchError) as e:
        fire(0)
    assert e.value.code == 201


@pytest.mark.parametrize(
    "metadata",
    [
        {"global_scratch_size": 64},
        {"profile_scratch_size": 8},
        {"launch_pdl": True},
        {"launch_cooperative_grid": True},
        {"num_ctas": 2},
    ],
)
def test_kernels_this_path_cannot_launch_keep_tritons(stage2, metadata, monkeypatch) -> None:
    monkeypatch.setattr(dl, "_LAUNCH", [lambda *a: 0])
    assert dl.launcher_for(_as_gpu_kernel(stage2), (1, 1, 1), ARGS, ()) is not None
    assert dl.launcher_for(_as_gpu_kernel(stage2, **metadata), (1, 1, 1), ARGS, ()) is None


def test_a_live_argument_must_be_a_pointer_the_gpu_code_takes(stage2, monkeypatch) -> None:
    monkeypatch.setattr(dl, "_LAUNCH", [lambda *a: 0])
    kernel = _as_gpu_kernel(stage2)
    assert dl.launcher_for(kernel, (1, 1, 1), ARGS, (4,)) is None  # num_splits: an int
    assert dl.launcher_for(kernel, (1, 1, 1), ARGS, (6,)) is None  # specialised away
    assert dl.launcher_for(SimpleNamespace(run=None), (1, 1, 1), ARGS, ()) is None


def test_no_driver_library_keeps_tritons_launcher(stage2, monkeypatch) -> None:
    def missing():
        raise OSError("libcuda.so.1: cannot open shared object file")

    monkeypatch.setattr(dl, "_LAUNCH", [])
    monkeypatch.setattr(dl, "_driver", missing)
    assert dl.launcher_for(_as_gpu_kernel(stage2), (1, 1, 1), ARGS, ()) is None
