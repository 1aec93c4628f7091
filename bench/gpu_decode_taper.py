"""Do later-dispatched splits need less work? A tapered cut for decode stage 1 (GPU machine).

The stamps of bench/gpu_decode_timeline.py show the second half of a request's splits running
1.5-3 us (3-5%) longer than the first half at every shape, on the same SMs, and the same with
the page table reversed (so it follows the split, not the pages it reads). The hardware
dispatches a grid (B, Hkv, splits) split-major, so later splits are the youngest programs on
their SMs. This cuts each request into splits whose tile counts fall linearly with the split
index, by ``TAPER_PM`` per mille between the ends (0: equal tiles), so the later programs get
less to do, and times it against the plan's own run.

The kernel is the library's ``_decode_stage1`` with only its cut replaced: its source is read
from kdash at run time and written to a temporary module with the call to ``_piece`` replaced
by ``_piece_taper`` below (nothing of the kernel is copied here). Launched on the plan's
arguments, followed by the plan's merge; output compared with ``plan.run``'s.
Writes $OUT/decode-taper-h200.json.
Run: python bench/gpu_decode_taper.py   (a CUDA GPU; kdash importable)
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import triton
import triton.language as tl
from kdash.kernels import bench
from kdash.kernels import decode_attention as da
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms
from kdash.kernels.decode_attention import _device_split_len

TAPERS = [0, 40, 80, 120]


@triton.jit
def _cum_tiles(s, n, tiles, TAPER_PM: tl.constexpr):
    """Tiles before split ``s`` of ``n``: weights 1 + TAPER_PM/1000 x (1/2 - s/(n-1))."""
    s64 = s.to(tl.int64)
    m = tl.maximum(n - 1, 1).to(tl.int64)
    num = 2000 * m * s64 + TAPER_PM * (s64 * m - s64 * (s64 - 1))
    return (tiles.to(tl.int64) * num // (2000 * m * n.to(tl.int64))).to(tl.int32)


@triton.jit
def _piece_taper(LENS, b, split, num_splits, split_len_hint, capacity, BLOCK_N: tl.constexpr,
                 DEVICE_PLAN: tl.constexpr, TARGET_VARLEN: tl.constexpr,
                 MIN_SPLIT: tl.constexpr, BLOCK_B: tl.constexpr, MAX_SPLITS: tl.constexpr,
                 MERGE: tl.constexpr, SEARCH: tl.constexpr, TAPER_PM: tl.constexpr):  # fmt: skip
    seq_len = tl.load(LENS + b)
    if DEVICE_PLAN:
        hint = _device_split_len(
            LENS, capacity, TARGET_VARLEN, MIN_SPLIT, BLOCK_N, BLOCK_B, MAX_SPLITS, MERGE, SEARCH
        )
    else:
        hint = split_len_hint
    n = tl.minimum(tl.maximum(tl.cdiv(seq_len, hint), 1), num_splits)
    tiles = tl.cdiv(seq_len, BLOCK_N)
    start = _cum_tiles(split, n, tiles, TAPER_PM) * BLOCK_N
    end = tl.minimum(_cum_tiles(split + 1, n, tiles, TAPER_PM) * BLOCK_N, seq_len)
    end = tl.where(split < n, end, start)
    return seq_len, start, end


def tapered_stage1():
    """The library's stage 1 with its cut replaced, as a JIT function of a temporary module."""
    src = inspect.getsource(getattr(da._decode_stage1, "fn", da._decode_stage1))
    call = "seq_len, start, end = _piece("
    tail = "        SEARCH,\n    )\n    offs_h"
    head = "    SEARCH: tl.constexpr = 1,\n):"
    assert src.count(call) == 1 and src.count(tail) == 1 and src.count(head) == 1, "layout"
    src = src.replace(call, "seq_len, start, end = _piece_taper(")
    src = src.replace(tail, "        SEARCH,\n        TAPER_PM,\n    )\n    offs_h")
    src = src.replace(head, "    SEARCH: tl.constexpr = 1,\n    TAPER_PM: tl.constexpr = 0,\n):")
    text = (
        "import triton\nimport triton.language as tl\n"
        "from kdash.kernels._common import mma, to_bf16\n"
        "from kdash.kernels.decode_attention import _tile_pages\n"
        f"from {__name__} import _piece_taper\n\n" + src
    )
    path = Path(tempfile.mkdtemp(prefix="kdash-taper-")) / "tapered_stage1.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("tapered_stage1", path)
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    return mod._decode_stage1


def main() -> int:
    kern = tapered_stage1()
    res: dict = {"command": "python bench/gpu_decode_taper.py", "tapers_per_mille": TAPERS}
    res["gpu"] = torch.cuda.get_device_name(0)
    res["rows"] = []
    for hq, lens in ((32, [65536]), (64, [65536]), (32, [16384] * 8), (32, [131072])):
        case = bench.DecodeCase(lens, hq, 8, 128, False)
        plan = case.plan(da.DEFAULT_CONFIG, False)
        q, k, v = case.q, case.k, case.v

        def base(plan=plan, q=q, k=k, v=v):
            plan.run(q, k, v)

        base()
        torch.cuda.synchronize()
        want = case.out.float().clone()
        args = (q, k, v, plan.page_table, plan.seq_lens, plan._ks, plan._vs, *plan._rest1)
        row: dict = {"heads": f"{hq}/8/128", "batch": len(lens), "max_len": max(lens)}
        row["splits"] = plan.num_splits
        row["plan"] = {"us_graph": bench_graph_ms(base) * 1e3, "us": bench_ms(base) * 1e3}
        for t in TAPERS:

            def step(t=t, args=args, plan=plan):
                kern[plan._grid1](*args, **plan._meta1, TAPER_PM=t)
                plan._s2(*plan._args2)

            try:
                step()
                torch.cuda.synchronize()
                diff = float((case.out.float() - want).abs().max())
                row[f"taper{t}"] = {"us_graph": bench_graph_ms(step) * 1e3,
                                    "us": bench_ms(step) * 1e3, "max_abs_diff": diff}  # fmt: skip
            except Exception as e:  # noqa: BLE001 - the failure is the finding
                row[f"taper{t}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        row["plan#2"] = {"us_graph": bench_graph_ms(base) * 1e3, "us": bench_ms(base) * 1e3}
        print(json.dumps(row), flush=True)
        res["rows"].append(row)
        torch.cuda.empty_cache()
    dest = Path(os.environ.get("OUT") or ".") / "decode-taper-h200.json"
    dest.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
