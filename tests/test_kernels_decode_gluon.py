"""The TMA decode stage 1 (kernels/decode_gluon.py): what it refuses, how a plan takes it, that
it compiles for sm_90 into the schedule it is written as, and that the launcher hands it the
plan's scratch buffer.

Gluon has no interpreter and this machine no GPU: the plan's choice is checked with the
kernel's refusal stood in for (``unsupported_reason`` patched to accept), the compile test runs
Triton's real compiler for an sm_90 target on the CPU, the launcher test gives the bound kernel
a stand-in compiled kernel whose launcher records its call (as tests/test_kernels_plan.py does),
and the numerics are gated on the GPU only (the ``gpu`` tests below, and
bench/gpu_decode_gluon.py, whose first H200 run is bench/results/decode-gluon-h200-run1.json).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import json
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kdash.kernels import decode_gluon, l2_hint, launch  # noqa: E402
from kdash.kernels.decode_attention import DecodeConfig  # noqa: E402
from kdash.kernels.decode_gluon import TmaConfig, unsupported_reason  # noqa: E402
from kdash.kernels.decode_plan import DecodePlan  # noqa: E402
from kdash.kernels.kv_cache import FP8, build_paged_cache, fp8_scales  # noqa: E402
from kdash.kernels.reference import baseline_for, decode_reference, error_gate  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_gluon = pytest.mark.skipif(decode_gluon.gluon is None, reason="no Gluon in this Triton")


SCALES: dict = {}  # the fp8 scales of the last case made (per test: cases are made first)


def make_case(lens, q_heads, kv_heads, page_size=16, *, device="cpu", fp8=False, seed=0):
    """A paged cache (NaN in every unowned slot), its page table and lengths, and a query batch;
    fp8: per-KV-head scales (unequal head magnitudes, so a swapped scale shows) in SCALES."""
    g = torch.Generator(device=device).manual_seed(seed)
    ks = [torch.randn(n, kv_heads, 128, generator=g, device=device) for n in lens]
    vs = [torch.randn(n, kv_heads, 128, generator=g, device=device) for n in lens]
    SCALES.clear()
    if fp8:
        mult = torch.linspace(0.5, 2.0, kv_heads, device=device).view(1, -1, 1)
        ks = [k * mult for k in ks]
        SCALES.update(k_scale=fp8_scales(torch.cat(ks)), v_scale=fp8_scales(torch.cat(vs)))
    kc, vc, pt, sl = build_paged_cache(
        ks, vs, page_size, dtype=FP8 if fp8 else torch.bfloat16,
        generator=torch.Generator().manual_seed(seed), **SCALES,
    )  # fmt: skip
    q = torch.randn(len(lens), q_heads, 128, generator=g, device=device).bfloat16()
    return q, kc, vc, pt, sl


def plan_for(q, kc, pt, sl, config, **kw) -> DecodePlan:
    return DecodePlan(
        pt, sl, q.shape[1], kc.shape[2], 128, kc.shape[1], max_seq_len=int(sl.max()),
        kv_dtype=kc.dtype, q_dtype=q.dtype, config=config, **SCALES, **kw,
    )  # fmt: skip


def test_refuses_what_it_cannot_run(monkeypatch) -> None:
    """One reason for each thing the kernel is not written for; None for what it is."""
    bf, ok = torch.bfloat16, (9, 0)
    if decode_gluon.gluon is not None:
        assert unsupported_reason(bf, 128, 16, 4, ok) is None
        assert unsupported_reason(bf, 128, 16, 4, ok, (16 * 1024, 1024, 128, 1)) is None
        assert "sm_90" in unsupported_reason(bf, 128, 16, 4, (8, 0))
        assert "sm_90" in unsupported_reason(bf, 128, 16, 4, None)
        assert unsupported_reason(FP8, 128, 16, 4, ok) is None
        assert "bf16 or fp8" in unsupported_reason(torch.float16, 128, 16, 4, ok)
        # fp8 rows are bytes: 16-byte aligned token rows at 128 heads x 1 byte
        assert unsupported_reason(FP8, 128, 16, 4, ok, (16 * 128, 128, 128, 1)) is None
        assert "head dim" in unsupported_reason(bf, 64, 16, 4, ok)
        assert "pages of 16" in unsupported_reason(bf, 128, 1, 4, ok)
        assert "query heads" in unsupported_reason(bf, 128, 16, 32, ok)
        # a page stride other than 16 token rows (a cache with padding between pages)
        assert "strides" in unsupported_reason(bf, 128, 16, 4, ok, (17 * 1024, 1024, 128, 1))
    monkeypatch.setattr(decode_gluon, "gluon", None)
    assert "no Gluon" in unsupported_reason(bf, 128, 16, 4, ok)


def test_a_plan_that_cannot_take_it_runs_the_triton_kernel_and_says_why() -> None:
    """On the CPU (the interpreter; no sm_90) a TmaConfig plan keeps the Triton stage 1, says
    why, and gives what the same plan without it gives."""
    q, kc, vc, pt, sl = make_case([5, 300, 77], 8, 2, seed=3)
    plan = plan_for(q, kc, pt, sl, TmaConfig(block_n=64, prefetch_pages=False))
    assert not plan.tma and "sm_90" in plan.tma_refused
    assert plan._scratch is None
    base = plan_for(q, kc, pt, sl, DecodeConfig(block_n=64, prefetch_pages=False))
    assert torch.equal(plan.run(q, kc, vc), base.run(q, kc, vc).clone())
    assert plan_for(q, kc, pt, sl, DecodeConfig()).tma_refused is None  # not asked for


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_plan_takes_it_where_it_runs(fp8, monkeypatch) -> None:
    """With the kernel's refusal stood in for (no sm_90 here): the plan launches this module's
    kernels on either path (stage 1 then the merge kernel; one launch with Gluon merge
    programs), one warp a program, the ring depth from the config, no Triton pipeline options,
    and a scratch buffer of the descriptors' size for every program of the grid; fp8 bytes are
    read as they are (not as the Triton kernels' int16 pairs, whose strides are halved)."""
    monkeypatch.setattr(decode_gluon, "unsupported_reason", lambda *a, **k: None)
    q, kc, vc, pt, sl = make_case([4096], 32, 8, seed=4, fp8=fp8)
    for fused, kern in ((False, "_decode_stage1_gluon"), (True, "_decode_fused_gluon")):
        plan = plan_for(q, kc, pt, sl, TmaConfig(stages=4), fused=fused)
        assert plan.tma and plan.tma_refused is None and plan.fused is fused
        assert plan._kern1 is getattr(decode_gluon, kern)
        meta = plan._meta1
        assert meta["num_warps"] == 1 and meta["STAGES"] == 4
        assert meta["KV_LAYOUT"] == decode_gluon.kv_layout(fp8) and meta["IS_FP8"] is fp8
        assert not plan.pairs
        assert "PREFETCH" not in meta and "num_stages" not in meta and "EVICT" not in meta
        assert ("CHUNK" in meta) is fused  # the merge programs' chunk of splits
        programs = plan._grid1[0] * plan._grid1[1] * plan._grid1[2]
        assert plan._grid1[2] == plan.num_splits + (4 if fused else 0)
        assert plan._scratch.numel() == programs * decode_gluon.SCRATCH_PER_PROGRAM
        assert (plan._s2 is None) is fused  # two launches: the plan's merge kernel follows
    # a cache the descriptors cannot view as token rows (padding between pages): refused
    padded = torch.zeros(kc.shape[0], 17, 8, 128).to(kc.dtype)[:, :16]
    with pytest.raises(ValueError, match="TMA decode needs"):
        plan.run(q, padded, padded)


def test_the_default_switch(monkeypatch) -> None:
    """With TMA_DEFAULT on (for every KV type, or for the plan's), a plan made without a config
    on an sm_90 (stood in for) is given the TmaConfig of its KV type's default (with
    L2_HINT_DEFAULT, asking for the L2 hint); elsewhere, or with it off, the Triton default."""
    from kdash.kernels import decode_plan
    from kdash.kernels.decode_attention import default_config

    q, kc, vc, pt, sl = make_case([300], 8, 2, seed=8)
    monkeypatch.setattr(decode_plan, "capability_of", lambda _d: (9, 0))
    assert type(plan_for(q, kc, pt, sl, None).config) is DecodeConfig
    monkeypatch.setattr(decode_gluon, "TMA_DEFAULT", True)
    cfg = plan_for(q, kc, pt, sl, None).config
    if decode_gluon.gluon is not None:
        assert isinstance(cfg, TmaConfig) and cfg.block_n == default_config(kc.dtype).block_n
        assert cfg.l2_evict_first is False
        monkeypatch.setattr(decode_gluon, "L2_HINT_DEFAULT", True)
        monkeypatch.setattr(decode_gluon.l2_hint, "install", lambda: None)  # no hook installed
        monkeypatch.setattr(decode_gluon, "unsupported_reason", lambda *a, **k: None)
        hinted = plan_for(q, kc, pt, sl, None)
        assert hinted.config.l2_evict_first and hinted._meta1["L2_HINT"] is True
    monkeypatch.setattr(decode_gluon, "TMA_DEFAULT", frozenset({torch.float8_e4m3fn}))
    assert type(plan_for(q, kc, pt, sl, None).config) is DecodeConfig  # bf16 KV: not in it
    monkeypatch.setattr(decode_gluon, "TMA_DEFAULT", frozenset({torch.bfloat16}))
    if decode_gluon.gluon is not None:
        assert isinstance(plan_for(q, kc, pt, sl, None).config, TmaConfig)
    monkeypatch.setattr(decode_plan, "capability_of", lambda _d: (8, 0))
    assert type(plan_for(q, kc, pt, sl, None).config) is DecodeConfig


def _stand_in_launch(scratch_size: int, annotated: bool, calls: list):
    """A compiled kernel whose launcher records its call (Triton 3.6's and 3.9's layouts)."""
    runner = SimpleNamespace(
        launch=lambda *a: calls.append(a), global_scratch_size=scratch_size,
        profile_scratch_size=0, launch_cooperative_grid=False, launch_pdl=False, num_ctas=1,
    )  # fmt: skip
    if annotated:
        runner.arg_annotations, runner.kernel_signature = "ANN", b"SIG"
    return SimpleNamespace(run=runner, function=77, packed_metadata=(1, 1, 0))


@pytest.mark.parametrize("annotated", [False, True], ids=["triton-3.6", "triton-3.9"])
def test_the_launcher_passes_the_plans_scratch(annotated, monkeypatch) -> None:
    """A kernel that needs global scratch gets a direct launcher only with a buffer of at least
    its size a program, and that buffer's pointer goes where Triton's launcher puts its own."""
    monkeypatch.setattr(launch.triton, "__version__", "3.9.0" if annotated else "3.6.0")
    calls: list = []
    compiled = _stand_in_launch(256, annotated, calls)
    grid, tail = (2, 3, 4), (16, True)
    assert launch._direct_entry(compiled, grid, tail) is None
    assert launch._direct_entry(compiled, grid, tail, (4096, 128)) is None  # too small
    fire = launch._direct_entry(compiled, grid, tail, (4096, 256))
    assert fire is not None
    fire(5, 111, 222)
    (a,) = calls
    assert a[:5] == (2, 3, 4, 5, 77)
    if annotated:  # packed, launch metadata, hooks x2, global scratch, profile scratch
        assert a[7] == (1, 1, 0) and a[8:11] == (None,) * 3 and a[11] == 4096 and a[12] is None
        assert a[15] == (111, 222, 16, True)
    else:  # global scratch, profile scratch, packed, launch metadata, hooks x2
        assert a[7] == 4096 and a[8] is None and a[9] == (1, 1, 0) and a[10:13] == (None,) * 3
        assert a[13:] == (111, 222, 16, True)
    # a kernel that needs none launches as before, whatever it is given
    calls.clear()
    plain = _stand_in_launch(0, annotated, calls)
    launch._direct_entry(plain, grid, tail, (4096, 256))(5, 111, 222)
    assert (calls[0][11] if annotated else calls[0][7]) is None


COMPILE_SM90 = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from kdash.kernels import decode_gluon as dg
from kdash.kernels import l2_hint

meta, fused, kv = json.loads(sys.argv[1]), sys.argv[2] == "fused", sys.argv[3]
warps = meta.pop("num_warps", 1)
meta_nreg = meta.pop("maxnreg", 0)
if meta.get("L2_HINT"):
    assert l2_hint.install() is None
fn = dg._decode_fused_gluon if fused else dg._decode_stage1_gluon
names = ("Q K V PT LENS KS VS OP LSEP " + ("Out LSE FLAGS " if fused else "")
         + "qk_scale num_splits split_len_hint capacity "
         "stride_qb stride_qh stride_kp stride_ks stride_kh stride_vp stride_vs stride_vh "
         "stride_ptb" + (" stride_outb stride_outh" if fused else "")).split()
outs = ["*bf16", "*fp32", "*i32"] if fused else []
ptrs = ["*bf16", kv, kv] + ["*i32"] * 2 + ["*fp32"] * 4 + outs
types = ptrs + ["fp32"] + ["i32"] * (len(names) - len(ptrs) - 1)
sig = dict(zip(names, types))
given = dict(meta, KV_LAYOUT=dg.kv_layout(meta["IS_FP8"]))
# in the kernel's parameter order; constexprs the plan leaves out at their defaults
const = {p.name: given.get(p.name, p.default) for p in fn.params if p.is_constexpr}
for k in const:
    sig[k] = "constexpr"
const = {(list(sig).index(k),): v for k, v in const.items()}
attrs = {(i,): [["tt.divisibility", 16]] for i in range(len(ptrs))}
src = GluonASTSource(fn, sig, const, attrs=attrs)
opts = {"num_warps": warps, **({"maxnreg": meta_nreg} if meta_nreg else {})}
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
if len(sys.argv) > 4:
    open(sys.argv[4], "wb").write(k.asm["cubin"])
print(json.dumps({"num_warps": k.metadata.num_warps, "shared": k.metadata.shared,
                  "scratch": k.metadata.global_scratch_size, "ptx": k.asm["ptx"],
                  "hinted": l2_hint.hinted(k)}))
"""


def _compile_sm90(meta: dict, fused: bool, kv: str, cache) -> dict:
    """COMPILE_SM90 in a child process (a private Triton cache, no interpreter): its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_SM90, json.dumps(meta), "fused" if fused else "two", kv],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_compiles_for_sm90_into_its_schedule(fused, fp8, tmp_path, monkeypatch) -> None:
    """The plan's own compile-time values (refusal stood in for), compiled by Triton for sm_90
    on the CPU: one warp; TMA tile copies completing on mbarriers; mma.sync (not the
    interpreter's fp32 dots); shared memory of the ring (6 slots of K and V pages, 48 KiB and a
    little) so 4 programs fit an H200 SM; descriptor scratch within what the plan allocates.
    One launch: the partials published by a release exchange after the CTA barrier, the merge
    programs polling with GPU-scope acquire loads and a sleep, no fence on either side (the
    bench's ``--fenced-merge``: a fence before the exchange, volatile polls and a fence after
    them, as the Triton kernel's fenced form). fp8: one copy a
    page (128-byte rows), the bytes widened by the e4m3 -> f16 conversion, fp16 mma, half the
    ring's bytes."""
    monkeypatch.setattr(decode_gluon, "unsupported_reason", lambda *a, **k: None)
    q, kc, vc, pt, sl = make_case([1000], 32, 8, seed=5, fp8=fp8)
    plan = plan_for(q, kc, pt, sl, TmaConfig(), fused=fused)
    meta = {k: v for k, v in plan._meta1.items() if k not in ("KV_LAYOUT", "num_warps")}
    kv = "*fp8e4nv" if fp8 else "*bf16"
    got = _compile_sm90(meta, fused, kv, tmp_path)
    ptx = got["ptx"]
    assert got["num_warps"] == 1
    ring = 2 * decode_gluon.STAGES * 16 * 128 * (1 if fp8 else 2)
    assert ring <= got["shared"] <= ring + 4096 and 4 * got["shared"] <= 227 * 1024
    assert 0 < got["scratch"] <= decode_gluon.SCRATCH_PER_PROGRAM
    assert "cp.async.bulk.tensor" in ptx and "mbarrier.try_wait" in ptx
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{'f16' if fp8 else 'bf16'}" in ptx
    assert "tensormap" in ptx  # the descriptors are made in the kernel
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) is fp8
    if fused:
        assert "atom.global.gpu.release.exch" in ptx and "fence.acq_rel.gpu" not in ptx
        assert "ld.acquire.gpu.global.b32" in ptx and "ld.volatile" not in ptx
        assert "nanosleep.u32" in ptx
        assert meta["FENCED"] is False
        fenced = _compile_sm90({**meta, "FENCED": True}, fused, kv, tmp_path)["ptx"]
        assert "atom.global.gpu.release.exch" in fenced and fenced.count("fence.acq_rel.gpu") == 2
        assert "ld.volatile" in fenced and "ld.acquire" not in fenced
    else:
        assert "atom." not in ptx and "fence.acq_rel.gpu" not in ptx


