"""Varlen prefill/extend attention (cached prefix through the page table + new tokens).

CPU CI runs the Triton kernels in its interpreter on small shapes; the ``gpu`` tests run the same
gates on benchmark-sized shapes (``TRITON_INTERPRET=0 pytest -m gpu`` on a CUDA machine). Every
gate runs the default path (``extend_attention`` without a config: on an sm_90 GPU at D=128
kernels/prefill_gluon.py's kernel, elsewhere kernels/prefill_hopper.py's at the H200's pick per
class where it runs), the pointer kernel of kernels/prefill_attention.py (the fallback) and each
Hopper variant; the GPU gates also run the Gluon kernel explicitly (it has no interpreter). In the
interpreter the Hopper paths run as on the GPU, host descriptors interpreted as tile loads; every
gate records which path ran (``path`` in the junit properties) and ``test_variant_paths`` pins them.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kdash.kernels import prefill_attention, prefill_hopper  # noqa: E402
from kdash.kernels.kv_cache import build_paged_cache  # noqa: E402
from kdash.kernels.prefill_attention import (  # noqa: E402
    PrefillConfig,
    chosen_config,
    default_config,
    extend_attention,
)
from kdash.kernels.prefill_gluon import (  # noqa: E402
    GLUON_DEFAULTS,
    GluonConfig,
    unsupported_reason,
)
from kdash.kernels.prefill_hopper import (  # noqa: E402
    HOPPER_DEFAULTS,
    VARIANTS,
    HopperConfig,
    default_hopper_config,
    descriptors_available,
    extend_attention_hopper,
    plan_path,
    variant_config,
)
from kdash.kernels.reference import baseline_for, error_gate, extend_reference  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="no CUDA and not interpreting"
)


KERNELS = ("default", "pointer", *VARIANTS)
# The Gluon kernel has no interpreter: its gates run on a GPU only (an sm_90 one; elsewhere the
# explicit config is refused, which test_gluon_refuses_what_it_cannot_run checks on the CPU).
GPU_KERNELS = (*KERNELS, "gluon")


def path_of(cfg, q, k_new, v_new, has_prefix: bool = False) -> str:
    """Which kernel and load path a config runs, in words."""
    if isinstance(cfg, GluonConfig):
        why = unsupported_reason(q, k_new, v_new, has_prefix=has_prefix)
        if why is None:
            return "gluon kernel"
        # The default falls back (an explicit Gluon config is refused instead).
        fallback = prefill_hopper.default_hopper_config(q.shape[-1], True, q.device)
        return f"{path_of(fallback, q, k_new, v_new)} (not gluon: {why})"
    if isinstance(cfg, PrefillConfig):
        return "pointer kernel"
    path = plan_path(q, k_new, v_new, cfg)
    return f"hopper kernel, {path}{' descriptors' if path != 'pointer' else ' loads'}"


def prefill(kernel: str, *args, record=None, **kwargs):
    """``extend_attention`` without a config (the default path), at the pointer kernel's config,
    or one Hopper variant, same arguments; with ``record`` (pytest's ``record_property``) the
    path that ran goes into the junit report."""
    q, k_new, v_new = args[:3]
    d, causal = q.shape[-1], kwargs.get("causal", True)
    if kernel == "default":
        cfg = chosen_config(d, causal, q.device)
    elif kernel == "pointer":
        cfg = kwargs["config"] = default_config(d, causal, q.device)
    elif kernel == "gluon":
        cfg = kwargs["config"] = GLUON_DEFAULTS.get(d, GluonConfig())
    else:
        cfg = variant_config(kernel, d, causal)
    if record:
        has_prefix = len(args) > 3 and args[3] is not None
        record("path", f"{kernel}: {path_of(cfg, q, k_new, v_new, has_prefix)}")
    if kernel in ("default", "pointer", "gluon"):
        return extend_attention(*args, **kwargs)
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
    """No prefix: the path the bench times."""
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
@pytest.mark.parametrize(
    "cfg",
    [
        HopperConfig(16, 32, 4, 2),
        HopperConfig(16, 32, 4, 2, descriptors="none"),
        HopperConfig(32, 64, 4, 2),
        PrefillConfig(16, 32, 4, 2),
    ],
    ids=["hopper-16x32", "hopper-16x32-loads", "hopper-32x64", "pointer-16x32"],
)
def test_causal_key_tiles_wider_than_query_tiles(cfg) -> None:
    """A key tile wider than the query tile must not let a query row see later keys: the whole
    tiles before the diagonal end at a key-tile boundary at or before the query tile's first
    row, and the masked tail covers the rest."""
    news = [100, 1, 37, 64]
    q, kn, vn, kc, vc, pt, pl, cu = make_case([0] * 4, news, 4, 2, 64, 1, seed=5)
    out = torch.full_like(q, float("nan"))
    args = (q, kn, vn, None, None, None, None, cu, max(news))
    if isinstance(cfg, HopperConfig):
        extend_attention_hopper(*args, causal=True, config=cfg, out=out)
    else:
        extend_attention(*args, causal=True, config=cfg, out=out)
    check(out, q, kn, vn, kc, vc, pt, pl, cu, True, paged=False)


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
@pytest.mark.parametrize("kernel", ["default", *VARIANTS])
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
    if kernel == "default":
        cfg = chosen_config(64, causal, q.device)
    else:
        cfg = variant_config(kernel, 64, causal)
    if cfg.descriptors == "host":  # the tiles that reach past the last request
        assert plan_path(q, kn, vn, cfg) == "host"
    check(out[:n], q[:n], kn[:n], vn[:n], kc, vc, pt, pl, cu, causal, paged=False)


def test_variant_paths() -> None:
    """Which path each variant takes, with and without a prefix, and the pointer fallback."""
    t = torch.zeros(64, 4, 64, dtype=torch.bfloat16)
    kv = torch.zeros(64, 2, 64, dtype=torch.bfloat16)
    for causal in (True, False):
        assert plan_path(t, kv, kv, variant_config("ffma", 64, causal)) == "pointer"
        assert plan_path(t, kv, kv, variant_config("tma", 64, causal)) == "host"
    # Heads not side by side (every other head of a wider tensor): no 2-D view for host
    # descriptors, so the pointer path.
    strided = torch.zeros(64, 8, 64, dtype=torch.bfloat16)[:, ::2]
    assert plan_path(strided, kv, kv, variant_config("tma", 64, True)) == "pointer"
    # A row stride that is not 16-byte aligned: no descriptor.
    odd = torch.zeros(64, 4 * 64 + 1, dtype=torch.bfloat16)[:, :256].view(64, 4, 64)
    assert plan_path(odd, kv, kv, variant_config("tma", 64, True)) == "pointer"


def test_the_default_path_per_class_is_the_h200_pick() -> None:
    """The H200's fastest per class (bench/results/prefill-variants-h200.json): host descriptors
    at 128 x 64 / 8 warps / 3 stages, except pointer loads (the FFMA softmax alone) at D=64
    causal; in the interpreter the same path on small tiles; other head dims keep the pointer
    kernel."""
    cpu = torch.device("cpu")
    for (d, causal), cfg in HOPPER_DEFAULTS.items():
        assert (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages) == (128, 64, 8, 3)
        assert cfg.descriptors == ("none" if (d, causal) == (64, True) else "host")
        small = chosen_config(d, causal, cpu)
        assert isinstance(small, HopperConfig) and small.descriptors == cfg.descriptors
        assert (small.block_m, small.block_n) == (64, 64)
    for d in (32, 256):
        assert chosen_config(d, True, cpu) == default_config(d, True, cpu)


def test_descriptors_need_tma_and_a_triton_that_has_them(monkeypatch) -> None:
    """Hopper (sm_90) and later have TMA: below that, or with a Triton without host tensor
    descriptors, the default is the pointer kernel (the capability is stood in for: no GPU)."""
    gpu = torch.device("cuda", 0)
    for cap, ok in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
        monkeypatch.setattr(prefill_hopper, "_capability", lambda _i, cap=cap: cap)
        assert descriptors_available(gpu) is ok
        got = default_hopper_config(128, True, gpu)
        assert got == (HOPPER_DEFAULTS[128, True] if ok else None)
    monkeypatch.setattr(prefill_hopper, "TensorDescriptor", None)
    assert not descriptors_available(torch.device("cpu"))
    assert isinstance(chosen_config(64, False, torch.device("cpu")), PrefillConfig)
    t = torch.zeros(64, 4, 64, dtype=torch.bfloat16)
    assert plan_path(t, t, t, variant_config("tma", 64, True)) == "pointer"


@needs_device
@pytest.mark.parametrize("descriptors", [True, False], ids=["hopper", "no-descriptors"])
def test_extend_attention_runs_the_chosen_kernel(descriptors: bool, monkeypatch) -> None:
    """Without a config, extend_attention runs prefill_hopper's kernel where descriptors run and
    the pointer kernel where they do not; both pass the gate (the Hopper entry is watched
    through a wrapper that calls it)."""
    if not descriptors:
        monkeypatch.setattr(prefill_hopper, "TensorDescriptor", None)
    calls = []
    real = prefill_attention.extend_attention_hopper

    def watched(*a, **kw):
        calls.append(kw["config"])
        return real(*a, **kw)

    monkeypatch.setattr(prefill_attention, "extend_attention_hopper", watched)
    news = [70, 33]
    q, kn, vn, kc, vc, pt, pl, cu = make_case([0, 0], news, 4, 2, 64, 1, seed=6)
    out = extend_attention(q, kn, vn, None, None, None, None, cu, max(news), causal=False)
    check(out, q, kn, vn, kc, vc, pt, pl, cu, False, paged=False)
    assert calls == ([chosen_config(64, False, q.device)] if descriptors else [])


@needs_device
@pytest.mark.parametrize("kernel", ["tma"])
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
@pytest.mark.parametrize("kernel", GPU_KERNELS)
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
    # No prefix: the bench's case, no cache passed.
    cache = (kc, vc, pt, pl) if prefix else (None, None, None, None)
    args = (q, kn, vn, *cache, cu, seq)
    if kernel == "gluon" and prefix:  # the Gluon kernel reads no cache: refused, not wrong
        with pytest.raises(ValueError, match="cached prefix"):
            prefill(kernel, *args, causal=causal, out=out)
        return
    prefill(kernel, *args, causal=causal, out=out, record=record_property)
    check(out, q, kn, vn, kc, vc, pt, pl, cu, causal, paged=prefix > 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_gluon_short_ragged_and_spare_nan_rows(causal: bool, head_dim: int) -> None:
    """The Gluon kernel on what its tiles make hard: lengths 1, 5, 100 and 500 (one partial tile
    each, a second consumer with no rows), GQA, and NaN rows after the last request (its
    descriptors are bounded by each request, so a tail tile reads zeros, never those rows)."""
    news = [1, 5, 100, 500, 129]
    q, kn, vn, kc, vc, pt, pl, cu = make_case(
        [0] * len(news), news, 8, 2, head_dim, 1, device="cuda", seed=9
    )
    spare = 70
    q, kn, vn = (torch.cat([t, torch.full_like(t[:spare], float("nan"))]) for t in (q, kn, vn))
    out = torch.full_like(q, float("nan"))
    prefill("gluon", q, kn, vn, None, None, None, None, cu, max(news), causal=causal, out=out)
    n = sum(news)
    assert torch.isfinite(out[:n]).all()
    check(out[:n], q[:n], kn[:n], vn[:n], kc, vc, pt, pl, cu, causal, paged=False)


@pytest.mark.gpu
@needs_cuda
def test_gpu_default_path_is_the_h200_pick_on_hopper() -> None:
    dev = torch.device("cuda")
    cap = torch.cuda.get_device_capability()
    hopper = cap >= (9, 0)
    for (d, causal), cfg in HOPPER_DEFAULTS.items():
        want = cfg if hopper else default_config(d, causal, dev)
        if cap == (9, 0) and d in GLUON_DEFAULTS:
            want = GLUON_DEFAULTS[d]
        assert chosen_config(d, causal, dev) == want
