"""fp8 stage 1 with K converted by Triton (``.to(tl.float16)`` after an fp8 load) and V as
``_decode_stage1_fp8_cvt`` converts it; the same arguments as that kernel (strides in int16 units).
An experiment for bench/gpu_fp8_knative.py, not a library kernel."""

import triton
import triton.language as tl
from kdash.kernels._common import mma
from kdash.kernels.decode_attention import _piece, _tile_pages
from kdash.kernels.decode_fp8 import _fp8_pairs_cvt


@triton.jit(do_not_specialize=["capacity"])
def _cvt_knative(
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
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h < GROUP
    heads = kvh * GROUP + offs_h
    row = (b * q_heads + heads).to(tl.int64) * num_splits + split
    if start >= end:
        tl.store(LSEP + row, float("-inf"), mask=hmask)
        return
    V = V.to(tl.pointer_type(tl.int16), bitcast=True)
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None],
        other=0.0,
    ).to(tl.float16)
    scale = qk_scale * tl.load(KS + kvh)
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
            page = page_next.to(tl.int64)
            page_next = _tile_pages(pt_row, offs_n + BLOCK_N, end, PAGE)
        else:
            page = _tile_pages(pt_row, offs_n, end, PAGE).to(tl.int64)
        slot = offs_n % PAGE
        k8 = tl.load(
            K
            + 2 * (page[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh)
            + offs_d[None, :],
            mask=nmask[:, None],
            other=0.0,
        )
        vw = tl.load(
            V
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vs
            + kvh * stride_vh
            + offs_j[None, :],
            mask=nmask[:, None],
            other=0,
        )
        qk = mma(q, tl.trans(k8.to(tl.float16)), UPCAST)
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
    vscale = tl.load(VS + kvh)
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    o_ptr = OP + row[:, None] * HEAD_DIM + 2 * offs_j[None, :]
    tl.store(o_ptr, acc_e * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(o_ptr + 1, acc_o * vscale / l_safe[:, None], mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)
