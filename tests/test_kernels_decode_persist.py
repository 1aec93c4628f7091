"""The persistent one-launch decode (kernels/decode_persist.py): how plans take it, its results
and counters in the CPU interpreter, its sm_90 compile, and its GPU gates.

In the interpreter programs run one after another, so the first takes every work item and the
others find none: the order of the takes, the counts, the merge and the counters' reset are
checked here; programs running at once (and the deadlock argument) only on the GPU (``gpu``).
The compile test runs Triton's real compiler for sm_90 in a child process (no GPU needed).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import re

import pytest

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

import decode_cases as cases  # noqa: E402
from decode_cases import check  # noqa: E402
from kdash.kernels import decode_persist, decode_plan  # noqa: E402
from kdash.kernels.decode_attention import DecodeConfig  # noqa: E402
from kdash.kernels.decode_plan import DecodePlan  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_device = pytest.mark.skipif(
    not INTERPRET and not torch.cuda.is_available(), reason="no CUDA and not interpreting"
)
SMALL = DecodeConfig(block_n=64, fp8_compute="cvt")


def make_case(lens, q_heads, kv_heads, head_dim=64, fp8=False, seed=0):
    return cases.make_case(lens, q_heads, kv_heads, head_dim, 16, fp8, seed=seed)


def plan_for(q, kc, pt, sl, scales, **kw) -> DecodePlan:
    kw.setdefault("config", SMALL)
    kw.setdefault("max_seq_len", int(sl.max()))
    return DecodePlan(
        pt, sl, q.shape[1], kc.shape[2], q.shape[2], kc.shape[1], kv_dtype=kc.dtype, **scales, **kw
    )


# --------------------------------------------------------------------------- the plan's choice
def test_what_it_cannot_run_is_said() -> None:
    assert decode_persist.unsupported_reason(False, False, False) is None
    assert decode_persist.unsupported_reason(False, True, True) is None
    assert "TMA" in decode_persist.unsupported_reason(True, False, False)
    assert "cvt" in decode_persist.unsupported_reason(False, True, False)


@needs_device
def test_an_explicit_ask_it_cannot_run_is_refused_a_default_falls_back(monkeypatch) -> None:
    q, kc, vc, pt, sl, sc = make_case([40, 7], 8, 2, fp8=True)
    pairs = DecodeConfig(block_n=64, fp8_compute="pairs_asm")
    with pytest.raises(ValueError, match="fp8_compute='cvt'"):
        plan_for(q, kc, pt, sl, sc, config=pairs, fused="persistent")
    monkeypatch.setattr(decode_plan, "FUSED_DEFAULT", "persistent")
    plan = plan_for(q, kc, pt, sl, sc, config=pairs)
    assert plan.path == "two" and not plan.fused and not plan.persistent
    assert plan_for(q, kc, pt, sl, sc).path == "persistent"  # cvt: it can


@needs_device
def test_the_auto_rule_takes_it_only_where_the_fused_launch_does_not_pay(monkeypatch) -> None:
    """With PERSISTENT_DEFAULT on: a few long requests (one wave, few merge programs) keep the
    fused launch; a batch of many requests, two launches before, takes the persistent one."""
    monkeypatch.setattr(decode_plan, "FUSED_DEFAULT", "auto")
    q, kc, vc, pt, sl, sc = make_case([700], 4, 1)
    q2, kc2, vc2, pt2, sl2, sc2 = make_case([30] * 12, 8, 2)
    assert plan_for(q, kc, pt, sl, sc).path == "fused"
    assert plan_for(q2, kc2, pt2, sl2, sc2).path == "two"  # off: as before
    monkeypatch.setattr(decode_persist, "PERSISTENT_DEFAULT", True)
    assert plan_for(q, kc, pt, sl, sc).path == "fused"
    many = plan_for(q2, kc2, pt2, sl2, sc2)
    assert many.path == "persistent" and many._s2 is None
    assert plan_for(q2, kc2, pt2, sl2, sc2, fused=False).path == "two"  # an explicit ask wins


# --------------------------------------------------------------------------- interpreted runs
@needs_device
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    ("lens", "splits"),
    [([1, 100, 300, 37], 3), ([500], 4), ([16, 17, 15], 1)],
    ids=["ragged", "one-long", "one-split"],
)
def test_results_match_two_launches_and_counters_come_back_to_zero(lens, splits, fp8) -> None:
    """Every stage-1 item and every merge item is done once: the output passes the reference
    gate and equals two launches' (the merges add the same partials in another order); the
    grid is the plan's residency or the item count if smaller; after each run the three
    counters are zero again, so a second run (or a graph replay) starts clean and agrees."""
    q, kc, vc, pt, sl, sc = make_case(lens, 8, 2, fp8=fp8, seed=len(lens))
    pers = plan_for(q, kc, pt, sl, sc, fused="persistent", num_splits=splits)
    two = plan_for(q, kc, pt, sl, sc, fused=False, num_splits=splits)
    work = decode_persist.items(len(lens), 2, pers.num_splits)
    assert pers._grid1 == (min(pers.capacity, work),)
    out = pers.run(q, kc, vc).clone()
    assert not pers._flags.any()
    check(out, q, kc, vc, pt, sl, sc)
    torch.testing.assert_close(out.float(), two.run(q, kc, vc).float(), atol=2e-2, rtol=2e-2)
    pers.out.fill_(float("nan"))
    assert torch.equal(pers.run(q, kc, vc), out)
    assert not pers._flags.any()


@needs_device
def test_a_grid_of_one_program_does_every_item(monkeypatch) -> None:
    """Residency 1 on 1 SM: one program takes all the stage-1 items, publishes once, merges
    every head, and as the last (only) program to finish zeroes the counters."""
    q, kc, vc, pt, sl, sc = make_case([90, 33], 4, 2)
    monkeypatch.setattr(decode_plan, "sm_count", lambda *a: 1)
    plan = plan_for(q, kc, pt, sl, sc, fused="persistent", num_splits=2,
                    config=DecodeConfig(block_n=64, programs_per_sm=1))  # fmt: skip
    assert plan._grid1 == (1,)
    check(plan.run(q, kc, vc), q, kc, vc, pt, sl, sc)
    assert not plan._flags.any()


@triton.jit
def _items_harness(LENS, OUT, batch, kv_heads, num_splits, hint, BLOCK_B: tl.constexpr):
    """Program i writes stage-1 item i's (request, KV head, split) and the item count."""
    i = tl.program_id(0)
    b, kvh, split = decode_persist._item_of(LENS, i, batch, kv_heads, num_splits, hint, BLOCK_B)
    n = tl.sum(decode_persist._request_items(LENS, batch, kv_heads, num_splits, hint, BLOCK_B)[1])
    tl.store(OUT + 4 * i, b)
    tl.store(OUT + 4 * i + 1, kvh)
    tl.store(OUT + 4 * i + 2, split)
    tl.store(OUT + 4 * i + 3, n)


