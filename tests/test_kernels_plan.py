"""Decode plan then run: one plan serving many runs, runs after a new plan, and graph safety.

CPU CI runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``), like the other kernel
tests; ``gpu`` tests repeat the essentials compiled, with a real CUDA-graph capture and replay.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import decode_cases  # noqa: E402
from decode_cases import check, make_case  # noqa: E402
from kdash.kernels import decode_attention as da  # noqa: E402
from kdash.kernels import decode_plan  # noqa: E402
from kdash.kernels._common import cdiv  # noqa: E402
from kdash.kernels.decode_attention import (  # noqa: E402
    DecodeConfig,
    DecodePlan,
    decode_attention,
    max_splits_for,
)
from kdash.kernels.kv_cache import FP8  # noqa: E402
from kdash.kernels.launch import BoundKernel  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="no CUDA and not interpreting"
)
SMALL = DecodeConfig(block_n=64, fp8_compute="cvt")  # fp8: the default's conversion


@pytest.fixture(params=[False, True, "persistent"], ids=["two-launch", "fused", "persistent"])
def path(request, monkeypatch) -> bool | str:
    """The launch paths: stage 1 then the merge kernel, one fused launch, or the persistent
    kernel (plans made without ``fused=`` take the module's default, set here)."""
    monkeypatch.setattr(decode_plan, "FUSED_DEFAULT", request.param)
    return request.param


def plan_for(pt, sl, q, kc, **kw) -> DecodePlan:
    kw.setdefault("config", SMALL)
    return decode_cases.plan_for(pt, sl, q, kc, **kw)


@needs_device
def test_one_plan_serves_many_runs_in_its_own_buffers(path) -> None:
    """Runs on new queries and on in-place rewritten lengths/pages reuse the plan's buffers."""
    q, kc, vc, pt, sl, sc = make_case([37, 300, 5], 8, 2, 64, 16, seed=1)
    plan = plan_for(pt, sl, q, kc, max_seq_len=512)
    assert plan.num_splits == max_splits_for(2, 512, config=SMALL)
    out1 = plan.run(q, kc, vc)
    check(out1, q, kc, vc, pt, sl, sc)
    first = out1.clone()
    bound = plan._s1
    q2 = torch.randn_like(q.float()).bfloat16()
    out2 = plan.run(q2, kc, vc)
    assert out2.data_ptr() == out1.data_ptr() == plan.out.data_ptr()
    assert plan._s1 is bound  # same layout: no re-derivation of the launch
    check(out2, q2, kc, vc, pt, sl, sc)
    assert not torch.equal(first, out2)
    # Lengths shrink and grow in place (as a replayed step's would), within max_seq_len: the
    # cut is taken from the lengths in memory, so every token is still covered exactly once.
    sl.copy_(torch.tensor([299, 1, 33], dtype=torch.int32))  # each within its new pages
    pt[[0, 1, 2]] = pt[[1, 2, 0]].clone()
    q3 = torch.randn_like(q.float()).bfloat16()
    check(plan.run(q3, kc, vc), q3, kc, vc, pt, sl, sc)


@needs_device
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_run_after_a_new_plan_of_another_composition(fp8: bool, path) -> None:
    """A second plan (more requests, other page size and lengths) and then the first again."""
    qa, kca, vca, pta, sla, sca = make_case([20, 130], 4, 2, 64, 16, fp8, seed=2)
    qb, kcb, vcb, ptb, slb, scb = make_case([3, 257, 64, 9, 100], 8, 2, 64, 1, fp8, seed=3)
    plan_a = plan_for(pta, sla, qa, kca, max_seq_len=130, total_tokens=150, **sca)
    check(plan_a.run(qa, kca, vca), qa, kca, vca, pta, sla, sca)
    plan_b = plan_for(ptb, slb, qb, kcb, max_seq_len=257, total_tokens=433)
    # fp8 scales may come with the run (per layer) rather than the plan
    out_b = plan_b.run(qb, kcb, vcb, scb.get("k_scale"), scb.get("v_scale"))
    check(out_b, qb, kcb, vcb, ptb, slb, scb)
    check(plan_a.run(qa, kca, vca), qa, kca, vca, pta, sla, sca)
    assert plan_a.out.data_ptr() != plan_b.out.data_ptr()


@needs_device
def test_one_plan_runs_every_layer_of_a_step(path) -> None:
    """Layers share a plan and bring their own caches (and fp8 scales): each one is right."""
    q0, kc0, vc0, pt, sl, sc0 = make_case([33, 150], 4, 2, 64, 16, True, seed=20)
    # a second layer over the same pages: other values (NaN slots stay NaN), other scales
    kc1 = (kc0.float() * -1).to(FP8)
    vc1 = vc0.float().flip(-1).to(FP8)
    sc1 = {"k_scale": sc0["k_scale"] * 2, "v_scale": sc0["v_scale"] * 0.5}
    q1 = torch.randn_like(q0.float()).bfloat16()
    layers = [(q0, kc0, vc0, sc0), (q1, kc1, vc1, sc1)]
    plan = plan_for(pt, sl, q0, kc0, max_seq_len=150, total_tokens=183)
    for _ in range(2):
        for q, kc, vc, sc in layers:
            out = plan.run(q, kc, vc, sc["k_scale"], sc["v_scale"])
            check(out, q, kc, vc, pt, sl, sc)


@needs_device
def test_run_refuses_what_the_plan_was_not_made_for() -> None:
    q, kc, vc, pt, sl, _ = make_case([10, 20], 4, 2, 64, 16, seed=4)
    plan = plan_for(pt, sl, q, kc, max_seq_len=32)
    with pytest.raises(ValueError, match="plan is for"):
        plan.run(q[:, :2].contiguous(), kc, vc)
    with pytest.raises(ValueError, match="caches must be"):
        plan.run(q, kc[:, :8].contiguous(), vc[:, :8].contiguous())
    with pytest.raises(ValueError, match="fp8 KV needs"):
        f = kc.float().nan_to_num(0.0).to(FP8)
        plan_for(pt, sl, q, f, max_seq_len=32).run(q, f, f)
    with pytest.raises(ValueError, match="int32"):
        plan_for(pt.long(), sl, q, kc, max_seq_len=32)


@needs_device
def test_a_misaligned_view_takes_the_checked_path_and_stays_right(path) -> None:
    """Compiled kernels assume 16-byte pointers; a view that breaks that must not be run fast."""
    q, kc, vc, pt, sl, sc = make_case([40, 3], 4, 2, 64, 16, seed=5)
    plan = plan_for(pt, sl, q, kc, max_seq_len=64)
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    # the same values one element (2 bytes) into a bigger buffer
    big = torch.empty(q.numel() + 1, dtype=q.dtype, device=q.device)
    shifted = big[1:].view_as(q)
    shifted.copy_(q)
    assert shifted.data_ptr() % 16
    check(plan.run(shifted, kc, vc), shifted, kc, vc, pt, sl, sc)


# ------------------------------------------------------------------- graph-capture safety
# What a CUDA graph cannot hold: a device allocation made by the call (the memory would be the
# graph pool's, and a plan's buffers must be the same at every replay) and anything that makes
# the host wait for the GPU (.item(), .cpu(), .tolist(), a tensor's truth value, a
# synchronize): under capture those raise or read garbage. The CPU has no graphs, so the test
# makes every such call raise while `run` executes. The kernel launches are recorded instead of
# executed inside that region: the CPU interpreter copies every tensor to host memory to run a
# kernel, which a GPU launch never does. The recorded launches then run for real, outside the
# region, and must give the right answer: the run handed the kernels everything they need.
ALLOCATORS = (
    "empty",
    "empty_like",
    "empty_strided",
    "zeros",
    "zeros_like",
    "ones",
    "ones_like",
    "full",
    "full_like",
    "tensor",
    "as_tensor",
    "arange",
    "cat",
    "stack",
)
TENSOR_SYNCS = ("item", "cpu", "tolist", "__bool__", "numpy", "clone", "contiguous", "to")


@contextlib.contextmanager
def no_allocation_no_sync():
    def refuse(name):
        def fail(*a, **k):
            raise AssertionError(f"{name} called inside DecodePlan.run")

        return fail

    mp = pytest.MonkeyPatch()
    try:
        for name in ALLOCATORS:
            mp.setattr(torch, name, refuse(f"torch.{name}"))
        for name in TENSOR_SYNCS:
            mp.setattr(torch.Tensor, name, refuse(f"Tensor.{name}"))
        mp.setattr(torch.cuda, "synchronize", refuse("torch.cuda.synchronize"))
        yield
    finally:
        mp.undo()


@pytest.fixture
def recorded_launches(monkeypatch):
    calls: list[tuple[BoundKernel, tuple]] = []

    def record(self, *args):
        calls.append((self, args))

    monkeypatch.setattr(BoundKernel, "__call__", record)
    return calls


@needs_device
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_run_allocates_nothing_and_never_waits_for_the_gpu(
    fp8: bool, recorded_launches, path
) -> None:
    q, kc, vc, pt, sl, sc = make_case([5, 200, 77], 8, 2, 64, 16, fp8, seed=6)
    plan = plan_for(pt, sl, q, kc, max_seq_len=256, **sc)
    out = torch.full_like(plan.out, float("nan"))
    plan.out.copy_(out)  # poisoned: the replayed launches must write every element
    plan.run(q, kc, vc)  # the first run binds the layout (validation, strides): not guarded
    recorded_launches.clear()
    ks, vs = sc.get("k_scale"), sc.get("v_scale")
    with no_allocation_no_sync():
        res = plan.run(q, kc, vc, ks, vs)
    assert res is plan.out
    want = [plan._kern1] if path else [plan._kern1, da._decode_stage2]
    assert [bk.fn for bk, _ in recorded_launches] == want
    # Sanity of the guard itself: it does refuse an allocation and a sync.
    with no_allocation_no_sync(), pytest.raises(AssertionError, match="torch.empty"):
        torch.empty(1)
    with no_allocation_no_sync(), pytest.raises(AssertionError, match="Tensor.item"):
        sl.max().item()
    for bk, args in recorded_launches:
        bk.jit(*args)
    check(plan.out, q, kc, vc, pt, sl, sc)
    if path:
        assert not plan._flags.any()  # the merge programs lower the flags they waited on


# --------------------------------------------------------------------------- GPU gates
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs CUDA (and TRITON_INTERPRET=0)"
)


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_fast_launch_matches_the_jit_launch_bit_for_bit(fp8: bool, path) -> None:
    q, kc, vc, pt, sl, sc = make_case([16384, 3000, 77], 32, 8, 128, 16, fp8, seed=7)
    plan = plan_for(pt, sl, q, kc, max_seq_len=16384, total_tokens=19461, config=None, **sc)
    assert plan.fused == bool(path) and plan.persistent == (path == "persistent")
    plan.run(q, kc, vc)
    kernels = [plan._s1] if path else [plan._s1, plan._s2]
    assert all(k.fast for k in kernels)  # armed by the first run
    import triton

    if triton.__version__.startswith(("3.6.", "3.9.")):  # launcher layouts read for these
        assert all(k._direct is not None for k in kernels)
        assert plan._fire is not None  # later runs hand pointers to the C launchers
    fast = plan.run(q, kc, vc).clone()
    args = (q, kc, vc, pt, sl, plan._ks, plan._vs, *plan._rest1)
    plan._s1.jit(*args)
    if not path:
        plan._s2.jit(*plan._args2)
    assert torch.equal(fast, plan.out)
    check(fast, q, kc, vc, pt, sl, sc)
    if path:
        torch.cuda.synchronize()
        assert not plan._flags.any()


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_graph_replay_follows_lengths_rewritten_in_place(fp8: bool, path) -> None:
    """Capture once for any lengths up to 32k; replay after rewriting lengths and pages."""
    lens = [32768, 1000, 5, 4000]
    q, kc, vc, pt, sl, sc = make_case(lens, 32, 8, 128, 16, fp8, seed=8)
    plan = plan_for(pt, sl, q, kc, max_seq_len=32768, config=None, **sc)
    q_in = q.clone()
    plan.run(q_in, kc, vc)  # compiles and arms outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        plan.run(q_in, kc, vc)
    # new row i takes old row perm[i]'s pages; each new length fits in those pages
    for new_lens, perm in (
        ([32768, 1000, 5, 4000], [0, 1, 2, 3]),
        ([7, 20000, 999, 5], [3, 0, 1, 2]),
    ):
        sl.copy_(torch.tensor(new_lens, dtype=torch.int32))
        pt.copy_(pt[perm].clone())
        q_in.copy_(torch.randn_like(q.float()).bfloat16())
        plan.out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        check(plan.out, q_in, kc, vc, pt, sl, sc)
        if path:
            assert not plan._flags.any()  # every replay leaves them as it found them


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_plan_plans_at_its_compiled_kernels_residency(fp8: bool, path) -> None:
    """The residency the plan found (compiled at plan time, or cached) is the one of the kernel
    its first run launches, as the bench reads it; the split count is the wave model's there."""
    from kdash.kernels import bench

    q, kc, vc, pt, sl, sc = make_case([16384] * 8, 64, 8, 128, 16, fp8, seed=11)
    plan = plan_for(pt, sl, q, kc, max_seq_len=16384, total_tokens=8 * 16384, config=None, **sc)
    assert plan.residency_source in ("compiled", "cache"), plan.residency_source
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert plan.fused == bool(path) and plan.persistent == (path == "persistent")
    occ = bench.stage1_occupancy(plan)
    assert occ["resident_per_sm"] == plan.resident_per_sm
    assert occ["registers"] == plan.residency.registers
    assert plan.num_splits == host_cut(plan, [16384] * 8)[0]
    assert used_splits(plan) == [plan.num_splits] * 8


