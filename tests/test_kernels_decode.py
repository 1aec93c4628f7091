"""Paged split-KV decode attention against fp32 references (FA-style error gates).

CPU CI runs the Triton kernel in its interpreter on small shapes; the ``gpu`` tests run the same
gates on the benchmark's shapes (``TRITON_INTERPRET=0 pytest -m gpu`` on a CUDA machine).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import math
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import decode_cases as cases  # noqa: E402
from kdash.kernels import decode_plan  # noqa: E402
from kdash.kernels._common import cdiv  # noqa: E402
from kdash.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    _fp8_pairs_to_fp16,
    choose_num_splits,
    decode_attention,
    default_config,
    plan_splits,
    wave_splits,
)
from kdash.kernels.kv_cache import FP8  # noqa: E402
from kdash.kernels.reference import (  # noqa: E402
    gather_kv,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def convert_pairs(W, Even, Odd, BLOCK: tl.constexpr, ASM: tl.constexpr):
    """Test harness for the fp8-pair conversion helper, one block of words per program."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e, o = _fp8_pairs_to_fp16(tl.load(W + offs), ASM)
    tl.store(Even + offs, e)
    tl.store(Odd + offs, o)


DEV = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="no CUDA and not interpreting"
)
# Interpreter runs are slow per program: small blocks and few splits keep CI within its budget.
# fp8 takes the default's conversion (every launch path has it); the others are gated below.
SMALL = DecodeConfig(block_n=64, prefetch_pages=False, fp8_compute="cvt")
SMALL_PREFETCH = DecodeConfig(block_n=64, prefetch_pages=True, fp8_compute="cvt")
# Every correctness gate runs with and without the page-index prefetch (prefetch_pages).
with_prefetch = pytest.mark.parametrize("cfg", [SMALL, SMALL_PREFETCH], ids=["plain", "prefetch"])


@pytest.fixture(params=[False, True, "persistent"], ids=["two-launch", "fused", "persistent"])
def path(request, monkeypatch) -> bool | str:
    """The launch paths of a plan: stage 1 then the merge kernel, the one fused launch, or the
    persistent kernel (the plans these tests make through decode_attention take the module's
    default; where a plan cannot run the persistent kernel, an fp8 config of another conversion,
    it takes two launches)."""
    monkeypatch.setattr(decode_plan, "FUSED_DEFAULT", request.param)
    return request.param


def make_case(
    lens: list[int],
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    page_size: int,
    fp8: bool,
    *,
    device: str = DEV,
    seed: int = 0,
):
    """A fresh random paged cache (NaN in every unowned slot) and the query batch for it; fp8 K
    of unequal magnitude per KV head, so a swapped head scale shows."""
    return cases.make_case(
        lens, q_heads, kv_heads, head_dim, page_size, fp8, seed=seed, device=device, unequal=True
    )


def check(out, q, kc, vc, pt, sl, scales, fp8: bool):
    # Decode always reads through the page table: the paged/fp8 factors (4x max, 3x mean).
    cases.check(out, q, kc, vc, pt, sl, scales)


@needs_device
@with_prefetch
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_matches_reference(page_size: int, head_dim: int, fp8: bool, cfg, path) -> None:
    # not block multiples; 1 and 5 are shorter than the split count; 500 gives each of its 4
    # splits two 64-token tiles, so the prefetch hands a tile's pages over across iterations
    lens = [1, 5, 100, 500]
    q, kc, vc, pt, sl, scales = make_case(lens, 8, 2, head_dim, page_size, fp8)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    decode_attention(q, kc, vc, pt, sl, num_splits=4, config=cfg, out=out, **scales)
    check(out, q, kc, vc, pt, sl, scales, fp8)


@needs_device
@with_prefetch
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (8, 1), (6, 2)])
def test_decode_gqa_groups(q_heads: int, kv_heads: int, cfg, path) -> None:
    """MHA (group 1), one KV head for 8 query heads, and a group that is not a power of two."""
    q, kc, vc, pt, sl, scales = make_case([7, 130], q_heads, kv_heads, 64, 16, False, seed=1)
    out = decode_attention(q, kc, vc, pt, sl, config=cfg, max_seq_len=130)
    check(out, q, kc, vc, pt, sl, scales, False)


@needs_device
@with_prefetch
def test_more_splits_than_tokens_gives_no_nan(cfg, path) -> None:
    q, kc, vc, pt, sl, scales = make_case([1, 2, 3], 4, 2, 64, 1, False, seed=2)
    out = decode_attention(q, kc, vc, pt, sl, num_splits=16, config=cfg)
    assert torch.isfinite(out.float()).all()
    check(out, q, kc, vc, pt, sl, scales, False)


