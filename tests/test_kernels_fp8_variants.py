"""The default fp8 stage 1 (kernels/decode_fp8.py, the hardware conversion) and its launch configs
against the fp32 reference, and against the integer-op fp8 kernel bit for bit.

Each config passes the gates of the integer-op fp8 path: NaN-filled unused slots, odd lengths,
GQA, pages 1 and 16, per-head and per-tensor fp8 scales, both launch paths. In the CPU
interpreter inline PTX cannot run, so the candidate's conversion takes Triton ops there (the
integer bit moves x 2^8); every test records which conversion ran (``conversion`` in the
junit properties, and the assertion on :func:`conversion_path`). On a GPU (``-m gpu`` with
``TRITON_INTERPRET=0``) the same tests run the PTX ``cvt.rn.f16x2.e4m3x2`` path.
"""

from __future__ import annotations

import os
from dataclasses import replace

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from decode_cases import check  # noqa: E402
from kdash.kernels import decode_fp8, decode_plan  # noqa: E402
from kdash.kernels._common import to_e4m3  # noqa: E402
from kdash.kernels.decode_attention import (  # noqa: E402
    DEFAULT_FP8_CONFIG,
    PAIRS_FP8_CONFIG,
    DecodeConfig,
    decode_attention,
    default_config,
)
from kdash.kernels.decode_fp8 import (  # noqa: E402
    Fp8Config,
    _decode_stage1_fp8_cvt,
    _fp8_pairs_cvt,
    _q_fp8_split,
    conversion_path,
)
from kdash.kernels.kv_cache import FP8, build_paged_cache, fp8_scales  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="no CUDA and not interpreting"
)
# Small tiles keep the interpreter's runs short; the candidates' configs as the GPU script runs
# them, scaled down: the hardware conversion at one and two pipeline stages, and with the
# register cap (which the interpreter, compiling nothing, leaves out).
VARIANTS = {
    "cvt": DecodeConfig(block_n=64, fp8_compute="cvt", prefetch_pages=True),
    "cvt-plain": DecodeConfig(block_n=64, fp8_compute="cvt", prefetch_pages=False),
    "cvt-3stages": DecodeConfig(block_n=32, num_stages=3, fp8_compute="cvt"),
    "cvt-maxnreg": Fp8Config(block_n=64, fp8_compute="cvt", maxnreg=128),
    "kmma": DecodeConfig(block_n=64, fp8_compute="kmma", prefetch_pages=True),
}
with_variant = pytest.mark.parametrize("cfg", list(VARIANTS.values()), ids=list(VARIANTS))


@pytest.fixture(params=[False, True], ids=["two-launch", "fused"])
def path(request, monkeypatch) -> bool:
    monkeypatch.setattr(decode_plan, "FUSED_DEFAULT", request.param)
    return request.param


@pytest.fixture
def which(record_property):
    """Records (and checks) which conversion a config runs here."""

    def say(cfg: DecodeConfig) -> str:
        ran = conversion_path(cfg, INTERPRET)
        record_property("conversion", ran)
        assert ran == ("triton-ops" if INTERPRET else "ptx-cvt")
        return ran

    return say


