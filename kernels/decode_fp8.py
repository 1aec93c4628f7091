"""The default fp8 stage-1 kernel for decode (``fp8_compute="cvt"``) and its launch configs.

The H200's profile of the integer-op fp8 stage 1 (``pairs_asm``; bench/NOTES-kernels.md): 59% of
DRAM bandwidth, 147 registers (3 programs of 4 warps an SM, 16.7% achieved occupancy), issue
slots 44% busy.
Too few bytes in flight, and many integer instructions per byte for the fp8 -> fp16 moves.

This kernel, ``fp8_compute="cvt"``, takes the hardware conversion instead. sm_89 and later have
``cvt.rn.f16x2.e4m3x2`` (PTX ISA 7.8), one instruction for the two e4m3 bytes of an int16 pair,
giving the exact fp16 values (no 2^-8 factor). One byte permute and two of them turn a 32-bit
register of two pairs into the even and odd fp16 pairs the tensor cores read: 3 instructions
for 4 values, against 9 (before ptxas merges some) for the bit moves of ``_fp8_pairs_to_fp16``
(on sm_90 the loop's integer and convert instructions drop by about a quarter).
It keeps the layout of the integer-op kernel (fp8 read as int16 pairs: two dims of one token, the
head dim as its even and odd halves), its cut into splits and its outputs, so the plan, the merge
and the fused launch take it unchanged.

The H200 timed it against the integer-op kernel (``"pairs_asm"``, kernels/decode_attention.py)
and against launch configs of both (bench/gpu_fp8_variants.py; figures in
bench/NOTES-kernels.md): at the fp8 launch config (128 tokens a tile, 4 warps, 2 stages) it beat
the integer-op kernel on every shape and had the highest ``fp8_speedup`` of all, eager and
graph-replayed, so that is the default (``DEFAULT_FP8_CONFIG``); fewer tokens a tile with a
deeper pipeline and a register cap (:class:`Fp8Config`'s ``maxnreg``) came close under graph
replay only. A GPU below sm_89 runs the integer-op kernel instead
(:func:`runnable_config`).

In the CPU interpreter (no inline PTX) the conversion takes Triton ops: the integer bit moves,
then x 2^8 in fp16 (exact: a power of two, and 448 x 2^-8 x 2^8 is in range), so the interpreter
checks everything but the PTX itself; :func:`conversion_path` says which one a plan runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import triton
import triton.language as tl

from ._common import mma, mma_acc, to_e4m3
from .decode_attention import DecodeConfig, _fp8_pairs_to_fp16, _piece, _tile_pages

# fp8_compute values that pick this module's kernel: "cvt" converts K and V; "kmma" feeds K's fp8
# bytes to the tensor cores as they are (Q split into two fp8 terms) and converts V alone.
CVT_MODES = ("cvt", "kmma")

# Whether plans compile this module's kernels to take V's addresses from K's row offsets where
# the two caches share a layout (KV_SAME: the same loads, about 1/8 fewer KV-loop instructions on
# sm_90, 153 -> 166 registers, still 3 programs an SM); set from the H200's figures.
KV_SAME_DEFAULT = True

# cvt.rn.f16x2.e4m3x2 (the default fp8 stage 1's conversion) is PTX for sm_89 and later.
CVT_MIN_CAPABILITY = (8, 9)


def runnable_config(config: DecodeConfig, capability: tuple[int, int] | None) -> DecodeConfig:
    """``config`` as a GPU of compute ``capability`` can run it: a config of this module's
    kernels (``fp8_compute`` "cvt" or "kmma", both on e4m3 instructions of sm_89+) becomes the
    same launch config on the integer-op conversion (``"pairs_asm"``: the same layout, both
    conversions exact) below :data:`CVT_MIN_CAPABILITY`. ``None`` (the CPU interpreter, which
    runs no PTX and takes Triton ops for either): unchanged."""
    below = capability is not None and tuple(capability) < CVT_MIN_CAPABILITY
    if below and config.fp8_compute in CVT_MODES:
        return replace(config, fp8_compute="pairs_asm")
    return config


@dataclass(frozen=True)
class Fp8Config(DecodeConfig):
    """A decode config with a register cap for stage 1 (Triton's ``maxnreg`` compile option,
    present in 3.6 and 3.9; ``None``: ptxas chooses). A cap that forces spills costs local-memory
    traffic, so the compiled kernel's spills must be read with its registers."""

    maxnreg: int | None = None


def is_cvt(config: DecodeConfig) -> bool:
    """Whether ``config`` picks one of this module's kernels."""
    return config.fp8_compute in CVT_MODES


