"""Split counts and launch paths of the default decode plan at one long request. (GPU machine)

At 1 x 64k the one-launch (fused) grid is stage 1's splits plus GROUP merge programs per KV
head; the default plan cuts one wave of the compiled kernel's residency and does not count the
merge programs. On the H100 (session 21), the hinted bf16 fused kernel at 32/8 took 155
registers (3 programs an SM, 49 splits) and ran 97.6 us replayed, where 64/8 took 124 (4 an SM,
64 splits) and ran 98.9. This times the plan at forced split counts below the default (the
kernel's device-side cut takes ``min(its own count, the grid's)``, so a smaller grid is honoured)
and the two-launch path at the default count, per head layout and KV dtype: do_bench us (L2
flushed by writing 256 MiB, the bench's ``decode_bw_ratio``), graph-replay us, read-flushed us,
registers, and the output against the default plan's. Every variant is timed in two passes, in
turn, so the spread between the passes shows the noise. The JSON (command, machine, rows) is
rewritten after every variant.
Run: python bench/gpu_decode_splits.py [--out FILE] [--shape 1x65536] [--heads 32/8,64/8]
     [--splits 40,44,48,49,52,56,58,60] [--kv bf16,fp8] [--configs r128,cap3,b128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from gpu_decode_persist import lens_of
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.decode_fp8 import Fp8Config
from kdash.kernels.decode_plan import DecodePlan

# Launch configs timed beside the default at their own split counts (bf16 only; fp8 has its
# own sweep in gpu_fp8_variants.py), with the launch path (None: the plan's choice). The plans
# that held 3 programs an SM through their 153-155 registers were the fastest on the H100, so
# the cap (DecodeConfig.max_resident_per_sm) and the register cap (maxnreg) ask whether that is
# the residency or the code (session 22: the code; see bench/NOTES-kernels.md).
CONFIGS: dict[str, tuple[DecodeConfig, bool | None]] = {
    "r128": (Fp8Config(maxnreg=128), None),
    "r128_two": (Fp8Config(maxnreg=128), False),
    "cap3": (DecodeConfig(max_resident_per_sm=3), None),
    "cap3_two": (DecodeConfig(max_resident_per_sm=3), False),
    "cap2": (DecodeConfig(max_resident_per_sm=2), None),
    "b128": (DecodeConfig(block_n=128), None),
}


def make_plan(
    case: bench.DecodeCase,
    splits: int | None,
    fused: bool | None,
    cfg: DecodeConfig | None = None,
) -> DecodePlan:
    if cfg is None:
        cfg = DEFAULT_FP8_CONFIG if case.fp8 else DecodeConfig()
    return case.plan(cfg, fused, splits)


def figures(case: bench.DecodeCase, plan: DecodePlan, copy_gbs: float) -> tuple[dict, object]:
    q, k, v = case.q, case.k, case.v

    def fn() -> None:
        plan.run(q, k, v)

    fn()
    torch.cuda.synchronize()
    out = case.out.float().clone()
    ms, ms_g, ms_r = bench_ms(fn), bench_graph_ms(fn), bench_readflush_ms(fn)
    nbytes = case.bytes_needed()
    occ = bench.occupancy_or_error(plan)
    return {
        "path": plan.path,
        "splits": plan.num_splits,
        "split_len": plan.split_len,
        "registers": occ.get("registers"),
        "spills": occ.get("spills"),
        "shared_asked": occ.get("shared_asked"),
        "shared_refused": occ.get("shared_refused"),
        "resident_per_sm": occ.get("resident_per_sm"),
        "programs": occ.get("programs"),
        "l2_refused": plan.l2_refused,
        "us": ms * 1e3,
        "us_graph": ms_g * 1e3,
        "us_readflush": ms_r * 1e3,
        "bw_ratio": nbytes / (ms * 1e-3) / 1e9 / copy_gbs,
        "bw_ratio_graph": nbytes / (ms_g * 1e-3) / 1e9 / copy_gbs,
    }, out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "splits.json")
    ap.add_argument("--shape", default="1x65536")
    ap.add_argument("--heads", default="32/8,64/8")
    ap.add_argument("--splits", default="33,40,44,48,49,52,56,58,60")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--configs", default=",".join(CONFIGS), help="bf16 configs beside the default")
    a = ap.parse_args(argv)
    unknown = [n for n in a.configs.split(",") if n and n not in CONFIGS]
    if unknown:
        print(f"unknown config {unknown[0]!r}: one of {', '.join(CONFIGS)}", file=sys.stderr)
        return 2
    try:
        forced = [int(s) for s in a.splits.split(",") if s]
    except ValueError:
        print(f"--splits takes whole numbers, not {a.splits!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gpu_decode_splits.py needs a CUDA GPU", file=sys.stderr)
        return 2
    result: dict = {
        "command": "python bench/gpu_decode_splits.py " + " ".join(argv or sys.argv[1:]),
        "machine": bench.machine(),
        "ceilings": bench.ceilings(),
        "rows": [],
    }
    copy_gbs = result["ceilings"]["copy_GBps"]
    for heads in a.heads.split(","):
        hq, hkv = (int(x) for x in heads.split("/"))
        for kv in a.kv.split(","):
            case = bench.DecodeCase(lens_of(a.shape), hq, hkv, 128, kv == "fp8")
            default = make_plan(case, None, None)
            variants: list[tuple[str, int | None, bool | None, DecodeConfig | None]] = [
                ("default", None, None, None),
                ("two", None, False, None),
            ]
            variants += [(f"s{s}", s, True, None) for s in forced if s < default.num_splits]
            if kv == "bf16":
                named = [(n, *CONFIGS[n]) for n in a.configs.split(",") if n]
                variants += [(n, None, fused, cfg) for n, cfg, fused in named]
            plans = {}
            for name, s, f, c in variants:
                try:
                    plans[name] = make_plan(case, s, f, c)
                except Exception as e:  # noqa: BLE001 - a config that cannot plan is a finding
                    print(f"{name}: no plan: {type(e).__name__}: {str(e)[:200]}", flush=True)
            want = None
            for pass_no in (1, 2):
                for name, plan in plans.items():
                    row = {"shape": a.shape, "heads": heads, "kv": kv, "variant": name}
                    row["pass"] = pass_no
                    try:
                        fig, out = figures(case, plan, copy_gbs)
                        want = out if want is None else want
                        fig["max_abs_diff_vs_default"] = float((out - want).abs().max())
                    except Exception as e:  # noqa: BLE001 - one variant's failure is a finding
                        fig = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    row.update(fig)
                    result["rows"].append(row)
                    a.out.write_text(json.dumps(result, indent=1))
                    print(json.dumps(row)[:420], flush=True)
            del case, plans, default
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
