"""The transposed TMA stage 1 (bench/decode_gluon_t.py) against the one-warp TMA stage 1, the
Triton stage 1 and the copies alone. (GPU machine, sm_90, Triton with Gluon)

Gates first: each case's two-launch Triton plan gives the reference output (unused cache slots
NaN-filled where the case says so); each TMA kernel runs on that plan's arguments (split count,
partial buffers, the device-side split search; at a forced split count the plan's host-side cut)
followed by the plan's merge kernel, and its output is compared. Then at the long shapes, us by
CUDA-graph replay (and by do_bench for stage 1 + merge): every kernel x ring depth x split count
(x1, x1.5, x2 the Triton plan's), stage 1 alone and with the merge; the Triton stage 1 and the
plan's paths; at 1 x 64k the copy-only TMA reader of bench/gpu_kv_tma.py (64 splits, 4 slots).
The TMA kernels carry the L2 evict-first hint where the hook installs, as the Triton defaults do.
Writes $OUT/decode-tform.json after every row; one line a row on stdout.
Run: python bench/gpu_decode_tform.py [--stages 3,4] [--factors 1,1.5,2] [--no-timing]
     [--no-hint] [--only-64k]
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
from kdash.kernels.decode_attention import DecodeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_gluon_t as dt
from gpu_decode_gluon import STRIP, nan_fill_unused, splits_plan, time_us

KERNELS = {"one": "one warp, S = Q K^T", "t": "transposed, S^T = K Q^T"}


def block_h(kernel: str, group: int) -> int:
    """The heads' tile: 16 rows for the one-warp kernel, 8 or 16 columns for the transposed."""
    if kernel == "one":
        return dg.BLOCK_H
    return 8 if group <= 8 else 16


def launcher(case: bench.DecodeCase, plan, kernel: str, stages: int, hint: bool, host_cut: bool):
    """``(stage1, both)``: the TMA stage 1 ``kernel`` on ``plan``'s bound arguments, alone and
    followed by the plan's merge kernel."""
    plan.run(case.q, case.k, case.v)  # binds the plan's arguments
    meta = {k: v for k, v in plan._meta1.items() if k not in STRIP}
    meta.update(STAGES=stages, KV_LAYOUT=dg.kv_layout(), num_warps=1)
    meta["BLOCK_H"] = block_h(kernel, case.hq // case.hkv)
    if hint:
        meta["L2_HINT"] = True
    if host_cut:
        meta["DEVICE_PLAN"] = False
    args = (case.q, case.k, case.v, case.page_table, case.seq_lens, plan._ks, plan._vs)
    args = (*args, *plan._rest1)
    fn = dg._decode_stage1_gluon if kernel == "one" else dt._decode_stage1_t
    grid = plan._grid1

    def stage1() -> None:
        fn[grid](*args, **meta)

    def both() -> None:
        stage1()
        plan._s2(*plan._args2)

    return stage1, both


def gate(lens, hq, hkv, stages, hint, nan: bool, factor: int = 1) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    if nan:
        nan_fill_unused(case)
    plan = case.plan(DecodeConfig(), fused=False)
    ref = plan.run(case.q, case.k, case.v).float().clone()
    if factor != 1:
        plan = splits_plan(case, plan.num_splits * factor)
    worst = {}
    for kernel in KERNELS:
        _, both = launcher(case, plan, kernel, stages, hint, host_cut=factor != 1)
        plan.out.fill_(float("nan"))
        both()
        torch.cuda.synchronize()
        out = plan.out.float()
        finite = bool(torch.isfinite(out).all())
        worst[kernel] = float((out - ref).abs().max()) if finite else float("inf")
    return {"lens": lens if len(lens) <= 8 else f"{len(lens)} requests", "heads": f"{hq}/{hkv}",
            "nan_filled": nan, "splits": plan.num_splits, "host_cut": factor != 1,
            "max_abs_diff": worst, "pass": all(w <= 2e-2 for w in worst.values())}  # fmt: skip


def timing(lens, hq, hkv, stages_list, factors, hint) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    q, k, v = case.q, case.k, case.v
    two = case.plan(DecodeConfig(), fused=False)
    two.run(q, k, v)
    s1_args = (q, k, v, case.page_table, case.seq_lens, two._ks, two._vs, *two._rest1)
    row: dict = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}",
                 "splits": two.num_splits, "bytes": case.bytes_needed(),
                 "l2_hint": hint}  # fmt: skip
    row["triton_stage1"] = time_us(lambda: two._s1(*s1_args))
    row["plan_two_launch"] = time_us(lambda: two.run(q, k, v))
    default = case.plan(DecodeConfig())
    row["plan_default"] = {"fused": default.fused, **time_us(lambda: default.run(q, k, v))}
    for f in factors:
        plan = two if f == 1 else splits_plan(case, int(two.num_splits * f))
        for kernel in KERNELS:
            for stages in stages_list:
                stage1, both = launcher(case, plan, kernel, stages, hint, host_cut=f != 1)
                key = f"{kernel}_s{stages}_x{f}"
                alone = time_us(stage1)["us_graph"]
                row[key] = {"splits": plan.num_splits, "stage1_us_graph": alone, **time_us(both)}
    if lens == [65536]:
        from gpu_kv_tma import reader  # Gluon: imported only where a GPU is

        copies = reader(case, "per_head", 64, 1, 4, 1)[0]
        row["copies_tma_64x4"] = time_us(copies)
    return row


