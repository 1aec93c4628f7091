"""Where a DecodePlan.run spends its host time on the GPU machine (diagnostic).

One decode shape (32/8/128, 8 x 16k tokens) with bf16 and fp8 KV: whether each stage's
BoundKernel took the direct launcher path, the host us per run (CPU timer over 100 calls in a
row, as the bench's decode_host_us), the same for each stage's launch alone, one empty kernel
launched through Triton's JIT path and through its packed C launcher (what a launch costs the
host on this machine), each part of a 1 x 64k run replayed from a CUDA graph, and cProfile's
top entries over 2,000 runs. Prints one JSON document (also to $OUT/decode-host-h200.json).
Run: python bench/gpu_decode_host.py   (kdash importable, a CUDA GPU)
"""

from __future__ import annotations

import cProfile
import io
import json
import os
import pstats
from pathlib import Path

import torch
import triton
import triton.language as tl
from kdash.kernels import bench
from kdash.kernels.decode_attention import default_config
from kdash.kernels.launch import BoundKernel


@triton.jit
def _empty(X, n):
    if tl.program_id(0) == n:  # never true: n is the grid size
        tl.store(X, 0)


def empty_launches() -> dict:
    """Host us of one empty kernel's launch: Triton's JIT path and its packed C launcher (the
    plan's path)."""
    x = torch.zeros(16, device="cuda")
    bk = BoundKernel(_empty, (1,), {})
    bk(x, 7)
    torch.cuda.synchronize()
    tri = bk.launcher((7,))
    out = {"jit_us": per_call_us(lambda: _empty[(1,)](x, 7))}
    if tri is not None:
        s = bk.stream()
        out["triton_packed_us"] = per_call_us(lambda: tri(s, x.data_ptr()))
    return out


def per_call_us(fn) -> float:
    """Host us per call over 100 calls in a row (the bench's decode_host_us measure)."""
    return bench.bench_host_nosync_us(fn)


def parts_at_64k() -> dict:
    """GPU us of one run at 1 x 64k (32/8/128) replayed from CUDA graphs, whole and by part
    (stage 1 alone, the merge alone), and the copy-bandwidth floor of its bytes: where the
    fixed cost of a step sits."""
    out: dict = {}
    for fp8 in (False, True):
        case = bench.DecodeCase([65536], 32, 8, 128, fp8)
        fn, splits = case.fn(default_config(case.k.dtype))
        fn()
        torch.cuda.synchronize()
        plan = case.last_plan
        a1 = (case.q, case.k, case.v, plan.page_table, plan.seq_lens, plan._ks, plan._vs)
        a1 = (*a1, *plan._rest1)
        r = {"splits": splits, "bytes": case.bytes_needed()}
        r["run_graph_us"] = bench.bench_graph_ms(fn) * 1e3
        r["run_dobench_us"] = bench.bench_ms(fn) * 1e3
        s1, s2, a2 = plan._s1, plan._s2, plan._args2
        r["stage1_graph_us"] = bench.bench_graph_ms(lambda s1=s1, a1=a1: s1(*a1)) * 1e3
        if s2 is not None:
            r["merge_graph_us"] = bench.bench_graph_ms(lambda s2=s2, a2=a2: s2(*a2)) * 1e3
        out["fp8" if fp8 else "bf16"] = r
    return out


def main() -> None:
    out: dict = {"triton": triton.__version__, "torch": torch.__version__, "cases": {}}
    out["empty_launch"] = empty_launches()
    out["parts_1x64k"] = parts_at_64k()
    for fp8 in (False, True):
        case = bench.DecodeCase([16384] * 8, 32, 8, 128, fp8)
        fn, splits = case.fn(default_config(case.k.dtype))
        fn()
        torch.cuda.synchronize()
        plan = case.last_plan
        s1, s2 = plan._s1, plan._s2
        r: dict = {"splits": splits}
        for name, s in (("s1", s1), ("s2", s2)):
            r[name] = {
                "fast": s.fast,
                "direct": s._direct is not None,
                "grid": list(s.grid),
            }
        r["run_us"] = per_call_us(fn)
        q, k, v = case.q, case.k, case.v
        a1 = (q, k, v, plan.page_table, plan.seq_lens, plan._ks, plan._ks, *plan._rest1)
        if fp8:
            a1 = (q, k, v, plan.page_table, plan.seq_lens, plan._ks, plan._vs, *plan._rest1)
        r["s1_us"] = per_call_us(lambda s1=s1, a1=a1: s1(*a1))
        r["s2_us"] = per_call_us(lambda s2=s2, a2=plan._args2: s2(*a2))
        r["empty_launch_us"] = per_call_us(lambda: torch.empty(0, device="cuda"))
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(2000):
            fn()
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        r["profile"] = buf.getvalue().splitlines()[-24:]
        out["cases"]["fp8" if fp8 else "bf16"] = r
    text = json.dumps(out, indent=1)
    print(text)
    dest = Path(os.environ.get("OUT") or ".") / "decode-host-h200.json"
    dest.write_text(text)


if __name__ == "__main__":
    main()