def test_a_config_of_several_warps_must_fit_its_steps() -> None:
    """``warps`` is 1, 2 or 4, and the split granularity holds whole steps of that many pages."""
    assert TmaConfig(warps=4, stages=2).warps == 4
    with pytest.raises(ValueError, match="one of"):
        TmaConfig(warps=3)
    with pytest.raises(ValueError, match="whole steps of 4 pages"):
        TmaConfig(warps=4, block_n=32)


@needs_gluon
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_a_page_a_warp_compiles_for_sm90(fused, tmp_path, monkeypatch) -> None:
    """``TmaConfig(warps=4, stages=2)`` through a plan, compiled by Triton for sm_90 on the CPU:
    4 warps; a ring of 2 slots of 4 K and 4 V pages (64 KiB and a little); 8 TMA copies a step
    into the slot's rows, one after the other (the prologue's two steps and the loop's); the
    warps' mma.sync over a 64-token step (S's 16 tokens a warp: 2 n8 tiles x 8 k16 steps each,
    O's 32 columns: 4 n8 tiles x 4 k16 steps); the row max and sum crossing the warps through
    shared memory. Whether it runs and how fast is the GPU's to say
    (bench/gpu_decode_gluon_w.py)."""
    monkeypatch.setattr(decode_gluon, "unsupported_reason", lambda *a, **k: None)
    q, kc, vc, pt, sl = make_case([1000], 32, 8, seed=5)
    plan = plan_for(q, kc, pt, sl, TmaConfig(warps=4, stages=2), fused=fused)
    meta = {k: v for k, v in plan._meta1.items() if k != "KV_LAYOUT"}
    assert meta["W"] == 4 and meta["num_warps"] == 4 and meta["STAGES"] == 2
    got = _compile_sm90(meta, fused, "*bf16", tmp_path)
    ptx = got["ptx"]
    assert got["num_warps"] == 4
    ring = 2 * 2 * 4 * 16 * 128 * 2
    assert ring <= got["shared"] <= ring + 4096
    # 2 prologue steps + 1 in the loop, 8 copies each
    assert ptx.count("cp.async.bulk.tensor.2d") == 3 * 8
    assert ptx.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16") == 16 + 16
    assert "bar.sync" in ptx and "st.shared" in ptx


