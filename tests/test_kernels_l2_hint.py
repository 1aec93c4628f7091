"""The L2 evict-first hint on the Triton decode kernels' ``cp.async`` copies (kernels/l2_hint.py).

What is checked without a GPU:
- the SASS reader against cuobjdump, on cubins recorded from the H200;
- the two probe cubins recorded here (tests/data/l2-probe: the probe PTX compiled by Triton
  3.6's ptxas 12.8, the H200's, and by ptxas 13.4.59 from NVIDIA's ``nvidia-cuda-nvcc`` wheel):
  the first names uniform field 0 in every hinted copy, the second the pair it made;
- the PTX rewrite, the hook's choice of kernels (Triton's stages stood in for by functions that
  return fixed text, said where used), and the plan's ask;
- the plan's stage 1, compiled for sm_90 by this Triton in a child process with the hint on: every
  copy carries the policy and the binary names the uniform pair ptxas made (or, where this
  Triton's ptxas cannot encode it, the plan did not ask).
Whether the hint pays is the GPU's to say (bench/gpu_decode_evict.py).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import re
import subprocess
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")

import decode_cases as cases  # noqa: E402
from kdash.kernels import l2_hint  # noqa: E402
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig  # noqa: E402
from kdash.kernels.decode_plan import DecodePlan  # noqa: E402
from sm90_compile import compile_sm90, cuobjdump  # noqa: E402

DATA = Path(__file__).parent / "data"
PROBES = DATA / "l2-probe"


# --------------------------------------------------------------------------- reading SASS
@pytest.mark.parametrize("name", ["_decode_stage1", "_decode_stage2", "_extend_kernel"])
def test_ldgsts_are_the_instructions_cuobjdump_names(name) -> None:
    """On cubins the H200's Triton compiled: the reader finds every LDGSTS cuobjdump lists, at
    the same offsets, and nothing else (stage 2 has none)."""
    tool = cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump (Triton's wheel carries one)")
    path = DATA / "h200-cubins" / f"{name}.cubin"
    sass = subprocess.run([tool, "-sass", str(path)], capture_output=True, text=True, check=True)
    want = [
        int(m.group(1), 16)
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+[^;]*\bLDGSTS\b", sass.stdout)
    ]
    code = l2_hint.text_sections(path.read_bytes())[name]
    copies = l2_hint.ldgsts(code)
    assert [c.offset for c in copies] == want
    assert (len(want) > 0) is (name != "_decode_stage2")
    # none of them adds a uniform register to its shared address (Triton dropped the kernels'
    # eviction hints; ptxas chose that form for hinted copies only)
    assert not any(c.uniform_base for c in copies)


def test_ptxas_before_13_4_names_uniform_field_0_in_a_hinted_copy() -> None:
    """The probe (a hinted copy to a register-plus-uniform shared address, in a loop) as ptxas
    12.8 and 13.4.59 compiled it: both hint every copy and put the same address register in it;
    12.8 names uniform pair 0, which nothing in the kernel writes, 13.4 the pair (UR6, UR7) it
    made the shared base and the policy in."""
    old = l2_hint.text_sections((PROBES / "probe-ptxas-12.8.cubin").read_bytes())
    new = l2_hint.text_sections((PROBES / "probe-ptxas-13.4.cubin").read_bytes())
    a, b = old["kdash_l2_probe"], new["kdash_l2_probe"]
    old_copies, new_copies = l2_hint.ldgsts(a), l2_hint.ldgsts(b)
    assert [(c.uniform_base, c.address_reg) for c in old_copies] == [(True, 11)] * 8
    assert [(c.uniform_base, c.address_reg) for c in new_copies] == [(True, 11)] * 8
    assert {c.field for c in old_copies} == {0} and l2_hint.misencoded(a) == 8
    assert {c.field for c in new_copies} == {6} and l2_hint.misencoded(b) == 0
    assert l2_hint.text_sections(b"not an ELF") == {}


def test_the_probe_asks_the_ptxas_it_is_given(tmp_path) -> None:
    """A ptxas that cannot run, or fails, is a reason; this Triton's own ptxas answers as its
    release says (13.4 and later encode the copy)."""
    assert "could not be run" in l2_hint.probe(str(tmp_path / "no-ptxas"))
    fails = tmp_path / "ptxas"
    fails.write_text("#!/bin/sh\necho 'ptxas fatal: no' >&2\nexit 1\n")
    fails.chmod(0o755)
    assert l2_hint.probe(str(fails)) == "ptxas failed on the probe: ptxas fatal: no"
    tool = l2_hint.triton_ptxas()
    if tool is None:
        pytest.skip("this Triton has no ptxas for sm_90")
    major, minor = (int(x) for x in tool[1].split(".")[:2])
    why = l2_hint.probe(tool[0])
    assert (why is None) is ((major, minor) >= (13, 4)), (tool, why)
    assert l2_hint.probe(tool[0], opaque_base=True) is None


def _release(ptxas: Path) -> tuple[int, int]:
    out = subprocess.run([str(ptxas), "--version"], capture_output=True, text=True, check=True)
    major, minor = re.search(r"release (\d+)\.(\d+)", out.stdout).groups()
    return int(major), int(minor)


def test_every_bundled_ptxas_encodes_the_copy_once_the_base_is_opaque() -> None:
    """Each ptxas this Triton's wheel carries (3.9: 12.9 as ``ptxas``, 13.4 as
    ``ptxas-blackwell``; 3.6: 12.8): the probe as the plain rewrite hints it is misencoded
    exactly where the release is before 13.4, and the rewrite that makes the shared base opaque
    is encoded right by all of them; so the form chosen is the opaque one exactly there."""
    tools = sorted((Path(triton.__file__).parent / "backends" / "nvidia" / "bin").glob("ptxas*"))
    if not tools:
        pytest.skip("this Triton's wheel carries no ptxas")
    for tool in tools:
        old = _release(tool) < (13, 4)
        why = l2_hint.probe(str(tool))
        assert (why is not None) is old, (tool, why)
        assert l2_hint.probe(str(tool), opaque_base=True) is None, tool
        assert l2_hint.cp_async_form(str(tool)) == (old, None)


# --------------------------------------------------------------------------- the rewrite
PTX = """
.visible .entry _decode_stage1(
\t.param .u64 p0
)
{
\t.reg .b32 \t%r<9>;
\t@%p3 cp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r4;
\tcp.async.ca.shared.global [ %r5 + 0 ], [ %rd6 + 0 ], 0x4;
\tcp.async.commit_group;
\tret;
}
"""


def test_each_copy_gets_the_policy_made_before_it() -> None:
    out, n = l2_hint.hint_cp_async(PTX)
    assert n == 2 and out.count(".L2::cache_hint") == 2
    assert out.count(f".reg .b64 \t{l2_hint.POLICY_REG};") == 1
    assert out.count("createpolicy.fractional.L2::evict_first") == 2
    copy = "cp.async.cg.shared.global.L2::cache_hint [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r4"
    assert f"@%p3 {copy}, {l2_hint.POLICY_REG};" in out
    assert f"0x4, {l2_hint.POLICY_REG};" in out
    lines = out.splitlines()
    for i, line in enumerate(lines):
        if "cp.async." in line and "commit" not in line:
            assert "createpolicy" in lines[i - 1]
    # hinted copies are not hinted again; two entries, or none, are left alone
    assert l2_hint.hint_cp_async(out) == (out, 0)
    two = PTX + PTX.replace("entry _decode_stage1(", "entry k2(")
    assert l2_hint.hint_cp_async(two) == (two, 0)
    # and the policy comes off again, the copies as they were
    assert l2_hint.unhint_cp_async(out).count(".L2::cache_hint") == 0
    assert "@%p3 cp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %r4;" in (
        l2_hint.unhint_cp_async(out)
    )


SMEM_PTX = ".extern .shared .align 16 .b8 global_smem[];\n" + PTX.replace(
    "\t@%p3", "\tmov.b32 \t%r1, global_smem;\n\tadd.s32 \t%r5, %r1, 64;\n\t@%p3"
)


def test_the_opaque_base_ors_each_move_of_the_shared_array_with_a_zero() -> None:
    """With ``opaque_base``: the shared array's address, right after it is moved into a
    register, is ORed with z, which the entry makes (dynamic shared size >> 31, ANDed with the
    thread index) before anything uses it; nothing else changes, and it is done once."""
    out, n = l2_hint.hint_cp_async(SMEM_PTX, opaque_base=True)
    plain, _ = l2_hint.hint_cp_async(SMEM_PTX)
    assert n == 2 and out.count(".L2::cache_hint") == 2
    z = "%rkdashl2z"
    lines = [line.strip() for line in out.splitlines()]
    at = lines.index("mov.b32 \t%r1, global_smem;")
    assert lines[at + 1] == f"or.b32 \t%r1, %r1, {z};"
    made = lines.index(f"and.b32 \t{z}, {z}, %rkdashl2w;")
    assert lines.index(f"mov.u32 \t{z}, %dynamic_smem_size;") < made < at
    assert lines.index(f"shr.u32 \t{z}, {z}, 31;") < made
    kept = [x for x in lines if z not in x and "%rkdashl2w" not in x]
    assert kept == [x.strip() for x in plain.splitlines()]
    assert l2_hint.hint_cp_async(out, opaque_base=True) == (out, 0)
    # PTX without an extern shared array gets the hint alone
    assert l2_hint.hint_cp_async(PTX, opaque_base=True) == l2_hint.hint_cp_async(PTX)


@pytest.mark.parametrize("opaque", [False, True], ids=["ptxas-13.4", "ptxas-12.8"])
@pytest.mark.parametrize(
    ("name", "asked", "hinted"),
    [("_decode_stage1", True, 2), ("_decode_stage1", False, 0), ("someone_elses", True, 0)],
)
def test_the_hook_hints_the_decode_kernels_that_asked(
    name, asked, hinted, opaque, no_stage_hook, monkeypatch
) -> None:
    """Triton's llir and ptx stages stood in for by functions returning fixed text (the real
    compile is the test below): a decode kernel whose GPU IR asked for evict-first gets every
    copy hinted, in the form this ptxas needs (its answer given), and the count in its
    metadata; one that did not, or another kernel, is left."""
    monkeypatch.setattr(l2_hint, "cp_async_form", lambda path: (opaque, None))
    ask = "evictionPolicy = evict_first" if asked else ""
    ttgir = f"%1 = ttg.async_copy_global_to_local %a, %b mask %c other %d {ask} : x"
    stages = {
        "llir": lambda src, md: md.update(name=name) or "llvm",
        "ptx": lambda src, md: SMEM_PTX,
    }
    assert l2_hint._hook() == l2_hint._HOOK_KEY
    l2_hint._hook(None, stages, None, None, 90)
    md: dict = {}
    stages["llir"](ttgir, md)
    out = stages["ptx"]("llvm", md)
    assert out.count(".L2::cache_hint") == hinted
    assert ("%dynamic_smem_size" in out) is (opaque and hinted > 0)
    assert md.get(l2_hint.META_KEY, 0) == hinted and l2_hint._ASKED not in md


def test_a_cubin_whose_copies_would_trap_is_made_again_without_the_hint(no_stage_hook) -> None:
    """Triton's cubin stage stood in for by a function that returns the probe as ptxas 12.8
    compiled it (recorded; its copies name field 0) for hinted PTX, and as 13.4 did otherwise:
    the hook reads the cubin back, compiles the PTX again without the policy, takes the copies
    off the kernel's count and says how many it dropped; a right cubin is kept as it is."""
    bad = (PROBES / "probe-ptxas-12.8.cubin").read_bytes()
    good = (PROBES / "probe-ptxas-13.4.cubin").read_bytes()
    seen: list[str] = []

    def make_cubin(src, md):
        seen.append(src)
        return bad if ".L2::cache_hint" in src else good

    stages = {"ptx": lambda src, md: src, "cubin": make_cubin}
    l2_hint._hook(None, stages, None, None, 90)
    hinted, _ = l2_hint.hint_cp_async(l2_hint._PROBE_PTX)
    md = {"name": "kdash_l2_probe", l2_hint.META_KEY: 1, l2_hint._CP_HINTED: 1}
    assert stages["cubin"](hinted, md) == good
    assert len(seen) == 2 and ".L2::cache_hint" not in seen[1]
    assert md[l2_hint.DROPPED_KEY] == 1 and l2_hint.META_KEY not in md
    # a kernel ptxas encoded right is compiled once and keeps its count
    seen.clear()
    md = {"name": "kdash_l2_probe", l2_hint.META_KEY: 1, l2_hint._CP_HINTED: 1}
    stages["cubin"] = make_cubin
    l2_hint._hook(None, stages, None, None, 90)
    assert stages["cubin"](l2_hint._PROBE_PTX, md) == good
    assert len(seen) == 1 and md[l2_hint.META_KEY] == 1 and l2_hint.DROPPED_KEY not in md


