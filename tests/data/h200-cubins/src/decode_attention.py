"""Flash-decoding over a paged KV cache (Triton): split-KV partials, then a log-sum-exp merge.

Decode is memory-bound: each step reads every cached K and V byte of every request once, does
about one multiply-add per byte, and writes one row per query head. The kernel therefore spends its
effort on keeping enough loads in flight: the KV range of each request is split across programs
(stage 1), each writing an unnormalised partial output and its log-sum-exp, and a tiny second kernel
(stage 2) merges the partials. The split count comes from the batch, the KV heads, the longest
request and the SM count, so a single 128k request still fills all 132 SMs of an H200 while a
batch of 128 short requests launches no useless splits.

Layout (the same as the workload's cache, see :mod:`kdash.kernels.kv_cache`):

- ``q``: ``[B, Hq, D]`` bf16, one new token per request.
- ``k_cache``/``v_cache``: ``[num_pages, page_size, Hkv, D]``, bf16 or ``torch.float8_e4m3fn``.
- ``page_table``: ``[B, max_pages]`` int32; token ``t`` of request ``b`` lives in page
  ``page_table[b, t // page_size]`` at slot ``t % page_size``. Entries past a request's length are
  never read (tests fill those slots with NaN to prove it).
- ``seq_lens``: ``[B]`` int32, the number of cached tokens to attend to (the new token included).

GQA: the ``Hq / Hkv`` query heads that share a KV head are handled by one program as the rows of
one ``tl.dot`` (padded to 16 rows, the smallest tensor-core tile), so K and V are read once per KV
head rather than once per query head.

fp8: e4m3 KV with one fp32 scale per KV head (``k_scale``/``v_scale`` of shape ``[Hkv]``; a
per-tensor scale is the special case of equal entries, and a float is accepted). Dequantised value
= fp8 value x scale. K's scale multiplies the logits and V's scale the finished output, so the
inner loop only converts fp8 to bf16 for the tensor cores; half the bytes of bf16 are read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpreting, mma, next_pow2, sm_count, to_bf16

LOG2E = 1.4426950408889634
FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of stage 1 (defaults picked on an H200, see bench/NOTES-kernels.md).

    ``fp8_compute`` says how fp8 KV reaches the tensor cores, all exact conversions to a 16-bit
    type: ``"pairs_asm"``/``"pairs"`` (fp8 read as int16 pairs and turned into fp16 by integer
    ops, in inline PTX on two pairs per register or in Triton ops; see :func:`_fp8_pairs_to_fp16`;
    the CPU interpreter always takes the Triton ops), ``"fp16"`` (Triton's e4m3 -> fp16
    conversion, one instruction per pair, but Triton then reads the transposed V operand byte by
    byte from shared memory) or
    ``"bf16"`` (a longer conversion chain). With fp16, Q and P are rounded to fp16, which is
    finer than bf16 for them (|q| must stay below 65504, as for any fp16 attention).
    """

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    # Target stage-1 programs per SM when planning splits: for a batch of (near) equal lengths,
    # and for a batch whose lengths vary, where finer pieces keep the longest request off the
    # critical path.
    programs_per_sm: int = 4
    programs_per_sm_varlen: int = 12
    min_tokens_per_split: int = 256
    max_splits: int = 256
    fp8_compute: str = "pairs_asm"
    evict_first: bool = False  # streaming hint on the K/V loads (they are read once)


DEFAULT_CONFIG = DecodeConfig()
# fp8 tiles carry half the bytes: twice the tokens per tile keeps the per-tile work the same.
DEFAULT_FP8_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=8)


def default_config(kv_dtype: torch.dtype) -> DecodeConfig:
    """The H200-picked config for a KV dtype (bench/NOTES-kernels.md has the sweeps)."""
    return DEFAULT_FP8_CONFIG if kv_dtype in FP8_DTYPES else DEFAULT_CONFIG


def plan_splits(
    batch: int,
    kv_heads: int,
    max_len: int,
    total_tokens: int | None = None,
    *,
    config: DecodeConfig = DEFAULT_CONFIG,
    sms: int | None = None,
) -> tuple[int, int]:
    """``(num_splits, split_len)``: the grid's split count and the planned tokens per split.

    The split length comes from the total work (``total_tokens * kv_heads`` token-heads) over the
    target program count (``programs_per_sm * sms``), so a batch of unequal requests is cut into
    pieces of about equal work rather than into an equal number of pieces; it is never below
    ``min_tokens_per_split`` (shorter splits cost more in partial outputs than they gain). The
    kernel then cuts each request into ``ceil(len / split_len)`` equal parts (at most
    ``num_splits``), so every token is covered whatever the lengths are at run time; a split past a
    request's end writes ``lse = -inf`` and is ignored by the merge, so short requests give no NaN.
    """
    sms = sms if sms is not None else sm_count()
    max_len = max(1, max_len)
    total = total_tokens if total_tokens is not None else batch * max_len
    varlen = batch * max_len > 1.5 * max(1, total)
    pps = config.programs_per_sm_varlen if varlen else config.programs_per_sm
    target = max(1, pps * sms)
    split_len = max(config.min_tokens_per_split, cdiv(max(1, total) * kv_heads, target))
    split_len = cdiv(split_len, config.block_n) * config.block_n
    num_splits = max(1, min(cdiv(max_len, split_len), config.max_splits))
    return int(num_splits), int(split_len)


