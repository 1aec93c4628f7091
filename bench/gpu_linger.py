"""What slows a target down after kdash has switched every activity kind off? (GPU machine)

bench/gpu_agent_cost.py saw an eager loop stay ~17% slower after a segment with RUNTIME API
records (narrowed to launch/sync calls) than after one with kernel records only (-2.6%). Here,
with plain cupti-python in one eager loop (torch matmul + a Triton kernel + a sync), each step
is timed for 2 s once it is over:

1. `before`; 2. CONCURRENT_KERNEL on then off; 3. RUNTIME on then off (no per-API calls);
4. RUNTIME on with every non-launch API switched off one by one
   (cuptiActivityEnableRuntimeApi(cbid, 0)), then the kind off, then nothing restored;
5. the same API switches put back to 1 (what kdash's detach does).
Writes $OUT/linger-h200.json. Run: `python bench/gpu_linger.py`.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from cupti import cupti

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")


@triton.jit
def axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = alpha * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
    tl.store(out_ptr + offs, v, mask=m)


def main() -> int:
    dev = "cuda"
    a = torch.randn(1024, 1024, device=dev)
    b = torch.randn(1024, 1024, device=dev)
    x = torch.randn(1 << 16, device=dev)
    y = torch.randn(1 << 16, device=dev)
    out = torch.empty_like(x)
    n = x.numel()

    def rate(seconds: float = 2.0) -> float:
        k = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            a @ b
            axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)
            torch.cuda.synchronize()
            k += 1
        return k / (time.perf_counter() - t0)

    rate(1.0)
    res: dict = {"command": "python bench/gpu_linger.py", "rates": {}}
    r = res["rates"]
    r["before"] = rate()
    cupti.activity_register_callbacks(lambda: (8 << 20, 0), lambda acts: None)
    ck, rt = cupti.ActivityKind.CONCURRENT_KERNEL, cupti.ActivityKind.RUNTIME
    cupti.activity_enable(ck)
    r["kernels_on"] = rate()
    cupti.activity_disable(ck)
    cupti.activity_flush_all(1)
    r["after_kernels"] = rate()
    cupti.activity_enable(rt)
    r["runtime_on"] = rate()
    cupti.activity_disable(rt)
    cupti.activity_flush_all(1)
    r["after_runtime"] = rate()
    keep = re.compile(r"Launch|Synchroniz|Memcpy|Memset|StreamWaitEvent|EventRecord")
    members = cupti.runtime_api_trace_cbid.__members__
    cbids = [
        int(v)
        for k, v in members.items()
        if k not in ("INVALID", "SIZE", "FORCE_INT") and not keep.search(k)
    ]
    res["cbids_switched"] = len(cbids)
    cupti.activity_enable(rt)
    fails = 0
    t0 = time.perf_counter()
    for c in cbids:
        try:
            cupti.activity_enable_runtime_api(c, 0)
        except Exception:  # noqa: BLE001 - counted
            fails += 1
    res["narrow_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    res["narrow_failures"] = fails
    r["runtime_narrowed_on"] = rate()
    cupti.activity_disable(rt)
    cupti.activity_flush_all(1)
    r["after_runtime_narrowed"] = rate()
    restore_fail = 0
    for c in cbids:
        try:
            cupti.activity_enable_runtime_api(c, 1)
        except Exception:  # noqa: BLE001 - counted
            restore_fail += 1
    res["restore_failures"] = restore_fail
    r["after_restore_to_1"] = rate()
    r["before_again_check"] = rate()
    base = r["before"]
    res["vs_before_pct"] = {k: round(100 * (v - base) / base, 2) for k, v in r.items()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "linger-h200.json").write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res["vs_before_pct"]), res["narrow_ms"], res["narrow_failures"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
