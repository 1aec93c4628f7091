"""Stage 1 with a shared tail: the programs of a (request, KV head) finish together.

Stamped on the H200 (bench/gpu_decode_timeline.py, bench/NOTES-kernels.md session 13), the
programs of one decode step start within 0.2 us of each other but end over ~10% of the step: at
1 x 64k (bf16, 512 programs, 4 an SM) the median program ends at 62.7 us and the last at 68.2,
at 8 x 16k and 1 x 128k 127 / 140 and 134 / 146. Equal work, unequal pace: a program on an SM
with three programs outruns one on an SM with four, and the youngest program on an SM runs
slowest. The merge waits for the last, and for the last ~5-12 us the memory system is fed by
ever fewer programs.

Here the tail of each request is not cut in advance. Each split first reads its share of the
first ``100 - POOL_PCT`` percent of the request's tiles (cut as stage 1 cuts the whole request),
then takes chunks of ``CHUNK`` tiles off a pool holding the rest, through an int32 counter per
(request, KV head): ``atomic_add`` hands out chunk numbers, and a program stops at its first
number past the pool. Attention over a set of tokens does not depend on their order, so a chunk
joins the taker's running softmax state and the merge is unchanged (a split's partial covers
its share and whatever it took). Every program of the group that has a share takes exactly one
number past the pool, so the group's numbers per launch are known in advance; the program that
draws the last one puts the counter back to 0 for the next launch (a CUDA graph's replays
included). Numbers are only work, never data: relaxed atomics.

Two kernels, bf16 KV and fp8 KV read as int16 pairs with the hardware conversion (decode_fp8's
layout); their tiles are the same arithmetic as ``_decode_stage1`` and
``_decode_stage1_fp8_cvt`` (whose source lines recorded H200 profiles point at, so they stay as
they are).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import mma, to_bf16
from .decode_attention import _device_split_len, _tile_pages
from .decode_fp8 import _fp8_pairs_cvt


@triton.jit
def _steal_plan(
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
    POOL_PCT: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """``(seq_len, n_here, start, end, pool_start, chunks)`` for this program: how many splits
    of the request have work (``_piece``'s count), this split's share ``[start, end)`` of the
    tokens before the pool, where the pool starts and how many chunks it holds."""
    seq_len = tl.load(LENS + b)
    if DEVICE_PLAN:
        hint = _device_split_len(
            LENS, capacity, TARGET_VARLEN, MIN_SPLIT, BLOCK_N, BLOCK_B, MAX_SPLITS, MERGE, SEARCH
        )
    else:
        hint = split_len_hint
    n_here = tl.minimum(tl.maximum(tl.cdiv(seq_len, hint), 1), num_splits)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    pool_tiles = tiles * POOL_PCT // 100
    pool_start = tl.minimum((tiles - pool_tiles) * BLOCK_N, seq_len)
    share = tl.cdiv(tl.cdiv(pool_start, n_here), BLOCK_N) * BLOCK_N
    start = tl.minimum(split * share, pool_start)
    end = tl.minimum(start + share, pool_start)
    chunks = tl.cdiv(pool_tiles, CHUNK)
    return seq_len, n_here, start, end, pool_start, chunks


@triton.jit
def _take(CTR, n_here, chunks, pool_start, seq_len, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """The next chunk of the pool ``(lo, hi, more)``; the last number of a launch resets the
    counter (the group draws ``chunks + n_here`` numbers a launch: every chunk, and one past the
    pool for each program with a share)."""
    c = tl.atomic_add(CTR, 1, sem="relaxed", scope="gpu")
    if c == chunks + n_here - 1:
        tl.atomic_xchg(CTR, 0, sem="relaxed", scope="gpu")
    lo = pool_start + c * (CHUNK * BLOCK_N)
    hi = tl.minimum(lo + CHUNK * BLOCK_N, seq_len)
    return lo, hi, c < chunks


@triton.jit(do_not_specialize=["capacity"])
def _decode_stage1_steal(
    Q,
    K,
    V,
    PT,
    LENS,
    KS,
    VS,
    OP,
    LSEP,
    CTR,
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
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr = False,
    DEVICE_PLAN: tl.constexpr = False,
    TARGET_VARLEN: tl.constexpr = 1,
    MIN_SPLIT: tl.constexpr = 256,
    BLOCK_B: tl.constexpr = 16,
    MAX_SPLITS: tl.constexpr = 256,
    MERGE: tl.constexpr = 0,
    SEARCH: tl.constexpr = 1,
    POOL_PCT: tl.constexpr = 10,
    CHUNK: tl.constexpr = 1,
):
    """bf16 KV: ``_decode_stage1``'s arguments and outputs, plus ``CTR`` (int32 per
    (request, KV head), zero before the first launch)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP
    seq_len, n_here, start, end, pool_start, chunks = _steal_plan(
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
        POOL_PCT,
        CHUNK,
    )
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if split >= n_here:
        tl.store(LSEP + row, float("-inf"), mask=hmask)
        return
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    ctr = CTR + b * tl.num_programs(1) + kvh
    offs_t = tl.arange(0, BLOCK_N)
    lo = start
    hi = end
    more = seq_len >= 0  # a tensor (the loop carries it); the first pass always runs
    while more:
        if PREFETCH:
            page_next = _tile_pages(pt_row, lo + offs_t, hi, PAGE)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_t
            nmask = offs_n < hi
            if PREFETCH:
                page = page_next.to(tl.int64)
                page_next = _tile_pages(pt_row, offs_n + BLOCK_N, hi, PAGE)
            else:
                page = _tile_pages(pt_row, offs_n, hi, PAGE).to(tl.int64)
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
            qk = mma(q, tl.trans(k), UPCAST) * qk_scale  # log2 domain
            qk = tl.where(nmask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + mma(to_bf16(p, UPCAST), v, UPCAST)
            m_i = m_new
        lo, hi, more = _take(ctr, n_here, chunks, pool_start, seq_len, BLOCK_N, CHUNK)

    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)


