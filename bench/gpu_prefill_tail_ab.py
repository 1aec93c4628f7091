"""The Gluon prefill with and without its split tail (kernels/prefill_gluon_tail.py), and SDPA's
cuDNN backend, timed call by call in turns; then where a split launch's time goes.

The bench's rounds (three do_bench runs a contender) moved 5-10% from round to round on an H100
at 700 W, more than the split can take. Here every iteration flushes L2 as do_bench does (a
256 MiB zero) and times one call of each contender between CUDA events, the contenders' order
turning each iteration, so clock states fall on all of them alike; the medians and quartiles
are kept. Then torch.profiler over a few calls of the split launch: each kernel's mean length
and the gap from the persistent kernel's end to the tail kernel's start.

``python bench/gpu_prefill_tail_ab.py [--iters N] [--out FILE.json]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from kdash.kernels import prefill_gluon as pg
from kdash.kernels._common import sm_count
from kdash.kernels.bench import PrefillCase

# (query heads, KV heads, S): 16k tokens a launch, as the bench's prefill table
SHAPES = [(16, 16, 4096), (16, 16, 8192), (16, 16, 16384), (32, 8, 8192), (4, 4, 16384),
          (16, 16, 2048)]  # fmt: skip


def timed_in_turns(fns: dict[str, Any], iters: int) -> dict[str, list[float]]:
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")
    names = list(fns)
    for fn in fns.values():  # compile and warm
        for _ in range(3):
            fn()
    got: dict[str, list[float]] = {n: [] for n in names}
    pairs = []
    for i in range(iters):
        order = names[i % len(names) :] + names[: i % len(names)]
        for n in order:
            flush.zero_()
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fns[n]()
            b.record()
            pairs.append((n, a, b))
    torch.cuda.synchronize()
    for n, a, b in pairs:
        got[n].append(a.elapsed_time(b) * 1e3)
    return got


def stats(us: list[float]) -> dict[str, float]:
    q = statistics.quantiles(us, n=4)
    return {"median": statistics.median(us), "q1": q[0], "q3": q[2], "min": min(us)}


def kernel_breakdown(fn, calls: int = 8) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [
        e
        for e in prof.events()
        if e.device_type.name == "CUDA" and "prefill" in e.name and e.time_range.elapsed_us() > 0
    ]
    events.sort(key=lambda e: e.time_range.start)
    by: dict[str, list[float]] = {}
    gaps = []
    for i, e in enumerate(events):
        name = "tail" if "tail" in e.name else "whole"
        by.setdefault(name, []).append(e.time_range.elapsed_us())
        if name == "tail" and i and "tail" not in events[i - 1].name:
            gaps.append(e.time_range.start - events[i - 1].time_range.end)
    out: dict[str, Any] = {f"{k}_us": statistics.median(v) for k, v in by.items()}
    if gaps:
        out["gap_us"] = statistics.median(gaps)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--out", type=Path, default=Path("prefill-tail-ab.json"))
    args = ap.parse_args()
    from torch.nn.attention import SDPBackend

    t0 = time.time()
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(0),
        "sms": sm_count(0),
        "rows": [],
    }
    split, whole = pg.GluonConfig(), pg.GluonConfig(split_tail=False)
    for hq, hkv, s in SHAPES:
        case = PrefillCase(s, hq, hkv, 128, False)
        tiles = case.batch * hq * s // (2 * split.block_m)
        plan = pg.split_plan(split, tiles, min(tiles, sm_count(0)), case.batch, case.q.shape[0],
                             s, False)  # fmt: skip

        def run(cfg, case=case, s=s):
            return lambda: pg.prefill_gluon(
                case.q, case.k, case.v, case.cu, s, causal=False, config=cfg, out=case.out
            )

        fns = {"split": run(split), "whole": run(whole),
               "cudnn": case.sdpa(SDPBackend.CUDNN_ATTENTION)}  # fmt: skip
        got = timed_in_turns(fns, args.iters)
        row: dict[str, Any] = {"heads": f"{hq}/{hkv}/128", "seq": s, "batch": case.batch,
                               "tiles": tiles, "plan": plan.__dict__ if plan else None}  # fmt: skip
        row |= {k: stats(v) for k, v in got.items()}
        row["whole_over_split"] = row["whole"]["median"] / row["split"]["median"]
        row["cudnn_over_split"] = row["cudnn"]["median"] / row["split"]["median"]
        row["cudnn_over_whole"] = row["cudnn"]["median"] / row["whole"]["median"]
        if plan:
            row["kernels"] = kernel_breakdown(fns["split"])
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
        result["seconds"] = round(time.time() - t0, 1)
        args.out.write_text(json.dumps(result, indent=1))
        del case, fns
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