@triton.jit
def _convert(W, Even, Odd, BLOCK: tl.constexpr, ASM: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    e, o = _fp8_pairs_cvt(tl.load(W + offs), ASM)
    tl.store(Even + offs, e)
    tl.store(Odd + offs, o)


@triton.jit
def _e4m3_round_trip(X, Y, BLOCK: tl.constexpr, EMULATE: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, to_e4m3(tl.load(X + offs), EMULATE).to(tl.float32))


@triton.jit
def _split_q(Q, HI, LO, MUL, H: tl.constexpr, D: tl.constexpr, EMULATE: tl.constexpr):
    offs = tl.arange(0, H)[:, None] * D + tl.arange(0, D)[None, :]
    hi, lo, mul = _q_fp8_split(tl.load(Q + offs), EMULATE)
    tl.store(HI + offs, hi.to(tl.float32))
    tl.store(LO + offs, lo.to(tl.float32))
    tl.store(MUL + tl.arange(0, H), mul)


@needs_device
def test_e4m3_rounding_is_round_to_nearest_even_everywhere() -> None:
    """to_e4m3 (emulated in the interpreter, cvt.rn.satfinite on the GPU) equals torch's
    conversion: carries into the next power of two (the interpreter's own cast gets -126.3 ->
    -64), ties, subnormals, zero and the range's ends."""
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(4096, generator=g) * s for s in (100, 1, 0.01, 0.003, 0.0005)]
    grid = torch.arange(-448, 448, 0.0625)  # every e4m3 tie above 2 and the values between
    tiny = torch.arange(-64, 64) * 2.0**-11  # around the subnormal quantum 2^-9
    x = torch.cat([*parts, grid, tiny, torch.tensor([0.0, 448.0, -448.0, 15.99, 16.0])])
    x = torch.cat([x, torch.zeros(-len(x) % 1024)]).float().to(DEV)
    y = torch.empty_like(x)
    _e4m3_round_trip[(len(x) // 1024,)](x, y, BLOCK=1024, EMULATE=INTERPRET)
    assert torch.equal(y.cpu(), x.cpu().to(FP8).float())


@needs_device
def test_q_split_holds_a_bf16_query_exactly_within_e4m3s_range() -> None:
    """kmma's Q terms: (hi + lo) / (16 mul) gives back a bf16 query row (8 significant bits in
    two 4-bit terms), |hi| <= 256 and |lo| <= 8 (e4m3 holds 448), mul a power of two putting
    the row's largest in [8, 16), rows of any magnitude, a zero row stays zero."""
    g = torch.Generator().manual_seed(6)
    rows = [torch.randn(1, 128, generator=g) * s for s in (1, 1e3, 1e-3, 3.7, 0.02, 60, 1)]
    rows.append(torch.zeros(1, 128))
    rows[-2][0, 5] = 8.0  # the row's largest |q| an exact power of two
    q = torch.cat(rows).bfloat16().to(DEV)
    hi, lo = torch.empty(8, 128, device=DEV), torch.empty(8, 128, device=DEV)
    mul = torch.empty(8, device=DEV)
    _split_q[(1,)](q, hi, lo, mul, H=8, D=128, EMULATE=INTERPRET)
    assert hi.abs().max() <= 256 and lo.abs().max() <= 8
    top_scaled = (q.float().abs().amax(1) * mul)[:-1]  # the zero row aside
    assert ((top_scaled >= 8) & (top_scaled < 16)).all()
    assert torch.equal(torch.exp2(torch.log2(mul).round()), mul)  # powers of two
    back, qf = (hi + lo) / (16 * mul[:, None]), q.float()
    top = qf.abs().amax(1, keepdim=True)
    # e4m3's normal range holds both terms of an element down to 1/64 of its row's largest;
    # below that the subnormals' fixed quantum leaves an error far under the row's scale
    normal = qf.abs() >= top / 64
    assert torch.equal(back[normal], qf[normal])
    assert ((back - qf).abs() <= top * 2.0**-12).all()
    assert torch.equal(back[-1], torch.zeros(128, device=DEV))


def make_case(lens, q_heads, kv_heads, head_dim, page_size, *, seed=0):
    """A random fp8 paged cache (NaN in every unowned slot), per-head scales, and the queries."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    mult = torch.linspace(0.5, 2.0, kv_heads, device=DEV).view(1, -1, 1)
    ks = [torch.randn(n, kv_heads, head_dim, generator=g, device=DEV) * mult for n in lens]
    vs = [torch.randn(n, kv_heads, head_dim, generator=g, device=DEV) for n in lens]
    scales = dict(k_scale=fp8_scales(torch.cat(ks)), v_scale=fp8_scales(torch.cat(vs)))
    kc, vc, pt, sl = build_paged_cache(
        ks, vs, page_size, dtype=FP8, generator=torch.Generator().manual_seed(seed), **scales
    )
    q = torch.randn(len(lens), q_heads, head_dim, generator=g, device=DEV).bfloat16()
    return q, kc, vc, pt, sl, scales


@needs_device
@pytest.mark.parametrize("asm", [False, True], ids=["triton-ops", "ptx-cvt"])
def test_conversion_is_exact_for_every_code(asm: bool, record_property) -> None:
    """All 65536 byte pairs: the fp16 values are the e4m3 values, exactly (NaN codes aside)."""
    if asm and INTERPRET:
        pytest.skip("inline PTX runs on the GPU only")
    record_property("conversion", "ptx-cvt" if asm else "triton-ops")
    words = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).to(DEV)
    even = torch.empty(65536, dtype=torch.float16, device=DEV)
    odd = torch.empty_like(even)
    _convert[(16,)](words, even, odd, BLOCK=4096, ASM=asm)
    pairs = words.view(FP8).view(65536, 2).float()  # little endian: byte 0 is dim 2j
    fin_e, fin_o = torch.isfinite(pairs[:, 0]), torch.isfinite(pairs[:, 1])
    assert torch.equal(even.float()[fin_e], pairs[fin_e, 0])
    assert torch.equal(odd.float()[fin_o], pairs[fin_o, 1])


@needs_device
@with_variant
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [1, 16])
def test_variant_matches_reference(page_size: int, head_dim: int, cfg, path, which) -> None:
    # Odd lengths, two shorter than the split count; 500 gives a split several tiles.
    which(cfg)
    q, kc, vc, pt, sl, scales = make_case([1, 5, 100, 500], 8, 2, head_dim, page_size)
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    decode_attention(q, kc, vc, pt, sl, num_splits=4, config=cfg, out=out, **scales)
    check(out, q, kc, vc, pt, sl, scales)


@needs_device
def test_a_v_cache_of_its_own_layout_takes_its_own_strides(path) -> None:
    """The cvt kernels take V's addresses from K's row offsets (KV_SAME) where the caches share
    a layout; a V cache laid out otherwise (here every head in a row twice as wide, the second
    half NaN) is read through its own strides, and a plan that sees both kinds in turn gives the
    reference output for each, and for the like caches the same bits as a plan without
    KV_SAME."""
    q, kc, vc, pt, sl, scales = make_case([5, 300, 77], 8, 2, 64, 16, seed=4)
    wide = torch.full((*vc.shape[:3], 128), float("nan"), device=DEV).to(FP8)
    wide[..., :64] = vc
    v_own = wide[..., :64]
    assert v_own.stride() != kc.stride()
    kw = dict(max_seq_len=300, kv_dtype=FP8, **scales)
    plan = decode_plan.DecodePlan(pt, sl, 8, 2, 64, 16, config=VARIANTS["cvt"], **kw)
    for v in (vc, v_own, vc):
        out = plan.run(q, kc, v).clone()
        assert plan._s1.meta["KV_SAME"] is (v is vc)
        check(out, q, kc, v, pt, sl, scales)
    try:
        decode_fp8.KV_SAME_DEFAULT = False
        apart = decode_plan.DecodePlan(pt, sl, 8, 2, 64, 16, config=VARIANTS["cvt"], **kw)
    finally:
        decode_fp8.KV_SAME_DEFAULT = True
    assert torch.equal(apart.run(q, kc, vc), plan.run(q, kc, vc))
    assert apart._s1.meta["KV_SAME"] is False


@needs_device
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(2, 2), (8, 1), (6, 2)])
def test_variant_gqa_groups(q_heads: int, kv_heads: int, path, which) -> None:
    cfg = VARIANTS["cvt"]
    which(cfg)
    q, kc, vc, pt, sl, scales = make_case([7, 130], q_heads, kv_heads, 64, 16, seed=1)
    out = decode_attention(q, kc, vc, pt, sl, config=cfg, max_seq_len=130, **scales)
    check(out, q, kc, vc, pt, sl, scales)


@needs_device
@pytest.mark.parametrize("page_size", [1, 16])
def test_variant_equals_the_current_kernel_bit_for_bit(page_size: int, which) -> None:
    """The current kernel's fp16 values are the e4m3 values x 2^-8 and its scales carry the 2^8:
    powers of two, so every product and sum is the same number and the outputs are equal."""
    cfg = VARIANTS["cvt"]
    which(cfg)
    q, kc, vc, pt, sl, scales = make_case([300, 77, 3], 8, 2, 64, page_size, seed=5)
    outs = [
        decode_attention(q, kc, vc, pt, sl, num_splits=3, config=c, **scales).clone()
        for c in (cfg, DecodeConfig(block_n=64, fp8_compute="pairs_asm"))
    ]
    assert torch.isfinite(outs[0].float()).all()
    assert torch.equal(outs[0], outs[1])


@needs_device
def test_variant_per_tensor_scale_as_float(which) -> None:
    cfg = VARIANTS["cvt"]
    which(cfg)
    q, kc, vc, pt, sl, _ = make_case([40, 9], 4, 2, 64, 16, seed=4)
    kf, vf = kc.float().nan_to_num(0.0).to(FP8), vc.float().nan_to_num(0.0).to(FP8)
    a = decode_attention(q, kf, vf, pt, sl, k_scale=0.5, v_scale=2.0, config=cfg)
    ks = torch.full((2,), 0.5, device=q.device)
    vs = torch.full((2,), 2.0, device=q.device)
    b = decode_attention(q, kf, vf, pt, sl, k_scale=ks, v_scale=vs, config=cfg)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    check(a, q, kf, vf, pt, sl, dict(k_scale=ks, v_scale=vs))


@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_plan_picks_the_variant_kernel(fused: bool) -> None:
    """fp8_compute="cvt" selects decode_fp8's kernel (inlined into the fused one), the current
    config stays on the current kernel, and the register cap reaches the compile options only
    where something is compiled."""
    q, kc, vc, pt, sl, scales = make_case([9], 4, 2, 64, 16)
    kw = dict(max_seq_len=9, kv_dtype=FP8, fused=fused, **scales)
    cvt = decode_plan.DecodePlan(pt, sl, 4, 2, 64, 16, config=VARIANTS["cvt-maxnreg"], **kw)
    cur = decode_plan.DecodePlan(pt, sl, 4, 2, 64, 16, config=DecodeConfig(block_n=64), **kw)
    if fused:
        assert cvt._meta1["CVT"] is True and "CVT" not in cur._meta1
    else:
        assert cvt._kern1 is _decode_stage1_fp8_cvt and cur._kern1 is not _decode_stage1_fp8_cvt
    assert cvt.pairs and cur.pairs
    assert ("maxnreg" in cvt._meta1) == (not INTERPRET)
    assert "maxnreg" not in cur._meta1


def test_the_fp8_default_is_the_hardware_conversion_at_the_fp8_launch_config() -> None:
    """What the H200 picked: the integer-op kernel's launch config with the conversion changed;
    every default asks for the L2 hint (sessions 20 and 21, on the H100); bf16 keeps its own
    launch config."""
    cfg = default_config(FP8)
    assert cfg is DEFAULT_FP8_CONFIG and cfg.fp8_compute == "cvt" and cfg.evict_first
    assert PAIRS_FP8_CONFIG.fp8_compute == "pairs_asm" and PAIRS_FP8_CONFIG.evict_first
    assert replace(cfg, fp8_compute="pairs_asm") == PAIRS_FP8_CONFIG
    assert default_config(torch.bfloat16).evict_first
    assert (cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.programs_per_sm) == (128, 4, 2, 3)
    assert default_config(torch.bfloat16).fp8_compute == "pairs_asm"  # not read for bf16
    assert default_config(torch.bfloat16).block_n == 64


@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_a_plan_without_a_config_runs_the_hardware_conversion(fused: bool) -> None:
    q, kc, vc, pt, sl, scales = make_case([9], 4, 2, 64, 16)
    plan = decode_plan.DecodePlan(
        pt, sl, 4, 2, 64, 16, max_seq_len=9, kv_dtype=FP8, fused=fused, **scales
    )
    assert plan.config is DEFAULT_FP8_CONFIG  # here (interpreter): no capability to check
    if fused:
        assert plan._meta1["CVT"] is True
    else:
        assert plan._kern1 is _decode_stage1_fp8_cvt
    check(plan.run(q, kc, vc).clone(), q, kc, vc, pt, sl, scales)


@pytest.mark.parametrize(
    ("capability", "runs"),
    [(None, "cvt"), ((8, 0), "pairs_asm"), ((8, 6), "pairs_asm"), ((8, 9), "cvt"), ((9, 0), "cvt")],
)
def test_a_gpu_without_the_conversion_instruction_runs_the_integer_op_kernel(capability, runs):
    """cvt.rn.f16x2.e4m3x2 is sm_89+: below that the same launch config (the register cap
    included) on the integer-op conversion; other modes are left alone."""
    capped = Fp8Config(**{**vars(DEFAULT_FP8_CONFIG), "maxnreg": 128})
    got = decode_plan.runnable_config(capped, capability)
    assert got.fp8_compute == runs
    assert isinstance(got, Fp8Config) and got.maxnreg == 128
    assert replace(got, fp8_compute="cvt") == capped
    for mode in ("pairs_asm", "pairs", "fp16", "bf16"):
        cfg = DecodeConfig(fp8_compute=mode)
        assert decode_plan.runnable_config(cfg, capability) is cfg
    # kmma's e4m3 operands are sm_89+ as well
    kmma = DecodeConfig(fp8_compute="kmma")
    assert decode_plan.runnable_config(kmma, capability).fp8_compute == (
        "kmma" if runs == "cvt" else "pairs_asm"
    )


# --------------------------------------------------------------------------- GPU gates
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and TRITON_INTERPRET=0)"
)
# The candidates at the GPU script's launch configs (bench/gpu_fp8_variants.py).
GPU_VARIANTS = {
    "cvt": DecodeConfig(block_n=128, fp8_compute="cvt", programs_per_sm=3),
    "cvt_64_3stages": DecodeConfig(block_n=64, num_stages=3, fp8_compute="cvt"),
    "cvt_64_4stages": DecodeConfig(block_n=64, num_stages=4, fp8_compute="cvt"),
    "cvt_maxnreg128": Fp8Config(block_n=128, fp8_compute="cvt", programs_per_sm=3, maxnreg=128),
    "cvt_32_1warp": DecodeConfig(block_n=32, num_warps=1, num_stages=3, fp8_compute="cvt"),
}


@gpu
@needs_cuda
def test_gpu_ptx_conversion_is_exact_for_every_code(record_property) -> None:
    test_conversion_is_exact_for_every_code(True, record_property)


@gpu
@needs_cuda
@pytest.mark.parametrize("cfg", list(GPU_VARIANTS.values()), ids=list(GPU_VARIANTS))
@pytest.mark.parametrize(
    ("q_heads", "lens", "page_size"),
    [(64, [65536], 1), (32, [16384] * 8, 16)],
    ids=["1x64k-p1", "8x16k"],
)
def test_gpu_variant_gates_at_benchmark_shapes(q_heads, lens, page_size, cfg, path, which) -> None:
    which(cfg)
    q, kc, vc, pt, sl, scales = make_case(lens, q_heads, 8, 128, page_size)
    out = torch.full_like(q, float("nan"))
    decode_attention(
        q, kc, vc, pt, sl, out=out, max_seq_len=max(lens), total_tokens=sum(lens), config=cfg,
        **scales,
    )  # fmt: skip
    check(out, q, kc, vc, pt, sl, scales)


@gpu
@needs_cuda
def test_gpu_default_plan_runs_the_hardware_conversion_on_sm89_and_later() -> None:
    q, kc, vc, pt, sl, scales = make_case([16384] * 2, 32, 8, 128, 16)
    plan = decode_plan.DecodePlan(
        pt, sl, 32, 8, 128, 16, max_seq_len=16384, total_tokens=32768, kv_dtype=FP8, **scales
    )
    sm89 = torch.cuda.get_device_capability() >= (8, 9)
    assert plan.config.fp8_compute == ("cvt" if sm89 else "pairs_asm")
    assert conversion_path(plan.config, False) == ("ptx-cvt" if sm89 else "other")
    check(plan.run(q, kc, vc).clone(), q, kc, vc, pt, sl, scales)


def _load_gpu_script():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "gpu_fp8_variants.py"
    spec = importlib.util.spec_from_file_location("gpu_fp8_variants", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(not INTERPRET, reason="the CPU wiring check of the GPU script")
def test_gpu_script_wiring_on_the_cpu(tmp_path, monkeypatch) -> None:
    """bench/gpu_fp8_variants.py end to end on CPU cases in the interpreter: real plans, real
    gates, real JSON; only the GPU timers (do_bench, graph replay) are stood in for by one
    timed call each, since they need CUDA. Tiny shapes, "long context" moved down to them."""
    from kdash.kernels import bench as kbench

    mod = _load_gpu_script()
    monkeypatch.setattr(kbench, "DEVICE", "cpu")
    monkeypatch.setattr(mod, "HEADS", [(4, 2, 64)])
    monkeypatch.setattr(mod, "SHAPES", [(1, 300), (2, 130)])
    monkeypatch.setattr(mod, "LONG_CONTEXT", 200)

    def one_call_ms(fn, **_):
        import time

        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    monkeypatch.setattr(mod, "bench_ms", one_call_ms)
    monkeypatch.setattr(mod, "bench_graph_ms", one_call_ms)
    out = tmp_path / "v.json"
    only = "pairs_asm,cvt_fused,cvt_vstrides,kmma"
    rc = mod.main(["--out", str(out), "--only", only, "--no-lognormal"])
    assert rc == 0
    import json

    res = json.loads(out.read_text())
    assert [s["long_context"] for s in res["shapes"]] == [True, False]
    assert set(res["summary"]) == set(only.split(","))
    for name, sm in res["summary"].items():
        assert sm["gate"]["passed"], (name, sm["gate"])
        assert sm["shapes_timed"] == 2
        assert sm["fp8_speedup"] is not None and sm["fp8_speedup"] > 0
    assert res["variants"]["cvt_fused"]["fused"] and not res["variants"]["pairs_asm"]["fused"]
    assert res["variants"]["cvt_fused"]["conversion"] == "ptx-cvt"  # what the GPU will run
    assert res["variants"]["pairs_asm"]["fp8_compute"] == "pairs_asm"
    for s in res["shapes"]:
        assert s["times"]["cvt_fused"]["fused"] and not s["times"]["pairs_asm"]["fused"]
        assert s["times"]["bf16_fused"]["fused"]
        # the switch holds for its variant's plans only, and is put back after
        assert s["times"]["cvt_vstrides"]["kv_same"] is False
        assert s["times"]["cvt_fused"]["kv_same"] is True and s["times"]["kmma"]["kv_same"] is True
    assert res["variants"]["cvt_vstrides"]["switches"] == {"KV_SAME_DEFAULT": False}
    assert res["variants"]["kmma"]["fp8_compute"] == "kmma"
    assert decode_fp8.KV_SAME_DEFAULT is True
