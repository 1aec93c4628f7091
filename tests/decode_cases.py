"""Decode test cases shared by the plan and persistent-decode tests: a shuffled paged cache with
NaN in every slot no request owns (so a kernel reading past a length shows), its queries, and
the FA-style gate against the fp32 reference."""

from __future__ import annotations

import os

import torch
from kdash.kernels.decode_plan import DecodePlan
from kdash.kernels.kv_cache import FP8, build_paged_cache, fp8_scales
from kdash.kernels.reference import baseline_for, decode_reference, error_gate

DEV = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"


def make_case(
    lens, q_heads, kv_heads, head_dim, page_size, fp8=False, *, seed=0, device=None, unequal=False
):
    """``(q, k_cache, v_cache, page_table, seq_lens, scales)`` on ``device`` (default: the test
    device). ``unequal``: fp8 K of unequal magnitude per KV head (x0.5 to x2), so a swapped
    head scale shows."""
    device = device or DEV
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where used: fast on the GPU
    ks = [torch.randn(n, kv_heads, head_dim, generator=g, device=device) for n in lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g, device=device) for n in lens]
    scales = {}
    if fp8:
        if unequal:
            mult = torch.linspace(0.5, 2.0, kv_heads, device=device).view(1, -1, 1)
            ks = [k * mult for k in ks]
        scales = dict(k_scale=fp8_scales(torch.cat(ks)), v_scale=fp8_scales(torch.cat(vs)))
    kc, vc, pt, sl = build_paged_cache(
        ks,
        vs,
        page_size,
        dtype=FP8 if fp8 else torch.bfloat16,
        generator=torch.Generator().manual_seed(seed),
        **scales,
    )
    q = torch.randn(len(lens), q_heads, head_dim, generator=g, device=device).bfloat16()
    return q, kc, vc, pt, sl, scales


def check(out, q, kc, vc, pt, sl, scales) -> None:
    """The decode gate (paged/fp8 factors: 4x the baseline's max error, 3x its mean)."""
    ref = decode_reference(q, kc, vc, pt, sl, **scales)
    base = decode_reference(q, kc, vc, pt, sl, fn=baseline_for(q.device), **scales)
    ok, msg = error_gate(out, ref, base, max_factor=4.0, mean_factor=3.0)
    assert ok, msg


def plan_for(pt, sl, q, kc, **kw) -> DecodePlan:
    """A plan for a case of :func:`make_case` (heads, head size, page size and dtypes read off
    ``q`` and the cache); ``kw`` go to :class:`DecodePlan`."""
    return DecodePlan(
        pt,
        sl,
        q.shape[1],
        kc.shape[2],
        q.shape[2],
        kc.shape[1],
        kv_dtype=kc.dtype,
        q_dtype=q.dtype,
        **kw,
    )
