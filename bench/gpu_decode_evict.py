"""The L2 evict-first hint on the Triton decode kernels' cp.async copies, against none. (GPU
machine)

Per shape, head layout and KV dtype, the default plan (its config and launch path) with
``evict_first`` off and on: do_bench us (L2 flushed by writing 256 MiB, the bench's
``decode_bw_ratio``), graph-replay us, read-flushed us (do_bench with L2 flushed by reading, so
no dirty line is written back inside the call), the output against the unhinted plan's, the
stage-1 kernel's registers, and how many of its copies the hook hinted. A plan whose ptxas cannot
encode the hint does not ask (``l2_refused`` says why) and its row says so: run the script once
with the ptxas Triton bundles and once with ``TRITON_PTXAS_PATH`` naming a ptxas 13.4 or later
(kernels/l2_hint.py), one process each (Triton reads the ptxas once per process). The JSON
(command, machine, the ptxas and its probe, rows) is rewritten after every row.
Run: python bench/gpu_decode_evict.py [--out FILE] [--shapes 1x65536,8x16384]
     [--heads 32/8,64/8]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from gpu_decode_persist import lens_of
from kdash.kernels import bench, l2_hint
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig

SHAPES = "1x65536,1x131072,8x16384"
HEADS = "32/8,64/8"


def figures(case: bench.DecodeCase, cfg: DecodeConfig, copy_gbs: float) -> tuple[dict, object]:
    fn, splits = case.fn(cfg, None)
    plan = case.last_plan
    fn()
    if case.out.is_cuda:
        torch.cuda.synchronize()
    out = case.out.float().clone()
    ck = plan._s1._compiled if plan._s1 is not None else None
    ms, ms_g, ms_r = bench_ms(fn), bench_graph_ms(fn), bench_readflush_ms(fn)
    nbytes = case.bytes_needed()
    fig = {
        "path": plan.path,
        "stage1_kernel": plan._kern1.__name__,
        "splits": splits,
        "registers": bench.occupancy_or_error(plan).get("registers"),
        "evict": plan._meta1.get("EVICT", ""),
        "l2_refused": plan.l2_refused,
        "hinted_copies": l2_hint.hinted(ck) if ck is not None else None,
        "us": ms * 1e3,
        "us_graph": ms_g * 1e3,
        "us_readflush": ms_r * 1e3,
        "bw_ratio": nbytes / (ms * 1e-3) / 1e9 / copy_gbs,
        "bw_ratio_graph": nbytes / (ms_g * 1e-3) / 1e9 / copy_gbs,
    }
    return fig, out


def row_for(shape: str, heads: str, fp8: bool, copy_gbs: float) -> dict:
    hq, hkv = (int(x) for x in heads.split("/"))
    case = bench.DecodeCase(lens_of(shape), hq, hkv, 128, fp8)
    base = DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()
    row: dict = {"shape": shape, "heads": heads, "kv": "fp8" if fp8 else "bf16"}
    want = None
    for name, evict in (("plain", False), ("evict", True)):
        try:
            fig, out = figures(case, replace(base, evict_first=evict), copy_gbs)
            if want is None:
                want = out
            fig["max_abs_diff_vs_plain"] = float((out - want).abs().max())
        except Exception as e:  # noqa: BLE001 - one variant's failure is a finding
            fig = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row[name] = fig
        print(f"{shape:>9} {heads} {row['kv']} {name:<5} {json.dumps(fig)}", flush=True)
    p, e = row["plain"], row["evict"]
    if "us" in p and "us" in e:
        row["delta_us"] = {k: e[k] - p[k] for k in ("us", "us_graph", "us_readflush")}
    del case
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "evict.json")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--heads", default=HEADS)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode_evict.py needs a CUDA GPU", file=sys.stderr)
        return 2
    tool = l2_hint.triton_ptxas()
    result: dict = {
        "command": "python bench/gpu_decode_evict.py " + " ".join(argv or sys.argv[1:]),
        "machine": bench.machine(),
        "ptxas": tool,
        "probe": l2_hint.probe(tool[0]) if tool else "no ptxas",
        "ceilings": bench.ceilings(),
        "rows": [],
    }
    print(f"ptxas {tool}: probe {result['probe'] or 'encodes the hinted copy'}", flush=True)
    copy_gbs = result["ceilings"]["copy_GBps"]
    for shape in a.shapes.split(","):
        for heads in a.heads.split(","):
            for fp8 in (False, True):
                result["rows"].append(row_for(shape, heads, fp8, copy_gbs))
                a.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
