"""Does a merge that overlaps stage 1 take the merge out of a decode step? (GPU machine)

A 1 x 64k bf16 step replayed from a CUDA graph is stage 1 (its last program ends at ~68 us) plus
a 1.2 us gap and a 2.8 us merge (bench/gpu_decode_timeline.py); the earlier one-launch kernel,
whose last split merged its pair alone, was ~7 us slower than two launches at every long shape.
This launches the fused kernel of :mod:`kdash.kernels.decode_fused` (merge programs in the same
grid, folding each chunk of splits as its flags come up) on the default two-launch plan's own
split count, cut and buffers, and times it against the plan's run, by graph replay and by
do_bench, with the merge's chunk and poll sleep varied. Each variant's output is compared with
the plan's, its flags are checked back at zero after the replays, and its registers are read
from the compiled kernel (a register cap keeps stage 1 at the plan's programs an SM).
Writes $OUT/decode-overlap-h200.json.
Run: python bench/gpu_decode_overlap.py   (a CUDA GPU; kdash importable)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms
from kdash.kernels.decode_attention import default_config
from kdash.kernels.decode_fused import _decode_fused

SHAPES = (
    ("1x64k bf16 32/8", [65536], 32, False),
    ("1x64k fp8 32/8", [65536], 32, True),
    ("1x64k bf16 64/8", [65536], 64, False),
    ("1x64k fp8 64/8", [65536], 64, True),
    ("8x16k bf16 32/8", [16384] * 8, 32, False),
    ("8x16k fp8 32/8", [16384] * 8, 32, True),
    ("1x128k bf16 32/8", [131072], 32, False),
    ("1x128k fp8 32/8", [131072], 32, True),
)
VARIANTS = ((16, 64), (8, 64), (32, 64), (16, 256))  # (CHUNK, POLL_NS)


def overlap_runner(case: bench.DecodeCase, plan, fused_plan, chunk: int, poll: int):
    """A step of the overlap kernel on ``plan``'s split count, cut and partial buffers."""
    meta = dict(fused_plan._meta1)
    meta.update(CHUNK=chunk, POLL_NS=poll)
    # Keep stage 1 at the plan's programs an SM: the register budget of that residency.
    per_sm = plan.resident_per_sm
    meta["maxnreg"] = min(255, (65536 // (per_sm * 32 * meta["num_warps"])) // 8 * 8)
    g1 = plan._grid1
    grid = (g1[0], g1[1], g1[2] + fused_plan._meta1["GROUP"])
    out = torch.empty_like(case.out)
    lse = torch.empty(case.out.shape[:2], device=out.device, dtype=torch.float32)
    flags = torch.zeros(g1[0] * case.hq * g1[2], device=out.device, dtype=torch.int32)
    scalars = plan._rest1[2:]
    ins = (case.q, case.k, case.v, plan.page_table, plan.seq_lens, plan._ks, plan._vs)
    args = (*ins, plan.o_part, plan.lse_part, out, lse, flags, *scalars, *out.stride()[:2])

    def step():
        return _decode_fused[grid](*args, **meta)

    return step, out, flags, meta


def shape_case(name: str, lens: list[int], hq: int, fp8: bool) -> dict:
    case = bench.DecodeCase(lens, hq, 8, 128, fp8)
    cfg = default_config(case.k.dtype)
    plan = case.plan(cfg, False)
    fused_plan = case.plan(cfg, True)
    q, k, v = case.q, case.k, case.v

    def base():
        plan.run(q, k, v)

    base()
    torch.cuda.synchronize()
    ref = case.out.clone()
    row = {
        "splits": plan.num_splits,
        "resident_per_sm": plan.resident_per_sm,
        "two_launch": {"us_graph": bench_graph_ms(base) * 1e3, "us": bench_ms(base) * 1e3},
        "variants": [],
    }
    for chunk, poll in VARIANTS:
        try:
            step, out, flags, meta = overlap_runner(case, plan, fused_plan, chunk, poll)
            kern = step()
            torch.cuda.synchronize()
            diff = (out.float() - ref.float()).abs().max().item()
            flags_zero = bool((flags == 0).all().item())
            g = bench_graph_ms(step) * 1e3
            d = bench_ms(step) * 1e3
            torch.cuda.synchronize()
            after = (out.float() - ref.float()).abs().max().item()
            got = {
                "chunk": chunk,
                "poll_ns": poll,
                "maxnreg": meta["maxnreg"],
                "registers": getattr(kern, "n_regs", None),
                "spills": getattr(kern, "n_spills", None),
                "us_graph": g,
                "us": d,
                "max_abs_diff_first": diff,
                "max_abs_diff_after_replays": after,
                "flags_zero_after": flags_zero and bool((flags == 0).all().item()),
            }
        except Exception as e:  # noqa: BLE001 - one variant's failure is reported, the rest run
            got = {"chunk": chunk, "poll_ns": poll, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["variants"].append(got)
        print(name, json.dumps(got), flush=True)
    row["two_launch_again"] = {"us_graph": bench_graph_ms(base) * 1e3, "us": bench_ms(base) * 1e3}
    return row


def main() -> int:
    t0 = time.time()
    res: dict = {
        "command": "python bench/gpu_decode_overlap.py",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "variants_chunk_poll_ns": VARIANTS,
        "shapes": {},
    }
    budget = float(os.environ.get("OVERLAP_BUDGET_S", "400"))
    for name, lens, hq, fp8 in SHAPES:
        if time.time() - t0 > budget:
            res["shapes"][name] = "not run (budget)"
            continue
        try:
            res["shapes"][name] = shape_case(name, lens, hq, fp8)
        except Exception as e:  # noqa: BLE001 - one shape's failure is reported, the rest run
            res["shapes"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        print(name, "two-launch", json.dumps(res["shapes"][name].get("two_launch")), flush=True)
        torch.cuda.empty_cache()
    res["elapsed_s"] = time.time() - t0
    dest = Path(os.environ.get("OUT") or ".") / "decode-overlap-h200.json"
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest, f"{res['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
