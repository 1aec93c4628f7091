"""The Gluon TMA decode kernels (kernels/decode_gluon.py) against the plan's own. (GPU machine)

Gates first: for each case a two-launch DecodePlan is made and run (its output is the
reference); the Gluon stage 1 is launched on that plan's arguments (split count, partial
buffers, device-side split search) and followed by the plan's merge kernel, and the TMA kernels
are run through plans of their own (``TmaConfig``, both paths); every output is compared. Cases:
odd lengths with every unused slot of the cache NaN-filled, GQA 1, 4 and 8, 40 one-split
requests, host-cut split counts twice the plan's. Then timings (CUDA-graph replay and do_bench
medians, us) at the long shapes: the Gluon stage 1 + merge at x1, x1.5 and x2 the plan's split
count, each stage 1 alone, the plan's two launches and default path, the plan's TMA paths; ring
depths beyond the first at 1 x 64k only. Then fp8 KV through plans: the Triton default against
the TMA kernels on both paths (checked against it). Writes $OUT/decode-gluon-h200.json after
every row.
Run: python bench/gpu_decode_gluon.py [--stages S] [--variants 3,6] [--factors 1,1.5,2]
     [--no-fused] [--no-timing]   (one line a row: pipe through bench/decode_gluon_summary.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
from kdash.kernels import bench, l2_hint
from kdash.kernels import decode_gluon as dg
from kdash.kernels._common import ensure_allocator
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.decode_gluon import TmaConfig
from kdash.kernels.decode_plan import DecodePlan

# The plan paths the TMA kernels are run on (--no-fused leaves out the one launch).
PATHS = [False, True]
STRIP = {"EVICT", "UPCAST", "IS_FP8", "FP8_FP16", "PREFETCH", "num_stages", "num_warps", "maxnreg"}


def nan_fill_unused(case: bench.DecodeCase) -> None:
    """Every slot of a request's last page past its length, and every page no request owns,
    set to NaN (as the GPU gates of tests/test_kernels_decode.py do)."""
    page = case.k.shape[1]
    used = torch.zeros(case.k.shape[0], page, dtype=torch.bool, device=case.k.device)
    for b, n in enumerate(case.lens):
        pages = case.page_table[b, : -(-n // page)].long()
        used[pages] = True
        last = pages[-1]
        used[last, n - (len(pages) - 1) * page :] = False
    for t in (case.k, case.v):
        if t.element_size() == 1:  # fp8 e4m3: 0x7f is its NaN (bytes, as few ops take fp8)
            t.view(torch.uint8)[~used] = 0x7F
        else:
            t[~used] = float("nan")


def splits_plan(case: bench.DecodeCase, splits: int) -> DecodePlan:
    """A two-launch plan of ``splits`` splits (the Gluon kernel fits more programs an SM than
    Triton's, so its own split count is timed too)."""
    return DecodePlan(case.page_table, case.seq_lens, case.hq, case.hkv, case.d, case.k.shape[1],
                      max_seq_len=max(case.lens), total_tokens=sum(case.lens),
                      kv_dtype=case.k.dtype, config=DecodeConfig(), out=case.out,
                      num_splits=splits, fused=False)  # fmt: skip


def gluon_fn(case: bench.DecodeCase, plan, stages: int, host_cut: bool = False):
    """Stage 1 in Gluon on the plan's arguments, then the plan's merge kernel; and stage 1
    alone. ``host_cut``: the plan's host-side split length instead of the device's search
    (whose wave model assumes the Triton kernel's residency)."""
    plan.run(case.q, case.k, case.v)  # binds the plan's arguments
    meta = {k: v for k, v in plan._meta1.items() if k not in STRIP}
    meta.update(STAGES=stages, KV_LAYOUT=dg.kv_layout(), num_warps=1)
    if host_cut:
        meta["DEVICE_PLAN"] = False
    args = (case.q, case.k, case.v, case.page_table, case.seq_lens, plan._ks, plan._vs)
    args = (*args, *plan._rest1)
    grid = plan._grid1

    def stage1():
        dg._decode_stage1_gluon[grid](*args, **meta)

    def both():
        stage1()
        plan._s2(*plan._args2)

    return both, stage1


def run_gates(cases, gate_fn, res: dict, save) -> bool:
    """``gate_fn(*case)`` for each case into ``res["gates"]``, one line each, saved after each
    (an exception is recorded as the row: one failing gate must not hide the others); whether
    all passed (also ``res["gates_pass"]``)."""
    for case in cases:
        try:
            row = gate_fn(*case)
        except Exception as exc:  # noqa: BLE001 - recorded; the other gates still run
            row = {"lens": str(case[0])[:60], "error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(row), flush=True)
        res["gates"].append(row)
        save()
    res["gates_pass"] = all(r.get("pass") for r in res["gates"])
    return res["gates_pass"]


def time_us(fn, readflush: bool = False) -> dict:
    fn()
    torch.cuda.synchronize()
    got = {"us": bench_ms(fn) * 1e3, "us_graph": bench_graph_ms(fn) * 1e3}
    if readflush:  # L2 flushed by reading: no dirty lines to write back in the timed call
        got["us_readflush"] = bench_readflush_ms(fn) * 1e3
    return got


def tma_plans(case: bench.DecodeCase, stages: int):
    """``(key, plan)`` for the TMA kernels as a plan takes them, both paths, without and with
    the L2 evict-first hint on their tile copies (kernels/l2_hint.py)."""
    for fused in PATHS:
        for hint in (False, True):
            name = f"plan_tma{'_l2' if hint else ''}_{'fused' if fused else 'two_launch'}"
            plan = case.plan(TmaConfig(stages=stages, l2_evict_first=hint), fused=fused)
            assert plan.tma, plan.tma_refused
            yield name, plan


def hint_facts(plan) -> dict:
    """What a plan asked of the L2 hint and what its compiled stage 1 carries (after a run)."""
    compiled = getattr(plan._s1, "_compiled", None)
    copies = l2_hint.hinted(compiled) if compiled is not None else None
    return {"l2_asked": plan.config.l2_evict_first, "l2_refused": plan.l2_refused,
            "hinted_copies": copies}  # fmt: skip


def gate(lens, hq, hkv, stages, nan: bool, factor: int = 1) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    if nan:
        nan_fill_unused(case)
    plan = case.plan(DecodeConfig(), fused=False)
    ref = plan.run(case.q, case.k, case.v).clone()
    if factor != 1:
        plan = splits_plan(case, plan.num_splits * factor)
    both, _ = gluon_fn(case, plan, stages, host_cut=factor != 1)
    plan.out.fill_(float("nan"))
    both()
    torch.cuda.synchronize()
    outs = {"manual": plan.out.float().clone()}
    if factor == 1:  # the TMA kernels as a plan takes them, both paths, hinted or not
        for name, tma in tma_plans(case, stages):
            outs[name[9:]] = tma.run(case.q, case.k, case.v).float()
            torch.cuda.synchronize()
    worst = {}
    for name, out in outs.items():
        finite = bool(torch.isfinite(out).all())
        worst[name] = float((out - ref.float()).abs().max()) if finite else float("inf")
    return {"lens": lens if len(lens) <= 8 else f"{len(lens)} requests", "heads": f"{hq}/{hkv}",
            "nan_filled": nan, "splits": plan.num_splits, "host_cut": factor != 1,
            "max_abs_diff": worst, "pass": all(w <= 2e-2 for w in worst.values())}  # fmt: skip


def timing(lens, hq, hkv, stages, factors) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    nbytes = case.bytes_needed()
    two = case.plan(DecodeConfig(), fused=False)
    q, k, v = case.q, case.k, case.v
    two.run(q, k, v)  # binds the plan's launch arguments (_rest1), which stage 1 is timed on
    s1_args = (q, k, v, case.page_table, case.seq_lens, two._ks, two._vs, *two._rest1)
    row = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}", "splits": two.num_splits,
           "bytes": nbytes}  # fmt: skip
    for f in factors:
        plan = two if f == 1 else splits_plan(case, int(two.num_splits * f))
        both, stage1 = gluon_fn(case, plan, stages, host_cut=f != 1)
        row[f"gluon_x{f}"] = {"splits": plan.num_splits, "two_launch": time_us(both),
                              "stage1": time_us(stage1)}  # fmt: skip
    row["plan_two_launch"] = time_us(lambda: two.run(q, k, v))
    row["triton_stage1"] = time_us(lambda: two._s1(*s1_args))
    default = case.plan(DecodeConfig())
    row["plan_default"] = time_us(lambda: default.run(q, k, v))
    row["plan_default_fused"] = default.fused
    # The TMA kernels as a plan takes them (its own residency and split count), both paths,
    # without and with the L2 hint; the read-flushed figure says what do_bench's write-back is.
    row["plan_default"]["us_readflush"] = bench_readflush_ms(lambda: default.run(q, k, v)) * 1e3
    for name, tma in tma_plans(case, stages):
        row[name] = {
            "tma": tma.tma, "refused": tma.tma_refused, "splits": tma.num_splits,
            "per_sm": tma.resident_per_sm,
            **time_us(lambda p=tma: p.run(q, k, v), readflush=True), **hint_facts(tma),
        }  # fmt: skip
    return row


