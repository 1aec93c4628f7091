"""The one-launch decode launched with programmatic dependent launch (PDL), against the plain
launch. (GPU machine)

By session 27's stamps on the H200 a 1 x 64k step spends 3.3-3.5 us at its edges: from the
launch to the first program's start and from the last program's end to the end event. With PDL
(``decode_fused.PDL_DEFAULT``: the grid launched with the driver's programmatic-serialisation
attribute, every program waiting on ``griddepcontrol.wait`` first) the grid may launch while the
kernel before it drains, and its programs take their slots as that kernel's programs leave. A
CUDA graph of steps gets programmatic edges between them; do_bench puts its flush kernel and an
event between a call and the one before, and a plan's own graph launch (``graph_launch``) is a
whole graph, which takes no programmatic edge from the stream's work before it: so each is timed
with the plan's graph slot on and off.

Variants (a plan each, made with the switch set): ``base`` (no PDL, slot on: the default),
``direct`` (no PDL, slot off), ``pdl`` (PDL, slot on), ``pdl_direct`` (PDL, slot off).

Gates, every variant: its output equal bit for bit to ``base``'s on cases with the unused cache
slots NaN-filled (odd lengths, GQA, pages 1 and 16, fp8); a CUDA graph of steps, each after a
copy kernel that writes q (so a step that read q before its wait would read the previous q),
replayed, every step's output equal to that q's eager output and the flags down after.
Timing: do_bench, graph replay and read-flushed medians, the variants in turn over ``--rounds``
rounds, and host us a call (no sync). Writes $OUT/decode-pdl-fused.json; one line a row.
Run: python bench/gpu_decode_pdl_fused.py [--rounds 3] [--no-timing]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import triton
from kdash.kernels import bench, decode_fused
from kdash.kernels.bench_timing import (
    bench_graph_ms,
    bench_host_nosync_us,
    bench_ms,
    bench_readflush_ms,
)
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.decode_plan import DecodePlan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_gluon import nan_fill_unused, run_gates

# name -> (PDL, the plan's graph slot)
VARIANTS = {
    "base": (False, True),
    "direct": (False, False),
    "pdl": (True, True),
    "pdl_direct": (True, False),
}
GATES = [
    ([65536], 64, 8, False, 16),
    ([65536], 32, 8, True, 16),
    ([1000, 37, 4097, 2222], 32, 4, False, 16),
    ([1000, 37, 4097, 2222], 32, 8, True, 1),
    ([513] * 40, 64, 8, False, 1),
]
TIMED = [
    ([65536], 32, 8, False),
    ([65536], 64, 8, False),
    ([65536], 64, 8, True),
    ([131072], 64, 8, False),
    ([16384] * 8, 64, 8, False),
]
STEPS = 6  # steps in the gate's graph, each after its own q copy


def make_plan(case: bench.DecodeCase, name: str) -> DecodePlan:
    pdl, slot = VARIANTS[name]
    before = decode_fused.PDL_DEFAULT
    decode_fused.PDL_DEFAULT = pdl
    try:
        return DecodePlan(case.page_table, case.seq_lens, case.hq, case.hkv, case.d,
                          case.k.shape[1], max_seq_len=max(case.lens),
                          total_tokens=sum(case.lens), kv_dtype=case.k.dtype,
                          config=DEFAULT_FP8_CONFIG if case.fp8 else DecodeConfig(),
                          out=torch.empty_like(case.q), graph=slot, **case.scales)  # fmt: skip
    finally:
        decode_fused.PDL_DEFAULT = before


def run_fn(case: bench.DecodeCase, plan: DecodePlan):
    return lambda: plan.run(case.q, case.k, case.v)


def gate(lens, hq, hkv, fp8: bool, page: int) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, fp8, page=page)
    nan_fill_unused(case)
    qs = [torch.randn_like(case.q) for _ in range(STEPS)]
    row: dict = {"lens": lens if len(lens) <= 8 else f"{len(lens)} x {lens[0]}",
                 "heads": f"{hq}/{hkv}", "kv": "fp8" if fp8 else "bf16", "page": page}  # fmt: skip
    want = None
    ok = True
    for name in VARIANTS:
        plan = make_plan(case, name)
        for _ in range(3):  # the third run goes through the slot's graph where there is one
            out = plan.run(case.q, case.k, case.v).clone()
        torch.cuda.synchronize()
        if want is None:
            want = out
            # each step's own q, eagerly, on the base plan
            refs = [plan.run(q, case.k, case.v).clone() for q in qs]
        same = bool(torch.equal(out, want)) and bool(torch.isfinite(out.float()).all())
        q_in = torch.empty_like(case.q)
        outs = [torch.empty_like(case.q) for _ in qs]
        plan.run(q_in, case.k, case.v)  # binds q_in's layout before the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for q, o in zip(qs, outs, strict=True):
                q_in.copy_(q)
                o.copy_(plan.run(q_in, case.k, case.v))
        for _ in range(20):
            g.replay()
        torch.cuda.synchronize()
        steps_equal = all(torch.equal(o, r) for o, r in zip(outs, refs, strict=True))
        flags_zero = int(plan._flags.abs().sum()) == 0 if plan.fused else True
        del g
        row[name] = {"path": plan.path, "splits": plan.num_splits, "equal_to_base": same,
                     "graph_steps_equal": steps_equal, "flags_zero": flags_zero,
                     "pdl": bool(plan._meta1.get("PDL"))}  # fmt: skip
        ok = ok and same and steps_equal and flags_zero
        ok = ok and (row[name]["pdl"] == (VARIANTS[name][0] and plan.path == "fused"))
    row["pass"] = ok
    return row


def timing(lens, hq, hkv, fp8: bool, rounds: int) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, fp8)
    plans = {name: make_plan(case, name) for name in VARIANTS}
    fns = {name: run_fn(case, p) for name, p in plans.items()}
    keys = ("us", "us_graph", "us_readflush")
    got = {n: {k: [] for k in keys} for n in VARIANTS}
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name]["us"].append(bench_ms(fn) * 1e3)
            got[name]["us_graph"].append(bench_graph_ms(fn) * 1e3)
            got[name]["us_readflush"].append(bench_readflush_ms(fn) * 1e3)
    p0 = plans["base"]
    row: dict = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}",
                 "kv": "fp8" if fp8 else "bf16", "path": p0.path, "splits": p0.num_splits,
                 "per_sm": p0.resident_per_sm, "bytes": case.bytes_needed()}  # fmt: skip
    for name, vals in got.items():
        row[name] = {k: round(statistics.median(v), 2) for k, v in vals.items()}
        row[name]["rounds"] = {k: [round(x, 2) for x in v] for k, v in vals.items()}
        row[name]["host_us"] = round(bench_host_nosync_us(fns[name]), 2)
    return row


def line(row: dict) -> str:
    if "base" not in row or "us" not in row["base"]:
        return json.dumps(row)
    head = f"{row['lens']} {row['heads']} {row['kv']} {row['path']} ({row['splits']} splits)"
    b = row["base"]
    parts = [head]
    for name in VARIANTS:
        v = row[name]
        parts.append(
            f"{name} {v['us']:.1f} ({v['us'] - b['us']:+.1f}) / graph {v['us_graph']:.1f} "
            f"({v['us_graph'] - b['us_graph']:+.1f}) / rf {v['us_readflush']:.1f} "
            f"({v['us_readflush'] - b['us_readflush']:+.1f}) / host {v['host_us']:.1f}"
        )
    return " | ".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()
    if args.rounds < 1:
        print("--rounds takes a count of 1 or more", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_decode_pdl_fused.py needs a CUDA GPU", file=sys.stderr)
        return 2
    res: dict = {"command": "python bench/gpu_decode_pdl_fused.py " + " ".join(sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
                 "variants": {k: {"pdl": p, "graph_slot": s} for k, (p, s) in VARIANTS.items()},
                 "gates": [], "timing": []}  # fmt: skip
    out = Path(os.environ.get("OUT", ".")) / "decode-pdl-fused.json"

    def save() -> None:
        out.write_text(json.dumps(res, indent=1))

    if not run_gates(GATES, gate, res, save):
        print("a gate failed: not timed", flush=True)
        return 1
    if args.no_timing:
        return 0
    for lens, hq, hkv, fp8 in TIMED:
        row = timing(lens, hq, hkv, fp8, args.rounds)
        print(line(row), flush=True)
        res["timing"].append(row)
        save()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