@needs_device
@with_prefetch
@pytest.mark.parametrize("num_splits", [1, 3])
def test_forced_split_counts_still_cover_every_token(num_splits: int, cfg, path) -> None:
    """A graph-captured split count must stay right for any lengths (only balance changes)."""
    q, kc, vc, pt, sl, scales = make_case([1, 130, 500], 4, 2, 64, 16, False, seed=6)
    out = decode_attention(q, kc, vc, pt, sl, num_splits=num_splits, max_seq_len=2, config=cfg)
    check(out, q, kc, vc, pt, sl, scales, False)


@needs_device
def test_lse_is_the_log_sum_exp_of_the_logits(path) -> None:
    q, kc, vc, pt, sl, _ = make_case([3, 77], 4, 2, 64, 16, False, seed=3)
    _, lse = decode_attention(q, kc, vc, pt, sl, num_splits=3, config=SMALL, return_lse=True)
    for b, n in enumerate(sl.tolist()):
        k = gather_kv(kc, pt, b, n).repeat_interleave(2, dim=1)  # [n, Hq, D]
        logits = torch.einsum("hd,nhd->hn", q[b].float(), k) / math.sqrt(64)
        torch.testing.assert_close(lse[b], torch.logsumexp(logits, dim=-1), rtol=1e-4, atol=1e-4)


@needs_device
def test_fp8_per_tensor_scale_as_float(path) -> None:
    """A single float is a per-tensor scale: same result as the equal per-head tensor."""
    q, kc, vc, pt, sl, _ = make_case([40, 9], 4, 2, 64, 16, False, seed=4)
    kf = kc.float().nan_to_num(0.0).to(FP8)
    vf = vc.float().nan_to_num(0.0).to(FP8)
    a = decode_attention(q, kf, vf, pt, sl, k_scale=0.5, v_scale=2.0, config=SMALL)
    ks = torch.full((2,), 0.5, device=q.device)
    vs = torch.full((2,), 2.0, device=q.device)
    b = decode_attention(q, kf, vf, pt, sl, k_scale=ks, v_scale=vs, config=SMALL)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    check(a, q, kf, vf, pt, sl, dict(k_scale=ks, v_scale=vs), True)
    # Float scales are turned into tensors once and reused: the reuse must follow the value.
    c = decode_attention(q, kf, vf, pt, sl, k_scale=1.0, v_scale=1.0, config=SMALL)
    ones = torch.ones(2, device=q.device)
    d = decode_attention(q, kf, vf, pt, sl, k_scale=ones, v_scale=ones, config=SMALL)
    torch.testing.assert_close(c, d, rtol=0, atol=0)
    assert not torch.equal(a, c)
    # A strided [Hkv] view is read as the values it shows, not as dense memory.
    wide = torch.tensor([[1.0, 7.0], [1.0, 7.0]], device=q.device)[:, 0]
    assert not wide.is_contiguous()
    e = decode_attention(q, kf, vf, pt, sl, k_scale=wide, v_scale=wide, config=SMALL)
    torch.testing.assert_close(e, d, rtol=0, atol=0)


@needs_device
def test_cached_launch_plan_still_validates_every_call() -> None:
    """The per-shape launch cache must not let a bad layout through after a good call."""
    q, kc, vc, pt, sl, scales = make_case([20], 4, 2, 64, 16, False, seed=10)
    out = decode_attention(q, kc, vc, pt, sl, num_splits=1, config=SMALL)
    check(out, q, kc, vc, pt, sl, scales, False)
    strided = torch.zeros(1, 4, 128, dtype=q.dtype, device=q.device)[..., ::2]
    strided.copy_(q)
    assert strided.shape == q.shape
    with pytest.raises(ValueError, match="contiguous"):
        decode_attention(strided, kc, vc, pt, sl, num_splits=1, config=SMALL)


@needs_device
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("mode", ["cvt", "kmma", "pairs_asm", "pairs", "fp16", "bf16"])
def test_every_fp8_compute_path_passes_the_gate(mode: str, prefetch: bool, path) -> None:
    q, kc, vc, pt, sl, scales = make_case([5, 300], 8, 2, 64, 16, True, seed=8)
    cfg = DecodeConfig(block_n=64, fp8_compute=mode, prefetch_pages=prefetch)
    out = decode_attention(q, kc, vc, pt, sl, num_splits=2, config=cfg, **scales)
    check(out, q, kc, vc, pt, sl, scales, True)


