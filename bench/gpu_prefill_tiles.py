"""Prefill at D=128 with tiles that let two programs share an SM (GPU machine).

Nsight Compute (bench/device_prefill_ncu.sh) puts the default Hopper kernel (128 x 64 tiles, 8
warps, 3 stages: 140 registers and 132 KiB of shared memory, one program an SM) at 54% SM busy
where cuDNN's kernel is at 73%: cuDNN runs one persistent program an SM with a producer warp
and two consumer warpgroups, so one warpgroup's softmax overlaps the other's matrix products.
Two independent programs an SM can overlap the same way without warp specialisation, if each
fits half the SM. This times such tiles against the default on the classes furthest from
cuDNN, checks each against the default's output, and times cuDNN alongside.
Writes $OUT/prefill-tiles-h200.json.
Run: python bench/gpu_prefill_tiles.py   (a CUDA GPU; kdash importable)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_ms
from kdash.kernels.prefill_hopper import HopperConfig, extend_attention_hopper
from torch.nn.attention import SDPBackend

CONFIGS = [
    HopperConfig(128, 64, 8, 3),  # the default
    HopperConfig(64, 64, 4, 2),
    HopperConfig(64, 64, 4, 3),
    HopperConfig(64, 128, 4, 2),
    HopperConfig(128, 64, 8, 2),
    HopperConfig(64, 64, 4, 4),
]
SHAPES = [(4096, 16, 16, False), (4096, 16, 16, True), (8192, 32, 8, False), (16384, 16, 16, False)]


def main() -> int:
    res: dict = {"command": "python bench/gpu_prefill_tiles.py", "rows": []}
    res["gpu"] = torch.cuda.get_device_name(0)
    for s, hq, hkv, causal in SHAPES:
        case = bench.PrefillCase(s, hq, hkv, 128, causal)
        row: dict = {"seq": s, "heads": f"{hq}/{hkv}/128", "causal": causal, "batch": case.batch}
        row["cudnn_us"] = bench_ms(case.sdpa(SDPBackend.CUDNN_ATTENTION)) * 1e3
        want = None
        for cfg in CONFIGS:
            key = f"{cfg.block_m}x{cfg.block_n}/{cfg.num_warps}w/{cfg.num_stages}s"

            def run(cfg=cfg, case=case):
                extend_attention_hopper(case.q, case.k, case.v, None, None, None, None,
                                        case.cu, case.seq, causal=case.causal, config=cfg,
                                        out=case.out)  # fmt: skip

            try:
                run()
                torch.cuda.synchronize()
                got = case.out.float().clone()
                if want is None:
                    want = got
                us = bench_ms(run) * 1e3
                row[key] = {"us": us, "vs_cudnn": row["cudnn_us"] / us,
                            "max_abs_diff_vs_default": float((got - want).abs().max()),
                            "finite": bool(torch.isfinite(got).all())}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - a config that does not fit is a finding
                row[key] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            print(s, row["heads"], "causal" if causal else "full", key, row[key], flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
    dest = Path(os.environ.get("OUT") or ".") / "prefill-tiles-h200.json"
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
