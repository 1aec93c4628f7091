"""The two-launch decode's merge over tagged partials (kernels/decode_tagged.py), in the CPU
interpreter: stage 1 stores each partial value under its launch's tag and the merge takes only
values carrying the tag it expects, so the result is the plain merge's and the tags move by one
a run, through runs with other queries. The interpreter runs stage 1 to its end before the
merge starts, so what it shows is the tags' bookkeeping and the arithmetic, not the overlap
(the programmatic launch and the polling run on the GPU only; a row missing there would show
here as a wrong result, not a hang)."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_cases  # noqa: E402
from kdash.kernels import bench_configs, decode_tagged  # noqa: E402
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig  # noqa: E402


def _plan(case, tagged: bool, monkeypatch, **kw):
    q, kc, _, pt, sl, sc = case
    monkeypatch.setattr(decode_tagged, "TAGGED_DEFAULT", tagged)
    kw.setdefault("config", DecodeConfig())
    return decode_cases.plan_for(pt, sl, q, kc, max_seq_len=int(sl.max()), **sc, **kw)


def _nan_fill(case) -> None:
    """Every cache slot no request reads set to NaN (past each request's length, and pages no
    request owns): a merge that took a stale or unwritten partial would show it."""
    q, kc, vc, pt, sl, _ = case
    page = kc.shape[1]
    used = torch.zeros(kc.shape[0], page, dtype=torch.bool, device=kc.device)
    for b, n in enumerate(sl.tolist()):
        pages = pt[b, : -(-n // page)].long()
        used[pages] = True
        used[pages[-1], n - (len(pages) - 1) * page :] = False
    for t in (kc, vc):
        t[~used] = float("nan")


@pytest.mark.parametrize(
    ("lens", "heads", "page", "splits"),
    [
        ([1000, 37, 2222], (16, 4), 16, None),
        ([513, 1, 900], (16, 4), 1, None),
        ([3000, 70], (4, 1), 16, 40),
    ],
    ids=["odd3-p16", "odd3-p1", "40-splits"],  # 40: the merge reads two chunks of 32
)
def test_tagged_runs_match_the_plain_merge_and_move_the_tags(
    lens, heads, page, splits, monkeypatch
) -> None:
    case = decode_cases.make_case(lens, *heads, 64, page, device="cpu", seed=7)
    _nan_fill(case)
    q, kc, vc, pt, sl, sc = case
    kw: dict = {"fused": False, "num_splits": splits}
    if splits:  # short splits, so that the longer request uses more than one chunk of them
        kw["config"] = DecodeConfig(min_tokens_per_split=16, block_n=16)
    plain = _plan(case, False, monkeypatch, **kw)
    tagged = _plan(case, True, monkeypatch, **kw)
    assert tagged.tagged and not plain.tagged
    assert tagged._meta1.get("TAGGED") is True and "TAGGED" not in plain._meta1
    assert tagged.num_splits == plain.num_splits > 1
    if splits:
        assert tagged.num_splits == splits > decode_tagged.CHUNK
    qs = [q, torch.randn_like(q), q]
    for i, x in enumerate(qs, start=1):
        want = plain.run(x, kc, vc).clone()
        got = tagged.run(x, kc, vc)
        assert torch.isfinite(got.float()).all()
        decode_cases.check(got, x, kc, vc, pt, sl, sc)
        # the same partials, folded in another order: within an ulp of bf16 or two
        assert (got.float() - want.float()).abs().max() <= 2e-2
        assert (tagged._ep == i).all()
        tags = (tagged.lse_part.view(torch.int64) >> 32).to(torch.int32)
        assert (tags == i).all()  # every slot, an empty split's included, written this run
    if splits:
        lse = tagged.lse_part.view(torch.int64).view(len(lens), heads[0], splits)
        live = torch.isfinite((lse & 0xFFFFFFFF).to(torch.int32).view(torch.float32))
        assert int(live[0, 0].sum()) > decode_tagged.CHUNK


def test_a_merge_whose_tag_never_comes_gives_up_with_nan(monkeypatch) -> None:
    """A merge program expecting a tag no stage 1 writes (its head's EP raised by hand) stops
    polling after MAX_POLLS and writes NaN for that head: a bookkeeping bug shows as a wrong
    output, not as a hang; the other heads stay right."""
    case = decode_cases.make_case([700, 90], 8, 2, 64, 16, device="cpu", seed=3)
    q, kc, vc, pt, sl, sc = case
    plan = _plan(case, True, monkeypatch, fused=False)
    assert plan._s2.meta["MAX_POLLS"] == 2  # the interpreter's bound
    plan.run(q, kc, vc)
    plan._ep[5] += 7  # request 0, head 5: waits for tag 9 while stage 1 writes tag 2
    got = plan.run(q, kc, vc).float()
    bad = ~torch.isfinite(got).all(-1)
    assert bad.view(-1).nonzero().view(-1).tolist() == [5]
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[0, :5]).all()
    assert int(plan._ep[5]) == 9 and (plan._ep[plan._ep != 9] == 2).all()


def test_an_output_value_under_an_old_tag_is_never_taken(monkeypatch) -> None:
    """The merge alone, run again over one run's partials with one output value of a split
    with keys set back to the tag before: that head comes out NaN (the merge waits for every
    value of an arrived split, then gives up), the others as the first merge gave them."""
    case = decode_cases.make_case([700, 90], 8, 2, 64, 16, device="cpu", seed=4)
    q, kc, vc, pt, sl, sc = case
    plan = _plan(case, True, monkeypatch, fused=False)
    first = plan.run(q, kc, vc).clone()
    lse = plan.lse_part.view(torch.int64).view(2, 8, plan.num_splits)
    live = torch.isfinite((lse[1, 6] & 0xFFFFFFFF).to(torch.int32).view(torch.float32))
    split = int(live.nonzero()[0])
    o = plan.o_part.view(torch.int64).view(2, 8, plan.num_splits, 64)
    o[1, 6, split, 17] = o[1, 6, split, 17] & 0xFFFFFFFF  # tag 0, its value kept
    plan._ep.zero_()  # the merge expects tag 1 again
    plan._s2(*plan._args2)
    out = plan.out.float()
    bad = ~torch.isfinite(out).all(-1)
    assert bad.nonzero().tolist() == [[1, 6]]
    assert torch.equal(out[~bad], first.float()[~bad])


def test_only_two_launch_bf16_plans_are_tagged(monkeypatch) -> None:
    case = decode_cases.make_case([1000], 32, 8, 128, 16, device="cpu")
    assert not _plan(case, True, monkeypatch, fused=True).tagged
    assert not _plan(case, False, monkeypatch, fused=False).tagged
    fp8 = decode_cases.make_case([1000], 32, 8, 128, 16, True, device="cpu")
    assert not _plan(fp8, True, monkeypatch, fused=False, config=DEFAULT_FP8_CONFIG).tagged


def test_the_sm90_builds_trigger_the_merge_and_poll_without_a_grid_wait(tmp_path, monkeypatch):
    """Compiled for sm_90 (Triton's own pipeline in a child process): the tagged stage 1 lets
    the next launch go (``griddepcontrol.launch_dependents``) before it reads the cache and
    stores 64-bit elements; the merge polls with volatile loads and never waits on the grid
    (``griddepcontrol.wait``): the tags are its only synchronisation."""
    from sm90_compile import compile_sm90

    case = decode_cases.make_case([1000], 32, 8, 128, 16, device="cpu")
    plan = _plan(case, True, monkeypatch, fused=False)
    meta = {k: v for k, v in plan._meta1.items() if k != "EVICT"}
    meta.update(UPCAST=False, EVICT="")
    ptrs = ["*bf16", "*bf16", "*bf16", "*i32", "*i32", "*i32", "*i32", "*fp32", "*fp32"]
    where = "kdash.kernels.decode_attention:_decode_stage1"
    s1 = compile_sm90(where, meta, ptrs, tmp_path / "a")["ptx"]
    body = s1[s1.index(".entry") :]
    trigger = body.index("griddepcontrol.launch_dependents")
    copies = [m.start() for m in re.finditer(r"cp\.async\.", body)]  # the cache's tiles
    assert copies and trigger < min(copies)
    assert re.search(r"st\.global(\.v2)?\.b64", body) and "griddepcontrol.wait" not in body
    meta2 = {k: v for k, v in plan._s2.meta.items() if k != "launch_pdl"}
    meta2.update(GPU=True, EMULATE_RTNE=False)
    ptrs2 = ["*fp32", "*fp32", "*bf16", "*fp32", "*i32"]
    where2 = "kdash.kernels.decode_tagged:_decode_merge_tagged"
    m = compile_sm90(where2, meta2, ptrs2, tmp_path / "b")["ptx"]
    assert "ld.volatile.global" in m and "griddepcontrol" not in m
    assert "nanosleep" in m


def test_the_bench_flags_set_the_switch(monkeypatch) -> None:
    import argparse

    monkeypatch.setattr(decode_tagged, "TAGGED_DEFAULT", False)
    ap = argparse.ArgumentParser()
    bench_configs.add_switches(ap)
    bench_configs.apply_switches(ap.parse_args(["--tagged-two"]))
    assert decode_tagged.TAGGED_DEFAULT is True
    bench_configs.apply_switches(ap.parse_args([]))
    assert decode_tagged.TAGGED_DEFAULT is True
    bench_configs.apply_switches(ap.parse_args(["--no-tagged-two"]))
    assert decode_tagged.TAGGED_DEFAULT is False


needs_cuda = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs CUDA (and TRITON_INTERPRET=0)",
)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    ("lens", "q_heads", "kv_heads"),
    [([65536], 64, 8), ([1000, 37, 4097, 2222], 32, 8), ([513] * 40, 32, 4)],
    ids=["1x64k", "odd4", "40x513"],
)
def test_on_the_gpu_tagged_steps_in_a_graph_match_their_eager_runs(
    lens, q_heads, kv_heads, monkeypatch
) -> None:
    """The merge launched while stage 1 runs, polling tagged partials: each run passes the
    gate, and a CUDA graph of steps, each after a copy kernel that writes q, replayed, gives
    every step its own query's eager output bit for bit (a merge that took a stale partial,
    the last step's or the last replay's, would not); the tags move by one a step."""
    case = decode_cases.make_case(lens, q_heads, kv_heads, 128, 16, device="cuda", seed=9)
    _nan_fill(case)
    q, kc, vc, pt, sl, sc = case
    plan = _plan(case, True, monkeypatch, fused=False)
    assert plan.tagged
    qs = [torch.randn_like(q) for _ in range(4)]
    refs = []
    for x in qs:
        got = plan.run(x, kc, vc)
        decode_cases.check(got, x, kc, vc, pt, sl, sc)
        refs.append(got.clone())
    q_in = torch.empty_like(q)
    outs = [torch.empty_like(q) for _ in qs]
    plan.run(q_in, kc, vc)
    torch.cuda.synchronize()
    before = int(plan._ep[0])
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for x, o in zip(qs, outs, strict=True):
            q_in.copy_(x)
            o.copy_(plan.run(q_in, kc, vc))
    for _ in range(10):
        g.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(o, r) for o, r in zip(outs, refs, strict=True))
    assert (plan._ep == before + 10 * len(qs)).all()