def conversion_path(config: DecodeConfig, interpreting: bool) -> str:
    """Which fp8 -> fp16 conversion a plan with ``config`` runs: ``"ptx-cvt"`` on the GPU,
    ``"triton-ops"`` in the interpreter (or for a config not of this module: ``"other"``)."""
    if not is_cvt(config):
        return "other"
    return "triton-ops" if interpreting else "ptx-cvt"


@triton.jit
def _fp8_pairs_cvt(w, ASM: tl.constexpr):
    """int16 words of two e4m3 bytes (dims 2j, 2j+1 of one token) -> (even, odd) fp16, the exact
    e4m3 values. With ``ASM`` (sm_89+): per 32-bit register (two words, the first in the low
    half; bytes e0 o0 e1 o1 from the low end) one ``prmt`` gathers the even bytes into the low
    half and the odd ones into the high half (e0 e1 o0 o1), then one ``cvt.rn.f16x2.e4m3x2`` per
    half (its low byte to the low fp16) gives the two even values and the two odd ones."""
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 r;
            .reg .b16 lo, hi;
            prmt.b32 r, $2, 0, 0x3120;
            mov.b32 {lo, hi}, r;
            cvt.rn.f16x2.e4m3x2 $0, lo;
            cvt.rn.f16x2.e4m3x2 $1, hi;
            }""",
            constraints="=r,=r,r",
            args=[w],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        e8, o8 = _fp8_pairs_to_fp16(w, False)
        even = (e8.to(tl.float32) * 256.0).to(tl.float16)
        odd = (o8.to(tl.float32) * 256.0).to(tl.float16)
    return even, odd


@triton.jit
def _q_fp8_split(q, EMULATE: tl.constexpr):
    """``q`` ``[heads, dims]`` -> ``(hi, lo, mul)``: e4m3 terms with ``16 * q * mul ~ hi + lo``
    per head row, where ``mul`` ``[heads]`` is the power of two putting the row's largest
    ``|q * mul|`` in [8, 16) (made from the exponent bits, so exact on the GPU as in the
    interpreter). ``hi`` is ``q * mul`` rounded to e4m3, times 16 (exact: at most 256); ``lo``
    is the residual times 16 (at most 8). The pair keeps about 8 significant bits, as bf16
    does, where one e4m3 term keeps 4; both terms on one scale let the two MMAs share an
    accumulator. An all-zero row stays zero."""
    q = q.to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(q), 1), 1e-30)
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax))
    mul = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2^(3 - e)
    qs = q * mul[:, None]
    hi = to_e4m3(qs, EMULATE).to(tl.float32)
    return to_e4m3(hi * 16.0, EMULATE), to_e4m3((qs - hi) * 16.0, EMULATE), mul


@triton.jit(do_not_specialize=["capacity"])
def _decode_stage1_fp8_cvt(
    Q,
    K,
    V,
    PT,
    LENS,
    KS,
    VS,
    OP,
    LSEP,
    qk_scale,
    num_splits,
    split_len_hint,
    capacity,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    EVICT: tl.constexpr,
    ASM: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    DEVICE_PLAN: tl.constexpr = False,
    TARGET_VARLEN: tl.constexpr = 1,
    MIN_SPLIT: tl.constexpr = 256,
    BLOCK_B: tl.constexpr = 16,
    MAX_SPLITS: tl.constexpr = 256,
    MERGE: tl.constexpr = 0,
    SEARCH: tl.constexpr = 1,
    KMMA: tl.constexpr = False,
    KV_SAME: tl.constexpr = False,
):
    """Stage 1 for fp8 KV read as int16 pairs, converted by ``_fp8_pairs_cvt`` (exact values, so
    the scales carry no 2^8). Arguments as ``_decode_stage1_fp8_pairs``'s (strides in int16
    units). ``KMMA``: K's bytes go to the tensor cores unconverted; ``KV_SAME``: V's strides are
    K's (:func:`_fp8_cvt_span`)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP
    seq_len, start, end = _piece(
        LENS,
        b,
        split,
        num_splits,
        split_len_hint,
        capacity,
        BLOCK_N,
        DEVICE_PLAN,
        TARGET_VARLEN,
        MIN_SPLIT,
        BLOCK_B,
        MAX_SPLITS,
        MERGE,
        SEARCH,
    )
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if start >= end:
        # Past the end of a short request: lse = -inf only, which the merge weighs as zero.
        tl.store(LSEP + row, float("-inf"), mask=hmask)
        return
    _fp8_cvt_span(
        Q, K, V, PT, KS, VS, OP, LSEP, qk_scale, stride_qb, stride_qh, stride_kp, stride_ks,
        stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, b, kvh, start, end, row, hmask,
        heads, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT, ASM, UPCAST, PREFETCH, KMMA, KV_SAME,
    )  # fmt: skip


