"""Which modules does CUPTI's PC sampling attribute? Variants in fresh processes (GPU machine).

bench/results/pcs-attribution-screen-h200.json: in a process where CUPTI was first touched by
PC sampling after the workload's modules were loaded, every sample was attributed, through
activity callbacks and windows; a `torch.compile`d block compiled afterwards (new modules) put
7% of the samples in the non-user bucket. Through the agent started by `kdash run` (CUPTI
attached before CUDA was initialised) 100% went there. Variants, one process each:

  late          modules loaded, then PC ranges (control), then a new module, ranges again
  early_cupti   activity callbacks registered before CUDA is initialised, then as `late`
  early_pc      one PC enable/disable right after the context exists, callbacks registered,
                then as `late`
  finalize      as `early_cupti`, then cuptiFinalize (no activity kind ever on), ranges
                (CUPTI starts again with the first enable), a new module, ranges
  enabled_load  as `late`, but PC sampling enabled (not started) while the new module loads
  finalize_after as `late`, then cuptiFinalize after the new module was lost, ranges again

Each range: 200 ms on the main thread (Start, the loop, synchronise, Stop), totals and the
attributed share of the named kernels. Writes $OUT/pcs-modules-h200.json.
Run: `python gpu_pcs_modules.py` (the driver) from bench/ with kdash installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
VARIANTS = ("late", "early_cupti", "early_pc", "finalize", "enabled_load", "finalize_after")


def child(variant: str) -> dict:
    import ctypes

    res: dict = {"variant": variant, "ranges": []}
    from cupti import cupti

    def requested():
        return 8 * 1024 * 1024, 0

    def completed(_activities):
        pass

    if variant in ("early_cupti", "finalize"):
        cupti.activity_register_callbacks(requested, completed)
    import torch

    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    from kdash.collectors.agent.pcsampling import PCSampler
    from kdash.collectors.agent.server import find_libcupti

    cupti.get_timestamp()
    lib_path, why = find_libcupti()
    if lib_path is None:
        raise RuntimeError(why)
    lib = ctypes.PyDLL(lib_path)
    libcuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    libcuda.cuCtxGetCurrent(ctypes.byref(ctx))
    sampler = PCSampler(lib, int(ctx.value or 0), period=13)
    if variant == "early_pc":
        sampler.enable()
        sampler.disable()
        cupti.activity_register_callbacks(requested, completed)

    from kdash.kernels.decode_attention import decode_attention
    from kdash.kernels.prefill_attention import extend_attention

    B, CTX, PAGE, H, KV, D = 32, 2048, 16, 16, 4, 128
    kc = torch.randn(B * CTX // PAGE, PAGE, KV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    pt = torch.arange(B * CTX // PAGE, device="cuda", dtype=torch.int32).view(B, CTX // PAGE)
    lens = torch.full((B,), CTX, device="cuda", dtype=torch.int32)
    q = torch.randn(B, H, D, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(H * D, 4096, device="cuda", dtype=torch.bfloat16)
    T = 4096
    pq = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    pk = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16)
    pv = torch.randn(T, KV, D, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, 2048, 4096], device="cuda", dtype=torch.int32)
    extra: list = []

    def step() -> None:
        o = decode_attention(q, kc, vc, pt, lens, max_seq_len=CTX, total_tokens=B * CTX)
        _ = o.view(B, -1) @ w
        extend_attention(pq, pk, pv, None, None, None, None, cu, 2048)
        for f in extra:
            f()

    for _ in range(3):
        step()
    torch.cuda.synchronize()

    def one_range(label: str, enable: bool = True) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if enable:
            sampler.enable()
        t_en = time.perf_counter() - t0
        sampler.start()
        end = time.perf_counter() + 0.2
        while time.perf_counter() < end:
            step()
        torch.cuda.synchronize()
        cols, stats = sampler.stop_columns()
        if enable:
            sampler.disable()
        by = defaultdict(int)
        for k, r, c in zip(cols["kernel"], cols["stall_reason"], cols["count"], strict=True):
            if not str(r).endswith("_not_issued"):
                by[str(k)] += int(c)
        s = sum(by.values()) or 1
        tot, nu = int(stats["total_samples"]), int(stats["non_user_samples"])
        res["ranges"].append(
            {
                "label": label,
                "total_samples": tot,
                "non_user_samples": nu,
                "non_user_share": round(nu / tot, 4) if tot else None,
                "enable_ms": round(t_en * 1e3, 1),
                "top": {
                    k[:60]: round(v / s, 4)
                    for k, v in sorted(by.items(), key=lambda kv: -kv[1])[:6]
                },
            }
        )

    def new_module() -> None:
        blk = torch.nn.Sequential(
            torch.nn.LayerNorm(2048), torch.nn.Linear(2048, 8192), torch.nn.GELU()
        ).to("cuda", torch.bfloat16)
        x = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
        cblk = torch.compile(blk)
        with torch.no_grad():
            for _ in range(2):
                cblk(x)
        torch.cuda.synchronize()

        def run_block() -> None:
            with torch.no_grad():
                cblk(x)

        extra.append(run_block)

    if variant == "finalize":
        one_range("before_finalize")
        torch.cuda.synchronize()
        res["finalize_rc"] = int(lib.cuptiFinalize())  # no kind was ever on: safe here
    one_range("old_modules")
    one_range("old_modules_again")
    if variant == "enabled_load":
        sampler.enable()
        new_module()
        one_range("new_module_loaded_while_enabled", enable=False)
        sampler.disable()
        one_range("new_module_next_enable")
    else:
        new_module()
        one_range("new_module")
        one_range("new_module_again")
    if variant == "finalize_after":  # the lost module, after a fresh CUPTI
        torch.cuda.synchronize()
        res["finalize_rc"] = int(lib.cuptiFinalize())
        one_range("after_finalize")
        one_range("after_finalize_again")
    return res


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        try:
            r = child(sys.argv[2])
        except Exception as e:  # noqa: BLE001 - reported to the driver
            r = {"variant": sys.argv[2], "error": f"{type(e).__name__}: {e}"}
            r["traceback"] = traceback.format_exc()[-2000:]
        print("RESULT " + json.dumps(r, default=str), flush=True)
        return 0
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_pcs_modules.py", "variants": {}}
    for v in sys.argv[1:] or VARIANTS:
        try:
            p = subprocess.run(
                [sys.executable, __file__, "--child", v],
                capture_output=True,
                text=True,
                timeout=150,
            )
            line = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
            res["variants"][v] = (
                json.loads(line[-1][7:])
                if line
                else {"rc": p.returncode, "stderr": p.stderr[-1500:]}
            )
        except subprocess.TimeoutExpired:
            res["variants"][v] = {"error": "timed out (150 s)"}
        (OUT / "pcs-modules-h200.json").write_text(json.dumps(res, indent=2) + "\n")
        r = res["variants"][v]
        print(v, [(x["label"], x["non_user_share"]) for x in r.get("ranges", [])], r.get("error"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