@gpu
@needs_cuda
def test_gpu_host_time_per_run_is_small(path) -> None:
    """Generous bound for CI-class hosts; the bench reports the real figure (decode_host_us)."""
    import time

    q, kc, vc, pt, sl, _ = make_case([4096] * 8, 32, 8, 128, 16, seed=9)
    plan = plan_for(pt, sl, q, kc, max_seq_len=4096, total_tokens=8 * 4096, config=None)
    for _ in range(10):
        plan.run(q, kc, vc)
    torch.cuda.synchronize()
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        plan.run(q, kc, vc)
    host_us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    assert host_us < 100, host_us


@needs_device
def test_functional_entry_point_is_a_plan_and_a_run(path) -> None:
    """decode_attention keeps its signature and results by making a plan and running it once."""
    q, kc, vc, pt, sl, _ = make_case([9, 70], 4, 2, 64, 16, seed=10)
    out = decode_attention(q, kc, vc, pt, sl, config=SMALL, max_seq_len=70, total_tokens=79)
    plan = plan_for(pt, sl, q, kc, max_seq_len=70, total_tokens=79)
    torch.testing.assert_close(out, plan.run(q, kc, vc), rtol=0, atol=0)


@needs_device
def test_fused_runs_leave_their_flags_at_zero_and_agree_with_two_launches() -> None:
    """The fused launch over several splits (SMALL: 3 splits of 256 for 700 tokens), run
    twice on new queries: the gate holds, every flag is lowered again for the next run (a
    graph replay relies on it), and output and LSE agree with the two-launch plan's."""
    q, kc, vc, pt, sl, sc = make_case([700, 3, 260], 8, 2, 64, 16, seed=12)
    fused = plan_for(pt, sl, q, kc, max_seq_len=700, total_tokens=963, fused=True)
    two = plan_for(pt, sl, q, kc, max_seq_len=700, total_tokens=963, fused=False)
    assert fused.num_splits == two.num_splits == 3 and fused._s2 is None
    assert fused._grid1 == (3, 2, 3 + 4)  # the merge programs: the last GROUP split slices
    for seed in (0, 1):
        q = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed)).bfloat16()
        fused.out.fill_(float("nan"))
        out, lse = fused.run(q, kc, vc, return_lse=True)
        check(out, q, kc, vc, pt, sl, sc)
        assert not fused._flags.any()
        out2, lse2 = two.run(q, kc, vc, return_lse=True)
        torch.testing.assert_close(lse, lse2, rtol=0, atol=1e-5)
        torch.testing.assert_close(out.float(), out2.float(), rtol=0, atol=1e-2)


