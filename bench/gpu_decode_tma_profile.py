"""Stage 1 of decode at 1 x 64k bf16, three ways, for Nsight Compute (GPU machine;
bench/device_decode_tma_ncu.sh runs it under ncu): the Triton kernel of the default config, the
Gluon TMA kernel (``TmaConfig``, ring depth 4, with the L2 hint), both through two-launch plans
at the plan's own split count, and the copy-only TMA reader of bench/gpu_kv_tma.py (64 splits,
a page a slot, 4 slots, one warp: its fastest per-head form on the H200, 63.2 us). Each runs 3
times first, then once more to be profiled (ncu skips the first 3 launches of each kernel name).
Session 21 on an H100: the TMA stage 1 2-5 us behind the Triton one, though its copies alone
read the layout faster (session 16 on the H200: 63.2 against 66.8-68 us); the profile says
which stall keeps it over its copies.
Run: python bench/gpu_decode_tma_profile.py [32/8|64/8]   (a CUDA GPU with Gluon; kdash importable)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from kdash.kernels import bench
from kdash.kernels.decode_attention import DecodeConfig
from kdash.kernels.decode_gluon import TmaConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    heads = sys.argv[1] if len(sys.argv) > 1 else "32/8"
    if not torch.cuda.is_available():
        print("gpu_decode_tma_profile.py needs a CUDA GPU", file=sys.stderr)
        return 2
    from gpu_kv_tma import reader  # Gluon: imported only where a GPU is

    hq, hkv = (int(x) for x in heads.split("/"))
    case = bench.DecodeCase([65536], hq, hkv, 128, False)
    q, k, v = case.q, case.k, case.v
    triton_plan = case.plan(DecodeConfig(), fused=False)
    tma_plan = case.plan(TmaConfig(stages=4, l2_evict_first=True), fused=False)
    if not tma_plan.tma:
        print(f"no TMA plan here: {tma_plan.tma_refused}", file=sys.stderr)
        return 2
    copies = reader(case, "per_head", 64, 1, 4, 1)[0]
    runs = {
        "triton": lambda: triton_plan.run(q, k, v),
        "tma": lambda: tma_plan.run(q, k, v),
        "copies": copies,
    }
    for name, fn in runs.items():
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
        print(name, "ran", flush=True)
    print(
        "splits: triton",
        triton_plan.num_splits,
        "tma",
        tma_plan.num_splits,
        "l2_refused",
        tma_plan.l2_refused,
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
