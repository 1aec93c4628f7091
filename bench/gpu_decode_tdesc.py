"""Decode stage 1 through Triton's own TMA descriptors (kernels/decode_tdesc.py) against the
plan's cp.async stage 1. (GPU machine)

Gates first: for each case a two-launch plan runs (its output is the reference); the
descriptor stage 1 runs on that plan's arguments (split count, partial buffers, device-side
split search), followed by the plan's merge kernel, and the outputs are compared. Cases: odd
lengths with every unused slot NaN-filled, GQA 4 and 8, 40 one-split requests. Then timings
(CUDA-graph replay and do_bench medians, us; read-flushed for the two launches) at the long
bf16 shapes: the plan's stage 1 alone, each variant's stage 1 alone (page indices a step
ahead or in the step; ``num_stages``; warps), at the plan's split count and 1.25x it (fewer
registers fit more programs an SM), the best variant with the merge, the plan's two launches
and its default path. Writes $OUT/decode-tdesc.json after every row.
Run: python bench/gpu_decode_tdesc.py [--shapes 1x65536,8x16384] [--no-timing]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from kdash.kernels import bench
from kdash.kernels import decode_tdesc as dt
from kdash.kernels._common import ensure_allocator
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DecodeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_gluon import nan_fill_unused, run_gates, splits_plan

# (name, compile-time values over the plan's): the page index a step ahead or in the step
VARIANTS = [
    ("ahead_s3_w4", {"PAGES_AHEAD": True, "num_stages": 3, "num_warps": 4}),
    ("ahead_s5_w4", {"PAGES_AHEAD": True, "num_stages": 5, "num_warps": 4}),
    ("ahead_s9_w4", {"PAGES_AHEAD": True, "num_stages": 9, "num_warps": 4}),
    ("ahead_s5_w2", {"PAGES_AHEAD": True, "num_stages": 5, "num_warps": 2}),
    ("tile64_s2_w4", {"PAGES_AHEAD": False, "num_stages": 2, "num_warps": 4}),
]


def tdesc_fns(case: bench.DecodeCase, plan, over: dict):
    """(stage 1 + the plan's merge, stage 1 alone) on the plan's bound arguments."""
    plan.run(case.q, case.k, case.v)  # binds the plan's arguments
    meta = dt.stage1_meta(plan._meta1, **over)
    args = (case.q, case.k, case.v, case.page_table, case.seq_lens, plan._ks, plan._vs)
    args = (*args, *plan._rest1)
    grid = plan._grid1

    def stage1():
        ensure_allocator()
        stage1.compiled = dt._decode_stage1_tdesc[grid](*args, **meta)

    def both():
        stage1()
        plan._s2(*plan._args2)

    return both, stage1


def time_us(fn, readflush: bool = False) -> dict:
    fn()
    torch.cuda.synchronize()
    got = {"us": bench_ms(fn) * 1e3, "us_graph": bench_graph_ms(fn) * 1e3}
    if readflush:
        got["us_readflush"] = bench_readflush_ms(fn) * 1e3
    return got


def gate(lens, hq, hkv, name: str) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    nan_fill_unused(case)
    plan = case.plan(DecodeConfig(), fused=False)
    ref = plan.run(case.q, case.k, case.v).float().clone()
    both, _ = tdesc_fns(case, plan, dict(VARIANTS)[name])
    plan.out.fill_(float("nan"))
    both()
    torch.cuda.synchronize()
    out = plan.out.float()
    worst = float((out - ref).abs().max()) if bool(torch.isfinite(out).all()) else float("inf")
    return {"variant": name, "lens": lens if len(lens) <= 8 else f"{len(lens)} requests",
            "heads": f"{hq}/{hkv}", "splits": plan.num_splits, "max_abs_diff": worst,
            "pass": worst <= 2e-2}  # fmt: skip


def timing(lens, hq, hkv, save) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    q, k, v = case.q, case.k, case.v
    two = case.plan(DecodeConfig(), fused=False)
    two.run(q, k, v)
    s1_args = (q, k, v, case.page_table, case.seq_lens, two._ks, two._vs, *two._rest1)
    row = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}", "splits": two.num_splits,
           "bytes": case.bytes_needed()}  # fmt: skip
    row["triton_stage1"] = time_us(lambda: two._s1(*s1_args))
    more = splits_plan(case, int(two.num_splits * 1.25))
    best, best_us = None, float("inf")
    for name, over in VARIANTS:
        for tag, plan in (("x1", two), ("x1.25", more)):
            try:
                # a forced split count is cut on the host (the device's search assumes the
                # plan's residency), as gpu_decode_gluon.py does
                host = {} if plan is two else {"DEVICE_PLAN": False}
                _, stage1 = tdesc_fns(case, plan, {**over, **host})
                got = time_us(stage1)
                got["splits"] = plan.num_splits
                got["registers"] = getattr(stage1.compiled, "n_regs", None)
                got["shared"] = getattr(stage1.compiled.metadata, "shared", None)
            except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
                got = {"error": f"{type(exc).__name__}: {exc}"[:400]}
            row[f"{name}_{tag}"] = got
            print(json.dumps({"shape": row["lens"], "heads": row["heads"], name + "_" + tag: got}))
            if got.get("us_graph", float("inf")) < best_us:
                best, best_us = (name, tag, plan), got["us_graph"]
            save()
    if best is not None:
        name, tag, plan = best
        host = {} if plan is two else {"DEVICE_PLAN": False}
        both, _ = tdesc_fns(case, plan, {**dict(VARIANTS)[name], **host})
        row["best"] = {"variant": f"{name}_{tag}", **time_us(both, readflush=True)}
    row["plan_two_launch"] = time_us(lambda: two.run(q, k, v), readflush=True)
    default = case.plan(DecodeConfig())
    row["plan_default"] = {"fused": default.fused,
                           **time_us(lambda: default.run(q, k, v), readflush=True)}  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1x65536,8x16384,1x131072")
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_decode_tdesc: needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(os.environ.get("OUT", ".")) / "decode-tdesc.json"
    res = {"command": "python bench/gpu_decode_tdesc.py " + " ".join(sys.argv[1:]),
           "machine": bench.machine(), "triton": triton.__version__, "gates": [],
           "rows": []}  # fmt: skip

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    cases = []
    for name, _ in VARIANTS:
        cases += [
            ([300, 41, 129, 1000], 32, 8, name),
            ([517, 64, 3000], 64, 8, name),
            ([37] * 40, 8, 2, name),
        ]
    if not run_gates(cases, gate, res, save):
        print("gpu_decode_tdesc: a gate failed; no timing", file=sys.stderr)
        return 1
    if args.no_timing:
        return 0
    res["ceilings"] = bench.ceilings()
    for shape in args.shapes.split(","):
        b, n = (int(x) for x in shape.split("x"))
        for hq in (32, 64):
            res["rows"].append(timing([n] * b, hq, 8, save))
            save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