def choose_num_splits(
    batch: int,
    kv_heads: int,
    max_len: int,
    *,
    config: DecodeConfig = DEFAULT_CONFIG,
    sms: int | None = None,
) -> int:
    """Split count for ``batch`` requests of ``max_len`` tokens (see :func:`plan_splits`)."""
    return plan_splits(batch, kv_heads, max_len, config=config, sms=sms)[0]


@triton.jit
def _decode_stage1(
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
    IS_FP8: tl.constexpr,
    FP8_FP16: tl.constexpr,
    EVICT: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP

    seq_len = tl.load(LENS + b)
    # This request's own cut: as many splits as its length needs at the planned split length
    # (never more than the grid has), equal parts rounded up to whole blocks.
    n_here = tl.minimum(tl.maximum(tl.cdiv(seq_len, split_len_hint), 1), num_splits)
    split_len = tl.cdiv(tl.cdiv(seq_len, n_here), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    scale = qk_scale
    if IS_FP8:
        scale = scale * tl.load(KS + kvh)
        if FP8_FP16:
            q = q.to(tl.float16)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)

    pt_row = PT + b * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(pt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k = tl.load(
            K
            + page[:, None] * stride_kp
            + slot[:, None] * stride_ks
            + kvh * stride_kh
            + offs_d[None, :],
            mask=nmask[:, None],
            other=0.0,
            eviction_policy=EVICT,
        )
        v = tl.load(
            V
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vs
            + kvh * stride_vh
            + offs_d[None, :],
            mask=nmask[:, None],
            other=0.0,
            eviction_policy=EVICT,
        )
        if IS_FP8:
            if FP8_FP16:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
            else:
                k = k.to(tl.bfloat16)
                v = v.to(tl.bfloat16)
        qk = mma(q, tl.trans(k), UPCAST) * scale  # log2 domain
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IS_FP8 and FP8_FP16:  # noqa: SIM108 - an if on constexprs compiles one branch
            p_op = p.to(tl.float16)
        else:
            p_op = to_bf16(p, UPCAST)
        acc = acc * alpha[:, None] + mma(p_op, v, UPCAST)
        m_i = m_new

    if IS_FP8:
        acc = acc * tl.load(VS + kvh)
    # An empty split (past the end of a short request) keeps m_i = -inf, l_i = 0: it writes
    # lse = -inf and o = 0, and the merge gives it zero weight.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    # Partials are contiguous [B, Hq, num_splits, D] and [B, Hq, num_splits].
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    tl.store(OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)


@triton.jit
def _fp8_pairs_to_fp16(w, ASM: tl.constexpr = False):
    """Two e4m3 bytes packed in an int16 -> (even, odd) fp16 values times 2^-8, exactly.

    e4m3's 4 exponent and 3 mantissa bits move into the low exponent bits and the top mantissa
    bits of an fp16; the exponent bias differs by 8, so the fp16 equals the e4m3 value x 2^-8 for
    normals and subnormals alike (the caller folds 2^8 into the scales). Plain integer ops on the
    registers the tensor cores read, where a converted 8-bit load would go through byte-wide
    shared-memory reads (see bench/NOTES-kernels.md). With ``ASM`` (GPU only) the same bit moves
    run on two int16 words per 32-bit register, about 2 instructions per value instead of 4.
    """
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 a, b;
            shl.b32 a, $2, 7;
            and.b32 a, a, 0x3F803F80;
            shl.b32 b, $2, 8;
            and.b32 b, b, 0x80008000;
            or.b32 $0, a, b;
            shr.b32 a, $2, 1;
            and.b32 a, a, 0x3F803F80;
            and.b32 b, $2, 0x80008000;
            or.b32 $1, a, b;
            }""",
            constraints="=r,=r,r",
            args=[w],
            dtype=(tl.float16, tl.float16),
            is_pure=True,
            pack=2,
        )
    else:
        u = w.to(tl.int32) & 0xFFFF
        e = ((u & 0x7F) << 7) | ((u & 0x80) << 8)
        o = ((u >> 1) & 0x3F80) | (u & 0x8000)
        even = e.to(tl.int16).to(tl.float16, bitcast=True)
        odd = o.to(tl.int16).to(tl.float16, bitcast=True)
    return even, odd


@triton.jit
def _decode_stage1_fp8_pairs(
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
):
    """Stage 1 for fp8 KV read as int16 pairs (K, V strides in int16 units).

    Each pair holds dims (2j, 2j+1) of one token, so the head dim is processed as its even and odd
    halves: q.k = q_even.k_even + q_odd.k_odd, and P@V is computed for the even and the odd output
    dims separately. Every operand is 16-bit, so shared-memory reads are ldmatrix, as for bf16.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP
    HALF: tl.constexpr = HEAD_DIM // 2

    seq_len = tl.load(LENS + b)
    n_here = tl.minimum(tl.maximum(tl.cdiv(seq_len, split_len_hint), 1), num_splits)
    split_len = tl.cdiv(tl.cdiv(seq_len, n_here), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, HALF)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * offs_j[None, :]
    q_even = tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.float16)
    q_odd = tl.load(q_ptr + 1, mask=hmask[:, None], other=0.0).to(tl.float16)
    scale = qk_scale * tl.load(KS + kvh) * 256.0

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)

    pt_row = PT + b * stride_ptb
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        page = tl.load(pt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        kw = tl.load(
            K
            + page[:, None] * stride_kp
            + slot[:, None] * stride_ks
            + kvh * stride_kh
            + offs_j[None, :],
            mask=nmask[:, None],
            other=0,
            eviction_policy=EVICT,
        )
        vw = tl.load(
            V
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vs
            + kvh * stride_vh
            + offs_j[None, :],
            mask=nmask[:, None],
            other=0,
            eviction_policy=EVICT,
        )
        k_even, k_odd = _fp8_pairs_to_fp16(kw, ASM)
        qk = mma(q_even, tl.trans(k_even), UPCAST) + mma(q_odd, tl.trans(k_odd), UPCAST)
        qk = qk * scale
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p16 = p.to(tl.float16)
        v_even, v_odd = _fp8_pairs_to_fp16(vw, ASM)
        acc_e = acc_e * alpha[:, None] + mma(p16, v_even, UPCAST)
        acc_o = acc_o * alpha[:, None] + mma(p16, v_odd, UPCAST)
        m_i = m_new

    vscale = tl.load(VS + kvh) * 256.0
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    o_ptr = OP + row[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    tl.store(o_ptr, acc_e * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(o_ptr + 1, acc_o * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)


@triton.jit
def _decode_stage2(
    OP,
    LSEP,
    Out,
    LSE,
    num_splits,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_heads = tl.num_programs(1)
    row0 = (b * q_heads + h).to(tl.int64) * num_splits
    offs_d = tl.arange(0, HEAD_DIM)
    # Pass 1: the largest partial LSE. BLOCK_S covers all splits (<= 256) in one chunk, so each
    # loop runs once: two dependent load round trips in all, not one per split.
    m_vec = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        lse = tl.load(LSEP + row0 + offs_s, mask=offs_s < num_splits, other=float("-inf"))
        m_vec = tl.maximum(m_vec, lse)
    m = tl.max(m_vec, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    # Pass 2: the weighted sum of the partial outputs.
    l_vec = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        offs_s = s0 + tl.arange(0, BLOCK_S)
        smask = offs_s < num_splits
        lse = tl.load(LSEP + row0 + offs_s, mask=smask, other=float("-inf"))
        w = tl.where(smask, tl.exp2(lse - m_safe), 0.0)
        part = tl.load(
            OP + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=smask[:, None],
            other=0.0,
        )
        part = tl.where(w[:, None] > 0, part, 0.0)
        acc += tl.sum(part * w[:, None], 0)
        l_vec += w
    denom = tl.sum(l_vec, 0)
    denom_safe = tl.where(denom > 0, denom, 1.0)
    out = acc / denom_safe
    tl.store(Out + b * stride_outb + h * stride_outh + offs_d, to_bf16(out, EMULATE_RTNE))
    # Natural-log LSE, for callers that merge further (e.g. a prefix + suffix split).
    lse_out = tl.where(
        denom > 0, (m_safe + tl.log2(denom_safe)) * 0.6931471805599453, -float("inf")
    )
    tl.store(LSE + b * q_heads + h, lse_out)


def _as_scale(
    scale: torch.Tensor | float | None, kv_heads: int, device: torch.device
) -> torch.Tensor:
    if scale is None:
        raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
    if isinstance(scale, torch.Tensor):
        s = scale.reshape(-1)
        if s.dtype != torch.float32 or s.device != device:
            s = s.to(device=device, dtype=torch.float32)
        if s.numel() == 1:
            s = s.expand(kv_heads).contiguous()
        if s.numel() != kv_heads:
            raise ValueError(f"scale has {s.numel()} entries, expected 1 or {kv_heads}")
        return s
    return torch.full((kv_heads,), float(scale), device=device, dtype=torch.float32)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    sm_scale: float | None = None,
    k_scale: torch.Tensor | float | None = None,
    v_scale: torch.Tensor | float | None = None,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    total_tokens: int | None = None,
    config: DecodeConfig | None = None,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per request over its paged KV cache.

    The split plan (:func:`plan_splits`) needs the longest length (``max_seq_len``, else
    ``seq_lens.max()``, which synchronises with the GPU) and, for a balanced cut of unequal
    requests, ``total_tokens`` (else ``batch * max_seq_len``). ``num_splits`` overrides the split
    count, e.g. for a CUDA graph captured once and replayed for any lengths: any lengths stay
    correct, only the balance changes. Returns ``[B, Hq, D]`` in q's dtype, and the natural-log
    LSE ``[B, Hq]`` fp32 when ``return_lse``.
    """
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("q must be [B, Hq, D] and the caches [pages, page_size, Hkv, D]")
    batch, q_heads, head_dim = q.shape
    _, page_size, kv_heads, kd = k_cache.shape
    if kd != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError("K/V cache shapes do not match q")
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} not a multiple of KV heads {kv_heads}")
    if head_dim & (head_dim - 1):
        raise ValueError("head_dim must be a power of two (64 and 128 are supported)")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension must be contiguous")
    group = q_heads // kv_heads
    is_fp8 = k_cache.dtype in FP8_DTYPES
    if is_fp8 != (v_cache.dtype in FP8_DTYPES):
        raise ValueError("K and V caches must both be fp8 or both not")
    dev = q.device
    config = config or default_config(k_cache.dtype)
    if is_fp8:
        ks = _as_scale(k_scale, kv_heads, dev)
        vs = _as_scale(v_scale, kv_heads, dev)
    else:
        ks = vs = seq_lens  # never read; any pointer does (saves an allocation and a fill)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if batch else 1
    splits, split_len = plan_splits(batch, kv_heads, max_seq_len, total_tokens, config=config)
    if num_splits is not None:
        splits = max(1, int(num_splits))
    if out is None:
        out = torch.empty_like(q)
    # One workspace allocation: partial O, partial LSE, final LSE.
    n_o = batch * q_heads * splits * head_dim
    n_l = batch * q_heads * splits
    ws = torch.empty(n_o + n_l + batch * q_heads, device=dev, dtype=torch.float32)
    o_part = ws[:n_o]
    lse_part = ws[n_o : n_o + n_l]
    lse = ws[n_o + n_l :].view(batch, q_heads)
    if batch == 0:
        return (out, lse) if return_lse else out
    upcast = interpreting(q)
    evict = "evict_first" if config.evict_first else ""
    block_h = max(16, next_pow2(group))
    if is_fp8 and config.fp8_compute in ("pairs", "pairs_asm"):
        if head_dim % 32:
            raise ValueError("fp8 pairs path needs head_dim a multiple of 32")
        k16 = k_cache.view(torch.int16)
        v16 = v_cache.view(torch.int16)
        _decode_stage1_fp8_pairs[(batch, kv_heads, splits)](
            q,
            k16,
            v16,
            page_table,
            seq_lens,
            ks,
            vs,
            o_part,
            lse_part,
            sm_scale * LOG2E,
            splits,
            split_len,
            q.stride(0),
            q.stride(1),
            k16.stride(0),
            k16.stride(1),
            k16.stride(2),
            v16.stride(0),
            v16.stride(1),
            v16.stride(2),
            page_table.stride(0),
            GROUP=group,
            BLOCK_H=block_h,
            HEAD_DIM=head_dim,
            BLOCK_N=config.block_n,
            PAGE=page_size,
            EVICT=evict,
            ASM=config.fp8_compute == "pairs_asm" and not upcast,
            UPCAST=upcast,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    else:
        _decode_stage1[(batch, kv_heads, splits)](
            q,
            k_cache,
            v_cache,
            page_table,
            seq_lens,
            ks,
            vs,
            o_part,
            lse_part,
            sm_scale * LOG2E,
            splits,
            split_len,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            page_table.stride(0),
            GROUP=group,
            BLOCK_H=block_h,
            HEAD_DIM=head_dim,
            BLOCK_N=config.block_n,
            PAGE=page_size,
            IS_FP8=is_fp8,
            FP8_FP16=config.fp8_compute != "bf16",
            EVICT=evict,
            UPCAST=upcast,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
    _decode_stage2[(batch, q_heads)](
        o_part,
        lse_part,
        out,
        lse,
        splits,
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=min(256, next_pow2(splits)),
        EMULATE_RTNE=upcast,
        # the [BLOCK_S, D] fp32 tile of partials at <= 64 registers a thread
        num_warps=max(1, min(8, next_pow2(splits) * head_dim // 2048)),
    )
    return (out, lse) if return_lse else out