@needs_device
@pytest.mark.parametrize(
    ("fp8", "mode"),
    [(False, "pairs"), (True, "pairs"), (True, "fp16")],
    ids=["bf16", "fp8-pairs", "fp8-fp16"],
)
@pytest.mark.parametrize("page_size", [1, 16])
def test_prefetch_changes_no_bit_of_the_result(page_size: int, fp8: bool, mode: str) -> None:
    """The prefetch only moves the page-index loads earlier: same tiles, same arithmetic.

    bf16 KV and both fp8 kernels (int16 pairs, and fp8 through ``_decode_stage1``); splits of
    several tiles each, and a request whose last tile is partial.
    """
    q, kc, vc, pt, sl, scales = make_case([300, 77], 4, 2, 64, page_size, fp8, seed=9)
    outs = [
        decode_attention(
            q,
            kc,
            vc,
            pt,
            sl,
            num_splits=2,
            config=DecodeConfig(block_n=32, fp8_compute=mode, prefetch_pages=p),
            **scales,
        )
        for p in (False, True)
    ]
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])


@needs_device
@pytest.mark.parametrize("asm", [False, True], ids=["triton-ops", "inline-ptx"])
def test_fp8_pair_conversion_is_exact_for_every_code(asm: bool) -> None:
    """All 65536 byte pairs: fp16 bits from integer ops == e4m3 value x 2^-8 (NaN codes aside)."""
    words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).to(DEV)
    even = torch.empty(65536, dtype=torch.float16, device=DEV)
    odd = torch.empty_like(even)
    if asm and INTERPRET:
        pytest.skip("inline PTX runs on the GPU only")
    convert_pairs[(16,)](words, even, odd, BLOCK=4096, ASM=asm)
    pairs = words.view(FP8).view(65536, 2).float()  # little endian: byte 0 is dim 2j
    want_e, want_o = pairs[:, 0] * 2.0**-8, pairs[:, 1] * 2.0**-8
    fin_e, fin_o = torch.isfinite(want_e), torch.isfinite(want_o)
    assert torch.equal(even.float()[fin_e], want_e[fin_e])
    assert torch.equal(odd.float()[fin_o], want_o[fin_o])


def test_fp8_without_scales_is_refused() -> None:
    q, kc, vc, pt, sl, _ = make_case([4], 2, 2, 64, 1, True, device="cpu")
    with pytest.raises(ValueError, match="scale"):
        decode_attention(q, kc, vc, pt, sl, num_splits=1)


