"""Flash-decoding over a paged KV cache (Triton): split-KV partials, then a log-sum-exp merge.

Decode is memory-bound: each step reads every cached K and V byte of every request once, does
about one multiply-add per byte, and writes one row per query head. The kernel therefore spends its
effort on keeping enough loads in flight: the KV range of each request is split across programs
(stage 1), each writing an unnormalised partial output and its log-sum-exp, and a tiny second kernel
(stage 2) merges the partials. The split count comes from the batch, the KV heads, the longest
request and how many stage-1 programs the GPU holds at once (the compiled kernel's residency x
the SMs), counted in whole waves, so a single 128k request still fills all 132 SMs of an H200, a
batch of 128 short requests launches no useless splits, and no grid ends in a nearly empty wave.

Plan, then run (as FlashInfer's decode wrappers): :class:`DecodePlan` is made once per batch
composition (grid, buffers, compile-time parameters) and :meth:`DecodePlan.run` is called per
layer and step: no allocation, no host synchronisation, a few microseconds of host time, and
capturable in a CUDA graph. Each request's cut into splits is computed on the GPU from the
lengths in memory, so a graph replayed while lengths change stays balanced.
:func:`decode_attention` is the one-call form (a plan made and run once).

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

import functools
import math
import weakref
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import _common, residency
from ._common import cdiv, interpreting, mma, next_pow2, sm_count, to_bf16
from .launch import BoundKernel
from .residency import MAX_BLOCKS_PER_SM, Residency

LOG2E = 1.4426950408889634
FP8_DTYPES = (torch.float8_e4m3fn,)
# Batches up to this size get their split length from the lengths in memory, one load of the
# whole batch per program; larger ones use the plan's (host-side) split length.
MAX_DEVICE_PLAN_BATCH = 4096


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
    # Stage-1 programs resident per SM, assumed for a batch of (near) equal lengths until the
    # compiled kernel says otherwise (DecodePlan reads its registers and shared memory; the CPU
    # interpreter compiles nothing): 4 fit at the 120 registers of the H200's 32/8/128 kernel.
    # For a batch whose lengths vary: the target programs per SM, where finer pieces keep the
    # longest request off the critical path.
    programs_per_sm: int = 4
    programs_per_sm_varlen: int = 12
    max_resident_per_sm: int = 0  # at most this many an SM (0: what fits), padded shared memory
    min_tokens_per_split: int = 256
    max_splits: int = 256
    fp8_compute: str = "pairs_asm"
    evict_first: bool = True  # L2 evict-first on the K/V copies, where l2_hint grants it
    # Page indices loaded a tile ahead, so the K/V address math waits on no just-issued load (PC
    # sampling on the H200 put 41.5% of stage 1's samples, 98% long-scoreboard, on that wait at
    # num_stages=2). On: run 4's H200 sweep picked it for bf16 and fp8 alike (``--sweep decode``).
    prefetch_pages: bool = True


DEFAULT_CONFIG = DecodeConfig()
# fp8 tiles carry half the bytes: twice the tokens per tile keeps the per-tile work the same.
# 3 resident per SM: the H200 kernel takes 147-156 registers (bench/results, 2026-12-01).
DEFAULT_FP8_CONFIG = DecodeConfig(block_n=128, num_warps=4, num_stages=2, programs_per_sm=3)


def default_config(kv_dtype: torch.dtype) -> DecodeConfig:
    """The H200-picked config for a KV dtype (bench/NOTES-kernels.md has the sweeps)."""
    return DEFAULT_FP8_CONFIG if kv_dtype in FP8_DTYPES else DEFAULT_CONFIG


# Split-count model for a batch of (near) equal lengths, in tokens of one program's loop: a
# stage-1 wave holds ``capacity`` programs (resident per SM x SMs) that run side by side, so the
# time is the number of waves the grid needs x (the tokens each program reads + one tile,
# ``block_n`` tokens, of start-up: the software pipeline waits for its first tile) plus the
# partial outputs written and merged for every split (:func:`merge_tokens` a program-split).
# WAVES_MAX bounds the split count at that many full waves: past it only the per-wave start-up
# grows, and the bound keeps a replayed plan's grid (max_splits_for) from growing with the length.
# A split count within NEAR_TIE_PCT percent of the best is as good: the fewest such wins. The
# cut's rounding to whole tiles moves the model by up to a tile per program; a real difference
# stays (1 x 128k at 8 KV heads and 396 resident: 49 splits of 2688 tokens are 2.3% faster in one
# wave than 48 of 2752, so a 3% window would throw that away).
WAVES_MAX = tl.constexpr(4)
NEAR_TIE_PCT = tl.constexpr(1)


def split_class(n: int) -> str:
    """How Triton specialises an integer argument (3.6 and 3.9 alike): ``1`` is folded in as a
    constant, a multiple of 16 is marked divisible, anything else is plain. A kernel compiled
    for one class may use other registers than one compiled for another."""
    if n == 1:
        return "1"
    return "D" if n % 16 == 0 else ""


def merge_tokens(group: int, kv_bytes: int) -> int:
    """One split's partial output in tokens of KV traffic: ``group`` rows of ``head_dim`` fp32
    written by stage 1 and read by stage 2, against ``2 x head_dim x kv_bytes`` per token."""
    return max(1, 4 * group // max(1, kv_bytes))


def wave_splits(
    programs: int,
    max_len: int,
    capacity: int,
    *,
    block_n: int,
    min_tokens: int,
    max_splits: int,
    merge: int = 0,
) -> int:
    """The split count with the least modelled time for ``programs`` programs per split
    (batch x KV heads) over requests of ``max_len`` tokens, ``capacity`` programs resident at
    once (see the comment above WAVES_MAX). Splits are ``cdiv(max_len, s)`` rounded up to
    ``block_n``, at least ``min_tokens`` long unless there is one. The kernel's
    ``_wave_split_len`` computes the same, in the same integer arithmetic.
    """
    best_score, scores = None, []
    max_len, capacity, programs = max(1, max_len), max(1, capacity), max(1, programs)
    cap = max(1, min(max_splits, WAVES_MAX.value * capacity // programs))
    for s in range(1, cap + 1):
        tokens = cdiv(cdiv(max_len, s), block_n) * block_n
        if s > 1 and tokens < min_tokens:
            break  # tokens only shrink as s grows
        waves = cdiv(programs * s, capacity)
        score = waves * (tokens + block_n) * capacity + s * programs * merge
        scores.append(score)
        best_score = score if best_score is None else min(best_score, score)
    assert best_score is not None
    for s, score in enumerate(scores, 1):
        if score * 100 <= best_score * (100 + NEAR_TIE_PCT.value):
            return s
    raise AssertionError("unreachable: the best score is within its own window")


def plan_splits(
    batch: int,
    kv_heads: int,
    max_len: int,
    total_tokens: int | None = None,
    *,
    config: DecodeConfig = DEFAULT_CONFIG,
    sms: int | None = None,
    resident_per_sm: int | None = None,
    merge: int = 0,
) -> tuple[int, int]:
    """``(num_splits, split_len)``: the grid's split count and the planned tokens per split.

    A batch of (near) equal lengths is cut by :func:`wave_splits`: whole waves of resident
    programs (``resident_per_sm`` x ``sms``; the compiled kernel's figure, which
    :class:`DecodePlan` finds; ``config.programs_per_sm`` when not given), since a last wave that
    is only partly full runs at a fraction of the bandwidth. A batch of unequal requests
    (``batch x max_len > 1.5 x total_tokens``) gets its split length from the total work
    (``total_tokens * kv_heads`` token-heads) over ``programs_per_sm_varlen * sms`` programs,
    so it is cut into pieces of about equal work rather than into an equal number of pieces.
    Splits are never shorter than ``min_tokens_per_split`` (shorter ones cost more in partial
    outputs than they gain). The kernel then cuts each request into ``ceil(len / split_len)``
    equal parts (at most ``num_splits``), so every token is covered whatever the lengths are at
    run time; a split past a request's end writes ``lse = -inf`` and is ignored by the merge, so
    short requests give no NaN.
    """
    sms = sms if sms is not None else sm_count()
    pps = resident_per_sm if resident_per_sm is not None else config.programs_per_sm
    return _plan(batch, kv_heads, max_len, total_tokens, config, sms, max(1, pps * sms), merge)


@functools.lru_cache(maxsize=512)
def _plan(
    batch: int,
    kv_heads: int,
    max_len: int,
    total_tokens: int | None,
    config: DecodeConfig,
    sms: int,
    capacity: int | None = None,
    merge: int = 0,
) -> tuple[int, int]:
    """:func:`plan_splits` proper, memoised: it runs on every decode step, and a benchmark (or a
    server at a steady batch) asks the same question each time. ``capacity``: programs resident
    at once (``config.programs_per_sm * sms`` when None)."""
    max_len = max(1, max_len)
    total = total_tokens if total_tokens is not None else batch * max_len
    varlen = batch * max_len > 1.5 * max(1, total)
    if not varlen:
        cap = capacity if capacity is not None else config.programs_per_sm * sms
        s = wave_splits(
            max(1, batch) * kv_heads,
            max_len,
            max(1, cap),
            block_n=config.block_n,
            min_tokens=config.min_tokens_per_split,
            max_splits=config.max_splits,
            merge=merge,
        )
        return s, cdiv(cdiv(max_len, s), config.block_n) * config.block_n
    target = max(1, config.programs_per_sm_varlen * sms)
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
    resident_per_sm: int | None = None,
) -> int:
    """Split count for ``batch`` requests of ``max_len`` tokens (see :func:`plan_splits`)."""
    return plan_splits(
        batch, kv_heads, max_len, config=config, sms=sms, resident_per_sm=resident_per_sm
    )[0]


@triton.jit
def _tile_pages(pt_row, offs_n, end, PAGE: tl.constexpr):
    """Page index of each token of a tile (int32); tokens at or past ``end`` read nothing.

    Their indices are never used (the K/V loads are masked the same way), but the prefetch asks
    for the tile after a split's last one, whose entries can lie past the end of the page table
    for the last request: the mask keeps every page-table read in bounds.
    """
    return tl.load(pt_row + offs_n // PAGE, mask=offs_n < end, other=0)


@triton.jit
def _wave_split_len(
    longest,
    programs,
    capacity,
    BLOCK_N: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MERGE: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """:func:`wave_splits` for every split count at once (``SEARCH`` lanes, a power of two at
    least as large as the host's bound), then the split length of the one it picks."""
    s = tl.arange(0, SEARCH) + 1
    cap = tl.maximum(tl.minimum(WAVES_MAX * capacity // programs, MAX_SPLITS), 1)
    tokens = tl.cdiv(tl.cdiv(longest, s), BLOCK_N) * BLOCK_N
    ok = (s <= cap) & ((s == 1) | (tokens >= MIN_SPLIT))
    waves = tl.cdiv(programs * s, capacity)
    score = (
        waves.to(tl.int64) * (tokens + BLOCK_N).to(tl.int64) * capacity
        + (s * programs).to(tl.int64) * MERGE
    )
    # 2^56 x 101 still fits an int64; real scores are far below 2^56.
    score = tl.where(ok, score, 1 << 56)
    best = tl.min(score, 0)
    near = ok & (score * 100 <= best * (100 + NEAR_TIE_PCT))
    n = tl.min(tl.where(near, s, SEARCH + 1), 0)
    return tl.cdiv(tl.cdiv(longest, n), BLOCK_N) * BLOCK_N


@triton.jit
def _device_split_len(
    LENS,
    capacity,
    TARGET_VARLEN: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MERGE: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """:func:`plan_splits`'s split length, computed by every program from the lengths in memory.

    A plan that is replayed (a CUDA graph) while the lengths change cannot carry a split length
    worked out on the host for one set of lengths; reading the batch's lengths (a few hundred
    bytes, from L2 after the first program) gives each replay the balance of its own lengths.
    The same integer arithmetic as the host's, so an eager plan and its replays cut alike.
    """
    batch = tl.num_programs(0)
    kv_heads = tl.num_programs(1)
    # One load of the whole batch (BLOCK_B >= batch): a loop here, ahead of the KV loop, kept
    # Triton from software-pipelining the KV loop (no cp.async in the PTX).
    offs = tl.arange(0, BLOCK_B)
    n = tl.load(LENS + offs, mask=offs < batch, other=0)
    total = tl.maximum(tl.sum(n.to(tl.int64), 0), 1)
    longest = tl.maximum(tl.max(n, 0), 1)
    # batch * longest > 1.5 * total, in integers
    varlen = 2 * batch * longest.to(tl.int64) > 3 * total
    by_work = tl.maximum(tl.cdiv(total * kv_heads, TARGET_VARLEN), MIN_SPLIT)
    by_work = (tl.cdiv(by_work, BLOCK_N) * BLOCK_N).to(tl.int32)
    by_waves = _wave_split_len(
        longest, batch * kv_heads, capacity, BLOCK_N, MIN_SPLIT, MAX_SPLITS, MERGE, SEARCH
    )
    return tl.where(varlen, by_work, by_waves)


@triton.jit
def _piece(
    LENS,
    b,
    split,
    num_splits,
    split_len_hint,
    capacity,
    BLOCK_N: tl.constexpr,
    DEVICE_PLAN: tl.constexpr,
    TARGET_VARLEN: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MERGE: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """``(seq_len, start, end)`` of this program's piece of request ``b``.

    The request is cut into as many splits as its length needs at the split length (never more
    than the grid has), equal parts rounded up to whole blocks; a split past its end is empty.
    """
    seq_len = tl.load(LENS + b)
    if DEVICE_PLAN:
        hint = _device_split_len(
            LENS,
            capacity,
            TARGET_VARLEN,
            MIN_SPLIT,
            BLOCK_N,
            BLOCK_B,
            MAX_SPLITS,
            MERGE,
            SEARCH,
        )
    else:
        hint = split_len_hint
    n_here = tl.minimum(tl.maximum(tl.cdiv(seq_len, hint), 1), num_splits)
    split_len = tl.cdiv(tl.cdiv(seq_len, n_here), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    return seq_len, start, end


@triton.jit(do_not_specialize=["capacity"])
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
    IS_FP8: tl.constexpr,
    FP8_FP16: tl.constexpr,
    EVICT: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    DEVICE_PLAN: tl.constexpr = False,
    TARGET_VARLEN: tl.constexpr = 1,
    MIN_SPLIT: tl.constexpr = 256,
    BLOCK_B: tl.constexpr = 16,
    MAX_SPLITS: tl.constexpr = 256,
    MERGE: tl.constexpr = 0,
    SEARCH: tl.constexpr = 1, OPAQUE_HEADS: tl.constexpr = False, TAGGED: tl.constexpr = False,
):  # fmt: skip
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
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h < (_common.opaque_i32(GROUP, not UPCAST) if OPAQUE_HEADS else GROUP)
    heads = kvh * GROUP + offs_h
    # Partials are contiguous [B, Hq, num_splits, D] and [B, Hq, num_splits].
    row, tag = _common.rows(b * q_heads + heads, num_splits, split, LSEP, TAGGED, UPCAST)
    if start >= end:
        # An empty split (past the end of a short request, or beyond what a replayed plan's
        # lengths need) only says so: lse = -inf, which the merge reads as zero weight.
        _common.store(LSEP, row, float("-inf"), hmask, TAGGED, tag)
        return
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
    offs_t = tl.arange(0, BLOCK_N)
    if PREFETCH:
        page_next = _tile_pages(pt_row, start + offs_t, end, PAGE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_t
        nmask = offs_n < end
        if PREFETCH:
            # This tile's indices arrived during the previous tile; the next tile's load is
            # issued before this tile's K/V loads, so its latency hides under their traffic.
            page = page_next.to(tl.int64)
            page_next = _tile_pages(pt_row, offs_n + BLOCK_N, end, PAGE)
        else:
            page = _tile_pages(pt_row, offs_n, end, PAGE).to(tl.int64)
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
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    _common.store(OP, row[:, None] * HEAD_DIM + offs_d[None, :], out, hmask[:, None], TAGGED, tag)
    _common.store(LSEP, row, lse, hmask, TAGGED, tag)


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


@triton.jit(do_not_specialize=["capacity"])
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
):
    """Stage 1 for fp8 KV read as int16 pairs (K, V: the fp8 caches; strides in int16 units).

    Each pair holds dims (2j, 2j+1) of one token, so the head dim is processed as its even and odd
    halves: q.k = q_even.k_even + q_odd.k_odd, and P@V is computed for the even and the odd output
    dims separately. Every operand is 16-bit, so shared-memory reads are ldmatrix, as for bf16.
    """
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP
    HALF: tl.constexpr = HEAD_DIM // 2
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
    offs_j = tl.arange(0, HALF)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if start >= end:
        tl.store(LSEP + row, float("-inf"), mask=hmask)
        return
    # The caches arrive as fp8; their bytes are read as int16 pairs (two dims of one token).
    K = K.to(tl.pointer_type(tl.int16), bitcast=True)
    V = V.to(tl.pointer_type(tl.int16), bitcast=True)
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * offs_j[None, :]
    q_even = tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.float16)
    q_odd = tl.load(q_ptr + 1, mask=hmask[:, None], other=0.0).to(tl.float16)
    scale = qk_scale * tl.load(KS + kvh) * 256.0

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
            # This tile's indices arrived during the previous tile; the next tile's load is
            # issued before this tile's K/V loads, so its latency hides under their traffic.
            page = page_next.to(tl.int64)
            page_next = _tile_pages(pt_row, offs_n + BLOCK_N, end, PAGE)
        else:
            page = _tile_pages(pt_row, offs_n, end, PAGE).to(tl.int64)
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
        # An empty split wrote no partial output (only its -inf LSE): never read it.
        live = smask & (w > 0)
        part = tl.load(
            OP + (row0 + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=live[:, None],
            other=0.0,
        )
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


# The host side (DecodePlan, decode_attention, max_splits_for) is in decode_plan.py, which
# imports this module; its names stay importable from here, loaded on first use so that either
# module may be imported first. The imports at the top that only the host side used are dropped
# here rather than there: the lines above stay as they are, since recorded GPU profiles and the
# tests' snapshots point at the kernels by line.
del math, weakref, residency, interpreting, next_pow2, BoundKernel, MAX_BLOCKS_PER_SM, Residency

# For the same reason the fp8 default is set here, below those lines (default_config reads the
# name when called): the launch config above with stage 1 on decode_fp8's hardware e4m3x2 ->
# f16x2 conversion, which the H200 timed faster than the integer-op conversion on every shape,
# eager and graph-replayed, at the same accuracy (bench/NOTES-kernels.md). The integer-op
# config, which every GPU runs, stays as PAIRS_FP8_CONFIG; a plan on a GPU without the
# instruction runs that (decode_fp8.runnable_config).
# Both dtypes ask for the L2 evict-first hint on their copies (kernels/l2_hint.py): fp8 -4 us by
# do_bench at 1 x 64k on the H100, every shape -1 to -2.7 us replayed (sessions 20 and 21).
PAIRS_FP8_CONFIG = DEFAULT_FP8_CONFIG
DEFAULT_FP8_CONFIG = DecodeConfig(**{**vars(PAIRS_FP8_CONFIG), "fp8_compute": "cvt"})

_PLAN_NAMES = frozenset({"DecodePlan", "decode_attention", "max_splits_for"})


def __getattr__(name: str):
    if name in _PLAN_NAMES:
        from . import decode_plan

        return getattr(decode_plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
