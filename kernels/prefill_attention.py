"""Prefill/extend attention (Triton): causal flash attention over varlen requests + cached prefix.

Each request ``b`` has ``prefix_lens[b]`` tokens already in the paged KV cache and
``cu_seqlens[b+1] - cu_seqlens[b]`` new tokens whose Q, K and V arrive packed (``[T, H, D]``, the
layout a server's projections produce). New token ``i`` sits at absolute position
``prefix_lens[b] + i``; with ``causal`` it attends the whole prefix and new tokens ``<= i``,
without it the whole prefix and all new tokens. A plain prefill is the case ``prefix_lens == 0``.

Prefill is compute-bound (``4 * S^2 * D`` flops per head, halved by causality), so the kernel is a
classic flash-attention forward: a ``BLOCK_M`` tile of queries stays in registers while K/V tiles
stream through shared memory into ``tl.dot`` (wgmma on Hopper), with an online softmax in the
log2 domain. The loop over new tokens runs in two parts so that only the diagonal tiles pay for the
causal mask; the prefix loop gathers through the page table (the same indexing as decode). Query
heads map to KV heads by ``h // (Hq / Hkv)`` (GQA).

Writing the new K/V into the cache is the caller's job (:func:`kdash.kernels.kv_cache.write_kv`),
as in a server, where it happens once per layer before attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._common import cdiv, interpreting, mma, to_bf16

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class PrefillConfig:
    """Tile shape and pipelining; see :func:`default_config` for the choices per head dim."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


def default_config(head_dim: int, causal: bool, device: torch.device) -> PrefillConfig:
    """Hand-picked per head dim and causality: the best of a 5-config sweep on an H200 at S=4k
    (bench/NOTES-kernels.md); small tiles in the CPU interpreter."""
    if device.type != "cuda":
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=1)
    if head_dim <= 64:
        if causal:
            return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)
    if causal:
        return PrefillConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
    return PrefillConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)