_COPY = "cp.async.bulk.tensor.2d.shared::{}.global.mbarrier::complete_tx::bytes"
PTX_TWO_COPIES = f"""
.visible .entry k(
\t.param .u64 k_param_0
)
{{
\t.reg .b32 \t%r<9>;
\t// kdash:l2-evict-first
\t@%p3 {_COPY.format("cluster")} [%r1], [%rd2, {{%r3, %r4}}], [%r5];
\t{_COPY.format("cta")} [%r6], [%rd2, {{%r3, %r7}}], [%r5];
\tret;
}}
"""


def test_l2_hint_rewrites_each_tile_copy_of_a_marked_kernel_only() -> None:
    """Both destination spellings (Triton 3.6's shared::cluster, later shared::cta), a
    predicated copy keeps its predicate, the policy register is declared and made once at the
    entry; PTX without the marker, or with two entries, is left as it is."""
    out, n = l2_hint.hint_ptx(PTX_TWO_COPIES)
    assert n == 2
    assert out.count(".L2::cache_hint") == 2 and out.count("createpolicy") == 1
    assert f"[%r5], {l2_hint.POLICY_REG};" in out
    assert "@%p3 cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier" in out
    assert out.index("createpolicy") < out.index("cp.async.bulk.tensor")
    plain = PTX_TWO_COPIES.replace(l2_hint.MARKER, "// another comment")
    assert l2_hint.hint_ptx(plain) == (plain, 0)
    two = PTX_TWO_COPIES + PTX_TWO_COPIES.replace("entry k(", "entry k2(")
    assert l2_hint.hint_ptx(two) == (two, 0)


