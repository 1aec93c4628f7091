"""Where do PC samples go? A factor screen for CUPTI's "non-user kernel" bucket (GPU machine).

Through the agent, 99.4% of a range's samples landed in `nonUsrKernelsTotalSamples` (no PC
records), while kdash's standalone ctypes run and its thread variant saw none. This script
adds the agent's CUPTI uses one at a time to one process, with PC ranges taken the agent's way
(pcsampling.SamplingRanges: its own thread, the primary context pushed, the GIL held) between
them, and records per range: total, non-user and dropped samples, samples per kernel.

The workload, eager on the main thread: one decode step of the demo model (kdash's split-KV
decode + cuBLAS projections) and one prefill; in the last phases a `torch.compile`d block
(inductor's Triton kernels) compiled after CUPTI was attached joins it, and the decode step
replayed from a CUDA graph.

Phases (each: 2 ranges of 200 ms, 300 ms apart):
  p0_plain            nothing else of CUPTI in the process (cupti-python imported only)
  p1_callbacks        cuptiActivityRegisterCallbacks done (no kind ever enabled)
  p2_kernel_window    after a 300 ms CONCURRENT_KERNEL window (its records give each kernel's
                      share of GPU time: `gpu_time_share`)
  p3_api_window       after a 300 ms RUNTIME + DRIVER window
  p4_new_modules      a torch.compile'd block compiled now, run in the loop with the rest
  p5_graph            the decode step replayed from a CUDA graph captured now
  p6_flush_first      as p5, with cuptiActivityFlushAll(1) right before each range
Writes $OUT/pcs-attribution-screen-h200.json. Run: `python bench/gpu_pcs_attribution.py`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import platform
import sys
import threading
import time
import traceback
from collections import defaultdict
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
NAME = "pcs-attribution-screen-h200.json"


def main() -> int:
    faulthandler.enable()
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_pcs_attribution.py", "phases": {}}

    def save() -> None:
        (OUT / NAME).write_text(json.dumps(res, indent=2, default=str) + "\n")

    try:
        run(res, save)
    except Exception as e:  # noqa: BLE001 - keep what was measured
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    save()
    brief = {
        k: [
            {kk: r.get(kk) for kk in ("total_samples", "non_user_samples", "user_share", "top")}
            for r in v.get("ranges", [])
        ]
        for k, v in res["phases"].items()
    }
    print(json.dumps(brief, default=str)[:6000])
    print(json.dumps({k: res.get(k) for k in ("error", "gpu_time_share")}, default=str)[:2000])
    return 0


def run(res: dict, save) -> None:
    import numpy as np
    import torch
    from cupti import cupti
    from kdash.collectors.agent.pcsampling import SamplingRanges
    from kdash.collectors.agent.server import find_libcupti
    from kdash.kernels.decode_attention import decode_attention
    from kdash.kernels.kv_cache import write_kv
    from kdash.kernels.prefill_attention import extend_attention
    from kdash.kernels.workload import Engine, ModelConfig

    dev = "cuda"
    res["machine"] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "CUDA_MODULE_LOADING": os.environ.get("CUDA_MODULE_LOADING", "(unset: lazy)"),
    }
    B, CTX, PAGE = 32, 2048, 16
    eng = Engine(
        ModelConfig(layers=4),
        num_pages=B * CTX // PAGE + 8,
        page_size=PAGE,
        max_running=B,
        max_context=CTX,
        device=dev,
    )
    pt = torch.arange(B * CTX // PAGE, device=dev, dtype=torch.int32).view(B, CTX // PAGE)
    pos = torch.full((B,), CTX - 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), CTX, device=dev, dtype=torch.int32)
    req = torch.arange(B, device=dev)
    tokens = torch.randint(0, eng.cfg.vocab, (B,), device=dev)
    T = 4096
    pq = torch.randn(T, 16, 128, device=dev, dtype=torch.bfloat16)
    pk = torch.randn(T, 4, 128, device=dev, dtype=torch.bfloat16)
    pv = torch.randn(T, 4, 128, device=dev, dtype=torch.bfloat16)
    cu = torch.tensor([0, 2048, 4096], device=dev, dtype=torch.int32)

    def decode() -> torch.Tensor:
        h = eng.embed[tokens]
        for i, lw in enumerate(eng.layers):
            q, k, v = eng._qkv(h, lw)
            write_kv(eng.k_cache[i], eng.v_cache[i], pt, req, pos, k, v, None, None)
            o = decode_attention(
                q.contiguous(),
                eng.k_cache[i],
                eng.v_cache[i],
                pt,
                lens,
                max_seq_len=CTX,
                total_tokens=B * CTX,
            )
            h = h + o.view(B, -1) @ lw["wo"]
            h = eng._mlp(h, lw)
        return h

    extra: list = []  # callables the later phases add to the loop

    cur = {"decode": decode}

    def step() -> None:
        cur["decode"]()
        extend_attention(pq, pk, pv, None, None, None, None, cu, 2048)
        for f in extra:
            f()

    for _ in range(3):
        step()
    torch.cuda.synchronize()

    iters = [0]

    lib_path, why = find_libcupti()
    if lib_path is None:
        cupti.get_timestamp()
        lib_path, why = find_libcupti()
    if lib_path is None:
        raise RuntimeError(f"libcupti not found: {why}")
    res["libcupti"] = lib_path
    ranges = SamplingRanges(lib_path, device=0)
    res["period_log2"] = ranges.sampler.period
    flush_first = [False]

    def take_ranges(label: str, n: int = 2) -> None:
        """n ranges from a second thread while the main thread loops."""
        out = []
        done = threading.Event()

        def sampler_thread() -> None:
            try:
                for _ in range(n):
                    if flush_first[0]:
                        cupti.activity_flush_all(1)
                    cols, stats = ranges.run(0.2)
                    out.append((cols, stats))
                    time.sleep(0.3)
            except Exception as e:  # noqa: BLE001 - recorded in the phase
                out.append((None, {"error": f"{type(e).__name__}: {e}"}))
            finally:
                done.set()

        th = threading.Thread(target=sampler_thread, daemon=True)
        i0, t0 = iters[0], time.perf_counter()
        th.start()
        while not done.is_set():
            step()
            iters[0] += 1
        torch.cuda.synchronize()
        th.join()
        rate = (iters[0] - i0) / (time.perf_counter() - t0)
        phase = {"ranges": [], "loop_rate": round(rate, 2)}
        for cols, stats in out:
            r = dict(stats)
            if cols is not None:
                by_issued = defaultdict(int)
                for k, reason, c in zip(
                    cols["kernel"], cols["stall_reason"], cols["count"], strict=True
                ):
                    if not str(reason).endswith("_not_issued"):
                        by_issued[k] += int(c)
                tot = int(stats.get("total_samples", 0))
                nu = int(stats.get("non_user_samples", 0))
                r["rows"] = len(cols["count"])
                r["samples_in_rows"] = int(np.sum(cols["count"])) if len(cols["count"]) else 0
                r["user_share"] = round(1 - nu / tot, 4) if tot else None
                s = sum(by_issued.values()) or 1
                r["top"] = {
                    k[:70]: round(v / s, 4)
                    for k, v in sorted(by_issued.items(), key=lambda kv: -kv[1])[:8]
                }
            phase["ranges"].append(r)
        res["phases"][label] = phase
        save()
        print(label, json.dumps(phase, default=str)[:800], flush=True)

    take_ranges("p0_plain")

    recs: list = []

    def requested():
        return 8 * 1024 * 1024, 0

    def completed(activities):
        for a in activities:
            if int(a.kind) == int(cupti.ActivityKind.CONCURRENT_KERNEL):
                recs.append((a.name, int(a.end) - int(a.start)))

    cupti.activity_register_callbacks(requested, completed)
    take_ranges("p1_callbacks")

    def window(kinds, seconds: float) -> None:
        for k in kinds:
            cupti.activity_enable(k)
        t_end = time.perf_counter() + seconds
        while time.perf_counter() < t_end:
            step()
        torch.cuda.synchronize()
        for k in kinds:
            cupti.activity_disable(k)
        cupti.activity_flush_all(1)

    window([cupti.ActivityKind.CONCURRENT_KERNEL], 0.3)
    tot = defaultdict(int)
    for name, d in recs:
        tot[name] += d
    s = sum(tot.values()) or 1
    res["gpu_time_share"] = {
        k[:70]: round(v / s, 4) for k, v in sorted(tot.items(), key=lambda kv: -kv[1])[:12]
    }
    res["kernel_records"] = len(recs)
    take_ranges("p2_kernel_window")

    window([cupti.ActivityKind.RUNTIME, cupti.ActivityKind.DRIVER], 0.3)
    take_ranges("p3_api_window")

    try:
        blk = torch.nn.Sequential(
            torch.nn.LayerNorm(2048), torch.nn.Linear(2048, 8192), torch.nn.GELU()
        ).to(dev, torch.bfloat16)
        xin = torch.randn(512, 2048, device=dev, dtype=torch.bfloat16)
        cblk = torch.compile(blk)
        with torch.no_grad():
            for _ in range(3):
                cblk(xin)
        torch.cuda.synchronize()

        def run_block() -> None:
            with torch.no_grad():
                cblk(xin).softmax(-1)

        extra.append(run_block)
        take_ranges("p4_new_modules")
    except Exception as e:  # noqa: BLE001
        res["phases"]["p4_new_modules"] = {"error": f"{type(e).__name__}: {e}"}

    g = torch.cuda.CUDAGraph()
    s_ = torch.cuda.Stream()
    s_.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s_):
        decode()
    torch.cuda.current_stream().wait_stream(s_)
    with torch.cuda.graph(g):
        decode()
    cur["decode"] = g.replay
    take_ranges("p5_graph")
    flush_first[0] = True
    take_ranges("p6_flush_first")
    ranges.close()


if __name__ == "__main__":
    sys.exit(main())