@triton.jit
def _online_step(
    q, k, v, m_i, l_i, acc, qk_scale, mask, MASKED: tl.constexpr, UPCAST: tl.constexpr
):
    """One K/V tile of the online softmax; ``mask`` is only applied when ``MASKED``."""
    qk = mma(q, tl.trans(k), UPCAST) * qk_scale
    if MASKED:
        qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + mma(to_bf16(p, UPCAST), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _extend_kernel(
    Q,
    KN,
    VN,
    KC,
    VC,
    PT,
    PREFIX,
    CU,
    Out,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_kcp,
    stride_kcs,
    stride_kch,
    stride_vcp,
    stride_vcs,
    stride_vch,
    stride_ptb,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
):
    # Heaviest query tiles first (under causality the last tiles see the most keys).
    m_blk = tl.num_programs(0) - 1 - tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2)
    kvh = h // GROUP

    q_start = tl.load(CU + b)
    q_len = tl.load(CU + b + 1) - q_start
    if m_blk * BLOCK_M >= q_len:
        return
    prefix = tl.load(PREFIX + b)

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_nb = tl.arange(0, BLOCK_N)
    mmask = offs_m < q_len
    q = tl.load(
        Q + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mmask[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # 1) The cached prefix, gathered through the page table; every query sees all of it.
    pt_row = PT + b * stride_ptb
    for n0 in range(0, prefix, BLOCK_N):
        offs_n = n0 + offs_nb
        nmask = offs_n < prefix
        page = tl.load(pt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        slot = offs_n % PAGE
        k = tl.load(
            KC
            + page[:, None] * stride_kcp
            + slot[:, None] * stride_kcs
            + kvh * stride_kch
            + offs_d[None, :],
            mask=nmask[:, None],
            other=0.0,
        )
        v = tl.load(
            VC
            + page[:, None] * stride_vcp
            + slot[:, None] * stride_vcs
            + kvh * stride_vch
            + offs_d[None, :],
            mask=nmask[:, None],
            other=0.0,
        )
        m_i, l_i, acc = _online_step(q, k, v, m_i, l_i, acc, qk_scale, nmask[None, :], True, UPCAST)

    # 2) New tokens, packed. Tiles entirely below the diagonal (causal) or entirely inside the
    # sequence (non-causal) need no mask at all.
    kn_base = KN + q_start.to(tl.int64) * stride_knt + kvh * stride_knh
    vn_base = VN + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh
    if CAUSAL:
        full_end = (m_blk * BLOCK_M) // BLOCK_N * BLOCK_N  # key tiles may outsize BLOCK_M
        tail_end = tl.minimum((m_blk + 1) * BLOCK_M, q_len)
    else:
        full_end = (q_len // BLOCK_N) * BLOCK_N
        tail_end = q_len
    for n0 in range(0, full_end, BLOCK_N):
        offs_n = n0 + offs_nb
        k = tl.load(kn_base + offs_n[:, None] * stride_knt + offs_d[None, :])
        v = tl.load(vn_base + offs_n[:, None] * stride_vnt + offs_d[None, :])
        m_i, l_i, acc = _online_step(q, k, v, m_i, l_i, acc, qk_scale, None, False, UPCAST)
    for n0 in range(full_end, tail_end, BLOCK_N):
        offs_n = n0 + offs_nb
        nmask = offs_n < q_len
        k = tl.load(
            kn_base + offs_n[:, None] * stride_knt + offs_d[None, :], mask=nmask[:, None], other=0.0
        )
        v = tl.load(
            vn_base + offs_n[:, None] * stride_vnt + offs_d[None, :], mask=nmask[:, None], other=0.0
        )
        mask = nmask[None, :]
        if CAUSAL:
            mask = mask & (offs_m[:, None] >= offs_n[None, :])
        m_i, l_i, acc = _online_step(q, k, v, m_i, l_i, acc, qk_scale, mask, True, UPCAST)

    out = acc / l_i[:, None]
    tl.store(
        Out
        + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot
        + h * stride_oh
        + offs_d[None, :],
        to_bf16(out, UPCAST),
        mask=mmask[:, None],
    )


# The default path on Hopper is prefill_gluon's kernel (sm_90, D=128, no cached prefix), else
# prefill_hopper's; imported here, below the lines above, which stay as they are since recorded
# GPU profiles point at this module's kernel by line.
from .prefill_gluon import GluonConfig, default_gluon_config, unsupported_reason  # noqa: E402
from .prefill_gluon import launch as launch_gluon  # noqa: E402
from .prefill_hopper import HopperConfig, default_hopper_config, extend_attention_hopper  # noqa: E402


def chosen_config(
    head_dim: int, causal: bool, device: torch.device
) -> PrefillConfig | HopperConfig | GluonConfig:
    """The config :func:`extend_attention` runs when given none: the Gluon kernel's on an sm_90
    GPU at the head dims where it is the fastest (:func:`~kdash.kernels.prefill_gluon.
    default_gluon_config`; a call it cannot run, such as one with a cached prefix, takes the
    next one), then prefill_hopper's for the head dim and causality where it runs
    (:func:`~kdash.kernels.prefill_hopper.default_hopper_config`: the H200's fastest per class),
    else this module's kernel at :func:`default_config`."""
    return (
        default_gluon_config(head_dim, device)
        or default_hopper_config(head_dim, causal, device)
        or default_config(head_dim, causal, device)
    )


def extend_attention(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor | None,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor | None,
    prefix_lens: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    max_new_len: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    config: PrefillConfig | HopperConfig | GluonConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention for packed new tokens ``q [T, Hq, D]`` over cached prefixes plus themselves.

    ``cu_seqlens`` (int32 ``[B+1]``) delimits each request's new tokens in ``q``/``k_new``/
    ``v_new`` (``[T, Hkv, D]``); ``max_new_len`` (a host int, so no sync) sizes the grid. Pass
    ``k_cache=v_cache=page_table=prefix_lens=None`` for a plain varlen prefill. bf16 only.
    ``config``: a :class:`PrefillConfig` runs this module's kernel, a
    :class:`~kdash.kernels.prefill_hopper.HopperConfig` prefill_hopper's, a
    :class:`~kdash.kernels.prefill_gluon.GluonConfig` the Gluon kernel's (a call it cannot run
    raises ValueError); None takes :func:`chosen_config`'s.
    """
    total, q_heads, head_dim = q.shape
    kv_heads = k_new.shape[1]
    if q_heads % kv_heads:
        raise ValueError(f"query heads {q_heads} not a multiple of KV heads {kv_heads}")
    if head_dim not in (16, 32, 64, 128, 256):
        raise ValueError("head_dim must be a power of two between 16 and 256")
    if q.dtype != torch.bfloat16 or k_new.dtype != torch.bfloat16:
        raise ValueError("extend_attention takes bf16 q/k/v")
    for t in (q, k_new, v_new):
        if t.stride(-1) != 1:
            raise ValueError("the head dimension must be contiguous")
    batch = cu_seqlens.numel() - 1
    dev = q.device
    cfg = config or chosen_config(head_dim, causal, dev)
    if isinstance(cfg, GluonConfig):
        why = unsupported_reason(q, k_new, v_new, out, has_prefix=k_cache is not None)
        if why is not None and config is not None:
            raise ValueError(f"the Gluon prefill kernel cannot run this call: {why}")
        if why is None:  # checked here, so the launch alone
            return launch_gluon(
                q, k_new, v_new, cu_seqlens, max_new_len, causal, sm_scale, cfg, out
            )
        cfg = default_hopper_config(head_dim, causal, dev) or default_config(head_dim, causal, dev)
    if isinstance(cfg, HopperConfig):
        cache = (k_cache, v_cache, page_table, prefix_lens)
        return extend_attention_hopper(
            q, k_new, v_new, *cache, cu_seqlens, max_new_len,
            causal=causal, sm_scale=sm_scale, config=cfg, out=out,
        )  # fmt: skip
    if k_cache is None:
        page_size = 1
        k_cache = v_cache = torch.empty((1, 1, kv_heads, head_dim), device=dev, dtype=q.dtype)
        page_table = torch.zeros((max(1, batch), 1), device=dev, dtype=torch.int32)
        prefix_lens = torch.zeros(max(1, batch), device=dev, dtype=torch.int32)
    else:
        page_size = k_cache.shape[1]
        if k_cache.dtype != torch.bfloat16:
            raise ValueError("extend_attention reads a bf16 cache")
    sm_scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    if out is None:
        out = torch.empty_like(q)
    if batch == 0 or total == 0 or max_new_len == 0:
        return out
    grid = (cdiv(max_new_len, cfg.block_m), q_heads, batch)
    _extend_kernel[grid](
        q,
        k_new,
        v_new,
        k_cache,
        v_cache,
        page_table,
        prefix_lens,
        cu_seqlens,
        out,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=q_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        PAGE=page_size,
        CAUSAL=causal,
        UPCAST=interpreting(q),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