@needs_gluon
def test_a_plan_asking_for_the_hint_installs_the_hook_or_says_why(no_stage_hook, monkeypatch):
    """l2_evict_first: the kernels get L2_HINT and the hook is in; another hook already there
    is not displaced, and the plan says so and runs without the hint. Without the ask, nothing
    is installed."""
    monkeypatch.setattr(decode_gluon, "unsupported_reason", lambda *a, **k: None)
    q, kc, vc, pt, sl = make_case([300], 32, 8, seed=2)
    plain = plan_for(q, kc, pt, sl, TmaConfig())
    assert "L2_HINT" not in plain._meta1 and plain.l2_refused is None
    assert no_stage_hook.add_stages_inspection_hook is None
    plan = plan_for(q, kc, pt, sl, TmaConfig(l2_evict_first=True))
    assert plan._meta1["L2_HINT"] is True and plan.l2_refused is None
    assert no_stage_hook.add_stages_inspection_hook is l2_hint._hook
    l2_hint.uninstall()

    def theirs(*args):
        return None

    no_stage_hook.add_stages_inspection_hook = theirs
    refused = plan_for(q, kc, pt, sl, TmaConfig(l2_evict_first=True))
    assert "L2_HINT" not in refused._meta1
    assert "another compile-stage hook" in refused.l2_refused
    assert no_stage_hook.add_stages_inspection_hook is theirs


