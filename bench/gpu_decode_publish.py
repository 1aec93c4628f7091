"""The one-launch decode's publish and poll, four ways (kernels/decode_fused.py). (GPU machine)

``_decode_fused``'s stage-1 programs publish each partial by a GPU-scope fence in every thread,
a CTA barrier and a release exchange of the flags; its merge programs poll the flags with
volatile loads and fence before reading the partials. Session 14 left two changes untried
(bench/NOTES-kernels.md): the release alone after the barrier (``PUBLISH_FENCE=False``: PTX's
release is cumulative over what the barrier ordered before it, as cooperative groups' grid sync
relies on) and acquire loads for the poll with no fence (``ACQUIRE_POLL=True``). Either takes a
GPU-scope fence off the chain that follows the last stage-1 program, the step's tail.

Gates: every variant on each case's plan arguments against the two-launch plan's output (unused
cache slots NaN-filled), then 200 graph replays of each variant with the output checked and the
flags back at zero (a protocol that loses a flag would hang: the device command's timeout says
so). Timing at the long single requests and 8 x 16k, bf16 and fp8, graph replay and do_bench
medians, the variants in turn over three rounds (the card's drift falls on all alike). Each
variant is launched through Triton's launcher on the plan's own bound arguments and
compile-time values (the L2 hint included); the baseline is the first variant, launched the
same way. Writes $OUT/decode-publish.json; one line a row.
Run: python bench/gpu_decode_publish.py [--rounds 3] [--no-timing]
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
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_decode_gluon import nan_fill_unused, run_gates

# (PUBLISH_FENCE, ACQUIRE_POLL): the current kernel first
VARIANTS = {
    "fence_volatile": (True, False),
    "release_volatile": (False, False),
    "fence_acquire": (True, True),
    "release_acquire": (False, True),
}


def variant_fn(case: bench.DecodeCase, plan, name: str):
    """The plan's one launch with ``name``'s publish and poll (the plan bound first)."""
    plan.run(case.q, case.k, case.v)
    torch.cuda.synchronize()
    fence, acquire = VARIANTS[name]
    meta = {**plan._s1.meta, "PUBLISH_FENCE": fence, "ACQUIRE_POLL": acquire}
    args = (case.q, case.k, case.v, case.page_table, case.seq_lens, plan._ks, plan._vs)
    args = (*args, *plan._rest1)
    kern, grid = plan._kern1, plan._grid1

    def run() -> None:
        kern[grid](*args, **meta)

    return run


def config_for(fp8: bool) -> DecodeConfig:
    return DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()


def gate(lens, hq, hkv, fp8: bool) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, fp8)
    nan_fill_unused(case)
    ref = case.plan(config_for(fp8), fused=False).run(case.q, case.k, case.v).float().clone()
    plan = case.plan(config_for(fp8), fused=True)
    worst, replay = {}, {}
    for name in VARIANTS:
        fn = variant_fn(case, plan, name)
        plan.out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        out = plan.out.float()
        finite = bool(torch.isfinite(out).all())
        worst[name] = float((out - ref).abs().max()) if finite else float("inf")
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        for _ in range(200):
            g.replay()
        torch.cuda.synchronize()
        flags_zero = int(plan._flags.abs().sum()) == 0
        same = bool(torch.equal(plan.out.float(), out)) if finite else False
        replay[name] = {"flags_zero": flags_zero, "equal_to_eager": same}
        del g
    tol = 6e-2 if fp8 else 2e-2
    ok = all(w <= tol for w in worst.values())
    ok = ok and all(r["flags_zero"] and r["equal_to_eager"] for r in replay.values())
    return {"lens": lens if len(lens) <= 8 else f"{len(lens)} requests", "heads": f"{hq}/{hkv}",
            "kv": "fp8" if fp8 else "bf16", "splits": plan.num_splits,
            "per_sm": plan.resident_per_sm, "max_abs_diff": worst, "replay": replay,
            "pass": ok}  # fmt: skip


def timing(lens, hq, hkv, fp8: bool, rounds: int) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, fp8)
    plan = case.plan(config_for(fp8), fused=True)
    fns = {name: variant_fn(case, plan, name) for name in VARIANTS}
    got: dict[str, dict[str, list[float]]] = {n: {"us": [], "us_graph": []} for n in VARIANTS}
    for _ in range(rounds):
        for name, fn in fns.items():
            got[name]["us_graph"].append(bench_graph_ms(fn) * 1e3)
            got[name]["us"].append(bench_ms(fn) * 1e3)
    row: dict = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}",
                 "kv": "fp8" if fp8 else "bf16", "splits": plan.num_splits,
                 "per_sm": plan.resident_per_sm}  # fmt: skip
    for name, vals in got.items():
        row[name] = {k: round(statistics.median(v), 2) for k, v in vals.items()}
        row[name]["rounds_graph"] = [round(x, 2) for x in vals["us_graph"]]
    return row


def line(row: dict) -> str:
    if "fence_volatile" not in row:
        return json.dumps(row)
    head = f"{row['lens']} {row['heads']} {row['kv']} ({row['splits']} splits, {row['per_sm']}/SM)"
    base = row["fence_volatile"]
    parts = [head]
    for name in VARIANTS:
        v = row[name]
        parts.append(
            f"{name} {v['us_graph']:.1f} ({v['us_graph'] - base['us_graph']:+.1f}) / "
            f"{v['us']:.1f} ({v['us'] - base['us']:+.1f})"
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
        print("gpu_decode_publish.py needs a CUDA GPU", file=sys.stderr)
        return 2
    res: dict = {"command": "python bench/gpu_decode_publish.py " + " ".join(sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
                 "variants": {k: {"PUBLISH_FENCE": f, "ACQUIRE_POLL": a}
                              for k, (f, a) in VARIANTS.items()},
                 "gates": [], "timing": []}  # fmt: skip
    dest = Path(os.environ.get("OUT") or ".") / "decode-publish.json"

    def save() -> None:
        dest.write_text(json.dumps(res, indent=1))

    gates = [
        ([1, 15, 16, 17, 1000, 4097], 32, 8, False),
        ([65531], 32, 8, False),
        ([65531], 64, 8, False),
        ([3, 70000, 129], 64, 8, False),
        ([33] * 40, 32, 8, False),
        ([8191, 1, 40000], 16, 16, False),
        ([1, 15, 16, 17, 1000, 4097], 32, 8, True),
        ([65531], 64, 8, True),
    ]
    run_gates(gates, gate, res, save)
    if args.no_timing or not res["gates_pass"]:
        save()
        return 0 if res["gates_pass"] else 1
    shapes = [([65536], 32, 8), ([65536], 64, 8), ([131072], 32, 8), ([16384] * 8, 32, 8)]
    for fp8 in (False, True):
        for lens, hq, hkv in shapes:
            try:
                row = timing(lens, hq, hkv, fp8, args.rounds)
            except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
                row = {"lens": len(lens), "heads": f"{hq}/{hkv}", "kv": "fp8" if fp8 else "bf16",
                       "error": f"{type(exc).__name__}: {exc}"[:500]}  # fmt: skip
            print(line(row), flush=True)
            res["timing"].append(row)
            save()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
