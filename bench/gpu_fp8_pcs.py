"""kdash's own PC sampling on the fp8 decode stage 1, K converted (``cvt``, the default) and K to
the fp8 tensor cores (``kmma``): where in the source each spends its samples (GPU machine).

For each conversion a target process runs one fp8 plan at 1 x 64k, 32/8/128 (the shape that
sets ``fp8_speedup``) in a loop; ``kdash attach --pid P --headless --pc-sampling --duration 8``
records it and ``kdash report --json`` gives the hot lines and top kernels. Writes
$OUT/fp8-cvt-pcs.kdash, $OUT/fp8-kmma-pcs.kdash and $OUT/fp8-pcs.json.
Run from bench/ with kdash installed: ``python gpu_fp8_pcs.py`` (the targets:
``python gpu_fp8_pcs.py --target cvt|kmma``).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import replace

from gpu_pcs_record import OUT, record, start, stop


def target(mode: str, seconds: float = 120.0) -> int:
    import torch
    from kdash.kernels.bench import DecodeCase
    from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG

    case = DecodeCase([65536], 32, 8, 128, True)
    plan = case.plan(replace(DEFAULT_FP8_CONFIG, fp8_compute=mode))
    q, k, v = case.q, case.k, case.v
    plan.run(q, k, v)
    torch.cuda.synchronize()
    print("ready", flush=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for _ in range(50):
            plan.run(q, k, v)
        torch.cuda.synchronize()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["--target"]:
        return target(sys.argv[2])
    res: dict = {"command": "python bench/gpu_fp8_pcs.py", "shape": "1 x 65536, 32/8/128, fp8"}
    for mode in ("cvt", "kmma"):
        t = start([sys.executable, __file__, "--target", mode], "ready", 2)
        try:
            record(res, f"fp8-{mode}-pcs", t, hot=12)
        finally:
            stop(t)
        print(json.dumps({mode: res[f"fp8-{mode}-pcs"]})[:2000], flush=True)
        (OUT / "fp8-pcs.json").write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