def test_what_the_two_tritons_print_is_an_ask() -> None:
    three6 = "ttg.async_copy_global_to_local %1, %2 mask %3 other %4 evictionPolicy = evict_first"
    three9 = (
        "ttg.async_copy_global_to_local %1, %2 {cachePolicy = #tt.cache_policy<cache_modifier"
        " = none, eviction_policy = evict_first>, contiguity = 8 : i32}"
    )
    assert l2_hint.wants_evict_first(three6) and l2_hint.wants_evict_first(three9)
    assert not l2_hint.wants_evict_first("tt.load %1 evictionPolicy = evict_first")
    assert not l2_hint.wants_evict_first("ttg.async_copy_global_to_local %1, %2")


# --------------------------------------------------------------------------- the plan's ask
def _plan(config: DecodeConfig, fp8: bool = False) -> DecodePlan:
    """fp8 on the one-launch path, bf16 on two launches (the two stage-1 forms of 1 x 64k)."""
    q, kc, vc, pt, sl, sc = cases.make_case([300], 32, 8, 128, 16, fp8, seed=1)
    return DecodePlan(
        pt, sl, 32, 8, 128, 16, max_seq_len=300, kv_dtype=kc.dtype, config=config, fused=fp8,
        **sc,
    )  # fmt: skip