@triton.jit(do_not_specialize=["capacity"])
def _decode_stage1_cvt_steal(
    Q,
    K,
    V,
    PT,
    LENS,
    KS,
    VS,
    OP,
    LSEP,
    CTR,
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
    POOL_PCT: tl.constexpr = 10,
    CHUNK: tl.constexpr = 1,
):
    """fp8 KV as int16 pairs: ``_decode_stage1_fp8_cvt``'s arguments and outputs (strides in
    int16 units), plus ``CTR``."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP
    HALF: tl.constexpr = HEAD_DIM // 2
    seq_len, n_here, start, end, pool_start, chunks = _steal_plan(
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
        POOL_PCT,
        CHUNK,
    )
    offs_h = tl.arange(0, BLOCK_H)
    offs_j = tl.arange(0, HALF)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if split >= n_here:
        tl.store(LSEP + row, float("-inf"), mask=hmask)
        return
    K = K.to(tl.pointer_type(tl.int16), bitcast=True)
    V = V.to(tl.pointer_type(tl.int16), bitcast=True)
    q_ptr = Q + b * stride_qb + heads[:, None] * stride_qh + 2 * offs_j[None, :]
    q_even = tl.load(q_ptr, mask=hmask[:, None], other=0.0).to(tl.float16)
    q_odd = tl.load(q_ptr + 1, mask=hmask[:, None], other=0.0).to(tl.float16)
    scale = qk_scale * tl.load(KS + kvh)
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc_e = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    acc_o = tl.zeros([BLOCK_H, HALF], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    ctr = CTR + b * tl.num_programs(1) + kvh
    offs_t = tl.arange(0, BLOCK_N)
    lo = start
    hi = end
    more = seq_len >= 0  # a tensor (the loop carries it); the first pass always runs
    while more:
        if PREFETCH:
            page_next = _tile_pages(pt_row, lo + offs_t, hi, PAGE)
        for n0 in range(lo, hi, BLOCK_N):
            offs_n = n0 + offs_t
            nmask = offs_n < hi
            if PREFETCH:
                page = page_next.to(tl.int64)
                page_next = _tile_pages(pt_row, offs_n + BLOCK_N, hi, PAGE)
            else:
                page = _tile_pages(pt_row, offs_n, hi, PAGE).to(tl.int64)
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
            k_even, k_odd = _fp8_pairs_cvt(kw, ASM)
            qk = mma(q_even, tl.trans(k_even), UPCAST) + mma(q_odd, tl.trans(k_odd), UPCAST)
            qk = tl.where(nmask[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p16 = p.to(tl.float16)
            v_even, v_odd = _fp8_pairs_cvt(vw, ASM)
            acc_e = acc_e * alpha[:, None] + mma(p16, v_even, UPCAST)
            acc_o = acc_o * alpha[:, None] + mma(p16, v_odd, UPCAST)
            m_i = m_new
        lo, hi, more = _take(ctr, n_here, chunks, pool_start, seq_len, BLOCK_N, CHUNK)

    vscale = tl.load(VS + kvh)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    o_ptr = OP + row[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    tl.store(o_ptr, acc_e * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(o_ptr + 1, acc_o * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)
