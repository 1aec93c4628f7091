"""The one-launch kernel's L2 prefetch of each split's first tiles, on and off. (GPU machine)

`decode_fused.WARM_TILES` (0: off) makes one-launch bf16 plans ask L2 for the first tiles of
each split's K and V before stage 1 runs, from the split length the plan computed on the host,
so the page-table read goes out beside the lengths' read instead of after it and the split
search. Per shape, one plan per setting over the same cache and query: the outputs must be bit
for bit the same (a prefetch changes no value), then in turns, ``--rounds`` times, do_bench,
graph-replay and read-flushed us. One JSON line per (round, shape, setting), appended to
``--out``. ``--fp8``: fp8 KV (the default fp8 config, one-launch pair plans), whose switch is
``decode_fused.WARM_TILES_FP8``.

Run: python bench/gpu_decode_warm.py [--fp8] [--warm 0,1,2] [--shapes 1x65536:32/8,...]
[--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from kdash.kernels import bench, decode_fused
from kdash.kernels.bench_occupancy import occupancy_or_error
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig

# (batch x context : query heads / KV heads), head dim 128
SHAPES = "1x65536:32/8,1x65536:64/8,1x131072:32/8,4x1000:32/8"


def parse_shape(spec: str) -> tuple[list[int], int, int]:
    """``BxCTX:HQ/HKV`` as (lengths, query heads, KV heads); one clear error otherwise."""
    try:
        shape, heads = spec.split(":")
        batch, ctx = (int(x) for x in shape.split("x"))
        hq, hkv = (int(x) for x in heads.split("/"))
    except ValueError:
        raise SystemExit(f"bad shape {spec!r}: BxCTX:HQ/HKV, e.g. 1x65536:32/8") from None
    if min(batch, ctx, hq, hkv) < 1 or hq % hkv:
        raise SystemExit(f"bad shape {spec!r}: positive sizes, HQ a multiple of HKV")
    return [ctx] * batch, hq, hkv


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--warm", default="0,1,2", help="tile counts, the first the baseline")
    ap.add_argument("--fp8", action="store_true", help="fp8 KV (WARM_TILES_FP8)")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--copy-gbs", type=float, help="the copy ceiling measured already (GB/s)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "warm.jsonl")
    a = ap.parse_args(argv)
    try:
        warms = [int(w) for w in a.warm.split(",")]
    except ValueError:
        raise SystemExit(f"bad --warm {a.warm!r}: tile counts, e.g. 0,1,2") from None
    shapes = [(spec, *parse_shape(spec)) for spec in a.shapes.split(",")]
    if not torch.cuda.is_available():
        print("gpu_decode_warm.py needs a CUDA GPU", file=sys.stderr)
        return 2
    machine = bench.machine()
    copy_gbs = a.copy_gbs or bench.ceilings()["copy_GBps"]
    switch = "WARM_TILES_FP8" if a.fp8 else "WARM_TILES"
    config = DEFAULT_FP8_CONFIG if a.fp8 else DecodeConfig()
    cases, default = [], getattr(decode_fused, switch)
    for spec, lens, hq, hkv in shapes:
        case = bench.DecodeCase(lens, hq, hkv, 128, a.fp8)
        runs, first = [], None
        for w in warms:
            setattr(decode_fused, switch, w)
            fn, splits = case.fn(config, None)
            plan = case.last_plan
            fn()
            torch.cuda.synchronize()
            out = case.out.clone()
            first = out if first is None else first
            same = bool(torch.equal(out, first))
            occ = occupancy_or_error(plan)
            runs.append((w, fn, splits, plan.path, occ.get("registers"), same))
            print(f"{spec} warm {w}: {plan.path}, {splits} splits, {occ.get('registers')} "
                  f"registers, output {'equal' if same else 'DIFFERS'}", flush=True)  # fmt: skip
        setattr(decode_fused, switch, default)
        cases.append((spec, case, runs))
    bad = [(spec, w) for spec, _, runs in cases for w, *_, same in runs if not same]
    for r in range(a.rounds):
        for spec, case, runs in cases:
            nbytes = case.bytes_needed()
            for w, fn, splits, path, regs, same in runs:
                ms, ms_g, ms_r = bench_ms(fn), bench_graph_ms(fn), bench_readflush_ms(fn)
                row = {
                    "warm_tiles": w, "kv": "fp8" if a.fp8 else "bf16", "round": r,
                    "shape": spec, "machine": machine,
                    "copy_GBps": copy_gbs, "path": path, "splits": splits, "registers": regs,
                    "output_equal_to_first": same, "us": ms * 1e3, "us_graph": ms_g * 1e3,
                    "us_readflush": ms_r * 1e3,
                    "bw_ratio": nbytes / (ms * 1e-3) / 1e9 / copy_gbs,
                    "bw_ratio_graph": nbytes / (ms_g * 1e-3) / 1e9 / copy_gbs,
                }  # fmt: skip
                with a.out.open("a") as fh:
                    fh.write(json.dumps(row) + "\n")
                print(
                    f"r{r} {spec:<16} warm {w} do_bench {row['us']:7.1f} graph "
                    f"{row['us_graph']:7.1f} readflush {row['us_readflush']:7.1f} us",
                    flush=True,
                )
    if bad:
        print(f"outputs differ from warm {warms[0]}: {bad}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
