"""Does a shared tail (kernels/decode_steal.py) take the stragglers out of a decode step? (GPU)

For each shape: the plan's own run (two launches) against stage 1 with a shared pool at several
pool sizes, chunk sizes and register caps, followed by the plan's merge, all on the plan's
buffers. Each variant's output is compared with the plan's (max abs difference; the tokens are
summed in another order), and the counters must be back at 0 after every launch. Timed by CUDA
graph replay and by do_bench. The split count of a variant is the plan's when it keeps the
plan's programs per SM, else the count that fills one wave at its own residency (``splits``).
Writes $OUT/decode-steal-h200.json.
Run: python bench/gpu_decode_steal.py           (a CUDA GPU, kdash importable)
     TRITON_INTERPRET=1 python bench/gpu_decode_steal.py --cpu   (the wiring on small shapes)
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
from kdash.kernels.decode_steal import _decode_stage1_cvt_steal, _decode_stage1_steal

CPU = "--cpu" in sys.argv
# (pool percent, chunk tiles, register cap or None, splits per KV head or None for the plan's)
VARIANTS = [
    (10, 1, None, 49),
    (10, 1, 128, None),
    (15, 1, 128, None),
    (6, 1, 128, None),
    (20, 2, 128, None),
    (10, 1, None, 64),
]
FP8_VARIANTS = [(10, 1, None, None), (15, 1, None, None), (6, 1, None, None), (20, 2, None, None)]


def stepper(case: bench.DecodeCase, plan, pool: int, chunk: int, maxnreg, splits: int | None):
    """``(step, plan_used, counters)``: one decode step with the shared-pool stage 1."""
    if splits is not None and splits != plan.num_splits:
        plan = bench.DecodePlan(
            case.page_table, case.seq_lens, case.hq, case.hkv, case.d, case.k.shape[1],
            max_seq_len=max(case.lens), total_tokens=sum(case.lens), kv_dtype=case.k.dtype,
            config=plan.config, out=case.out, num_splits=splits, **case.scales,
        )  # fmt: skip
    plan.run(case.q, case.k, case.v)  # binds the plan's arguments and buffers
    torch.cuda.synchronize() if not CPU else None
    ctr = torch.zeros(plan._grid1[0] * plan._grid1[1], device=case.q.device, dtype=torch.int32)
    fp8 = case.k.dtype != torch.bfloat16
    kern = _decode_stage1_cvt_steal if fp8 else _decode_stage1_steal
    meta = {k: v for k, v in plan._meta1.items() if k not in ("IS_FP8", "FP8_FP16")}
    meta.update(POOL_PCT=pool, CHUNK=chunk)
    if maxnreg and not CPU:
        meta["maxnreg"] = maxnreg
    o_part, lse_part, *scalars = plan._rest1
    args = (case.q, case.k, case.v, plan.page_table, plan.seq_lens, plan._ks, plan._vs)
    args += (o_part, lse_part, ctr, *scalars)
    s2 = plan._s2
    grid = plan._grid1

    def step():
        kern[grid](*args, **meta)
        s2(*plan._args2)

    return step, plan, ctr


def variant_row(case: bench.DecodeCase, want: torch.Tensor, plan, v: tuple) -> dict:
    pool, chunk, maxnreg, splits = v
    row: dict = {"pool_pct": pool, "chunk": chunk, "maxnreg": maxnreg}
    step, used, ctr = stepper(case, plan, pool, chunk, maxnreg, splits)
    step()
    if not CPU:
        torch.cuda.synchronize()
    row["splits"] = used.num_splits
    row["max_abs_diff"] = float((case.out.float() - want).abs().max())
    row["counters_zero"] = bool(int(ctr.abs().sum()) == 0)
    if not CPU:
        row["us_graph"] = bench_graph_ms(step) * 1e3
        row["us"] = bench_ms(step) * 1e3
        torch.cuda.synchronize()
        row["counters_zero_after_timing"] = bool(int(ctr.abs().sum()) == 0)
    return row


def shape_rows(lens: list[int], hq: int, fp8: bool) -> dict:
    case = bench.DecodeCase(lens, hq, 8, 128, fp8)
    plan = case.plan(default_config(case.k.dtype), False)
    q, k, v = case.q, case.k, case.v

    def base():
        plan.run(q, k, v)

    base()
    if not CPU:
        torch.cuda.synchronize()
    want = case.out.float().clone()
    out: dict = {"heads": f"{hq}/8/128", "batch": len(lens), "max_len": max(lens)}
    out["kv"] = "fp8" if fp8 else "bf16"
    out["plan_splits"] = plan.num_splits
    if not CPU:
        out["base"] = {"us_graph": bench_graph_ms(base) * 1e3, "us": bench_ms(base) * 1e3}
    out["variants"] = []
    for var in FP8_VARIANTS if fp8 else VARIANTS:
        try:
            row = variant_row(case, want, plan, var)
        except Exception as e:  # noqa: BLE001 - a variant that fails is a finding, the rest run
            row = {"variant": list(var), "error": f"{type(e).__name__}: {str(e)[:300]}"}
        out["variants"].append(row)
        print(out["heads"], out["batch"], out["max_len"], out["kv"], row, flush=True)
    return out


def main() -> int:
    t0 = time.time()
    res: dict = {"command": "python bench/gpu_decode_steal.py", "triton": triton.__version__}
    if CPU:
        bench.DEVICE = "cpu"
        shapes = [([300, 1000, 77], 32, False), ([900], 32, True)]
        global VARIANTS, FP8_VARIANTS
        VARIANTS = [(10, 1, None, None), (30, 2, None, 5)]
        FP8_VARIANTS = [(25, 1, None, None)]
    else:
        res["gpu"] = torch.cuda.get_device_name(0)
        shapes = [([65536], 32, False), ([65536], 32, True), ([16384] * 8, 32, False)]
        shapes += [([16384] * 8, 32, True), ([131072], 32, False), ([65536], 64, False)]
    res["shapes"] = [shape_rows(*s) for s in shapes]
    res["elapsed_s"] = time.time() - t0
    dest = Path(os.environ.get("OUT") or ".") / "decode-steal-h200.json"
    if not CPU:
        dest.write_text(json.dumps(res, indent=1))
    print("done", dest, f"{res['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
