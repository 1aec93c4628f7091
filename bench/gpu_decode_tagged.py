"""The two-launch decode with its merge over tagged partials, launched while stage 1 runs
(kernels/decode_tagged.py), against the plain two launches and the one-launch default. (GPU)

Gates first: `pytest -m gpu tests/test_kernels_decode_tagged.py` (runs against the reference,
a CUDA graph of steps each after a copy kernel that writes q, bit for bit against their eager
runs). Then, per shape, three plans timed in turns over ``--rounds`` rounds: ``fused`` (the
default one launch), ``two`` (stage 1, then the plain merge) and ``tagged`` (stage 1 storing
tagged partials, the merge launched with programmatic dependent launch and polling them), by
do_bench, graph replay and after a read-only flush; medians, us; each plan's output checked
against ``two``'s first (within 2e-2: the merges fold in another order).
Writes $OUT/decode-tagged.json; one line a shape.
Run: python bench/gpu_decode_tagged.py [--rounds 3]
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
from kdash.kernels import bench, decode_tagged
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DecodeConfig

SHAPES = [([65536], 32, 8), ([65536], 64, 8), ([131072], 64, 8), ([16384] * 8, 64, 8)]
KEYS = ("us", "us_graph", "us_readflush")


def plans(case: bench.DecodeCase) -> dict:
    made = {}
    for name, fused, tagged in (
        ("fused", True, False),
        ("two", False, False),
        ("tagged", False, True),
    ):
        decode_tagged.TAGGED_DEFAULT = tagged
        made[name] = case.plan(DecodeConfig(), fused=fused)
    decode_tagged.TAGGED_DEFAULT = False
    assert made["tagged"].tagged and not made["two"].tagged
    return made


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
    args = ap.parse_args()
    if args.rounds < 1:
        print("--rounds takes a count of 1 or more", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_decode_tagged.py needs a CUDA GPU", file=sys.stderr)
        return 2
    res: dict = {"command": "python bench/gpu_decode_tagged.py " + " ".join(sys.argv[1:]),
                 "gpu": torch.cuda.get_device_name(0), "triton": triton.__version__,
                 "rows": []}  # fmt: skip
    out = Path(os.environ.get("OUT", ".")) / "decode-tagged.json"
    ok = True
    for lens, hq, hkv in SHAPES:
        row = shape_row(lens, hq, hkv, args.rounds)
        ok = ok and row["pass"]
        print(json.dumps({k: v for k, v in row.items() if k not in ("fused", "two", "tagged")}
                         | {n: {k: row[n][k] for k in KEYS} for n in ("fused", "two", "tagged")}),
              flush=True)  # fmt: skip
        res["rows"].append(row)
        out.write_text(json.dumps(res, indent=1))
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
