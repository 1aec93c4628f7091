"""Does programmatic dependent launch (PDL) take the merge's launch off a decode step? (GPU machine)

A decode run is stage 1 then the split merge. Replayed from a CUDA graph at 1 x 64k (32/8/128,
bf16) the run took 73.1 us where stage 1 alone took 68.8 and the merge alone 3.9
(bench/results/decode-host-h200-s12-driver.json): ~4 us of a step is the merge, most of it its
launch and ramp. With PDL the merge is launched while stage 1 still runs and waits on the GPU
(``griddepcontrol.wait``) for stage 1's writes; stage 1 may signal early
(``griddepcontrol.launch_dependents``) so the merge's programs are resident before stage 1 ends.

Variants, on the plan's own buffers and arguments (kernels wrapped here, the library's kernels
untouched):
- ``base``: ``plan.run`` (the library's two launches);
- ``merge_pdl``: stage 1 as is, the merge launched with PDL and waiting on the grid dependency
  (stage 1's implicit trigger: its programs' exit);
- ``early_pdl`` (measured at commit f7eecc8, dropped since: stage 1 wrapped, its whole signature
  repeated, to trigger its dependents at its start; the merge as above).

Each is checked bit for bit against ``base`` and timed by graph replay and by ``do_bench``
(L2 flushed), at 1 x 64k and 8 x 16k with bf16 KV and 1 x 64k with fp8 KV (merge only).
Writes $OUT/decode-pdl-h200.json.
Run: python bench/gpu_decode_pdl.py   (kdash importable, a CUDA GPU with sm_90)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from kdash.kernels import bench
from kdash.kernels.decode_attention import _decode_stage2, default_config
from kdash.kernels.launch import BoundKernel


@triton.jit
def _merge_pdl(
    OP,
    LSEP,
    Out,
    LSE,
    num_splits,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    tl.extra.cuda.gdc_wait()  # stage 1's writes are visible after this
    _decode_stage2(
        OP, LSEP, Out, LSE, num_splits, stride_outb, stride_outh, HEAD_DIM, BLOCK_S, EMULATE_RTNE
    )


def variants(case: bench.DecodeCase) -> dict:
    fn, splits = case.fn(default_config(case.k.dtype))
    fn()
    torch.cuda.synchronize()
    plan = case.last_plan
    if plan._s2 is None:
        return {"skipped": "a fused plan has no merge launch"}
    a1 = (case.q, case.k, case.v, plan.page_table, plan.seq_lens, plan._ks, plan._vs)
    a1 = (*a1, *plan._rest1)
    s2 = plan._s2
    merge = BoundKernel(_merge_pdl, s2.grid, {**s2.meta, "launch_pdl": True})
    s1 = plan._s1

    def merge_pdl() -> None:
        s1(*a1)
        merge(*plan._args2)

    out: dict = {"splits": splits, "bytes": case.bytes_needed()}
    plan.out.zero_()
    fn()
    want = plan.out.clone()
    runs = [("base", fn), ("merge_pdl", merge_pdl)]
    for name, f in runs:
        try:
            plan.out.fill_(float("nan"))
            f()
            f()  # arms the bound kernels, then the packed path
            torch.cuda.synchronize()
            same = bool(torch.equal(plan.out, want))
            g = bench.bench_graph_ms(f) * 1e3
            e = bench.bench_ms(f) * 1e3
            out[name] = {"same_as_base": same, "graph_us": g, "dobench_us": e}
            out[name]["bw_ratio_graph"] = case.bytes_needed() / (g * 1e-6) / 1e9 / COPY_GBPS
            out[name]["bw_ratio"] = case.bytes_needed() / (e * 1e-6) / 1e9 / COPY_GBPS
        except Exception as ex:  # noqa: BLE001 - one variant failing is a result
            out[name] = {"error": f"{type(ex).__name__}: {str(ex)[:300]}"}
        print(name, out[name], flush=True)
    return out


COPY_GBPS = 4282.0  # the bench's copy ceiling on the H200 (kernels-h200.json), for the ratios


def main() -> int:
    res: dict = {
        "command": "python bench/gpu_decode_pdl.py",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "copy_GBps_assumed": COPY_GBPS,
        "cases": {},
    }
    for lens, fp8 in (([65536], False), ([16384] * 8, False), ([65536], True)):
        key = f"{len(lens)}x{lens[0]} {'fp8' if fp8 else 'bf16'}"
        case = bench.DecodeCase(lens, 32, 8, 128, fp8)
        print(key, flush=True)
        res["cases"][key] = variants(case)
        del case
        torch.cuda.empty_cache()
    dest = Path(os.environ.get("OUT") or ".") / "decode-pdl-h200.json"
    dest.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