@pytest.mark.parametrize(
    ("batch", "kv_heads", "max_len"), [(1, 8, 131072), (8, 8, 16384), (128, 8, 1024), (1, 1, 5)]
)
def test_split_count_fills_the_gpu_without_waste(batch: int, kv_heads: int, max_len: int) -> None:
    cfg = DecodeConfig()
    s = choose_num_splits(batch, kv_heads, max_len, config=cfg, sms=132)
    assert 1 <= s <= cfg.max_splits
    # never more splits than blocks of min_tokens_per_split in the longest request
    assert s <= max(1, -(-max_len // cfg.min_tokens_per_split))
    # enough programs to cover the SMs whenever the request is long enough to split that far
    if max_len >= cfg.min_tokens_per_split * cfg.programs_per_sm * 132 // (batch * kv_heads):
        assert batch * kv_heads * s >= 132


def test_split_plan_balances_unequal_requests() -> None:
    """Pieces of about equal work: a long request gets more splits, short ones one each."""
    cfg = DecodeConfig(block_n=64, programs_per_sm=4, programs_per_sm_varlen=8)
    lens = [32768] + [512] * 63
    splits, split_len = plan_splits(64, 8, max(lens), sum(lens), config=cfg, sms=132)
    assert split_len % 64 == 0 and split_len >= 256
    assert splits * split_len >= max(lens)
    pieces = sum(8 * -(-n // split_len) for n in lens)  # programs that do work
    # fills the GPU without a flood of tiny programs (the varlen target, give or take rounding)
    assert 132 <= pieces <= 2 * cfg.programs_per_sm_varlen * 132
    # the longest piece is not much longer than the planned split length
    assert -(-max(lens) // min(splits, -(-max(lens) // split_len))) <= split_len


@pytest.mark.parametrize(
    ("programs", "max_len", "capacity", "splits", "tokens"),
    [
        # 8 x 16k at 8 KV heads, 3 resident per SM x 132: one wave of 2752 tokens (384
        # programs), not the work-based 7 splits (448 programs: a second, 13% wave).
        (8 * 8, 16384, 396, 6, 2752),
        (1 * 8, 131072, 396, 49, 2688),  # 392 programs: the most one wave holds
        # 32 x 4k: 3 splits are 2 waves of 1408 tokens; 2 splits are 2 waves of 2048
        (32 * 8, 4096, 396, 3, 1408),
        (32 * 8, 4096, 528, 2, 2048),  # at 4 per SM the 512 programs of 2 splits are 1 wave
        (8 * 8, 16384, 528, 8, 2048),
        (128 * 8, 1024, 396, 1, 1024),  # already 2.6 waves unsplit
        (1, 100, 396, 1, 128),  # too short to split at all
    ],
)
def test_wave_model_picks_whole_waves(programs, max_len, capacity, splits, tokens) -> None:
    got = wave_splits(
        programs, max_len, capacity, block_n=64, min_tokens=256, max_splits=256, merge=16
    )
    assert got == splits
    assert cdiv(cdiv(max_len, got), 64) * 64 == tokens
    batch = programs // 8 if programs >= 8 else 1
    kv = 8 if programs >= 8 else 1
    per_sm = capacity // 132
    cfg = DecodeConfig()
    ns, split_len = plan_splits(
        batch,
        kv,
        max_len,
        batch * max_len,
        config=cfg,
        sms=132,
        resident_per_sm=per_sm,
        merge=16,
    )
    assert (ns, split_len) == (splits, tokens)


def test_wave_model_prefers_fewer_splits_only_on_near_ties() -> None:
    """Without merge cost 32 x 4k ties at 3 and 6 splits (2 x 1472 = 4 x 736 token-rounds):
    the fewer wins; a real gain (49 over 48 splits at 1 x 128k, 2.3%) is kept."""
    kw = dict(block_n=64, min_tokens=256, max_splits=256)
    assert wave_splits(256, 4096, 396, **kw) == 3
    assert wave_splits(8, 131072, 396, **kw) == 49
    # the split count never exceeds WAVES_MAX full waves, nor the tiles of min_tokens
    for programs in (1, 8, 64, 512):
        s = wave_splits(programs, 1 << 20, 396, **kw)
        assert programs * s <= max(programs, 4 * 396)
    assert wave_splits(8, 1000, 396, **kw) <= -(-1000 // 256)


# --------------------------------------------------------------------------- GPU gates
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and TRITON_INTERPRET=0)"
)


def _lognormal_lens(batch: int, mean: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(batch).log_normal_(math.log(mean) - 0.5 * 0.6**2, 0.6, generator=g)
    return [max(1, min(int(v), 8 * mean)) for v in x.tolist()]


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("q_heads", "lens", "page_size", "head_dim"),
    [
        (32, [131072], 16, 128),
        (64, [65536], 1, 128),
        (32, [16384] * 8, 16, 128),
        (64, [4096] * 32, 16, 128),
        (32, [1024] * 128, 1, 128),
        (32, "lognormal", 16, 128),
        (32, [16384] * 2, 16, 64),
    ],
    ids=["1x128k", "1x64k-p1", "8x16k", "32x4k", "128x1k-p1", "64xlognormal4k", "2x16k-d64"],
)
def test_gpu_decode_gates_at_benchmark_shapes(
    q_heads, lens, page_size, head_dim, fp8, path
) -> None:
    if lens == "lognormal":
        lens = _lognormal_lens(64, 4096, seed=5)
    q, kc, vc, pt, sl, scales = make_case(lens, q_heads, 8, head_dim, page_size, fp8, device="cuda")
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, kc, vc, pt, sl, out=out, max_seq_len=max(lens), total_tokens=sum(lens), **scales
    )
    check(out, q, kc, vc, pt, sl, scales, fp8)


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("lens", "page_size"),
    [([131072], 16), ([65536], 1), ("lognormal", 16)],
    ids=["1x128k", "1x64k-p1", "64xlognormal4k"],
)
def test_gpu_prefetch_gates_at_benchmark_shapes(lens, page_size, fp8, path) -> None:
    """The compiled page-index prefetch (not only the interpreter's) at the sweep's shapes."""
    if lens == "lognormal":
        lens = _lognormal_lens(64, 4096, seed=5)
    q, kc, vc, pt, sl, scales = make_case(lens, 32, 8, 128, page_size, fp8, device="cuda")
    cfg = replace(default_config(kc.dtype), prefetch_pages=True)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q,
        kc,
        vc,
        pt,
        sl,
        out=out,
        max_seq_len=max(lens),
        total_tokens=sum(lens),
        config=cfg,
        **scales,
    )
    check(out, q, kc, vc, pt, sl, scales, fp8)