@needs_device
def test_auto_takes_one_launch_for_a_few_long_requests_only(monkeypatch) -> None:
    """``FUSED_DEFAULT = "auto"``: a plan takes the fused launch when stage 1 fits one wave and
    its merge programs (request x query head) are at most half the SMs (8 "SMs" here, so 4),
    two launches otherwise; an explicit ``fused`` wins either way."""
    from kdash.kernels.decode_plan import fused_pays

    monkeypatch.setattr(decode_plan, "FUSED_DEFAULT", "auto")
    q, kc, vc, pt, sl, sc = make_case([700], 4, 1, 64, 16, seed=14)
    few = plan_for(pt, sl, q, kc, max_seq_len=700, total_tokens=700)
    assert few.fused and few._grid1 == (1, 1, few.num_splits + 4)
    check(few.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert not few._flags.any()
    assert not plan_for(pt, sl, q, kc, max_seq_len=700, fused=False).fused
    assert plan_for(pt, sl, q, kc, max_seq_len=700, fused="auto").fused
    q2, kc2, vc2, pt2, sl2, sc2 = make_case([700, 9], 4, 1, 64, 16, seed=15)
    many = plan_for(pt2, sl2, q2, kc2, max_seq_len=700, total_tokens=709)  # 8 merge programs
    assert not many.fused and many._s2 is not None
    check(many.run(q2, kc2, vc2), q2, kc2, vc2, pt2, sl2, sc2)
    assert plan_for(pt2, sl2, q2, kc2, max_seq_len=700, fused=True).fused
    # The rule at the H200's 132 SMs and 4 programs an SM (528 at once).
    assert fused_pays(1, 32, 512, 528, 132) and fused_pays(1, 64, 512, 528, 132)
    assert not fused_pays(8, 32, 512, 528, 132)  # 256 merge programs
    assert not fused_pays(1, 32, 529, 528, 132)  # stage 1 past one wave


@needs_device
def test_the_fused_merge_covers_splits_past_one_chunk() -> None:
    """38 working splits of 40 (16-token tiles and splits): the fused merge takes them 16 at a
    time at head_dim 64, so three steps per head, the last one partly past the grid."""
    cfg = DecodeConfig(block_n=16, min_tokens_per_split=16, prefetch_pages=False)
    q, kc, vc, pt, sl, sc = make_case([600, 7], 4, 2, 64, 16, seed=13)
    kw = dict(max_seq_len=600, num_splits=40, config=cfg)
    fused = plan_for(pt, sl, q, kc, fused=True, **kw)
    two = plan_for(pt, sl, q, kc, fused=False, **kw)
    out, lse = fused.run(q, kc, vc, return_lse=True)
    check(out, q, kc, vc, pt, sl, sc)
    assert used_splits(fused) == [38, 1] and fused._meta1["CHUNK"] == 16
    assert not fused._flags.any()
    _, lse2 = two.run(q, kc, vc, return_lse=True)
    torch.testing.assert_close(lse, lse2, rtol=0, atol=1e-5)


def test_the_plan_module_imports_first_without_a_cycle() -> None:
    """decode_attention re-exports the plan's names lazily: either module may come first."""
    import subprocess
    import sys

    code = (
        "import kdash.kernels.decode_plan as p\n"
        "from kdash.kernels.decode_attention import DecodePlan, decode_attention\n"
        "assert DecodePlan is p.DecodePlan and decode_attention is p.decode_attention\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert da.DecodePlan is DecodePlan and da.max_splits_for is max_splits_for


# ------------------------------------------------------------------------- bench wiring
def _decode_row(ctx, bw, bw_graph, host, fp8_x):
    side = {"bw_ratio": bw, "bw_ratio_graph": bw_graph, "bw_ratio_readflush": bw}
    return {
        "long_context": ctx >= 16384,
        "bf16": {**side, "host_us_nosync": host},
        "fp8": {**side, "host_us_nosync": host / 2},
        "fp8_speedup": fp8_x,
        "fp8_speedup_graph": fp8_x,
    }


def test_bench_summary_judges_each_key_against_its_floor() -> None:
    from kdash.kernels import bench

    decode = [
        _decode_row(131072, 0.85, 0.93, 7.5, 1.6),
        _decode_row(65536, 0.82, 0.91, 9.0, 1.55),
        _decode_row(4096, 0.10, 0.10, 30.0, 0.5),  # short context: not in the ratios
        {"error": "RuntimeError: out of memory"},
    ]
    prefill = [
        {"seq": 2048, "vs_sdpa_flash": 1.2, "vs_sdpa_cudnn": 0.5},  # below 4k: not cuDNN's
        {"seq": 4096, "vs_sdpa_flash": 1.3, "vs_sdpa_cudnn": 0.85},
        {"seq": 8192, "vs_sdpa_flash": 1.4},  # cuDNN failed on this shape
    ]
    s = bench.summarize(decode, prefill)
    assert s["decode_bw_ratio"] == 0.82 and s["decode_bw_ratio_graph"] == 0.91
    assert s["decode_host_us"] == 30.0  # the worst shape, short ones included
    assert s["prefill_vs_sdpa_flash"] == 1.2 and s["prefill_vs_sdpa_cudnn"] == 0.85
    assert s["fp8_speedup"] == 1.55
    assert s["status"] == {
        "decode_bw_ratio": "pass",
        "decode_bw_ratio_graph": "pass",
        "decode_host_us": "miss",  # an upper bound: 30 > 10
        "fp8_speedup": "pass",
        "prefill_vs_sdpa_flash": "pass",
        "prefill_vs_sdpa_cudnn": "miss",
    }
    assert s["short_by"]["decode_host_us"] == pytest.approx(20.0)
    assert s["short_by"]["prefill_vs_sdpa_cudnn"] == pytest.approx(0.05)
    # floors recorded as the issue sets them; none lowered
    assert bench.FLOORS["decode_host_us"] == 10 and bench.FLOORS["prefill_vs_sdpa_cudnn"] == 0.9
    assert bench.FLOORS["decode_bw_ratio_graph"] == 0.9 and bench.FLOORS["fp8_speedup"] == 1.5
    from kdash.kernels.bench_summary import floor_status

    assert floor_status("prefill_vs_sdpa_cudnn", None) == "miss"


@needs_device
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_bench_decode_case_times_a_plan_run_that_passes_the_gate(fp8: bool, monkeypatch) -> None:
    from kdash.kernels import bench

    monkeypatch.setattr(bench, "DEVICE", DEV)
    case = bench.DecodeCase([300, 40], 8, 2, 64, fp8)
    fn, splits = case.fn(SMALL)
    assert splits >= 1
    case.out.fill_(float("nan"))
    fn()
    sc = case.scales
    check(case.out, case.q, case.k, case.v, case.page_table, case.seq_lens, sc)
    assert case.check(SMALL)["passed"]


@needs_device
def test_bench_decode_row_times_every_launch_path(monkeypatch) -> None:
    """The wiring of the decode table and its summary for the three paths, on the CPU: the GPU
    timers cannot run here, so they are replaced by fixed figures per path (two launches 10%
    slower than fused and the persistent kernel 5%; host times 10, 8 and 7 us), so the summary
    can be checked per path. The runs that compare the paths' outputs are real (interpreted)."""
    from kdash.kernels import bench

    monkeypatch.setattr(bench, "DEVICE", DEV)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    plans: list = []
    factor = {"two": 1.1, "fused": 1.0, "persistent": 1.05}
    host = {"two": 10.0, "fused": 8.0, "persistent": 7.0}

    def timed(base):
        def fake(fn, **_kw):
            plan = plans[-1]
            return base * factor[plan.path] * (0.6 if plan.is_fp8 else 1.0)

        return fake

    real_fn = bench.DecodeCase.fn

    def fn(self, cfg, fused=None):
        out = real_fn(self, cfg, fused)
        plans.append(self.last_plan)
        return out

    monkeypatch.setattr(bench.DecodeCase, "fn", fn)
    monkeypatch.setattr(bench, "bench_ms", timed(0.1))
    monkeypatch.setattr(bench, "bench_graph_ms", timed(0.09))
    monkeypatch.setattr(bench, "bench_readflush_ms", timed(0.095))
    monkeypatch.setattr(bench, "bench_host_us", lambda fn: host[plans[-1].path] + 4)

    def calls(fn):  # a median run's mean that slow calls have moved, and the median call
        mid = host[plans[-1].path]
        return {"per_call_us": mid - 5, "run_mean_us": mid, "p90_us": mid + 1, "max_us": 900.0,
                "calls_over_50us": 1}  # fmt: skip

    monkeypatch.setattr(bench, "bench_host_calls", calls)
    row = {"long_context": True}
    bench.decode_row(row, [300, 40], 8, 2, 64, 3000.0, {"bf16": SMALL, "fp8": SMALL})
    d = plans[0].path  # the path a default plan takes for this batch
    assert d in ("two", "fused")  # persistent only with decode_persist.PERSISTENT_DEFAULT
    others = [p for p in ("two", "fused", "persistent") if p != d]
    assert [p.path for p in plans] == [d, *others] * 2  # the default path first, bf16 then fp8
    assert row["bf16"]["path"] == bench.PATH_KEYS[d] and row["bf16"]["fused"] is (d != "two")
    assert row["bf16"]["host_us_nosync"] == host[d] and row["bf16"]["host_us_call"] == host[d] - 5
    assert row["bf16"]["host_calls"]["max_us"] == 900.0
    two, fused, pers = (row["paths"][k] for k in ("two_launch", "fused", "persistent"))
    assert fused["bf16"]["us"] == pytest.approx(100.0) and two["bf16"]["us"] == pytest.approx(110.0)
    assert pers["bf16"]["us"] == pytest.approx(105.0)
    assert fused["fp8_speedup"] == pytest.approx(1 / 0.6)
    for tag in ("bf16", "fp8"):
        for other in others:
            path = row["paths"][bench.PATH_KEYS[other]]
            assert path[tag]["max_abs_diff_vs_default"] < 0.05  # bf16 outputs of |x| < ~3
    s = bench.summarize([row], [])
    assert decode_plan.FUSED_DEFAULT == "auto"  # the module's default: chosen per batch
    assert s["default_path"] == "per batch (decode_plan.fused_pays)"
    by = s["by_path"]
    assert by["fused"]["decode_host_us"] == 8.0 and by["two_launch"]["decode_host_us"] == 10.0
    assert by["persistent"]["decode_host_us"] == 7.0
    # One row: the top-level keys are those of the path its default plan took.
    assert s["decode_host_us"] == by[bench.PATH_KEYS[d]]["decode_host_us"] == host[d]
    assert s["decode_host_us_call"] == host[d] - 5
    assert by["fused"]["decode_bw_ratio"] > by["persistent"]["decode_bw_ratio"]
    assert by["persistent"]["decode_bw_ratio"] > by["two_launch"]["decode_bw_ratio"]
    assert by["persistent"]["status"]["decode_host_us"] == "pass"
    line = bench.paths_line(row)
    assert "two_launch bf16" in line and "fused fp8" in line
    assert all(p["shapes"] == "1 of 1" for p in by.values())

    # --default-path-only: the default path alone is timed, and the summary says so per path
    monkeypatch.setattr(bench, "OTHER_PATHS", False)
    plans.clear()
    row = {"long_context": True}
    bench.decode_row(row, [300, 40], 8, 2, 64, 3000.0, {"bf16": SMALL, "fp8": SMALL})
    assert [p.path for p in plans] == [d, d]
    assert all(not row["paths"][bench.PATH_KEYS[o]] for o in others)
    assert bench.paths_line(row).count(bench.PATH_KEYS[d]) == 2
    by = bench.summarize([row], [])["by_path"]
    assert by[bench.PATH_KEYS[d]]["shapes"] == "1 of 1"
    assert all(by[bench.PATH_KEYS[o]]["shapes"] == "0 of 1" for o in others)
    assert all(by[bench.PATH_KEYS[o]]["decode_host_us"] is None for o in others)


# ------------------------------------------------------------ the packed pointer launchers
# Triton's C launcher needs a GPU, so these tests give the bound kernels a stand-in compiled
# kernel whose launcher records what it is called with (the layouts of Triton 3.6 and 3.9, as
# read in their launcher sources): what a run hands the launcher, and in which order, is then
# checked on the CPU against the tensor arguments the interpreter runs with.
def _stand_in(bk: BoundKernel, n_runtime: int, calls: list, annotated: bool) -> None:
    import inspect
    from types import SimpleNamespace

    from kdash.kernels import launch

    params = list(inspect.signature(getattr(bk.fn, "fn", bk.fn)).parameters.values())
    tail = tuple(bk.meta.get(p.name, p.default) for p in params[n_runtime:])
    runner = SimpleNamespace(
        launch=lambda *a: calls.append((bk.fn, a)),
        global_scratch_size=0,
        profile_scratch_size=0,
        launch_cooperative_grid=False,
        launch_pdl=False,
    )
    if annotated:
        runner.arg_annotations, runner.kernel_signature = "ANN", b"SIG"
    compiled = SimpleNamespace(run=runner, function=77, packed_metadata=(4, 1, 0))
    bk._compiled, bk._tail = compiled, tail
    bk._stream, bk._device = (lambda _d: 5), 0
    bk._direct = launch._direct_entry(compiled, bk._g, tail)


def _kernel_args(call, annotated: bool) -> tuple:
    """The kernel's arguments (runtime then constexpr) out of one recorded launcher call."""
    fn, a = call
    assert a[3] == 5 and a[4] == 77  # the stream, then the function handle
    if annotated:
        assert a[7] == (4, 1, 0) and a[13:15] == ("ANN", b"SIG") and a[8:13] == (None,) * 5
        return a[15]
    assert a[7:9] == (None, None) and a[9] == (4, 1, 0) and a[10:13] == (None,) * 3
    return a[13:]


def _as_ptrs(args: tuple) -> tuple:
    return tuple(x.data_ptr() if isinstance(x, torch.Tensor) else x for x in args)


@pytest.mark.skipif(not INTERPRET, reason="stands in for the GPU's launcher on the CPU")
@pytest.mark.parametrize("annotated", [False, True], ids=["triton-3.6", "triton-3.9"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_run_hands_the_launcher_pointers_in_the_kernels_order(
    fp8, annotated, path, monkeypatch
) -> None:
    """After the first run, a run calls the packed launchers with ints: exactly the tensor
    arguments of Triton's own path with every tensor replaced by its pointer, then the
    constexprs; no allocation or sync; a misaligned q leaves them for Triton's path."""
    q, kc, vc, pt, sl, sc = make_case([5, 200, 77], 8, 2, 64, 16, fp8, seed=14)
    plan = plan_for(pt, sl, q, kc, max_seq_len=256, **sc)
    calls: list = []
    saved = BoundKernel.__call__
    BoundKernel.__call__ = lambda self, *a: None  # binds the layout without interpreting
    try:
        plan.run(q, kc, vc)
    finally:
        BoundKernel.__call__ = saved
    _stand_in(plan._s1, 7 + len(plan._rest1), calls, annotated)
    if plan._s2 is not None:
        _stand_in(plan._s2, len(plan._args2), calls, annotated)
    plan._arm_fire()
    assert plan._fire is not None
    q2 = torch.randn_like(q.float()).bfloat16()
    with no_allocation_no_sync():
        plan.run(q2, kc, vc)
    assert [fn for fn, _ in calls] == ([plan._kern1] if path else [plan._kern1, da._decode_stage2])
    want1 = (q2, kc, vc, pt, sl, plan._ks, plan._vs, *plan._rest1)
    got1 = _kernel_args(calls[0], annotated)
    assert all(type(x) is not torch.Tensor for x in got1)
    assert got1 == (*_as_ptrs(want1), *plan._s1._tail)
    if not path:
        assert _kernel_args(calls[1], annotated) == (*_as_ptrs(plan._args2), *plan._s2._tail)
    # a misaligned q: Triton's own path (recorded here), with tensors, not the launchers
    big = torch.empty(q.numel() + 1, dtype=q.dtype)
    shifted = big[1:].view_as(q)
    jitted: list = []
    monkeypatch.setattr(BoundKernel, "jit", lambda self, *a: jitted.append((self.fn, a)))
    calls.clear()
    plan.run(shifted, kc, vc)
    assert [(fn, a[0]) for fn, a in jitted] == [(plan._kern1, shifted)]
    assert [fn for fn, _ in calls] == ([] if path else [da._decode_stage2])


def test_a_launcher_exists_only_once_the_kernel_is_armed() -> None:
    bk = BoundKernel(da._decode_stage2, (1, 1), {})
    assert bk.launcher(()) is None and not bk.fast


def test_an_empty_launch_hook_chain_is_not_a_hook() -> None:
    """Triton keeps each launch hook as a chain object whether or not anything was added, so
    'is a hook installed' must look inside it: read as 'not None', every run took Triton's own
    launch path and paid ~50 µs of host time per decode on the H200
    (bench/results/decode-host-h200.json). The real chain of the installed Triton is used."""
    from kdash.kernels import launch

    try:
        from triton import knobs
    except ImportError:
        pytest.skip("this Triton keeps its launch hooks elsewhere")
    rt = knobs.runtime
    assert not launch._hooks_installed()  # nothing added: the fast path is open

    def hook(*_a, **_k) -> None:
        return None

    chain = rt.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(hook)
        try:
            assert launch._hooks_installed()  # a profiler's hook: Triton's own path
        finally:
            chain.remove(hook)
    else:  # a Triton whose hook is a plain attribute
        rt.launch_enter_hook = hook
        try:
            assert launch._hooks_installed()
        finally:
            rt.launch_enter_hook = chain
    assert not launch._hooks_installed()
    assert launch._hook_set(None) is False and launch._hook_set(hook) is True


# ------------------------------------------------------------------ wave-aware split counts
def used_splits(plan: DecodePlan) -> list[int]:
    """Per request, the splits the device-side cut gave work (finite partial LSE), read back
    from the plan's workspace after a run: the cut the kernel made, not the host's guess. The
    caller fills the workspace with NaN before the run: the two-launch and fused kernels mark an
    empty split -inf, the persistent one never takes it as an item (it stays NaN)."""
    lse = plan.lse_part.view(plan.batch, plan.q_heads, plan.num_splits)
    counts = torch.isfinite(lse).sum(-1)  # [B, Hq]; every head of a request is cut alike
    assert (counts == counts[:, :1]).all()
    return counts[:, 0].tolist()


def host_cut(plan: DecodePlan, lens: list[int]) -> list[int]:
    """What the host's model says each request is cut into at the plan's residency."""
    cfg = plan.config
    s = da.wave_splits(
        plan.batch * plan.kv_heads,
        max(lens),
        plan.capacity,
        block_n=cfg.block_n,
        min_tokens=cfg.min_tokens_per_split,
        max_splits=cfg.max_splits,
        merge=da.merge_tokens(plan.q_heads // plan.kv_heads, 1 if plan.is_fp8 else 2),
    )
    hint = cdiv(cdiv(max(lens), s), cfg.block_n) * cfg.block_n
    return [min(plan.num_splits, max(1, cdiv(n, hint))) for n in lens]


@needs_device
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "page_size", "fp8"),
    [(8, 2, 16, False), (8, 2, 1, False), (4, 1, 16, True), (6, 2, 1, True)],
    ids=["gqa4-p16", "gqa4-p1", "gqa4-p16-fp8", "gqa3-p1-fp8"],
)
def test_the_device_cut_is_the_host_wave_plan(q_heads, kv_heads, page_size, fp8, path) -> None:
    """Odd near-equal lengths under a grid sized for any lengths up to 3072 (12 splits): the
    kernel's own search, from the lengths in memory, picks the split count the host's model
    does, and the result passes the gate. At 2 KV heads that is 5 splits (30 programs, one wave
    of the 32 resident), where the work-based cut gave 6 (36 programs: a second wave of 4). The
    interpreter compiles nothing, so the plan uses the config's residency (4 per SM x the
    interpreter's 8 SMs)."""
    lens = [2999, 2901, 2777]
    q, kc, vc, pt, sl, sc = make_case(lens, q_heads, kv_heads, 64, page_size, fp8, seed=30)
    plan = plan_for(pt, sl, q, kc, max_seq_len=3072, **sc)
    assert plan.residency_source == "config" and plan.capacity == SMALL.programs_per_sm * 8
    assert plan.num_splits == 12
    want = host_cut(plan, lens)
    if kv_heads == 2:
        assert want == [5, 5, 5]
    plan.lse_part.fill_(float("nan"))
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert used_splits(plan) == want


@needs_device
def test_a_filled_residency_cache_sets_the_waves(residency_entry) -> None:
    """One program per SM (set by hand for this variant) makes a wave 8 programs: 2 splits of
    1024 tokens in one wave beat the 8 splits that fill the config's 32."""
    lens = [1999, 1873]
    q, kc, vc, pt, sl, sc = make_case(lens, 8, 2, 64, 16, seed=31)
    kw = dict(max_seq_len=max(lens), total_tokens=sum(lens))
    first = plan_for(pt, sl, q, kc, **kw)
    assert first.num_splits == 8 and first.residency_source == "config"
    residency_entry(first.variant_key(first.num_splits), 1)
    plan = plan_for(pt, sl, q, kc, **kw)
    assert plan.residency_source == "cache" and plan.resident_per_sm == 1
    assert plan.capacity == 8 and plan.num_splits == 2 and plan.split_len == 1024
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert used_splits(plan) == host_cut(plan, lens) == [2, 2]
    # a variant the cache has no entry for (another page size) keeps the config's figure
    q2, kc2, vc2, pt2, sl2, _ = make_case(lens, 8, 2, 64, 1, seed=31)
    other = plan_for(pt2, sl2, q2, kc2, **kw)
    assert other.residency_source == "config" and other.num_splits == 8


@needs_device
def test_a_replay_plan_follows_the_wave_plan_of_its_lengths(residency_entry) -> None:
    """A plan for lengths unknown at plan time (grid from max_splits_for) cuts each run by
    the lengths in memory: 2 of its splits at first, 1 after the lengths shrink in place."""
    lens = [1999, 1873]
    q, kc, vc, pt, sl, sc = make_case(lens, 8, 2, 64, 16, seed=32)
    probe = plan_for(pt, sl, q, kc, max_seq_len=2048)
    grid = probe.num_splits
    residency_entry(probe.variant_key(grid), 1)
    plan = plan_for(pt, sl, q, kc, max_seq_len=2048)
    assert plan.capacity == 8
    assert plan.num_splits == max_splits_for(2, 2048, config=SMALL, resident_per_sm=1) > 2
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert used_splits(plan) == [2, 2]
    sl.copy_(torch.tensor([300, 201], dtype=torch.int32))  # shorter: one split of 320 tokens
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert used_splits(plan) == [1, 1]


def test_bench_summary_keeps_the_run_means_and_shows_the_median_call() -> None:
    from kdash.kernels import bench

    row = _decode_row(65536, 0.82, 0.91, 12.0, 1.55)  # run means carrying slow calls
    row["bf16"]["host_us_call"], row["fp8"]["host_us_call"] = 6.0, 7.5
    s = bench.summarize([row], [])
    assert s["decode_host_us"] == 12.0 and s["status"]["decode_host_us"] == "miss"
    assert s["decode_host_us_call"] == 7.5  # beside it, not the key


def test_host_calls_tell_a_stalled_call_from_the_cost_of_one(monkeypatch) -> None:
    """bench_host_calls on the CPU (the GPU drain stood in for: there is no GPU here): one call
    in a hundred stalls 2 ms, so each run's mean carries ~20 us of it while the median call
    does not; the stalls are counted. The margins hold on a loaded machine."""
    from kdash.kernels import bench_timing

    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    n = [0]

    def call() -> None:
        n[0] += 1
        if n[0] % 100 == 50:
            time.sleep(0.002)

    got = bench_timing.bench_host_calls(call, calls=100, reps=7)
    assert got["calls_over_50us"] >= 7 and got["max_us"] >= 2000
    assert got["run_mean_us"] >= 20 > got["per_call_us"]
