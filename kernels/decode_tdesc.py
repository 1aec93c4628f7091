"""Decode stage 1 with the paged cache read through TMA tensor descriptors in Triton itself.

The Gluon TMA kernels (:mod:`kdash.kernels.decode_gluon`) read the cache at the speed of TMA's
copies but run one warp a program, which issues the copies and does the math, and waits on its
copies (bench/NOTES-kernels.md, session 23). Here Triton's own pipeliner drives the copies:
each page of a tile is one ``desc.load`` of ``[PAGE, HEAD_DIM]`` rows of one KV head (the
cache seen as ``[token slots, kv_heads * HEAD_DIM]``), which Triton turns into TMA copies into a
ring of ``num_stages`` slots completing on mbarriers, with the program's warps (4) doing the
math. Pages are not contiguous, so a tile of ``BLOCK_N = P * PAGE`` tokens is ``P`` loads and
``P`` steps of the online softmax (no concatenation of tiles).

Same contract as :func:`kdash.kernels.decode_attention._decode_stage1` (grid, positional
arguments, partial outputs, the device-side split search), bf16 KV only, pages of ``PAGE``
token rows apart (a cache made by slicing a bigger one is not). Full tiles run unmasked; the
request's last part (fewer than ``BLOCK_N`` tokens) runs page by page with the tokens past the
end masked and their V rows zeroed (an unused slot may hold NaN). An experiment
(``bench/gpu_decode_tdesc.py``); plans do not take it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import mma, to_bf16
from .decode_attention import _piece

# the descriptors' row bound: the page table locates the pages
ROWS_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def _page_step(q, k, v, tmask, m_i, l_i, acc, scale, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """One page's online-softmax step (log2 domain) on ``k``, ``v`` ``[PAGE, D]``."""
    if MASKED:
        v = tl.where(tmask[:, None], v, 0.0)
    qk = mma(q, tl.trans(k), UPCAST) * scale
    if MASKED:
        qk = tl.where(tmask[None, :], qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(to_bf16(p, UPCAST), v, UPCAST)
    return m_new, l_i, acc


@triton.jit(do_not_specialize=["capacity"])
def _decode_stage1_tdesc(
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
    UPCAST: tl.constexpr,
    DEVICE_PLAN: tl.constexpr = False,
    TARGET_VARLEN: tl.constexpr = 1,
    MIN_SPLIT: tl.constexpr = 256,
    BLOCK_B: tl.constexpr = 16,
    MAX_SPLITS: tl.constexpr = 256,
    MERGE: tl.constexpr = 0,
    SEARCH: tl.constexpr = 1,
    PAGES_AHEAD: tl.constexpr = False,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    q_heads = tl.num_programs(1) * GROUP
    P: tl.constexpr = BLOCK_N // PAGE
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
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if start >= end:
        tl.store(LSEP + row, float("-inf"), mask=hmask)
        return
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    cols = tl.num_programs(1) * HEAD_DIM
    k_desc = tl.make_tensor_descriptor(K, [ROWS_MAX, cols], [stride_ks, 1], [PAGE, HEAD_DIM])
    v_desc = tl.make_tensor_descriptor(V, [ROWS_MAX, cols], [stride_vs, 1], [PAGE, HEAD_DIM])
    col = kvh * HEAD_DIM
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    offs_p = tl.arange(0, PAGE)
    # full tiles (full pages, with PAGES_AHEAD) run unmasked; the rest page by page, masked
    STEP: tl.constexpr = PAGE if PAGES_AHEAD else BLOCK_N
    full_end = start + (end - start) // STEP * STEP
    if PAGES_AHEAD:
        # the page of the next step loaded a step ahead (a loop-carried value, not a load in
        # the step itself, so the copies' coordinates are known a step early)
        pg = tl.load(pt_row + start // PAGE)
        for t0 in range(start, full_end, PAGE):
            nxt = tl.load(pt_row + tl.minimum(t0 + PAGE, end - 1) // PAGE)
            k = k_desc.load([pg * PAGE, col])
            v = v_desc.load([pg * PAGE, col])
            m_i, l_i, acc = _page_step(q, k, v, offs_p, m_i, l_i, acc, qk_scale, False, UPCAST)
            pg = nxt
    else:
        for n0 in range(start, full_end, BLOCK_N):
            for j in tl.static_range(P):
                pg = tl.load(pt_row + n0 // PAGE + j)
                k = k_desc.load([pg * PAGE, col])
                v = v_desc.load([pg * PAGE, col])
                m_i, l_i, acc = _page_step(q, k, v, offs_p, m_i, l_i, acc, qk_scale, False, UPCAST)
    for t0 in range(full_end, end, PAGE):
        pg = tl.load(pt_row + t0 // PAGE)
        k = k_desc.load([pg * PAGE, col])
        v = v_desc.load([pg * PAGE, col])
        tmask = t0 + offs_p < end
        m_i, l_i, acc = _page_step(q, k, v, tmask, m_i, l_i, acc, qk_scale, True, UPCAST)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)


# The plan's compile-time values this kernel takes (the rest of a plan's stage-1 meta is for
# the kernels it replaces).
META_KEYS = frozenset(
    {"GROUP", "BLOCK_H", "HEAD_DIM", "BLOCK_N", "PAGE", "UPCAST", "DEVICE_PLAN"}
    | {"TARGET_VARLEN", "MIN_SPLIT", "BLOCK_B", "MAX_SPLITS", "MERGE", "SEARCH"}
    | {"num_warps", "num_stages"}
)


def stage1_meta(plan_meta: dict, **over) -> dict:
    """This kernel's compile-time values from a two-launch plan's stage-1 meta."""
    return {**{k: v for k, v in plan_meta.items() if k in META_KEYS}, **over}
