"""Paged KV cache layout shared by the kernels, the references, the benchmark and the workload.

A cache is a pair of tensors ``[num_pages, page_size, Hkv, D]`` (bf16, or fp8 e4m3 with one fp32
scale per KV head) and, per request, a row of a page table: token ``t`` of request ``b`` lives in
page ``page_table[b, t // page_size]``, slot ``t % page_size``. Pages need not be contiguous or in
order; the builders below shuffle them on purpose so that tests catch indexing that assumes they
are.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-KV-head fp32 scales ``[Hkv]`` mapping the amax of ``x [..., Hkv, D]`` onto e4m3."""
    amax = x.detach().float().abs().amax(dim=tuple(i for i in range(x.dim()) if i != x.dim() - 2))
    return (amax / FP8_MAX).clamp_min(1e-8)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x / scale`` per KV head (dim -2), saturated to +-448 and rounded to e4m3."""
    y = x.float() / scale.view(*([1] * (x.dim() - 2)), -1, 1)
    return y.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def dequantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 values an fp8 cache stands for (the reference the fp8 gates compare against)."""
    return x.float() * scale.view(*([1] * (x.dim() - 2)), -1, 1)


# Float scales become [Hkv] tensors once, not on every call: a torch.full per decode step is an
# allocation plus a fill kernel, both inside a benchmark's timed region. Bounded; keyed by value.
_SCALE_CACHE: dict[tuple[float, int, torch.device], torch.Tensor] = {}


def scale_per_head(
    scale: torch.Tensor | float | None, kv_heads: int, device: torch.device
) -> torch.Tensor:
    """``scale`` (one float, or a tensor of 1 or ``kv_heads`` entries) as the dense ``[Hkv]``
    fp32 tensor on ``device`` that the decode kernels index; a float's tensor is kept for reuse."""
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


def slot_index(
    page_table: torch.Tensor, req: torch.Tensor, pos: torch.Tensor, page_size: int
) -> torch.Tensor:
    """Flat slot (``page * page_size + offset``) of token ``pos[i]`` of request ``req[i]``."""
    pages = page_table[req.long(), (pos // page_size).long()].long()
    return pages * page_size + (pos % page_size).long()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """Store ``k``/``v`` (``[T, Hkv, D]``) for tokens ``(req[i], pos[i])`` into the cache.

    Pure tensor indexing, so it runs on the CPU, on the GPU and inside CUDA graphs alike.
    """
    page_size = k_cache.shape[1]
    slots = slot_index(page_table, req, pos, page_size)
    kf = k_cache.view(-1, *k_cache.shape[2:])
    vf = v_cache.view(-1, *v_cache.shape[2:])
    if k_cache.dtype == FP8:
        if k_scale is None or v_scale is None:
            raise ValueError("an fp8 cache needs k_scale and v_scale")
        kf[slots] = quantize_fp8(k, k_scale)
        vf[slots] = quantize_fp8(v, v_scale)
    else:
        kf[slots] = k.to(k_cache.dtype)
        vf[slots] = v.to(v_cache.dtype)


def build_paged_cache(
    ks: list[torch.Tensor],
    vs: list[torch.Tensor],
    page_size: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    spare_pages: int = 2,
    fill: float = float("nan"),
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter per-request K/V (``[L_b, Hkv, D]`` each) into shuffled pages of a fresh cache.

    Every slot that no request owns (spare pages, the tail of each request's last page) holds
    ``fill`` (NaN by default) so that a kernel reading out of bounds fails its test. Page-table
    entries past a request's last page point at a spare NaN page too. Returns
    ``(k_cache, v_cache, page_table, seq_lens)``.
    """
    device = ks[0].device
    kv_heads, head_dim = ks[0].shape[1:]
    lens = [int(k.shape[0]) for k in ks]
    pages_per = [-(-n // page_size) for n in lens]
    total = sum(pages_per) + spare_pages
    perm = torch.randperm(total, generator=generator).to(device)
    k_cache = torch.full((total, page_size, kv_heads, head_dim), fill, device=device)
    v_cache = torch.full_like(k_cache, fill)
    max_pages = max(1, max(pages_per))
    spare = int(perm[-1]) if spare_pages else 0
    page_table = torch.full((len(ks), max_pages), spare, dtype=torch.int32, device=device)
    nxt = 0
    for b, n in enumerate(pages_per):
        page_table[b, :n] = perm[nxt : nxt + n].to(torch.int32)
        nxt += n
    if dtype == FP8:
        k_cache = k_cache.to(FP8)  # NaN survives the cast: e4m3fn has a NaN encoding
        v_cache = v_cache.to(FP8)
    else:
        k_cache = k_cache.to(dtype)
        v_cache = v_cache.to(dtype)
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):
        pos = torch.arange(lens[b], device=device)
        req = torch.full_like(pos, b)
        write_kv(k_cache, v_cache, page_table, req, pos, k, v, k_scale, v_scale)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return k_cache, v_cache, page_table, seq_lens
