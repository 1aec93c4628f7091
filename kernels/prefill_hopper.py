"""Prefill/extend attention built for Hopper (sm_90): the default prefill path where it runs.

Same call and semantics as :func:`kdash.kernels.prefill_attention.extend_attention` (packed
varlen new tokens over a paged cached prefix, causal or not, GQA), which calls this module's
kernel by default (:func:`default_hopper_config`) and keeps its own pointer-load kernel for the
rest: head dims other than 64 and 128, GPUs before Hopper, a Triton without host-side tensor
descriptors. What differs from that kernel is how the new-token loop is built:

- the softmax in the form the hardware likes (always on here): the row max is taken on the raw
  scores and scaled once per row, so each score costs one FFMA (``s * scale - m``) before
  ``exp2`` instead of an FMUL kept alive for the max plus an FADD; the P@V product accumulates
  in the dot itself (``tl.dot(p, v, acc)``: wgmma's accumulator input, no separate add), and
  ``l`` is updated after the dot so the row sums are not live across it.
- ``descriptors="host"``: Q, K and V of the new tokens are read through host-side tensor
  descriptors (TMA on Hopper): one thread issues a whole tile copy into shared memory, so the
  256 threads no longer compute addresses and issue ``cp.async`` per tile. The packed
  ``[T, H, D]`` tensors are viewed as ``[T, H * D]``; a tile at row ``t`` and column ``h * D``
  is one head's ``BLOCK x D`` block. Rows past a request's end belong to the next request (or
  are zero past the tensor's end): their scores are masked in the tail tile and their V rows
  zeroed there, so they add nothing even if they held Inf/NaN. The output is stored with a row
  mask (a descriptor store would write the next request's rows). ``"none"``: pointer loads.

The variants the GPU script times (``bench/gpu_prefill_variants.py``): ``ffma`` (pointer loads)
and ``tma`` (host descriptors), each at a few tiles and pipeline depths. On the H200 ``tma`` at
128 x 64 tiles, 8 warps, 3 stages was the fastest in three classes (D=64 full, D=128 causal and
full) and ``ffma`` at the same tiles in the fourth (D=64 causal): those are the defaults
(:data:`HOPPER_DEFAULTS`; bench/NOTES-kernels.md has the figures).

The cached-prefix loop is the pointer kernel's (a page-table gather; TMA cannot gather rows). A
layout the descriptors cannot take (a row stride or base not 16-byte aligned, a head stride
other than D) runs the same kernel with pointer loads: :func:`plan_path` says which path a call
takes; the tests assert it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from ._common import _capability, cdiv, interpreting, mma, to_bf16

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # a Triton without host-side tensor descriptors: the pointer kernel runs
    TensorDescriptor = None

LOG2E = math.log2(math.e)
# TMA (the tensor memory accelerator the host descriptors drive) came with Hopper.
TMA_MIN_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class HopperConfig:
    """Tiles, pipelining and which of the module's knobs are on (see the module docstring)."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 2
    descriptors: str = "host"  # "none" (pointer loads) or "host" (see the module)


# The default per (head dim, causal): each class's fastest config on the H200 (Triton 3.6,
# S 4k-16k; bench/NOTES-kernels.md). Q 32 KiB + 3 stages of K and V (16 KiB each at D=128):
# 128 KiB of the 227 KiB of shared memory.
HOPPER_DEFAULTS = {
    (64, True): HopperConfig(128, 64, 8, 3, descriptors="none"),
    (64, False): HopperConfig(128, 64, 8, 3),
    (128, True): HopperConfig(128, 64, 8, 3),
    (128, False): HopperConfig(128, 64, 8, 3),
}
VARIANTS = ("ffma", "tma")


def variant_config(name: str, head_dim: int, causal: bool) -> HopperConfig:
    """The config a variant runs at by default for a head dim and causality.

    ``ffma`` keeps the pointer kernel's tiles (so the softmax rewrite is measured alone); ``tma``
    takes the tiles it was fastest at on the H200 in every class (128 x 64, 8 warps, 3 stages).
    """
    if name not in VARIANTS:
        raise ValueError(f"unknown prefill variant {name!r}; known: {', '.join(VARIANTS)}")
    if name == "ffma":
        if head_dim <= 64 and not causal:
            return HopperConfig(64, 64, 4, 4, descriptors="none")
        if head_dim > 64 and not causal:
            return HopperConfig(128, 128, 8, 3, descriptors="none")
        return HopperConfig(128, 64, 8, 3, descriptors="none")
    return HopperConfig(128, 64, 8, 3)