def fp8_rows(lens, hq, hkv, stages: int) -> dict:
    """fp8 KV through the plans: the Triton default (the reference output and the timing to
    beat) and the TMA kernels on both paths, each checked against it (NaN in unused slots)."""
    case = bench.DecodeCase(lens, hq, hkv, 128, True)
    nan_fill_unused(case)
    q, k, v = case.q, case.k, case.v
    base = case.plan(DEFAULT_FP8_CONFIG)
    ref = base.run(q, k, v).float().clone()
    row = {"kv": "fp8", "lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}",
           "triton_default": {"fused": base.fused, "splits": base.num_splits,
                              **time_us(lambda: base.run(q, k, v))}}  # fmt: skip
    for name, tma in tma_plans(case, stages):
        out = tma.run(q, k, v).float()
        finite = bool(torch.isfinite(out).all())
        diff = float((out - ref).abs().max()) if finite else float("inf")
        row[name] = {
            "splits": tma.num_splits, "per_sm": tma.resident_per_sm, "max_abs_diff": diff,
            "pass": diff <= 2e-2, **time_us(lambda p=tma: p.run(q, k, v), readflush=True),
            **hint_facts(tma),
        }  # fmt: skip
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", type=int, default=dg.STAGES)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--variants", default="", help="more ring depths, 1 x 64k only: 3,4")
    ap.add_argument("--factors", default="1,2", help="split counts timed, x the plan's")
    ap.add_argument("--no-fused", action="store_true", help="leave out the one-launch form")
    args = ap.parse_args()
    if args.no_fused:
        PATHS.remove(True)
    ensure_allocator()
    res: dict = {"command": "python bench/gpu_decode_gluon.py " + " ".join(sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
                 "stages": args.stages, "gates": [], "timing": []}  # fmt: skip
    dest = Path(os.environ.get("OUT") or ".") / "decode-gluon-h200.json"

    def save() -> None:
        dest.write_text(json.dumps(res, indent=1))

    gates = [
        ([1, 15, 16, 17, 1000, 4097], 32, 8, True),
        ([65531], 32, 8, True),
        ([3, 70000, 129], 64, 8, True),
        ([33] * 40, 32, 8, True),
        ([8191, 1, 40000], 16, 16, True),
        ([16384] * 8, 32, 8, False),
        ([1, 15, 16, 17, 1000, 4097], 32, 8, True, 2),
        ([65531], 64, 8, True, 2),
    ]
    cases = [(lens, hq, hkv, args.stages, nan, *factor) for lens, hq, hkv, nan, *factor in gates]
    run_gates(cases, gate, res, save)
    if args.no_timing or not res["gates_pass"]:
        save()
        return 0 if res["gates_pass"] else 1
    shapes = [([65536], 32, 8), ([65536], 64, 8), ([16384] * 8, 32, 8), ([131072], 32, 8),
              ([4096] * 32, 32, 8)]  # fmt: skip
    variants = [args.stages, *(int(v) for v in filter(None, args.variants.split(",")))]
    factors = [float(f) for f in args.factors.split(",")]
    for stages in variants:
        for lens, hq, hkv in shapes:
            if stages != variants[0] and lens != [65536]:
                continue
            try:
                row = {"stages": stages, **timing(lens, hq, hkv, stages, factors)}
            except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
                err = f"{type(exc).__name__}: {exc}"[:500]
                row = {"stages": stages, "lens": len(lens), "error": err}
            print(json.dumps(row), flush=True)
            res["timing"].append(row)
            save()
            torch.cuda.empty_cache()
    for lens, hq, hkv in shapes[:4]:
        try:
            row = {"stages": args.stages, **fp8_rows(lens, hq, hkv, args.stages)}
        except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
            row = {"kv": "fp8", "lens": len(lens), "error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(row), flush=True)
        res["timing"].append(row)
        save()
        torch.cuda.empty_cache()
    save()
    print("wrote", dest, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
