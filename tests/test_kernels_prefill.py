"""Varlen prefill/extend attention (cached prefix through the page table + new tokens).

CPU CI runs the Triton kernels in its interpreter on small shapes; the ``gpu`` tests run the same
gates on benchmark-sized shapes (``TRITON_INTERPRET=0 pytest -m gpu`` on a CUDA machine). Every
gate runs the default kernel and each Hopper variant (kernels/prefill_hopper.py). In the
interpreter the variants run their own paths: host descriptors and in-kernel descriptors are
interpreted as tile loads, and ``warp_specialize`` is a compile hint the interpreter ignores, so
``tma_ws`` runs its single masked loop there; ``test_variant_paths`` pins which path each takes.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kdash.kernels.kv_cache import build_paged_cache  # noqa: E402
from kdash.kernels.prefill_attention import extend_attention  # noqa: E402
from kdash.kernels.prefill_hopper import (  # noqa: E402
    VARIANTS,
    extend_attention_hopper,
    plan_path,
    variant_config,
    warp_specialized,
)
from kdash.kernels.reference import baseline_for, error_gate, extend_reference  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="no CUDA and not interpreting"
)


KERNELS = ("default", *VARIANTS)


def prefill(kernel: str, *args, record=None, **kwargs):
    """``extend_attention`` (the default kernel) or one Hopper variant, same arguments; with
    ``record`` (pytest's ``record_property``) the path that ran goes into the junit report."""
    if kernel == "default":
        if record:
            record("path", "default kernel, pointer loads")
        return extend_attention(*args, **kwargs)
    q, k_new, v_new, k_cache = args[:4]
    cfg = variant_config(
        kernel, q.shape[-1], kwargs.get("causal", True), has_prefix=k_cache is not None
    )
    path = plan_path(q, k_new, v_new, cfg)
    if record:
        ws = warp_specialized(cfg, path, k_cache is not None)
        record(
            "path",
            f"{kernel}: {path}{' descriptors' if path != 'pointer' else ' loads'}"
            f"{', warp-specialised loop (a compile hint the interpreter ignores)' if ws else ''}",
        )
    return extend_attention_hopper(*args, variant=kernel, **kwargs)


def make_case(prefixes, news, q_heads, kv_heads, head_dim, page_size, *, device=DEV, seed=0):
    """Random packed new tokens plus a NaN-padded paged cache holding each request's prefix."""
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where used: fast on the GPU
    ks = [torch.randn(n, kv_heads, head_dim, generator=g, device=device) for n in prefixes]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g, device=device) for n in prefixes]
    kc, vc, pt, pl = build_paged_cache(
        ks, vs, page_size, generator=torch.Generator().manual_seed(seed)
    )
    total = sum(news)
    cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()], dtype=torch.int32)

    def rnd(h):
        return torch.randn(total, h, head_dim, generator=g, device=device).bfloat16()

    return rnd(q_heads), rnd(kv_heads), rnd(kv_heads), kc, vc, pt, pl, cu.to(device)


def check(out, q, kn, vn, kc, vc, pt, pl, cu, causal, paged: bool):
    ref = extend_reference(q, kn, vn, kc, vc, pt, pl, cu, causal=causal)
    base = extend_reference(q, kn, vn, kc, vc, pt, pl, cu, causal=causal, fn=baseline_for(q.device))
    if paged:
        ok, msg = error_gate(out, ref, base, max_factor=4.0, mean_factor=3.0)
    else:
        ok, msg = error_gate(out, ref, base, max_factor=2.0)
    assert ok, msg


@needs_device
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_extend_with_prefix_matches_reference(
    page_size: int, head_dim: int, causal: bool, kernel: str, record_property
) -> None:
    prefixes = [0, 5, 100, 37]  # a request with no prefix, and lengths off every block size
    news = [100, 1, 5, 60]
    q, kn, vn, kc, vc, pt, pl, cu = make_case(prefixes, news, 4, 2, head_dim, page_size)
    out = torch.full_like(q, float("nan"))
    prefill(
        kernel,
        q,
        kn,
        vn,
        kc,
        vc,
        pt,
        pl,
        cu,
        max(news),
        causal=causal,
        out=out,
        record=record_property,
    )
    check(out, q, kn, vn, kc, vc, pt, pl, cu, causal, paged=True)