def test_a_plan_asks_only_where_the_copies_will_be_right(no_stage_hook, monkeypatch) -> None:
    """``evict_first``: the kernels get ``EVICT`` and the hook goes in where the probe passes;
    where it does not, no ask and the plan says why; without ``evict_first`` neither."""
    plain = _plan(DecodeConfig(evict_first=False))
    assert plain._meta1["EVICT"] == "" and plain.l2_refused is None
    assert no_stage_hook.add_stages_inspection_hook is None
    monkeypatch.setattr(l2_hint, "triton_ptxas", lambda: ("/x/ptxas", "12.8"))
    monkeypatch.setattr(l2_hint, "probe", lambda path, opaque_base=False: "it is wrong")
    refused = _plan(DecodeConfig(evict_first=True))
    assert refused._meta1["EVICT"] == ""
    assert refused.l2_refused.startswith("ptxas 12.8 (/x/ptxas): it is wrong;")
    assert "TRITON_PTXAS_PATH" in refused.l2_refused
    assert no_stage_hook.add_stages_inspection_hook is None
    # a GPU other than sm_90 is not asked: the probe and the SASS reader are sm_90's
    from kdash.kernels import decode_choice

    monkeypatch.setattr(decode_choice, "capability_of", lambda device: (8, 0))
    ampere = _plan(DecodeConfig(evict_first=True))
    assert ampere._meta1["EVICT"] == "" and "not sm_80" in ampere.l2_refused
    monkeypatch.setattr(decode_choice, "capability_of", lambda device: None)  # the CPU's answer
    # a ptxas that is right once the shared base is opaque (12.8 to 13.3) is asked
    monkeypatch.setattr(
        l2_hint, "probe", lambda path, opaque_base=False: None if opaque_base else "it is wrong"
    )
    assert l2_hint.cp_async_form("/x/ptxas") == (True, None)
    opaque = _plan(DecodeConfig(evict_first=True))
    assert opaque._meta1["EVICT"] == "evict_first" and opaque.l2_refused is None
    assert no_stage_hook.add_stages_inspection_hook is l2_hint._hook
    l2_hint.uninstall()
    monkeypatch.setattr(l2_hint, "probe", lambda path, opaque_base=False: None)
    for config, fp8 in ((DecodeConfig(evict_first=True), False), (
        DecodeConfig(**{**DEFAULT_FP8_CONFIG.__dict__, "fp8_compute": "cvt", "evict_first": True}),
        True,
    )):  # fmt: skip
        asked = _plan(config, fp8)
        assert asked._meta1["EVICT"] == "evict_first" and asked.l2_refused is None
        assert no_stage_hook.add_stages_inspection_hook is l2_hint._hook


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8-cvt-fused"])
def test_stage1_compiled_for_sm90_carries_a_hint_ptxas_encodes(fp8, tmp_path, no_stage_hook):
    """The plan's stage 1 (bf16, two launches; fp8 ``cvt``, one launch), compiled for sm_90 by
    this Triton with ``evict_first``: every global -> shared copy of the PTX carries the policy,
    the kernel's metadata counts the ones the hook added, and no LDGSTS of the cubin names
    field 0 with a register-plus-uniform address. Where this Triton's ptxas is before 13.4
    (Triton 3.6's 12.8) the shared base is opaque and every copy addresses shared memory by a
    register alone; where it is 13.4 or later (Triton 3.9's) the base is left as it was."""
    if fp8:
        config = DecodeConfig(
            **{**DEFAULT_FP8_CONFIG.__dict__, "fp8_compute": "cvt", "evict_first": True}
        )
    else:
        config = DecodeConfig(evict_first=True)
    plan = _plan(config, fp8)
    meta = dict(plan._meta1, UPCAST=False)
    if fp8:
        meta["ASM"] = True
    name = plan._kern1.__name__
    assert name == ("_decode_fused" if fp8 else "_decode_stage1")
    kv = "*fp8e4nv" if fp8 else "*bf16"
    scale = "*fp32" if fp8 else "*i32"
    ptrs = ["*bf16", kv, kv, "*i32", "*i32", scale, scale, "*fp32", "*fp32"]
    ptrs += ["*bf16", "*fp32", "*i32"] if plan.fused else []
    module = "decode_fused" if fp8 else "decode_attention"
    hint = bool(meta.get("EVICT"))
    got = compile_sm90(f"kdash.kernels.{module}:{name}", meta, ptrs, tmp_path, hint=hint)
    copies = len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global", got["ptx"]))
    assert copies >= 16 and len(got["ldgsts"]) == copies
    assert plan.l2_refused is None and meta["EVICT"] == "evict_first"
    opaque = l2_hint.cp_async_form(l2_hint.triton_ptxas()[0])[0]
    # Triton 3.9 writes the hint itself for PTX 9.4 and later (its PR 11848); 3.6 leaves it to
    # the hook, which counts what it added
    assert got["ptx"].count(".L2::cache_hint") == copies and got["hinted"] in (0, copies)
    assert got["misencoded"] == 0 and got["dropped"] == 0
    assert ("%dynamic_smem_size" in got["ptx"]) is opaque
    if opaque:
        assert got["hinted"] == copies
        assert not any(c[1] for c in got["ldgsts"])  # no uniform part in any shared address


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU wiring check")
@pytest.mark.parametrize("encodes", [True, False], ids=["ptxas-encodes", "ptxas-cannot"])
def test_the_gpu_script_times_both_plans_on_the_cpu(encodes, monkeypatch, no_stage_hook):
    """bench/gpu_decode_evict.py's rows on a tiny CPU case in the interpreter: real plans and
    outputs; only the GPU timers are stood in for by one timed call each (they need CUDA), and
    the probe's answer is given. The hinted plan asks only where the probe passes, and its
    output equals the plain one (the interpreter has no cache to hint)."""
    import time

    from kdash.kernels import bench as kbench

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "bench"))
    import gpu_decode_evict as script

    monkeypatch.setattr(kbench, "DEVICE", "cpu")
    monkeypatch.setattr(l2_hint, "triton_ptxas", lambda: ("/x/ptxas", "13.4"))
    monkeypatch.setattr(
        l2_hint, "probe", lambda path, opaque_base=False: None if encodes else "it cannot"
    )

    def one_call_ms(fn, **_):
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3

    for name in ("bench_ms", "bench_graph_ms", "bench_readflush_ms"):
        monkeypatch.setattr(script, name, one_call_ms)
    for fp8 in (False, True):
        row = script.row_for("2x130", "4/2", fp8, copy_gbs=100.0)
        plain, evict = row["plain"], row["evict"]
        assert "error" not in plain and "error" not in evict, row
        assert plain["evict"] == "" and plain["l2_refused"] is None
        assert evict["evict"] == ("evict_first" if encodes else "")
        assert (evict["l2_refused"] is None) is encodes
        assert evict["max_abs_diff_vs_plain"] == 0.0
        assert set(row["delta_us"]) == {"us", "us_graph", "us_readflush"}


