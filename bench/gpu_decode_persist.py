"""The persistent one-launch decode (kernels/decode_persist.py) against the plan's other paths.
(GPU machine)

Per shape (32/8/128, page 16) and KV dtype, each through a DecodePlan on the same case: two
launches, the fused launch, the persistent kernel, and for bf16 the persistent kernel under a
128-register cap (4 programs an SM, with the spills ptxas then makes; uncapped it compiles to
~160 registers, 3 an SM). Per variant: CUDA-graph replay and do_bench medians (us), host us
per run (no sync), the compiled kernel's registers and residency, the grid, and the largest
difference from two launches' output. Writes the JSON after every shape.
Run: python bench/gpu_decode_persist.py [--out FILE] [--shapes 1x65536,64xlognormal]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_host_nosync_us, bench_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.decode_fp8 import Fp8Config

SHAPES = "1x65536,8x16384,32x4096,128x1024,64xlognormal"


def variants(fp8: bool) -> dict[str, tuple[DecodeConfig, bool | str]]:
    """name -> (config, the plan's ``fused``)."""
    cfg = DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()
    out: dict[str, tuple[DecodeConfig, bool | str]] = {
        "two": (cfg, False),
        "fused": (cfg, True),
        "persistent": (cfg, "persistent"),
    }
    if not fp8:
        out["persistent-cap128"] = (Fp8Config(**asdict(cfg), maxnreg=128), "persistent")
    return out


def lens_of(shape: str) -> list[int]:
    batch, ctx = shape.split("x")
    if ctx == "lognormal":
        return bench.lognormal_lens(int(batch), int(os.environ.get("LOGNORMAL_MEAN", "4096")))
    return [int(ctx)] * int(batch)


def row_for(shape: str, fp8: bool) -> dict:
    lens = lens_of(shape)
    case = bench.DecodeCase(lens, 32, 8, 128, fp8)
    row: dict = {"shape": shape, "kv": "fp8" if fp8 else "bf16", "tokens": sum(lens)}
    want = None
    for name, (cfg, fused) in variants(fp8).items():
        try:
            fn, splits = case.fn(cfg, fused)
            plan = case.last_plan
            fn()
            torch.cuda.synchronize()
            got = case.out.float().clone()
            if want is None:
                want = got
            occ = bench.occupancy_or_error(plan)
            fig = {
                "path": plan.path,
                "splits": splits,
                "grid": list(plan._grid1),
                "registers": occ.get("registers"),
                "resident_per_sm": plan.resident_per_sm,
                "us": bench_ms(fn) * 1e3,
                "us_graph": bench_graph_ms(fn) * 1e3,
                "host_us_nosync": bench_host_nosync_us(fn),
                "max_abs_diff_vs_two": float((got - want).abs().max()),
            }
            if plan.persistent:
                torch.cuda.synchronize()
                fig["counters_zero"] = not bool(plan._flags.any())
        except Exception as e:  # noqa: BLE001 - one variant's failure is a finding
            fig = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row[name] = fig
        print(f"{shape:>14} {row['kv']} {name:<18} {json.dumps(fig)}", flush=True)
    del case
    torch.cuda.empty_cache()
    return row


def run_shapes(script: str, doc: str, default_out: str, row_for, argv: list[str] | None) -> int:
    """The main of a per-shape decode probe: ``row_for(shape, fp8)`` for every ``--shapes``
    entry, bf16 then fp8, the JSON (command, machine, rows) rewritten after every row."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    out_dir = Path(os.environ.get("OUT", "."))
    ap.add_argument("--out", type=Path, default=out_dir / default_out)
    ap.add_argument("--shapes", default=SHAPES)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print(f"{script} needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict = {
        "command": f"python bench/{script} " + " ".join(argv or sys.argv[1:]),
        "machine": bench.machine(),
        "rows": [],
    }
    for shape in a.shapes.split(","):
        for fp8 in (False, True):
            result["rows"].append(row_for(shape, fp8))
            a.out.write_text(json.dumps(result, indent=1))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_shapes("gpu_decode_persist.py", __doc__, "decode-persist-h200.json", row_for, argv)


if __name__ == "__main__":
    sys.exit(main())