@needs_device
def test_items_are_the_splits_with_tokens_in_request_order() -> None:
    """The stage-1 items are the (request, KV head, split) of the two-launch kernels' cut
    (splits = ceil(len / split length), at least 1, at most the grid's), requests in order, KV
    heads fastest: a request of no tokens keeps its one split (it writes lse = -inf), and of
    the 30 (request, split) pairs of a 6-split grid the 17 with no tokens are no items."""
    lens, kv_heads, num_splits, hint = [300, 0, 64, 129, 1000], 3, 6, 128
    want = []
    for b, n in enumerate(lens):
        for split in range(min(max(-(-n // hint), 1), num_splits)):
            want += [(b, kvh, split) for kvh in range(kv_heads)]
    assert len(want) == 3 * (3 + 1 + 1 + 2 + 6)
    sl = torch.tensor(lens, dtype=torch.int32, device=cases.DEV)
    out = torch.full((len(want), 4), -1, dtype=torch.int32, device=cases.DEV)
    _items_harness[(len(want),)](sl, out, len(lens), kv_heads, num_splits, hint, BLOCK_B=8)
    assert [tuple(r[:3]) for r in out.tolist()] == want
    assert set(out[:, 3].tolist()) == {len(want)}


@needs_device
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_plan_sized_for_longer_lengths_gives_the_same_results(fp8) -> None:
    """A plan made for lengths up to 4096 (as a CUDA graph replayed while requests grow is),
    run on short ones and on a request of no tokens: equal to two launches' output, and the
    gate on the requests that have tokens."""
    lens = [5, 300, 0, 77]
    q, kc, vc, pt, sl, sc = make_case([max(n, 1) for n in lens], 8, 2, fp8=fp8, seed=9)
    sl.copy_(torch.tensor(lens, dtype=torch.int32))
    pers = plan_for(q, kc, pt, sl, sc, fused="persistent", max_seq_len=4096)
    two = plan_for(q, kc, pt, sl, sc, fused=False, max_seq_len=4096)
    assert pers.num_splits > 2  # sized for 4096 tokens: most splits of these requests are empty
    out = pers.run(q, kc, vc).float().clone()
    assert not pers._flags.any()
    assert torch.equal(out[2], torch.zeros_like(out[2]))  # no tokens: zero, as two launches give
    torch.testing.assert_close(out, two.run(q, kc, vc).float(), atol=2e-2, rtol=2e-2)
    keep = [0, 1, 3]
    sub = [t[keep] for t in (q, pt, sl)]
    check(pers.out[keep], sub[0], kc, vc, sub[1], sub[2], sc)


# --------------------------------------------------------------------------- sm_90 compile


@needs_device
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_compiles_for_sm90_with_its_loop_pipelined_and_its_protocol(fp8, tmp_path) -> None:
    """The plan's own compile-time values (GPU ones: no interpreter upcast), compiled by Triton
    for sm_90 on the CPU: the KV loop inside the persistent loop is still software-pipelined
    (cp.async), the takes are relaxed atomic adds, the publish a GPU-scope fence and a release
    add, the finish an acquire-release add; the merge polls with volatile loads and a sleep.
    fp8 carries the plan's register cap (3 programs an SM at 4 warps)."""
    q, kc, vc, pt, sl, sc = make_case([1000], 32, 8, head_dim=128, fp8=fp8)
    plan = plan_for(q, kc, pt, sl, sc, fused="persistent", config=None)
    meta = dict(plan._meta1, UPCAST=False)
    if fp8:
        meta["ASM"] = True
        meta.setdefault("maxnreg", decode_persist.FP8_MAXNREG)  # the interpreter plan omits it
    kv = "*fp8e4nv" if fp8 else "*bf16"
    ptrs = ["*bf16", kv, kv, "*i32", "*i32"] + ["*fp32"] * 4 + ["*bf16", "*fp32", "*i32"]
    where = "kdash.kernels.decode_persist:_decode_persistent"
    ptx = compile_sm90(where, meta, ptrs, tmp_path)["ptx"]
    assert "cp.async" in ptx and "mma.sync.aligned" in ptx
    assert ptx.count("atom.global.gpu.relaxed.add") == 2  # the first take, the next take
    # the publish's result is unused: Triton 3.9 makes it a reduction (red), 3.6 an atom
    assert re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx)
    assert "atom.global.gpu.acq_rel.add" in ptx
    assert "fence.acq_rel.gpu" in ptx and "ld.volatile" in ptx and "nanosleep.u32" in ptx
    assert ("cvt.rn.f16x2.e4m3x2" in ptx) is fp8
    assert (f".maxnreg {decode_persist.FP8_MAXNREG}" in ptx) is fp8


# --------------------------------------------------------------------------- GPU gates
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    INTERPRET or not torch.cuda.is_available(), reason="needs a CUDA GPU and TRITON_INTERPRET=0"
)


@gpu
@needs_cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize(
    "lens",
    [[1024] * 128, [4096] * 32, "lognormal"],
    ids=["128x1k", "32x4k", "64-lognormal"],
)
def test_gpu_many_waves_match_two_launches_and_replays_leave_counters_at_zero(lens, fp8) -> None:
    """The shapes where the fused launch lost 9-40% (many waves of stage 1, many merges): the
    persistent kernel against two launches (the reference gate on a few requests too), then 200
    replays of a CUDA graph holding it, each equal to the first, with the counters at zero."""
    if lens == "lognormal":
        g = torch.Generator().manual_seed(3)
        lens = [int(x) for x in torch.empty(64).log_normal_(8.0, 1.0, generator=g).clamp(64, 32768)]
    q, kc, vc, pt, sl, sc = make_case(lens, 32, 8, head_dim=128, fp8=fp8, seed=4)
    pers = plan_for(q, kc, pt, sl, sc, fused="persistent", config=None, total_tokens=sum(lens))
    two = plan_for(q, kc, pt, sl, sc, fused=False, config=None, total_tokens=sum(lens))
    want = two.run(q, kc, vc).float().clone()
    got = pers.run(q, kc, vc).float().clone()
    torch.cuda.synchronize()
    assert not pers._flags.any()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    n = 4
    check(pers.out[:n], q[:n], kc, vc, pt[:n], sl[:n], sc)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pers.run(q, kc, vc)
    for _ in range(200):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pers.out.float(), got)
    assert not pers._flags.any()