def summary_line(row: dict) -> str:
    """The row's graph figures, one line: stage 1 alone, then with the merge."""
    if "error" in row or "triton_stage1" not in row:
        return json.dumps(row)
    parts = [f"{row['lens']} {row['heads']}", f"triton s1 {row['triton_stage1']['us_graph']:.1f}",
             f"plan2 {row['plan_two_launch']['us_graph']:.1f}",
             f"default {row['plan_default']['us_graph']:.1f}"]  # fmt: skip
    if "copies_tma_64x4" in row:
        parts.append(f"copies {row['copies_tma_64x4']['us_graph']:.1f}")
    for key, val in row.items():
        if isinstance(val, dict) and "stage1_us_graph" in val:
            alone, both = val["stage1_us_graph"], val["us_graph"]
            parts.append(f"{key}({val['splits']}) {alone:.1f}/{both:.1f}")
    return " | ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="3,4", help="ring depths timed (the first gates)")
    ap.add_argument("--factors", default="1,1.5,2", help="split counts timed, x the plan's")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--no-hint", action="store_true", help="no L2 evict-first hint")
    ap.add_argument("--only-64k", action="store_true", help="time the 1 x 64k shapes only")
    args = ap.parse_args()
    try:
        stages_list = [int(s) for s in args.stages.split(",")]
        factors = [float(f) for f in args.factors.split(",")]
    except ValueError:
        print(f"--stages and --factors take numbers: {args.stages!r}, {args.factors!r}",
              file=sys.stderr)  # fmt: skip
        return 2
    if not torch.cuda.is_available() or dg.gluon is None:
        print("gpu_decode_tform.py needs a CUDA GPU and a Triton with Gluon", file=sys.stderr)
        return 2
    ensure_allocator()
    hint = not args.no_hint and l2_hint.install() is None
    res: dict = {"command": "python bench/gpu_decode_tform.py " + " ".join(sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
                 "kernels": KERNELS, "l2_hint": hint, "gates": [], "timing": []}  # fmt: skip
    dest = Path(os.environ.get("OUT") or ".") / "decode-tform.json"

    def save() -> None:
        dest.write_text(json.dumps(res, indent=1))

    gates = [
        ([1, 15, 16, 17, 1000, 4097], 32, 8, True),
        ([65531], 32, 8, True),
        ([3, 70000, 129], 64, 8, True),
        ([33] * 40, 32, 8, True),
        ([8191, 1, 40000], 16, 16, True),
        ([5000, 77, 1], 128, 8, True),
        ([1, 15, 16, 17, 1000, 4097], 32, 8, True, 2),
        ([65531], 64, 8, True, 2),
    ]
    for lens, hq, hkv, nan, *factor in gates:
        try:
            row = gate(lens, hq, hkv, stages_list[0], hint, nan, *factor)
        except Exception as exc:  # noqa: BLE001 - one failing gate must not hide the others
            row = {"lens": str(lens)[:60], "error": f"{type(exc).__name__}: {exc}"[:500]}
        print(json.dumps(row), flush=True)
        res["gates"].append(row)
        save()
    res["gates_pass"] = all(r.get("pass") for r in res["gates"])
    if args.no_timing or not res["gates_pass"]:
        save()
        return 0 if res["gates_pass"] else 1
    shapes = [([65536], 32, 8), ([65536], 64, 8), ([16384] * 8, 32, 8), ([131072], 32, 8)]
    if args.only_64k:
        shapes = shapes[:2]
    for lens, hq, hkv in shapes:
        try:
            row = timing(lens, hq, hkv, stages_list, factors, hint)
        except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
            row = {"lens": len(lens), "heads": f"{hq}/{hkv}",
                   "error": f"{type(exc).__name__}: {exc}"[:500]}  # fmt: skip
        print(summary_line(row), flush=True)
        res["timing"].append(row)
        save()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
