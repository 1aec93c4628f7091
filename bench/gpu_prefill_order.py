"""Does a prefill contender's do_bench time depend on what ran just before it? At a few of the
kernel bench's prefill shapes, ours (the default path), SDPA-FLASH and SDPA-cuDNN are timed in
every one of the six orders, ``--cycles`` times over, each ``do_bench(rep=40)`` as the bench's
rounds take them (kernels/bench_timing.py). Each figure is kept with its position and the
contender before it (the one timed last in the previous order, for the first). The bench times
them in one fixed order (ours, FLASH, cuDNN), so cuDNN always follows FLASH and ours follows
cuDNN; a figure that moves with its predecessor says that order biases the bench's ratios.

Use: ``python bench/gpu_prefill_order.py --out prefill-order.json``; without a GPU it says so
and exits 2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--cycles", type=int, default=2)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(
            "gpu_prefill_order: no CUDA GPU here (this script times kernels on one)",
            file=sys.stderr,
        )
        return 2
    from kdash.kernels.bench import PrefillCase
    from kdash.kernels.bench_timing import bench_ms
    from torch.nn.attention import SDPBackend

    shapes = [(16, 16, 128, False, 4096), (16, 16, 128, True, 4096), (32, 8, 128, False, 8192)]
    result = {"command": "python " + " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
              "rows": []}  # fmt: skip
    t0 = time.time()
    for hq, hkv, d, causal, s in shapes:
        case = PrefillCase(s, hq, hkv, d, causal)
        fns = {
            "ours": case.ours(None),
            "flash": case.sdpa(SDPBackend.FLASH_ATTENTION),
            "cudnn": case.sdpa(SDPBackend.CUDNN_ATTENTION),
        }
        for fn in fns.values():  # compile and warm every contender first
            bench_ms(fn, rep=10)
        last = None
        for cycle in range(args.cycles):
            for order in itertools.permutations(fns):
                for pos, name in enumerate(order):
                    ms = bench_ms(fns[name], rep=40)
                    result["rows"].append({
                        "shape": f"{hq}/{hkv}/{d} {'causal' if causal else 'full'} {s}",
                        "cycle": cycle, "order": list(order), "position": pos,
                        "contender": name, "after": last, "us": ms * 1e3,
                    })  # fmt: skip
                    last = name
        del case
        torch.cuda.empty_cache()
        args.out.write_text(json.dumps(result, indent=1))
    result["seconds"] = round(time.time() - t0, 1)
    by: dict[tuple, list[float]] = {}
    for r in result["rows"]:
        by.setdefault((r["shape"], r["contender"], r["after"]), []).append(r["us"])
    summary = []
    for (shape, name, after), us in sorted(by.items(), key=lambda kv: str(kv[0])):
        us.sort()
        mid = us[len(us) // 2]
        summary.append({"shape": shape, "contender": name, "after": after, "n": len(us),
                        "median_us": mid, "min_us": us[0]})  # fmt: skip
        print(f"{shape:24s} {name:6s} after {after!s:6s} n={len(us):2d} median {mid:7.1f}")
    result["summary"] = summary
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
