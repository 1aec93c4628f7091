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

from . import residency
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
    min_tokens_per_split: int = 256
    max_splits: int = 256
    fp8_compute: str = "pairs_asm"
    evict_first: bool = False  # streaming hint on the K/V loads (they are read once)
    # Software-pipeline the page-table reads: each tile's page indices are loaded one iteration
    # ahead, so the K/V address math no longer waits on a just-issued index load (PC sampling on
    # the H200 put 41.5% of stage 1's samples, 98% long-scoreboard, on that wait at num_stages=2).
    # On: run 4's H200 sweep picked it for bf16 and fp8 alike (``--sweep decode`` times both).
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
    SEARCH: tl.constexpr = 1,
):
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
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    # Partials are contiguous [B, Hq, num_splits, D] and [B, Hq, num_splits].
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if start >= end:
        # An empty split (past the end of a short request, or beyond what a replayed plan's
        # lengths need) only says so: lse = -inf, which the merge reads as zero weight.
        tl.store(LSEP + row, float("-inf"), mask=hmask)
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


# Float scales become [Hkv] tensors once, not on every call: a torch.full per decode step is an
# allocation plus a fill kernel, both inside a benchmark's timed region. Bounded; keyed by value.
_SCALE_CACHE: dict[tuple[float, int, torch.device], torch.Tensor] = {}


def _as_scale(
    scale: torch.Tensor | float | None, kv_heads: int, device: torch.device
) -> torch.Tensor:
    if scale is None:
        raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
    if isinstance(scale, torch.Tensor):
        if (
            scale.dim() == 1
            and scale.dtype == torch.float32
            and scale.shape[0] == kv_heads
            and scale.device == device
            and scale.is_contiguous()
        ):
            return scale  # the usual case, used as it is: no reshape, no copy
        s = scale.reshape(-1)
        if s.dtype != torch.float32 or s.device != device:
            s = s.to(device=device, dtype=torch.float32)
        if s.numel() == 1:
            s = s.expand(kv_heads)
        if s.numel() != kv_heads:
            raise ValueError(f"scale has {s.numel()} entries, expected 1 or {kv_heads}")
        return s.contiguous()  # the kernels index the scales as a dense [Hkv] array
    key = (float(scale), kv_heads, device)
    s = _SCALE_CACHE.get(key)
    if s is None:
        s = torch.full((kv_heads,), float(scale), device=device, dtype=torch.float32)
        # Made during CUDA-graph capture, the fill would only run at replay: never keep that one.
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            if len(_SCALE_CACHE) >= 64:
                _SCALE_CACHE.clear()
            _SCALE_CACHE[key] = s
    return s


def max_splits_for(
    kv_heads: int,
    max_seq_len: int,
    *,
    config: DecodeConfig = DEFAULT_CONFIG,
    sms: int | None = None,
    resident_per_sm: int | None = None,
) -> int:
    """The most splits the device-side cut gives any request of up to ``max_seq_len`` tokens.

    Whatever the other lengths are, a request's split length is at least ``min_tokens_per_split``
    and the wave model picks a count whose splits are that long (a count whose rounding leaves a
    split empty never wins: one fewer gives the same splits in no more waves), so no request needs
    more than ``ceil(max_seq_len / min_tokens_per_split)``. The wave model also stops at
    ``WAVES_MAX`` waves of ``resident_per_sm x sms`` programs (at least ``kv_heads`` a split), and
    a batch of unequal lengths gives a request at most ``ceil(target / kv_heads) + 1`` splits
    (its split length is at least its own ``len * kv_heads / target``). A plan for lengths
    unknown at plan time (a CUDA graph replayed as requests grow) sizes its grid by this;
    programs past a request's cut return at once.
    """
    sms = sms if sms is not None else sm_count()
    pps = resident_per_sm if resident_per_sm is not None else config.programs_per_sm
    by_len = cdiv(max(1, max_seq_len), config.min_tokens_per_split)
    by_work = cdiv(max(1, config.programs_per_sm_varlen * sms), max(1, kv_heads)) + 1
    by_waves = WAVES_MAX.value * max(1, pps * sms) // max(1, kv_heads)
    return max(1, min(by_len, max(by_work, by_waves), config.max_splits))


