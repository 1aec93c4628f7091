"""Which evict-first variants of decode stage 1 run, and what they buy (GPU machine).

One decode config per entry of ``CFGS`` (a JSON list of ``DecodeConfig`` overrides, an optional
``"kv"`` key limiting an entry to ``bf16`` or ``fp8``), on 1 x 64k and 8 x 16k (32/8/128) with
both KV dtypes: do_bench, read-flush and graph-replay us, registers and programs per SM.
Session 13 ran it with kernels/l2_hint.py (commit 659a742, removed since: it rewrote the K/V
``cp.async`` to carry an evict-first L2 policy, and the H200 faulted on it). A fresh Triton cache
per process: compile hooks are not part of Triton's cache key. One JSON line per row; the
first failure stops the process with exit 3 (a GPU fault leaves the context unusable).
Run: CFGS='[{}, {"evict_first": true, "num_stages": 1}]' python bench/gpu_decode_evict_probe.py
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import replace

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="tc-")

import torch
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import default_config


def main() -> int:
    cfgs = json.loads(os.environ.get("CFGS", "[{}]"))
    shapes = [("65536", False), ("16384x8", False), ("65536", True), ("16384x8", True)]
    for lens_s, fp8 in shapes:
        lens = [65536] if lens_s == "65536" else [16384] * 8
        kv = "fp8" if fp8 else "bf16"
        case = bench.DecodeCase(lens, 32, 8, 128, fp8)
        base = default_config(case.k.dtype)
        for c in cfgs:
            if c.get("kv", kv) != kv:
                continue
            cfg = replace(base, **{k: v for k, v in c.items() if k != "kv"})
            row: dict = {"shape": lens_s, "kv": kv, "cfg": c}
            try:
                fn, splits = case.fn(cfg, False)
                fn()
                torch.cuda.synchronize()
                ms, ms_r, ms_g = bench_ms(fn), bench_readflush_ms(fn), bench_graph_ms(fn)
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                print(json.dumps({**row, "error": str(e)[:120]}), flush=True)
                return 3
            occ = bench.occupancy_or_error(case.last_plan)
            row.update(splits=splits, us=ms * 1e3, us_readflush=ms_r * 1e3, us_graph=ms_g * 1e3)
            row.update(regs=occ.get("registers"), per_sm=occ.get("resident_per_sm"))
            print(json.dumps(row), flush=True)
        del case
    return 0


if __name__ == "__main__":
    sys.exit(main())
