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
    """Launch parameters of stage 1 (defaults picked on an H200, see bench/NOTES-kernels.md)."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: int = 4  # target number of stage-1 programs per SM when choosing splits
    min_tokens_per_split: int = 256
    max_splits: int = 256


DEFAULT_CONFIG = DecodeConfig()


def choose_num_splits(
    batch: int,
    kv_heads: int,
    max_len: int,
    *,
    config: DecodeConfig = DEFAULT_CONFIG,
    sms: int | None = None,
) -> int:
    """Splits per request so that ``batch * kv_heads * splits`` fills the GPU a few times over.

    Never more splits than the longest request has blocks of ``min_tokens_per_split``: beyond that
    the partial outputs cost more than the parallelism gains. A request shorter than the split
    count simply leaves some of its splits empty; those write ``lse = -inf`` and are ignored by the
    merge, so they cannot produce NaN.
    """
    sms = sms if sms is not None else sm_count()
    base = max(1, batch * kv_heads)
    want = cdiv(config.programs_per_sm * sms, base)
    useful = cdiv(max(1, max_len), config.min_tokens_per_split)
    return int(max(1, min(want, useful, config.max_splits)))


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
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IS_FP8: tl.constexpr,
    UPCAST: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(LENS + b)
    # Split length rounded to whole blocks so that only the last block of a split is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
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
        )
        v = tl.load(
            V
            + page[:, None] * stride_vp
            + slot[:, None] * stride_vs
            + kvh * stride_vh
            + offs_d[None, :],
            mask=nmask[:, None],
            other=0.0,
        )
        if IS_FP8:
            k = k.to(tl.bfloat16)
            v = v.to(tl.bfloat16)
        qk = mma(q, tl.trans(k), UPCAST) * scale  # log2 domain
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(to_bf16(p, UPCAST), v, UPCAST)
        m_i = m_new

    if IS_FP8:
        acc = acc * tl.load(VS + kvh)
    # An empty split (request shorter than the split count) keeps m_i = -inf, l_i = 0: it writes
    # lse = -inf and o = 0, and the merge gives it zero weight.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(
        OP + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :],
        out,
        mask=hmask[:, None],
    )
    tl.store(LSEP + b * stride_lb + heads * stride_lh + split, lse, mask=hmask)


@triton.jit
def _decode_stage2(
    OP,
    LSEP,
    Out,
    LSE,
    num_splits,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, HEAD_DIM)
    smask = offs_s < num_splits
    lse = tl.load(LSEP + b * stride_lb + h * stride_lh + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m_safe)
    w = tl.where(smask, w, 0.0)
    denom = tl.sum(w, 0)
    part = tl.load(
        OP + b * stride_ob + h * stride_oh + offs_s[:, None] * stride_os + offs_d[None, :],
        mask=smask[:, None],
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    denom_safe = tl.where(denom > 0, denom, 1.0)
    out = out / denom_safe
    tl.store(Out + b * stride_outb + h * stride_outh + offs_d, to_bf16(out, EMULATE_RTNE))
    # Natural-log LSE, for callers that merge further (e.g. a prefix + suffix split).
    lse_out = tl.where(
        denom > 0, (m_safe + tl.log2(denom_safe)) * 0.6931471805599453, float("-inf")
    )
    tl.store(LSE + b * tl.num_programs(1) + h, lse_out)  # LSE is a contiguous [B, Hq] tensor


def _as_scale(
    scale: torch.Tensor | float | None, kv_heads: int, device: torch.device
) -> torch.Tensor:
    if scale is None:
        raise ValueError("fp8 KV needs k_scale and v_scale (per KV head, or one float)")
    if isinstance(scale, torch.Tensor):
        s = scale.to(device=device, dtype=torch.float32).reshape(-1)
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
    config: DecodeConfig = DEFAULT_CONFIG,
    out: torch.Tensor | None = None,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention of one new query token per request over its paged KV cache.

    ``num_splits`` fixes the split count (needed inside a CUDA graph, where reading lengths back
    to the host is not allowed); otherwise it is chosen by :func:`choose_num_splits` from
    ``max_seq_len`` (or ``seq_lens.max()``, which synchronises). Returns ``[B, Hq, D]`` in q's
    dtype, and the natural-log LSE ``[B, Hq]`` fp32 when ``return_lse``.
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
    if is_fp8:
        ks = _as_scale(k_scale, kv_heads, dev)
        vs = _as_scale(v_scale, kv_heads, dev)
    else:
        ks = vs = torch.ones(1, device=dev, dtype=torch.float32)
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if num_splits is None:
        if max_seq_len is None:
            max_seq_len = int(seq_lens.max().item()) if batch else 0
        num_splits = choose_num_splits(batch, kv_heads, max_seq_len, config=config)
    if out is None:
        out = torch.empty_like(q)
    o_part = torch.empty((batch, q_heads, num_splits, head_dim), device=dev, dtype=torch.float32)
    lse_part = torch.empty((batch, q_heads, num_splits), device=dev, dtype=torch.float32)
    lse = torch.empty((batch, q_heads), device=dev, dtype=torch.float32)
    if batch == 0:
        return (out, lse) if return_lse else out
    upcast = interpreting(q)
    _decode_stage1[(batch, kv_heads, num_splits)](
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
        num_splits,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=config.block_n,
        PAGE=page_size,
        IS_FP8=is_fp8,
        UPCAST=upcast,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    _decode_stage2[(batch, q_heads)](
        o_part,
        lse_part,
        out,
        lse,
        num_splits,
        o_part.stride(0),
        o_part.stride(1),
        o_part.stride(2),
        lse_part.stride(0),
        lse_part.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_S=next_pow2(num_splits),
        EMULATE_RTNE=upcast,
        num_warps=4 if head_dim >= 128 else 2,
    )
    return (out, lse) if return_lse else out