@needs_device
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_plain_prefill_matches_reference(causal: bool, kernel: str, record_property) -> None:
    """No prefix: the path the bench times (``tma_ws`` warp-specialised on a GPU)."""
    news = [100, 1, 5, 60, 130]
    q, kn, vn, kc, vc, pt, pl, cu = make_case([0] * 5, news, 4, 2, 128, 1, seed=3)
    out = torch.full_like(q, float("nan"))
    prefill(
        kernel,
        q,
        kn,
        vn,
        None,
        None,
        None,
        None,
        cu,
        max(news),
        causal=causal,
        out=out,
        record=record_property,
    )
    check(out, q, kn, vn, kc, vc, pt, pl, cu, causal, paged=False)


@needs_device
@pytest.mark.parametrize("kernel", KERNELS)
def test_long_request_lengths_1_5_100_500(kernel: str, record_property) -> None:
    news = [1, 5, 100, 500]
    q, kn, vn, kc, vc, pt, pl, cu = make_case([0, 0, 0, 0], news, 2, 1, 64, 1, seed=1)
    out = torch.full_like(q, float("nan"))
    prefill(
        kernel,
        q,
        kn,
        vn,
        None,
        None,
        None,
        None,
        cu,
        max(news),
        causal=True,
        out=out,
        record=record_property,
    )
    check(out, q, kn, vn, kc, vc, pt, pl, cu, True, paged=False)


@needs_device
@pytest.mark.parametrize("kernel", VARIANTS)
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rows_past_the_last_request_do_not_leak(causal: bool, kernel: str, record_property) -> None:
    """Packed tensors longer than the batch, their spare rows NaN: a tile that reaches past the
    last request (host descriptors read those rows) must not carry a NaN into the output."""
    news = [70, 33]
    q, kn, vn, kc, vc, pt, pl, cu = make_case([0, 0], news, 2, 2, 64, 1, seed=4)
    spare = 40
    q, kn, vn = (torch.cat([t, torch.full_like(t[:spare], float("nan"))]) for t in (q, kn, vn))
    out = torch.full_like(q, float("nan"))
    prefill(
        kernel,
        q,
        kn,
        vn,
        None,
        None,
        None,
        None,
        cu,
        max(news),
        causal=causal,
        out=out,
        record=record_property,
    )
    n = sum(news)
    if kernel != "ffma":
        assert plan_path(q, kn, vn, variant_config(kernel, 64, causal)) != "pointer"
    check(out[:n], q[:n], kn[:n], vn[:n], kc, vc, pt, pl, cu, causal, paged=False)