@triton.jit
def _fp8_cvt_span(
    Q, K, V, PT, KS, VS, OP, LSEP, qk_scale, stride_qb, stride_qh, stride_kp, stride_ks,
    stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, b, kvh, start, end, row, hmask,
    heads, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr, EVICT: tl.constexpr, ASM: tl.constexpr, UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr, KMMA: tl.constexpr = False, KV_SAME: tl.constexpr = False,
):  # fmt: skip
    """Tokens ``[start, end)`` (not empty) of request ``b`` for KV head ``kvh``'s query heads
    ``heads``: the partial output and LSE written to rows ``row`` of ``OP``/``LSEP``. The body of
    :func:`_decode_stage1_fp8_cvt`, also run per work item by the persistent decode
    (:mod:`kdash.kernels.decode_persist`).

    With ``KMMA`` the scores are ``K @ Q^T`` on fp8 tensor cores: K's tile goes from shared
    memory to the MMA as e4m3 bytes (no conversion, no trip through registers), Q as two e4m3
    terms per head (:func:`_q_fp8_split`: about bf16's precision), and the ``[tokens, heads]``
    result is turned round for the softmax. V is converted as without it.

    ``KV_SAME`` (V's strides equal K's, as in a cache made of two like tensors): V's addresses
    reuse K's row offsets, which takes about an eighth of the KV loop's instructions (its
    address arithmetic) off the sm_90 SASS (bench/decode_regs_cpu.py --kmma)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_j = tl.arange(0, HALF)
    K8 = K  # the fp8 cache itself, for KMMA's byte tiles (offsets: int16 units x 2)
    K = K.to(tl.pointer_type(tl.int16), bitcast=True)
    V = V.to(tl.pointer_type(tl.int16), bitcast=True)
    scale = qk_scale * tl.load(KS + kvh)
    if KMMA:
        offs_d = tl.arange(0, HEAD_DIM)
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q_hi, q_lo, q_mul = _q_fp8_split(tl.load(q_ptr, mask=hmask[:, None], other=0.0), UPCAST)
        row_scale = scale / (16.0 * q_mul)
    else:
        q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * offs_j[None, :]
        q_even = tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.float16)
        q_odd = tl.load(q_ptr + 1, mask=hmask[:, None], other=0.0).to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)

    pt_row = PT + b * stride_ptb
    offs_t = tl.arange(0, BLOCK_N)
    if PREFETCH:
        page_next = _tile_pages(pt_row, start + offs_t, end, PAGE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_t
        nmask = offs_n < end
        if PREFETCH:
            # Indices for this tile came during the previous one; the next tile's go out first.
            page = page_next.to(tl.int64)
            page_next = _tile_pages(pt_row, offs_n + BLOCK_N, end, PAGE)
        else:
            page = _tile_pages(pt_row, offs_n, end, PAGE).to(tl.int64)
        slot = offs_n % PAGE
        k_row = page * stride_kp + slot * stride_ks + kvh * stride_kh
        v_row = k_row if KV_SAME else page * stride_vp + slot * stride_vs + kvh * stride_vh
        if KMMA:
            k8 = tl.load(
                K8 + 2 * k_row[:, None] + offs_d[None, :],
                mask=nmask[:, None],
                other=0.0,
                eviction_policy=EVICT,
            )
            # [tokens, heads]: the tile is the MMA's first operand, read from shared memory
            st = mma_acc(k8, tl.trans(q_lo), mma(k8, tl.trans(q_hi), UPCAST), UPCAST)
            qk = tl.trans(st) * row_scale[:, None]
        else:
            kw = tl.load(
                K + k_row[:, None] + offs_j[None, :],
                mask=nmask[:, None],
                other=0,
                eviction_policy=EVICT,
            )
            k_even, k_odd = _fp8_pairs_cvt(kw, ASM)
            qk = mma(q_even, tl.trans(k_even), UPCAST) + mma(q_odd, tl.trans(k_odd), UPCAST)
            qk = qk * scale
        vw = tl.load(
            V + v_row[:, None] + offs_j[None, :],
            mask=nmask[:, None],
            other=0,
            eviction_policy=EVICT,
        )
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(tl.float16)
        v_even, v_odd = _fp8_pairs_cvt(vw, ASM)
        acc_e = acc_e * alpha[:, None] + mma(p16, v_even, UPCAST)
        acc_o = acc_o * alpha[:, None] + mma(p16, v_odd, UPCAST)
        m_i = m_new

    vscale = tl.load(VS + kvh)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    o_ptr = OP + row[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    tl.store(o_ptr, acc_e * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(o_ptr + 1, acc_o * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)
