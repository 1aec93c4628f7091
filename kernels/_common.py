"""Small helpers shared by the Triton kernels: device facts, block sizes, the interpreter switch.

Why a helper for ``tl.dot``: under ``TRITON_INTERPRET=1`` (the CPU CI path) Triton 3.9's
interpreter returns garbage for a ``tl.dot`` on bf16 operands (seen with torch 2.13 CPU), while an
fp32 dot is right; and its fp32 -> bf16 conversion truncates where the GPU rounds to nearest
even. The kernels therefore round their operands to bf16 exactly as the GPU path does and, when
interpreting, upcast those bf16 values to fp32 before the dot. The product of two bf16
values is exact in fp32, so the CPU run checks the same numerics that the tensor cores compute
(bf16 operands, fp32 accumulation), up to the order of the fp32 additions.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl


def interpreting(t: torch.Tensor) -> bool:
    """True when kernels on ``t`` run in Triton's CPU interpreter rather than on a GPU."""
    return t.device.type == "cpu" or os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def sm_count(device_index: int = 0) -> int:
    """Multiprocessor count of a CUDA device (132 on an H200); 8 on the CPU interpreter."""
    if not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (Triton block shapes must be powers of two)."""
    return 1 << max(0, math.ceil(math.log2(max(1, n))))


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative integers."""
    return -(-a // b)


@triton.jit
def mma(a, b, UPCAST: tl.constexpr):
    """``a @ b`` with fp32 accumulation; ``UPCAST`` routes around the interpreter's bf16 dot."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def mma_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` (fp32): on the GPU one accumulator, so consecutive MMAs chain without a
    wait between them; ``UPCAST`` as :func:`mma`."""
    if UPCAST:
        return acc + tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def to_bf16(x, EMULATE: tl.constexpr):
    """fp32 -> bf16 with round-to-nearest-even.

    The GPU's conversion already rounds to nearest even; Triton 3.9's interpreter truncates
    instead (twice the rounding error, seen on torch 2.13 CPU), so with ``EMULATE`` the rounding is
    done on the bits first and the cast that follows is exact.
    """
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = bits & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def to_e4m3(x, EMULATE: tl.constexpr):
    """fp32 (within e4m3's range) -> e4m3 with round-to-nearest-even.

    The GPU converts with ``cvt.rn.satfinite``; Triton 3.9's interpreter gets the exponent wrong
    when rounding carries into the next power of two (-126.3 becomes -64, seen on torch 2.13
    CPU), so with ``EMULATE`` the value is rounded in fp32 first (3 mantissa bits by integer
    add and mask; e4m3's subnormals, below 2^-6, to multiples of 2^-9 by the 1.5 x 2^23 trick)
    and the cast that follows is exact."""
    if EMULATE:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000
        normal = bits.to(tl.float32, bitcast=True)
        sub = ((x * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
        return tl.where(tl.abs(x) < 0.015625, sub, normal).to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def opaque_i32(x, GPU: tl.constexpr):
    """The int32 ``x`` as a value the compilers cannot fold (a register move in inline PTX);
    ``x`` itself in the interpreter, which runs no PTX. A register-allocation lever
    (``decode_fused.OPAQUE_HEADS``), not a change of value."""
    if GPU:
        return tl.inline_asm_elementwise(
            asm="mov.b32 $0, $1;", constraints="=r,r", args=[x], dtype=tl.int32, is_pure=True,
            pack=1,
        )  # fmt: skip
    else:
        return x


@triton.jit
def rows(heads, num_splits, split, LSEP, TAGGED: tl.constexpr, UPCAST: tl.constexpr):
    """Stage 1's partial rows of ``heads`` (``heads * num_splits + split``, int64) and, with
    ``TAGGED`` (:mod:`kdash.kernels.decode_tagged`), this launch's tag: one more than the tag
    its first row's LSE holds from the last launch (0 without). With ``TAGGED`` on the GPU the
    program also lets the merge kernel, launched after it with programmatic dependent launch,
    start (``griddepcontrol.launch_dependents``): the merge reads nothing but tagged partials,
    so it needs no grid-wide wait. ``UPCAST``: the interpreter's switch (no PTX there)."""
    row = heads.to(tl.int64) * num_splits + split
    if TAGGED:
        if not UPCAST:
            tl.inline_asm_elementwise(
                asm="griddepcontrol.launch_dependents; // $0", constraints="=r", args=[],
                dtype=tl.int32, is_pure=False, pack=1,
            )  # fmt: skip
        # every row of a launch carries one tag: the first's will do (one scalar load)
        last = tl.load(LSEP.to(tl.pointer_type(tl.int64)) + tl.min(row, 0))
        return row, tag_of(last) + 1
    else:
        return row, 0


@triton.jit
def store(P, offs, val, mask, TAGGED: tl.constexpr, tag):
    """A decode partial (fp32 ``val``) stored at ``offs`` of ``P``; with ``TAGGED`` as one
    int64 a value, ``tag`` (one a row of ``offs``) in the high 32 bits and the value's bits in
    the low 32, in a buffer twice as wide. One aligned 64-bit element is written whole
    (single-copy atomic), so a reader that sees the tag sees the value beside it."""
    if TAGGED:
        v = val + tl.zeros(offs.shape, tl.float32)
        bits = v.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        t = tag.to(tl.int64) << 32
        if len(offs.shape) == 2 and len(t.shape) == 1:  # a tag a row
            t = t[:, None]
        tl.store(P.to(tl.pointer_type(tl.int64)) + offs, t | bits, mask=mask)
    else:
        tl.store(P + offs, val, mask=mask)


@triton.jit
def tagged_value(x):
    """The fp32 value of a tagged int64 (:func:`store`)."""
    return (x & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def tag_of(x):
    """The tag of a tagged int64 (:func:`store`)."""
    return (x >> 32).to(tl.int32)


def _scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for the TMA descriptors the Gluon kernels make (128 bytes a descriptor)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


def ensure_allocator() -> None:
    """Give Triton an allocator for in-kernel descriptors unless the caller set one (Triton
    keeps it per context, so this runs on every launch that may need it; a caller's own
    allocator is kept)."""
    from triton.runtime import _allocation

    if isinstance(_allocation._allocator.get(), _allocation.NullAllocator):
        triton.set_allocator(_scratch)


@functools.lru_cache(maxsize=16)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def capability_of(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of a CUDA ``device``; None for any other (the CPU interpreter)."""
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())