def test_variant_paths() -> None:
    """Which path each variant takes, with and without a prefix, and the pointer fallback."""
    t = torch.zeros(64, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    seen = {}
    for name in VARIANTS:
        for has_prefix in (False, True):
            cfg = variant_config(name, 64, True, has_prefix=has_prefix)
            path = plan_path(t, kv, kv, cfg)
            seen[name, has_prefix] = (path, warp_specialized(cfg, path, has_prefix))
    assert seen["ffma", False] == ("pointer", False)
    assert seen["tma", False] == seen["tma", True] == ("host", False)
    assert seen["tma_ws", False] == ("device", True)
    assert seen["tma_ws", True] == ("host", False)  # with a prefix it runs as tma
    # Heads not side by side (every other head of a wider tensor): no 2-D view for host
    # descriptors, so the pointer path; in-kernel descriptors only need aligned strides.
    strided = torch.zeros(64, 8, 64, dtype=torch.bfloat16)[:, ::2]
    assert plan_path(strided, kv, kv, variant_config("tma", 64, True)) == "pointer"
    assert plan_path(strided, kv, kv, variant_config("tma_ws", 64, True)) == "device"
    # A row stride that is not 16-byte aligned: no descriptor of either kind.
    odd = torch.zeros(64, 4 * 64 + 1, dtype=torch.bfloat16)[:, :256].view(64, 4, 64)
    assert plan_path(odd, kv, kv, variant_config("tma_ws", 64, True)) == "pointer"


@needs_device
@pytest.mark.parametrize("kernel", ["tma", "tma_ws"])
def test_pointer_fallback_matches_reference(kernel: str, record_property) -> None:
    """A layout no descriptor takes (misaligned row stride) runs the pointer path, correctly."""
    news = [50, 20]
    q, kn, vn, kc, vc, pt, pl, cu = make_case([0, 0], news, 2, 1, 64, 1, seed=5)
    wide = torch.zeros(q.shape[0], 2 * 64 + 1, dtype=q.dtype, device=q.device)
    wide[:, :128] = q.reshape(q.shape[0], 128)
    qs = wide[:, :128].view(q.shape[0], 2, 64)
    assert plan_path(qs, kn, vn, variant_config(kernel, 64, True)) == "pointer"
    out = torch.full_like(q, float("nan"))
    prefill(
        kernel,
        qs,
        kn,
        vn,
        None,
        None,
        None,
        None,
        cu,
        max(news),
        causal=True,
        out=out,
        record=record_property,
    )
    check(out, q, kn, vn, kc, vc, pt, pl, cu, True, paged=False)


@needs_device
@pytest.mark.parametrize("kernel", KERNELS)
def test_extend_equals_prefill_of_the_whole_sequence(kernel: str) -> None:
    """Splitting a sequence into cached prefix + new tokens must not change its last rows."""
    g = torch.Generator().manual_seed(2)
    n, p, hq, hkv, d = 90, 53, 4, 2, 64
    q = torch.randn(n, hq, d, generator=g).to(DEV, torch.bfloat16)
    k = torch.randn(n, hkv, d, generator=g).to(DEV, torch.bfloat16)
    v = torch.randn(n, hkv, d, generator=g).to(DEV, torch.bfloat16)
    cu_all = torch.tensor([0, n], dtype=torch.int32, device=DEV)
    full = prefill(kernel, q, k, v, None, None, None, None, cu_all, n)
    kc, vc, pt, pl = build_paged_cache([k[:p].float()], [v[:p].float()], 16, generator=g)
    cu_new = torch.tensor([0, n - p], dtype=torch.int32, device=DEV)
    part = prefill(kernel, q[p:], k[p:], v[p:], kc, vc, pt, pl, cu_new, n - p)
    torch.testing.assert_close(part.float(), full[p:].float(), atol=2e-2, rtol=2e-2)
    assert (part.float() - full[p:].float()).abs().mean() < 2e-3


@pytest.mark.parametrize("kernel", KERNELS)
def test_rejects_mismatched_heads(kernel: str) -> None:
    q = torch.zeros(4, 6, 64, dtype=torch.bfloat16)
    kv = torch.zeros(4, 4, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="multiple"):
        prefill(kernel, q, kv, kv, None, None, None, None, cu, 4)


def test_rejects_an_unknown_variant() -> None:
    q = torch.zeros(4, 2, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="unknown prefill variant"):
        extend_attention_hopper(q, q, q, None, None, None, None, cu, 4, variant="fa4")


# --------------------------------------------------------------------------- GPU gates
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and TRITON_INTERPRET=0)"
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "head_dim", "seq", "causal", "prefix"),
    [
        (16, 16, 128, 4096, True, 0),
        (32, 32, 64, 2048, False, 0),
        (32, 32, 64, 8192, True, 0),
        (32, 8, 128, 2048, True, 0),
        (32, 8, 128, 1000, True, 3000),
    ],
    ids=["h2048-d128-4k-causal", "h2048-d64-2k-full", "h2048-d64-8k-causal", "gqa-2k", "extend"],
)
def test_gpu_prefill_gates(
    q_heads, kv_heads, head_dim, seq, causal, prefix, kernel, record_property
) -> None:
    batch = 2
    q, kn, vn, kc, vc, pt, pl, cu = make_case(
        [prefix] * batch, [seq, seq - 7], q_heads, kv_heads, head_dim, 16, device="cuda"
    )
    out = torch.full_like(q, float("nan"))
    # No prefix: the bench's case, no cache passed (tma_ws takes its warp-specialised loop).
    cache = (kc, vc, pt, pl) if prefix else (None, None, None, None)
    prefill(kernel, q, kn, vn, *cache, cu, seq, causal=causal, out=out, record=record_property)
    check(out, q, kn, vn, kc, vc, pt, pl, cu, causal, paged=prefix > 0)
