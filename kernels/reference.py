"""fp32 torch references for the kernels, plus the bf16 SDPA baselines their error gates use.

The gates follow FlashAttention's tests: a kernel's error against the fp32 reference may be at
most a small multiple of the error that torch's own bf16 attention (SDPA) makes against the same
reference, plus a small absolute noise term. That scales the tolerance with the problem instead of
hard-coding one, and fails loudly on real indexing bugs (which give O(1) errors or NaN).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .kv_cache import FP8, dequantize_fp8


def gather_kv(
    cache: torch.Tensor,
    page_table: torch.Tensor,
    b: int,
    length: int,
    scale: torch.Tensor | None = None,
    start: int = 0,
) -> torch.Tensor:
    """Tokens ``[start, length)`` of request ``b`` as fp32 ``[L, Hkv, D]`` (dequantised if fp8)."""
    page_size = cache.shape[1]
    pos = torch.arange(start, length, device=cache.device)
    pages = page_table[b, pos // page_size].long()
    x = cache[pages, pos % page_size]
    if cache.dtype == FP8:
        if scale is None:
            raise ValueError("fp8 cache needs its scale")
        return dequantize_fp8(x, scale)
    return x.float()


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    q_offset: int = 0,
    sm_scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Plain softmax attention of ``q [Sq, Hq, D]`` over ``k, v [Sk, Hkv, D]`` in ``dtype``.

    Causal means query ``i`` (at absolute position ``q_offset + i``) sees keys ``j <= q_offset + i``
    (the prefix of a cached request plus its new tokens up to itself).
    """
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    g = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qf = q.to(dtype).transpose(0, 1)  # [Hq, Sq, D]
    kf = k.to(dtype).repeat_interleave(g, dim=1).transpose(0, 1)
    vf = v.to(dtype).repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if causal:
        qi = torch.arange(sq, device=q.device)[:, None] + q_offset
        kj = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, vf).transpose(0, 1)  # [Sq, Hq, D]


def sdpa_bf16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    q_offset: int = 0,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """torch SDPA on bf16 inputs: the baseline error a bf16 attention is allowed to make."""
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    g = hq // hkv
    qb = q.to(torch.bfloat16).transpose(0, 1)[None]
    kb = k.to(torch.bfloat16).repeat_interleave(g, dim=1).transpose(0, 1)[None]
    vb = v.to(torch.bfloat16).repeat_interleave(g, dim=1).transpose(0, 1)[None]
    mask = None
    if causal:
        qi = torch.arange(sq, device=q.device)[:, None] + q_offset
        kj = torch.arange(sk, device=q.device)[None, :]
        mask = kj <= qi
    o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=sm_scale)
    return o[0].transpose(0, 1).float()


def flash_bf16(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    q_offset: int = 0,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """The numerics of a bf16 flash-attention kernel, in plain torch ops.

    bf16 Q/K/V, fp32 scores and softmax, the unnormalised probabilities rounded to bf16 before the
    P@V product (as FA2, i.e. SDPA's FLASH_ATTENTION backend, does on the GPU), fp32 accumulation,
    bf16 output. It is the CPU stand-in for :func:`sdpa_bf16`: torch's CPU SDPA keeps P in fp32,
    so its error is about half of what any bf16 tensor-core kernel makes, and a 2x gate against it
    would fail a correct kernel.
    """
    sq, hq, d = q.shape
    sk, hkv, _ = k.shape
    g = hq // hkv
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(d)
    qf = q.to(torch.bfloat16).float().transpose(0, 1)
    kf = k.to(torch.bfloat16).float().repeat_interleave(g, dim=1).transpose(0, 1)
    vf = v.to(torch.bfloat16).float().repeat_interleave(g, dim=1).transpose(0, 1)
    s = torch.matmul(qf, kf.transpose(1, 2)) * scale
    if causal:
        qi = torch.arange(sq, device=q.device)[:, None] + q_offset
        kj = torch.arange(sk, device=q.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    p = torch.exp(s - s.amax(dim=-1, keepdim=True))
    o = torch.matmul(p.to(torch.bfloat16).float(), vf) / p.sum(dim=-1, keepdim=True)
    return o.to(torch.bfloat16).float().transpose(0, 1)


def baseline_for(device: torch.device):
    """The gate's baseline: SDPA in bf16 on a GPU, :func:`flash_bf16` on the CPU (see there)."""
    return sdpa_bf16 if device.type == "cuda" else flash_bf16


def decode_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    sm_scale: float | None = None,
    fn=attention,
) -> torch.Tensor:
    """Decode attention per request from the gathered (dequantised) cache: ``[B, Hq, D]`` fp32.

    ``fn`` is :func:`attention` (fp32 reference) or :func:`sdpa_bf16` (the gate's baseline).
    """
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        k = gather_kv(k_cache, page_table, b, n, k_scale)
        v = gather_kv(v_cache, page_table, b, n, v_scale)
        outs.append(fn(q[b : b + 1], k, v, causal=False, sm_scale=sm_scale)[0].float())
    return torch.stack(outs)


def extend_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    prefix_lens: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    fn=attention,
) -> torch.Tensor:
    """Prefill/extend per request: cached prefix (through the page table) + new tokens, fp32."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    cu = cu_seqlens.tolist()
    for b, p in enumerate(prefix_lens.tolist()):
        s, e = cu[b], cu[b + 1]
        if e == s:
            continue
        k = torch.cat([gather_kv(k_cache, page_table, b, p), k_new[s:e].float()])
        v = torch.cat([gather_kv(v_cache, page_table, b, p), v_new[s:e].float()])
        out[s:e] = fn(q[s:e], k, v, causal=causal, q_offset=p, sm_scale=sm_scale).float()
    return out


def error_gate(
    out: torch.Tensor,
    ref: torch.Tensor,
    baseline: torch.Tensor,
    *,
    max_factor: float = 2.0,
    mean_factor: float | None = None,
    noise: float = 1e-4,
) -> tuple[bool, str]:
    """FA-style gate: ``max|out-ref| <= max_factor * max|baseline-ref| + noise`` (and the mean).

    Returns ``(passed, message)``; NaN anywhere fails.
    """
    out = out.float()
    err = (out - ref).abs()
    base = (baseline.float() - ref).abs()
    if not torch.isfinite(out).all():
        return False, f"non-finite output ({int((~torch.isfinite(out)).sum())} elements)"
    ok = float(err.max()) <= max_factor * float(base.max()) + noise
    msg = f"max err {float(err.max()):.3e} vs {max_factor}x baseline {float(base.max()):.3e}"
    if mean_factor is not None:
        ok_mean = float(err.mean()) <= mean_factor * float(base.mean()) + noise / 10
        ok = ok and ok_mean
        msg += f"; mean err {float(err.mean()):.3e} vs {mean_factor}x {float(base.mean()):.3e}"
    return ok, msg
