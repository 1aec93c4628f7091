"""The two-launch decode with its merge over tagged partials, launched while stage 1 runs
(kernels/decode_tagged.py), against the plain two launches and the one-launch default. (GPU)

Gates first: `pytest -m gpu tests/test_kernels_decode_tagged.py` (runs against the reference,
a CUDA graph of steps each after a copy kernel that writes q, bit for bit against their eager
runs). Then, per shape, four plans timed in turns over ``--rounds`` rounds: ``fused`` (the
default one launch), ``two`` (stage 1, then the plain merge), ``tagged`` (stage 1 storing
tagged partials, the merge launched with programmatic dependent launch and polling them) and
``tagged_after`` (the same merge launched after stage 1), by do_bench, graph replay and after
a read-only flush; medians, us; each plan's output checked against ``two``'s first (within
2e-2: the merges fold in another order).
Writes $OUT/decode-tagged.json; one line a shape.
``--probe``: no timing; per shape, with and without the programmatic launch, three runs of a
new tagged plan, each followed by what its buffers hold: the output finite or not, its
distance to the plain merge's, the merge's tags and how many partial slots carry another tag
than the run's (a merge that polls in vain gives up after decode_tagged.MAX_POLLS and writes
NaN). Writes $OUT/decode-tagged-probe.json.
Run: python bench/gpu_decode_tagged.py [--rounds 3] [--probe]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
from kdash.kernels import bench, decode_tagged
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DecodeConfig

SHAPES = [([65536], 32, 8), ([65536], 64, 8), ([131072], 64, 8), ([16384] * 8, 64, 8)]
KEYS = ("us", "us_graph", "us_readflush")
PLANS = ("fused", "two", "tagged", "tagged_after")


def tagged_plan(case: bench.DecodeCase, pdl: bool):
    """A two-launch plan over tagged partials, the merge launched early (``pdl``) or after
    stage 1; the module's switches left as they were."""
    was = decode_tagged.TAGGED_DEFAULT, decode_tagged.PDL
    decode_tagged.TAGGED_DEFAULT, decode_tagged.PDL = True, pdl
    try:
        plan = case.plan(DecodeConfig(), fused=False)
    finally:
        decode_tagged.TAGGED_DEFAULT, decode_tagged.PDL = was
    assert plan.tagged and plan._s2.meta.get("launch_pdl", False) == pdl
    return plan


def plans(case: bench.DecodeCase) -> dict:
    made = {n: case.plan(DecodeConfig(), fused=f) for n, f in (("fused", True), ("two", False))}
    made["tagged"] = tagged_plan(case, True)
    made["tagged_after"] = tagged_plan(case, False)
    assert not made["two"].tagged
    return made


def probe_row(lens, hq, hkv, pdl: bool) -> dict:
    """Three runs of a new tagged plan and what its buffers hold after each (see --probe)."""
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    plain = case.plan(DecodeConfig(), fused=False)
    want = plain.run(case.q, case.k, case.v).float().clone()
    plan = tagged_plan(case, pdl)
    splits = plan.num_splits
    runs = []
    for i in range(1, 4):
        t0 = time.perf_counter()
        got = plan.run(case.q, case.k, case.v).float()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        lse = plan.lse_part.view(torch.int64)[: len(lens) * hq * splits]
        o = plan.o_part.view(torch.int64)[: len(lens) * hq * splits * case.d].view(-1, case.d)
        ltag = (lse >> 32).to(torch.int32)
        live = torch.isfinite((lse & 0xFFFFFFFF).to(torch.int32).view(torch.float32))
        otag_ok = ((o >> 32).to(torch.int32) == i).all(1)
        runs.append({
            "run": i, "wall_ms": round(wall * 1e3, 2),
            "finite": bool(torch.isfinite(got).all()),
            "nan_heads": int((~torch.isfinite(got)).any(-1).sum()),
            "max_abs_diff": float((got - want).nan_to_num(1e9).abs().max()),
            "ep": sorted({int(x) for x in plan._ep.tolist()}),
            "lse_tag_off": int((ltag != i).sum()), "live": int(live.sum()),
            "o_tag_off_live": int((live & ~otag_ok).sum()),
        })  # fmt: skip
    return {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}", "pdl": pdl,
            "splits": splits, "runs": runs}  # fmt: skip


def probe(out: Path) -> int:
    res: dict = {"command": "python bench/gpu_decode_tagged.py --probe", "rows": [],
                 "gpu": torch.cuda.get_device_name(0),
                 "max_polls": decode_tagged.MAX_POLLS}  # fmt: skip
    ok = True
    for lens, hq, hkv in SHAPES[:2] + [([1000, 37, 4097, 2222], 32, 8)]:
        for pdl in (False, True):
            row = probe_row(lens, hq, hkv, pdl)
            ok = ok and all(r["finite"] and r["max_abs_diff"] <= 2e-2 for r in row["runs"])
            print(json.dumps(row), flush=True)
            res["rows"].append(row)
            out.write_text(json.dumps(res, indent=1))
    return 0 if ok else 1


def shape_row(lens, hq, hkv, rounds: int) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    ps = plans(case)
    fns = {n: (lambda p=p: p.run(case.q, case.k, case.v)) for n, p in ps.items()}
    want = fns["two"]().float().clone()
    diff = {n: float((f().float() - want).abs().max()) for n, f in fns.items()}
    torch.cuda.synchronize()
    got = {n: {k: [] for k in KEYS} for n in fns}
    for _ in range(rounds):
        for n, f in fns.items():
            got[n]["us"].append(bench_ms(f) * 1e3)
            got[n]["us_graph"].append(bench_graph_ms(f) * 1e3)
            got[n]["us_readflush"].append(bench_readflush_ms(f) * 1e3)
    row: dict = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}",
                 "splits": {n: p.num_splits for n, p in ps.items()},
                 "per_sm": {n: p.resident_per_sm for n, p in ps.items()},
                 "max_abs_diff_to_two": diff}  # fmt: skip
    for n, vals in got.items():
        row[n] = {k: round(statistics.median(v), 2) for k, v in vals.items()}
        row[n]["rounds"] = {k: [round(x, 2) for x in v] for k, v in vals.items()}
    row["pass"] = all(d <= 2e-2 for d in diff.values())
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--probe", action="store_true", help="what the buffers hold, no timing")
    args = ap.parse_args()
    if args.rounds < 1:
        print("--rounds takes a count of 1 or more", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_decode_tagged.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.probe:
        return probe(Path(os.environ.get("OUT", ".")) / "decode-tagged-probe.json")
    res: dict = {"command": "python bench/gpu_decode_tagged.py " + " ".join(sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
                 "rows": []}  # fmt: skip
    out = Path(os.environ.get("OUT", ".")) / "decode-tagged.json"
    ok = True
    for lens, hq, hkv in SHAPES:
        row = shape_row(lens, hq, hkv, args.rounds)
        ok = ok and row["pass"]
        brief = {k: v for k, v in row.items() if k not in PLANS}
        print(json.dumps(brief | {n: {k: row[n][k] for k in KEYS} for n in PLANS}), flush=True)
        res["rows"].append(row)
        out.write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