@functools.lru_cache(maxsize=512)
def _stage2_meta(splits: int, head_dim: int) -> tuple[int, int]:
    """``(BLOCK_S, num_warps)`` of the merge: all splits in one chunk, and the [BLOCK_S, D] fp32
    tile of partials at <= 64 registers a thread."""
    return min(256, next_pow2(splits)), max(1, min(8, next_pow2(splits) * head_dim // 2048))


_NO_SCALE = object()


def _aligned(*ts: torch.Tensor) -> bool:
    """Every pointer on 16 bytes, as the compiled kernels assume (a misaligned view re-JITs)."""
    bits = 0
    for t in ts:
        bits |= t.data_ptr()
    return not bits & 15


class DecodePlan:
    """Decode attention for one batch composition: planned once, then run per layer and step.

    As FlashInfer's decode wrappers split the work: everything that depends only on the batch
    (its size, the head layout, the page size, the longest length it may reach) is worked out
    here once: the split count and grid, the compile-time parameters, the output and scratch
    buffers. :meth:`run` then only launches the two kernels on the caller's ``q`` and caches: no
    allocation, no host synchronisation, no per-argument inspection, so it costs a few
    microseconds of host time and can be captured in a CUDA graph.

    ``page_table`` (``[B, max_pages]`` int32) and ``seq_lens`` (``[B]`` int32) are kept by
    reference and read on the GPU at every run: a caller (or a CUDA graph replay) may rewrite them
    in place between runs, within the plan's limits: the same batch size, no length above
    ``max_seq_len``, no page past the table's width. Each request's cut into splits is computed on
    the GPU from the lengths in memory at that run (see :func:`_device_split_len`), so a replay
    is balanced for its own lengths. With ``total_tokens`` the grid is sized for lengths like the
    ones given (the eager case); without it, for any lengths up to ``max_seq_len``
    (:func:`max_splits_for`; the replay case). ``num_splits`` overrides either.

    Waves need the residency of the stage-1 kernel that will run (programs per SM, from its
    registers and shared memory; :mod:`kdash.kernels.residency`), which only the compiled kernel
    knows. The plan finds it before it sizes anything: from a per-process cache keyed by what
    decides the compiled kernel (:meth:`variant_key`), else by compiling that kernel here with
    Triton's ``warmup`` (no launch; the first run then finds it in Triton's cache). Compiling at
    plan time rather than re-planning after a first run is deliberate: a re-plan could need a
    larger workspace (an allocation in :meth:`run`) and a kernel compiled, and its module
    loaded, while a CUDA graph may be capturing. The grid, the buffers and the kernel's
    ``capacity`` argument (the device-side search's wave size, not specialised on, so it never
    selects another compiled kernel) are therefore fixed before the first run. In the CPU
    interpreter, during a capture, or if compiling fails (``residency_source`` says why), the
    config's ``programs_per_sm`` stands in. ``capacity``, ``resident_per_sm`` and ``residency``
    report what was used.

    :meth:`run` writes into the plan's output buffer (``out`` at plan time, else one allocated
    here) and returns it: the next run overwrites it. fp8 KV takes ``k_scale``/``v_scale`` here
    (one float, or ``[Hkv]``) or per run (``[Hkv]`` fp32 tensors, e.g. per layer).
    """

    def __init__(
        self,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        *,
        max_seq_len: int,
        total_tokens: int | None = None,
        kv_dtype: torch.dtype = torch.bfloat16,
        q_dtype: torch.dtype = torch.bfloat16,
        sm_scale: float | None = None,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        num_splits: int | None = None,
        config: DecodeConfig | None = None,
        out: torch.Tensor | None = None,
    ) -> None:
        if seq_lens.dim() != 1 or page_table.dim() != 2:
            raise ValueError("seq_lens must be [B] and page_table [B, max_pages]")
        batch = seq_lens.shape[0]
        if page_table.shape[0] != batch:
            raise ValueError(f"page_table has {page_table.shape[0]} rows for {batch} requests")
        if seq_lens.dtype != torch.int32 or page_table.dtype != torch.int32:
            raise ValueError("seq_lens and page_table must be int32")
        if page_table.stride(1) != 1 or not seq_lens.is_contiguous():
            raise ValueError("page_table rows and seq_lens must be contiguous")
        if num_kv_heads < 1 or num_q_heads % num_kv_heads:
            raise ValueError(f"query heads {num_q_heads} not a multiple of KV heads {num_kv_heads}")
        if head_dim < 16 or head_dim & (head_dim - 1):
            raise ValueError("head_dim must be a power of two (64 and 128 are supported)")
        dev = seq_lens.device
        self.device = dev
        self.config = config = config or default_config(kv_dtype)
        self.batch, self.q_heads, self.kv_heads = batch, num_q_heads, num_kv_heads
        self.head_dim, self.page_size = head_dim, page_size
        self.kv_dtype, self.q_dtype = kv_dtype, q_dtype
        self.is_fp8 = kv_dtype in FP8_DTYPES
        self.pairs = self.is_fp8 and config.fp8_compute in ("pairs", "pairs_asm")
        if self.pairs and head_dim % 32:
            raise ValueError("fp8 pairs path needs head_dim a multiple of 32")
        self.upcast = interpreting(seq_lens)
        self.sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
        self.page_table, self.seq_lens = page_table, seq_lens
        self.max_seq_len = max(1, int(max_seq_len))
        sms = sm_count()
        group = num_q_heads // num_kv_heads
        meta: dict = dict(
            GROUP=group,
            BLOCK_H=max(16, next_pow2(group)),
            HEAD_DIM=head_dim,
            BLOCK_N=config.block_n,
            PAGE=page_size,
        )
        if self.pairs:
            self._kern1 = _decode_stage1_fp8_pairs
        else:
            self._kern1 = _decode_stage1
            meta.update(IS_FP8=self.is_fp8, FP8_FP16=config.fp8_compute != "bf16")
        meta.update(EVICT="evict_first" if config.evict_first else "", UPCAST=self.upcast)
        if self.pairs:
            meta["ASM"] = config.fp8_compute == "pairs_asm" and not self.upcast
        self._merge = merge_tokens(group, 1 if self.is_fp8 else 2)
        programs = max(1, batch * num_kv_heads)
        meta.update(
            PREFETCH=config.prefetch_pages,
            DEVICE_PLAN=batch <= MAX_DEVICE_PLAN_BATCH,
            TARGET_VARLEN=max(1, config.programs_per_sm_varlen * sms),
            MIN_SPLIT=config.min_tokens_per_split,
            BLOCK_B=min(MAX_DEVICE_PLAN_BATCH, max(16, next_pow2(batch))),
            MAX_SPLITS=config.max_splits,
            MERGE=self._merge,
            # Lanes of the device's split search: every count the wave model may pick for any
            # residency (at most MAX_BLOCKS_PER_SM an SM), so no residency needs a recompile.
            SEARCH=next_pow2(
                max(
                    1, min(config.max_splits, WAVES_MAX.value * MAX_BLOCKS_PER_SM * sms // programs)
                )
            ),
            num_warps=config.num_warps,
            num_stages=config.num_stages,
        )
        self._meta1 = meta
        self._sms = sms
        plan_args = (batch, num_kv_heads, self.max_seq_len, total_tokens, num_splits)
        splits, split_len = self._plan_waves(*plan_args)
        self.num_splits, self.split_len = splits, split_len
        if out is None:
            out = torch.empty(batch, num_q_heads, head_dim, device=dev, dtype=q_dtype)
        elif out.shape != (batch, num_q_heads, head_dim) or out.stride(2) != 1:
            raise ValueError("out must be [B, Hq, D] with a contiguous head dimension")
        self.out = out
        # One workspace: partial O [B, Hq, splits, D], partial LSE, final LSE.
        n_l = batch * num_q_heads * splits
        n_o = n_l * head_dim
        ws = torch.empty(n_o + n_l + batch * num_q_heads, device=dev, dtype=torch.float32)
        self.o_part, self.lse_part, lse = ws.split_with_sizes((n_o, n_l, batch * num_q_heads))
        self.lse = lse.view(batch, num_q_heads)
        self._ks = self._vs = seq_lens  # never read without fp8; any pointer does
        # What the scale tensors were made from: a run passing the same object (or none) uses them
        # as they are. _NO_SCALE until a scale is given, so an fp8 run without one is refused.
        self._ks_src: object = _NO_SCALE
        self._vs_src: object = _NO_SCALE
        self._scales_aligned = True
        if self.is_fp8 and k_scale is not None and v_scale is not None:
            self._ks, self._ks_src = _as_scale(k_scale, num_kv_heads, dev), k_scale
            self._vs, self._vs_src = _as_scale(v_scale, num_kv_heads, dev), v_scale
            self._scales_aligned = _aligned(self._ks, self._vs)
        self._grid1 = (batch, num_kv_heads, splits)
        self._q_stride: tuple | None = None
        self._q_shape: tuple | None = None
        self._cache_layout: tuple | None = None
        self._known: dict[int, weakref.ref] = {}
        self._s1: BoundKernel | None = None
        self._rest1: tuple = ()
        block_s, warps2 = _stage2_meta(splits, head_dim)
        self._s2 = BoundKernel(
            _decode_stage2,
            (batch, num_q_heads),
            dict(HEAD_DIM=head_dim, BLOCK_S=block_s, EMULATE_RTNE=self.upcast, num_warps=warps2),
        )
        self._args2 = (
            self.o_part,
            self.lse_part,
            out,
            lse,
            splits,
            out.stride(0),
            out.stride(1),
        )

    def _plan_waves(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        total_tokens: int | None,
        num_splits: int | None,
    ) -> tuple[int, int]:
        """The split plan at the stage-1 kernel's residency: the compiled kernel's (cached per
        variant, else compiled here), else the config's ``programs_per_sm``. A split count of
        another specialisation class is another kernel, so the figure is read again for the
        chosen count until it stops changing (there are 3 classes)."""
        per_sm = min(MAX_BLOCKS_PER_SM, max(1, self.config.programs_per_sm))
        self.residency_source = "config"
        self.residency: Residency | None = None
        plan_args = (batch, kv_heads, max_len, total_tokens, num_splits)
        splits, split_len = self._splits(*plan_args, per_sm)
        for _ in range(3):
            found = self._residency_of(splits, split_len)
            if found is None:
                break
            self.residency = found
            if found.per_sm == per_sm:
                break
            per_sm = found.per_sm
            splits, split_len = self._splits(*plan_args, per_sm)
        self.resident_per_sm = per_sm
        self.capacity = per_sm * self._sms  # stage-1 programs resident at once, as planned
        return splits, split_len

    def _splits(
        self,
        batch: int,
        kv_heads: int,
        max_len: int,
        total_tokens: int | None,
        num_splits: int | None,
        per_sm: int,
    ) -> tuple[int, int]:
        """``(grid splits, split-length hint)`` at ``per_sm`` resident programs an SM."""
        config, sms = self.config, self._sms
        capacity = per_sm * sms
        args = (batch, kv_heads, max_len, total_tokens or None, config, sms, capacity)
        _, split_len = _plan(*args, self._merge)
        if num_splits is not None:
            splits = max(1, int(num_splits))
        elif total_tokens is not None:
            splits = _plan(
                batch, kv_heads, max_len, total_tokens, config, sms, capacity, self._merge
            )[0]
        else:
            splits = max_splits_for(
                kv_heads, max_len, config=config, sms=sms, resident_per_sm=per_sm
            )
        return splits, split_len

    def variant_key(self, splits: int, split_len: int | None = None) -> tuple:
        """What decides the compiled stage-1 kernel of this plan at ``splits`` splits: the kernel,
        its compile-time values, the dtypes, the device and the specialisation of the integer
        arguments known at plan time (q and the caches are assumed contiguous, as the workload's
        are: a layout of other stride classes compiles another kernel, whose figure this plan
        does not see). The key of :mod:`kdash.kernels.residency`'s cache."""
        hint = split_len if split_len is not None else self.split_len
        return (
            self._kern1.__name__,
            tuple(sorted(self._meta1.items())),
            str(self.q_dtype),
            str(self.kv_dtype),
            str(self.device),
            split_class(splits),
            split_class(hint),
            split_class(self.page_table.stride(0)),
        )

    def _residency_of(self, splits: int, split_len: int) -> Residency | None:
        """The cached residency of the kernel for ``splits``, or that of the kernel compiled now.

        Plan time may compile (and wait): Triton's ``warmup`` compiles the very kernel the first
        run will launch (same arguments' specialisation: dtype placeholders stand for q and the
        caches, their pointers taken as 16-byte aligned as the fast path requires) and the first
        run then finds it in Triton's cache. None in the CPU interpreter (nothing is compiled:
        the config's figure stays) or when compiling here failed (the reason is kept in
        ``residency_source``; the first run compiles as before).
        """
        key = self.variant_key(splits, split_len)
        found = residency.lookup(key)
        if found is not None:
            self.residency_source = "cache"
            return found
        if self.upcast or self.device.type != "cuda":
            return None
        if torch.cuda.is_current_stream_capturing():
            return None  # no module is loaded inside a capture; the config's figure stays
        d = self.head_dim
        ks = (self.page_size * self.kv_heads * d, self.kv_heads * d, d)
        if self.pairs:
            ks = tuple(x // 2 for x in ks)
        scale_t = torch.float32 if self.is_fp8 else torch.int32
        args = (
            self.q_dtype,
            self.kv_dtype,
            self.kv_dtype,
            self.page_table,
            self.seq_lens,
            scale_t,
            scale_t,
            torch.float32,
            torch.float32,
            self.sm_scale * LOG2E,
            splits,
            split_len,
            self._sms,
            self.q_heads * d,
            d,
            *ks,
            *ks,
            self.page_table.stride(0),
        )
        grid = (self.batch, self.kv_heads, splits)
        try:
            with torch.cuda.device(self.device):
                compiled = self._kern1.warmup(*args, grid=grid, **self._meta1)
                found = residency.of_compiled(
                    compiled, self.config.num_warps, self.device.index or 0
                )
        except Exception as e:  # noqa: BLE001 - any failure leaves the config's figure, said why
            self.residency_source = f"config ({type(e).__name__}: {str(e)[:160]})"
            return None
        residency.record(key, found)
        self.residency_source = "compiled"
        return found

    def _bind(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Check a new layout of q and the caches and derive the stage-1 arguments from it."""
        if q.dim() != 3 or k_cache.dim() != 4 or v_cache.dim() != 4:
            raise ValueError("q must be [B, Hq, D] and the caches [pages, page_size, Hkv, D]")
        if tuple(q.shape) != (self.batch, self.q_heads, self.head_dim):
            raise ValueError(
                f"q is {tuple(q.shape)}; the plan is for "
                f"{(self.batch, self.q_heads, self.head_dim)}"
            )
        want = (self.page_size, self.kv_heads, self.head_dim)
        if tuple(k_cache.shape[1:]) != want or v_cache.shape != k_cache.shape:
            raise ValueError(f"K/V caches must be [pages, {want[0]}, {want[1]}, {want[2]}]")
        if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
            raise ValueError("the head dimension must be contiguous")
        if q.dtype != self.q_dtype:
            raise ValueError(f"q is {q.dtype}; the plan is for {self.q_dtype}")
        if k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype:
            raise ValueError(f"K/V caches must be {self.kv_dtype} (the plan's kv_dtype)")
        ks, vs = k_cache.stride()[:3], v_cache.stride()[:3]
        if self.pairs:
            if any(x % 2 for x in (*ks, *vs)):
                raise ValueError("fp8 pairs path needs even cache strides")
            ks, vs = tuple(x // 2 for x in ks), tuple(x // 2 for x in vs)  # int16 units
        self._rest1 = (
            self.o_part,
            self.lse_part,
            self.sm_scale * LOG2E,
            self.num_splits,
            self.split_len,
            self.capacity,
            q.stride(0),
            q.stride(1),
            *ks,
            *vs,
            self.page_table.stride(0),
        )
        self._s1 = BoundKernel(self._kern1, self._grid1, self._meta1)
        self._q_stride, self._q_shape = q.stride(), q.shape
        self._cache_layout = (k_cache.stride(), v_cache.stride())
        self._known.clear()

    def _admit(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        """Check caches not seen before against the bound layout (rebinding if it differs) and
        remember them; False when one is misaligned (that call takes Triton's own path)."""
        if (k_cache.stride(), v_cache.stride()) != self._cache_layout or (
            k_cache.dtype != self.kv_dtype or v_cache.dtype != self.kv_dtype
        ):
            self._bind(q, k_cache, v_cache)
        elif tuple(k_cache.shape[1:]) != (self.page_size, self.kv_heads, self.head_dim):
            self._bind(q, k_cache, v_cache)  # raises: same strides, other shape
        if not _aligned(k_cache, v_cache):
            return False
        if len(self._known) > 256:
            self._known.clear()
        for c in (k_cache, v_cache):
            self._known[id(c)] = weakref.ref(c)
        return True

    def _scale(self, which: str, scale) -> torch.Tensor:
        """The ``[Hkv]`` fp32 scale tensor for ``scale`` (None: the plan's), kept for reuse."""
        src = self._ks_src if which == "k" else self._vs_src
        if scale is None:
            if src is _NO_SCALE:
                raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
            return self._ks if which == "k" else self._vs
        t = _as_scale(scale, self.kv_heads, self.device)
        if which == "k":
            self._ks, self._ks_src = t, scale
        else:
            self._vs, self._vs_src = t, scale
        self._scales_aligned = _aligned(self._ks, self._vs)
        return t

    def run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        k_scale: torch.Tensor | float | None = None,
        v_scale: torch.Tensor | float | None = None,
        *,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[B, Hq, D]`` attention output of ``q`` over the caches (the plan's output buffer).

        With ``return_lse``, also the natural-log LSE ``[B, Hq]`` fp32 (the plan's buffer too).
        """
        # Host cost is the point of a plan: a handful of attribute reads per call. q is new at
        # every call (layout and alignment checked each time); a cache tensor is checked once
        # and then known by identity (a cache whose storage is swapped with set_() is not).
        if q.stride() != self._q_stride or q.shape != self._q_shape or q.dtype != self.q_dtype:
            self._bind(q, k_cache, v_cache)
        known = self._known
        fast = True
        for c in (k_cache, v_cache):
            r = known.get(id(c))
            if r is None or r() is not c:
                fast = self._admit(q, k_cache, v_cache) and fast
        if self.is_fp8:
            ks = self._ks if k_scale is self._ks_src else self._scale("k", k_scale)
            vs = self._vs if v_scale is self._vs_src else self._scale("v", v_scale)
            fast = fast and self._scales_aligned
        else:
            ks = vs = self._ks
        if self.batch:
            s1 = self._s1
            if fast and not q.data_ptr() & 15:
                s1(q, k_cache, v_cache, self.page_table, self.seq_lens, ks, vs, *self._rest1)
            else:  # a misaligned pointer: Triton's own path specialises for it
                s1.jit(q, k_cache, v_cache, self.page_table, self.seq_lens, ks, vs, *self._rest1)
            self._s2(*self._args2)
        return (self.out, self.lse) if return_lse else self.out


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
    """Attention of one new query token per request over its paged KV cache, in one call.

    A :class:`DecodePlan` made for this call and run once: for a step that runs many layers (or
    a CUDA graph), make the plan once and call :meth:`DecodePlan.run` instead. The grid needs the
    longest length (``max_seq_len``, else ``seq_lens.max()``, which synchronises with the GPU)
    and, for unequal requests, ``total_tokens`` (else ``batch * max_seq_len``). ``num_splits``
    overrides the split count; any lengths stay correct, only the balance changes. Returns
    ``[B, Hq, D]`` in q's dtype (``out`` if given), and the natural-log LSE ``[B, Hq]`` fp32 when
    ``return_lse``.
    """
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError("q must be [B, Hq, D] and the caches [pages, page_size, Hkv, D]")
    if (k_cache.dtype in FP8_DTYPES) != (v_cache.dtype in FP8_DTYPES):
        raise ValueError("K and V caches must both be fp8 or both not")
    if k_cache.dtype in FP8_DTYPES and (k_scale is None or v_scale is None):
        raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
    batch = q.shape[0]
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max().item()) if batch else 1
    plan = DecodePlan(
        page_table,
        seq_lens,
        q.shape[1],
        k_cache.shape[2],
        q.shape[2],
        k_cache.shape[1],
        max_seq_len=max_seq_len,
        total_tokens=total_tokens if total_tokens is not None else batch * max(1, max_seq_len),
        kv_dtype=k_cache.dtype,
        q_dtype=q.dtype,
        sm_scale=sm_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        num_splits=num_splits,
        config=config,
        out=out,
    )
    return plan.run(q, k_cache, v_cache, return_lse=return_lse)