def descriptors_available(device: torch.device) -> bool:
    """Whether host tensor descriptors run here: a Triton that has them, and a GPU with TMA (or
    the CPU interpreter, which runs a descriptor's loads as tile loads)."""
    if TensorDescriptor is None:
        return False
    if device.type != "cuda":
        return True
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _capability(index) >= TMA_MIN_CAPABILITY


def default_hopper_config(head_dim: int, causal: bool, device: torch.device) -> HopperConfig | None:
    """This module's default config for a head dim and causality on ``device``, or None where
    the pointer kernel of :mod:`kdash.kernels.prefill_attention` runs instead (a head dim the
    H200 did not time, or no host descriptors: see :func:`descriptors_available`). In the CPU
    interpreter: the class's config on small tiles (the same path, quicker to interpret)."""
    cfg = HOPPER_DEFAULTS.get((head_dim, causal))
    if cfg is None or not descriptors_available(device):
        return None
    if device.type != "cuda":
        return replace(cfg, block_m=64, block_n=64, num_warps=4, num_stages=1)
    return cfg


@triton.jit
def _dot_acc(a, b, acc, UPCAST: tl.constexpr):
    """``acc + a @ b`` inside the dot (wgmma's accumulator); ``UPCAST`` as in ``mma``."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _step(q, k, v, m_i, l_i, acc, qk_scale, mask, MASKED: tl.constexpr, UPCAST: tl.constexpr):
    """One K/V tile of the online softmax with the scale folded into the exponent's FFMA.

    ``m_i`` is kept in scaled log2 units; the max of raw scores times ``qk_scale`` (> 0) is the
    max of the scaled scores, so only one multiply per row is needed for it.
    """
    s = mma(q, tl.trans(k), UPCAST)
    if MASKED:
        s = tl.where(mask, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    acc = _dot_acc(to_bf16(p, UPCAST), v, acc * alpha[:, None], UPCAST)
    l_i = l_i * alpha + tl.sum(p, 1)
    return m_new, l_i, acc


@triton.jit
def _prefix_loop(
    q, m_i, l_i, acc, qk_scale, KC, VC, PT, PREFIX, b, kvh, offs_d, offs_nb,
    stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_ptb,
    BLOCK_N: tl.constexpr, PAGE: tl.constexpr, UPCAST: tl.constexpr,
):  # fmt: skip
    """The cached prefix, gathered through the page table; every query sees all of it."""
    prefix = tl.load(PREFIX + b)
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
        m_i, l_i, acc = _step(q, k, v, m_i, l_i, acc, qk_scale, nmask[None, :], True, UPCAST)
    return m_i, l_i, acc


@triton.jit
def _hopper_kernel(
    Q,
    KN,
    VN,
    QD,
    KD,
    VD,
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
    DESC: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
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

    offs_m = m_blk * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_nb = tl.arange(0, BLOCK_N)
    mmask = offs_m < q_len
    # Host descriptors span the packed [T, H * D] tensors: a request's tiles start at its first
    # row, a head's at column h * D.
    q_row, kv_row, q_col, kv_col = q_start, q_start, h * HEAD_DIM, kvh * HEAD_DIM
    if DESC:
        # Rows past the request's end are another request's queries: computed, never stored.
        q = QD.load([q_row + m_blk * BLOCK_M, q_col])
    else:
        q = tl.load(
            Q
            + (q_start + offs_m)[:, None].to(tl.int64) * stride_qt
            + h * stride_qh
            + offs_d[None, :],
            mask=mmask[:, None],
            other=0.0,
        )
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

    # 1) The cached prefix through the page table, as in the pointer kernel.
    if HAS_PREFIX:
        m_i, l_i, acc = _prefix_loop(
            q, m_i, l_i, acc, qk_scale, KC, VC, PT, PREFIX, b, kvh, offs_d, offs_nb,
            stride_kcp, stride_kcs, stride_kch, stride_vcp, stride_vcs, stride_vch, stride_ptb,
            BLOCK_N, PAGE, UPCAST,
        )  # fmt: skip

    # 2) New tokens: the unmasked part (below the diagonal, or whole tiles inside the sequence),
    # then the masked tail (the diagonal tiles, or the sequence's last partial tile).
    kn_base = KN + q_start.to(tl.int64) * stride_knt + kvh * stride_knh
    vn_base = VN + q_start.to(tl.int64) * stride_vnt + kvh * stride_vnh
    if CAUSAL:
        # Whole key tiles below the query tile's first row: with key tiles wider than query
        # tiles (BLOCK_N > BLOCK_M) the tile holding that row would reach past the diagonal.
        full_end = (m_blk * BLOCK_M) // BLOCK_N * BLOCK_N
        tail_end = tl.minimum((m_blk + 1) * BLOCK_M, q_len)
    else:
        full_end = (q_len // BLOCK_N) * BLOCK_N
        tail_end = q_len
    for n0 in range(0, full_end, BLOCK_N):
        if DESC:
            k = KD.load([kv_row + n0, kv_col])
            v = VD.load([kv_row + n0, kv_col])
        else:
            offs_n = n0 + offs_nb
            k = tl.load(kn_base + offs_n[:, None] * stride_knt + offs_d[None, :])
            v = tl.load(vn_base + offs_n[:, None] * stride_vnt + offs_d[None, :])
        m_i, l_i, acc = _step(q, k, v, m_i, l_i, acc, qk_scale, None, False, UPCAST)
    for n0 in range(full_end, tail_end, BLOCK_N):
        offs_n = n0 + offs_nb
        nmask = offs_n < q_len
        if DESC:
            k = KD.load([kv_row + n0, kv_col])
            # Host descriptors read the next request's V rows here: they get weight 0, and
            # zeroing them keeps an Inf or NaN there from making 0 * x a NaN.
            v = tl.where(nmask[:, None], VD.load([kv_row + n0, kv_col]), 0.0)
        else:
            k = tl.load(
                kn_base + offs_n[:, None] * stride_knt + offs_d[None, :],
                mask=nmask[:, None],
                other=0.0,
            )
            v = tl.load(
                vn_base + offs_n[:, None] * stride_vnt + offs_d[None, :],
                mask=nmask[:, None],
                other=0.0,
            )
        mask = nmask[None, :]
        if CAUSAL:
            mask = mask & (offs_m[:, None] >= offs_n[None, :])
        m_i, l_i, acc = _step(q, k, v, m_i, l_i, acc, qk_scale, mask, True, UPCAST)

    out = acc / l_i[:, None]
    tl.store(
        Out
        + (q_start + offs_m)[:, None].to(tl.int64) * stride_ot
        + h * stride_oh
        + offs_d[None, :],
        to_bf16(out, UPCAST),
        mask=mmask[:, None],
    )


def _descriptor_ok(t: torch.Tensor) -> bool:
    """Whether ``t [T, H, D]`` can be read through host descriptors: a 16-byte aligned base and
    row stride, and the heads side by side (head stride D: the 2-D ``[T, H * D]`` view)."""
    _, heads, d = t.shape
    size = t.element_size()
    ok = t.stride(2) == 1 and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0
    return ok and (heads == 1 or t.stride(1) == d)


def plan_path(q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, cfg: HopperConfig) -> str:
    """Which path a call takes for the new tokens: ``"host"`` descriptors (TMA tiles), or
    ``"pointer"`` loads (the config asks for no descriptors, this Triton has none, or a tensor's
    layout cannot take one)."""
    if (
        cfg.descriptors == "host"
        and TensorDescriptor is not None
        and all(_descriptor_ok(t) for t in (q, k_new, v_new))
    ):
        return "host"
    return "pointer"


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    """``[T, H, D]`` viewed as ``[T, H * D]`` with the row stride kept (no copy)."""
    total, heads, d = t.shape
    return t.as_strided((total, heads * d), (t.stride(0), 1))


def extend_attention_hopper(
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
    config: HopperConfig | None = None,
    variant: str = "tma",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`~kdash.kernels.prefill_attention.extend_attention` built as ``variant`` (or as
    ``config``, which then wins); arguments and result are the same."""
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
    has_prefix = k_cache is not None
    cfg = config or variant_config(variant, head_dim, causal)
    if cfg.descriptors not in ("none", "host"):
        raise ValueError(f"descriptors must be none or host, not {cfg.descriptors!r}")
    batch = cu_seqlens.numel() - 1
    dev = q.device
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
    path = plan_path(q, k_new, v_new, cfg)
    if path == "host":
        qd = TensorDescriptor.from_tensor(_as_rows(q), [cfg.block_m, head_dim])
        kd = TensorDescriptor.from_tensor(_as_rows(k_new), [cfg.block_n, head_dim])
        vd = TensorDescriptor.from_tensor(_as_rows(v_new), [cfg.block_n, head_dim])
    else:
        qd, kd, vd = q, k_new, v_new  # unused: pointer loads
    grid = (cdiv(max_new_len, cfg.block_m), q_heads, batch)
    _hopper_kernel[grid](
        q,
        k_new,
        v_new,
        qd,
        kd,
        vd,
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
        DESC=path == "host",
        HAS_PREFIX=has_prefix,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out