# --------------------------------------------------------------------------- GPU gates
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.gpu
@pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and TRITON_INTERPRET=0)"
)
@pytest.mark.parametrize("fused", [False, True], ids=["two-launch", "fused"])
@pytest.mark.parametrize(
    ("fp8", "page", "lens", "heads"),
    [
        (False, 16, [16384, 3001, 77], (32, 8)),
        (False, 1, [4099, 1], (64, 8)),
        (True, 16, [16384, 3001, 77], (32, 8)),
        (True, 1, [4099, 1], (64, 8)),
    ],
    ids=["bf16-p16", "bf16-p1-gqa8", "fp8-p16", "fp8-p1-gqa8"],
)
def test_gpu_hinted_plans_pass_the_decode_gates(fp8, page, lens, heads, fused) -> None:
    """With ``evict_first`` (Triton 3.6's ptxas 12.8 gets the shared base made opaque, a 13.4
    or later named by TRITON_PTXAS_PATH the plain rewrite): the decode gate against the fp32
    reference (NaN in every slot no request owns, odd lengths, GQA, pages of 1 and 16, fp8
    scales), the copies hinted, none dropped, and two hundred runs without a fault, equal to
    the first."""
    q, kc, vc, pt, sl, sc = cases.make_case(lens, *heads, 128, page, fp8, seed=3)
    base = DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()
    config = DecodeConfig(**{**base.__dict__, "evict_first": True})
    plan = DecodePlan(
        pt, sl, heads[0], heads[1], 128, page, max_seq_len=max(lens), kv_dtype=kc.dtype,
        config=config, fused=fused, **sc,
    )  # fmt: skip
    if plan.l2_refused:
        pytest.skip(f"no hint here: {plan.l2_refused}")
    out = plan.run(q, kc, vc).clone()
    cases.check(out, q, kc, vc, pt, sl, sc)
    ptx = plan._s1._compiled.asm["ptx"]
    copies = len(re.findall(r"\bcp\.async\.c[ag]\.shared\.global", ptx))
    assert copies and ptx.count(".L2::cache_hint") == copies
    code = l2_hint.text_sections(plan._s1._compiled.asm["cubin"])
    assert not any(l2_hint.misencoded(c) for c in code.values())
    assert not getattr(plan._s1._compiled.metadata, l2_hint.DROPPED_KEY, 0)
    for _ in range(200):
        plan.run(q, kc, vc)
    torch.cuda.synchronize()
    assert torch.equal(plan.out, out)