@needs_gluon
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
def test_l2_hint_compiles_for_sm90_with_a_policy_on_every_tile_copy(
    fused, fp8, tmp_path, monkeypatch, no_stage_hook
) -> None:
    """Compiled by Triton for sm_90 on the CPU with the plan's values and the hint: every TMA
    tile load of the PTX carries the evict-first policy, and ptxas turns each into a UTMALDG
    whose policy sits in an even uniform register pair (the ``cp.async`` form of the same hint
    got an odd one from ptxas and faulted on the H200, bench/NOTES-kernels.md session 13)."""
    monkeypatch.setattr(decode_gluon, "unsupported_reason", lambda *a, **k: None)
    q, kc, vc, pt, sl = make_case([1000], 32, 8, seed=5, fp8=fp8)
    plan = plan_for(q, kc, pt, sl, TmaConfig(l2_evict_first=True), fused=fused)
    meta = {k: v for k, v in plan._meta1.items() if k not in ("KV_LAYOUT", "num_warps")}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    cubin = tmp_path / "k.cubin"
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_SM90, json.dumps(meta), "fused" if fused else "two",
         "*fp8e4nv" if fp8 else "*bf16", str(cubin)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    copies = got["ptx"].count("cp.async.bulk.tensor")
    assert copies > 0 and got["hinted"] == copies == got["ptx"].count(".L2::cache_hint")
    import triton

    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    sass = subprocess.run(
        [os.path.join(tools, "cuobjdump"), "-sass", str(cubin)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    loads = [line for line in sass.splitlines() if "UTMALDG" in line]
    assert len(loads) == copies
    for line in loads:
        reg = re.search(r"desc\[UR(\d+)\]", line)
        assert reg is not None and int(reg.group(1)) % 2 == 0, line


# --------------------------------------------------------------------------- GPU gates
needs_sm90 = pytest.mark.skipif(
    INTERPRET
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() != (9, 0)
    or decode_gluon.gluon is None,
    reason="needs an sm_90 GPU, Gluon and TRITON_INTERPRET=0",
)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("q_heads", "lens"),
    [
        (32, [131072]),
        (64, [65536]),
        (32, [16384] * 8),
        (64, [4096] * 32),
        (32, [1, 15, 16, 17, 1000, 4097]),
        (16, [8191, 1, 40000]),
    ],
    ids=["1x128k", "1x64k-gqa8", "8x16k", "32x4k", "odd", "gqa2"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_tma_gates(q_heads, lens, fused, fp8) -> None:
    """The TMA stage 1 through a plan, on both paths and both KV types, against the fp32
    reference (unowned slots NaN); the one-launch plan's flags are all down after the run."""
    q, kc, vc, pt, sl = make_case(lens, q_heads, 8, device="cuda", seed=6, fp8=fp8)
    plan = plan_for(q, kc, pt, sl, TmaConfig(), total_tokens=sum(lens), fused=fused)
    assert plan.tma and plan.fused is fused, plan.tma_refused
    _gate(plan, q, kc, vc, pt, sl)


def _gate(plan, q, kc, vc, pt, sl) -> None:
    """``plan``'s output against the fp32 reference; a one-launch plan's flags all down."""
    out = plan.run(q, kc, vc).clone()
    ref = decode_reference(q, kc, vc, pt, sl, **SCALES)
    base = decode_reference(q, kc, vc, pt, sl, fn=baseline_for(q.device), **SCALES)
    ok, msg = error_gate(out, ref, base, max_factor=4.0, mean_factor=3.0)
    assert ok, msg
    if plan.fused:
        assert int(plan._flags.abs().sum()) == 0


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_tma_plan_replays_from_a_graph(fused, fp8) -> None:
    """Captured once, replayed after the query and the lengths change in place: as eager."""
    q, kc, vc, pt, sl = make_case([3000, 70000], 32, 8, device="cuda", seed=7, fp8=fp8)
    plan = plan_for(q, kc, pt, sl, TmaConfig(), fused=fused)
    assert plan.tma, plan.tma_refused
    plan.run(q, kc, vc)  # compiles and arms outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(q, kc, vc)
    q.copy_(torch.randn_like(q.float()).bfloat16())
    sl.copy_(torch.tensor([2500, 65000], dtype=torch.int32, device="cuda"))
    graph.replay()
    replayed = plan.out.clone()
    eager = plan.run(q, kc, vc).clone()
    assert torch.equal(replayed, eager)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize(
    ("q_heads", "lens"),
    [(64, [65536]), (32, [1, 15, 16, 17, 1000, 4097]), (16, [8191, 1, 40000])],
    ids=["1x64k-gqa8", "odd", "gqa2"],
)
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_page_a_warp_gates(q_heads, lens, fused, fp8) -> None:
    """``TmaConfig(warps=4, stages=2)`` (a warp a page, 4 pages a step) through a plan against
    the fp32 reference, unowned slots NaN; the one-launch plan's flags all down after."""
    q, kc, vc, pt, sl = make_case(lens, q_heads, 8, device="cuda", seed=8, fp8=fp8)
    plan = plan_for(q, kc, pt, sl, TmaConfig(warps=4, stages=2), total_tokens=sum(lens),
                    fused=fused)  # fmt: skip
    assert plan.tma and plan._meta1["num_warps"] == 4, plan.tma_refused
    _gate(plan, q, kc, vc, pt, sl)
