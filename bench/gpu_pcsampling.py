"""PC sampling on the GPU machine with kdash's own ctypes layer (collectors/agent/pcsampling.py):
does it work, what does a range cost, does it coexist with the Activity API, and where do
kdash's own attention kernels stall? (issue 5; one run, one JSON plus the raw samples.)

Workload, eager on the main thread: one decode step of the demo model (8 layers, batch 32 at
2k context: kdash's split-KV decode attention plus cuBLAS projections) and one causal prefill
of 2 x 2048 new tokens through kdash's extend attention (16/4 heads, D=128), in a loop.

Phases (rates are loop iterations/s):
1. `baseline`: 3 s, nothing on.
2. `sampling`: PC sampling enabled on the context (timed), then 3 cycles of a 200 ms range
   (device synchronised, Start, the loop, synchronised, Stop and read) and 800 ms without:
   rows and totals per range, the CPU time of Stop + reads, and the rate over the phase.
3. `with_activity`: CONCURRENT_KERNEL activity on (cupti-python, a callback that counts
   records), then 2 more cycles: do kernel records still arrive during a range, do samples?
4. `after`: 3 s with everything off again (PC sampling disabled).

Writes $OUT/pcsampling-h200.json (figures, hot lines of the sampled kernels mapped through
their Triton cubins with kdash.cubin) and $OUT/pcsamples-h200.json.gz (the rows, for tests)
and copies the sampled kernels' cubins to $OUT/cubins/.
Run: `python bench/gpu_pcsampling.py` from the repository root with kdash importable.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")


def main() -> int:
    faulthandler.enable()
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {"command": "python bench/gpu_pcsampling.py", "phases": {}}

    def save() -> None:
        (OUT / "pcsampling-h200.json").write_text(json.dumps(res, indent=2, default=str) + "\n")

    try:
        run(res, save)
    except Exception as e:  # noqa: BLE001 - keep what was measured
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()[-3000:]
    save()
    print(json.dumps({k: v for k, v in res.items() if k != "hot_lines"}, default=str)[:3000])
    return 0


def run(res: dict, save) -> None:
    import pandas as pd
    import torch
    from cupti import cupti
    from kdash.collectors.agent.pcsampling import PCSampler
    from kdash.collectors.agent.server import find_libcupti
    from kdash.kernels.decode_attention import decode_attention
    from kdash.kernels.kv_cache import write_kv
    from kdash.kernels.prefill_attention import extend_attention
    from kdash.kernels.workload import Engine, ModelConfig

    from kdash import cubin

    dev = "cuda"
    res["machine"] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }
    B, CTX, PAGE = 32, 2048, 16
    eng = Engine(
        ModelConfig(layers=8),
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

    def step() -> None:
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
        extend_attention(pq, pk, pv, None, None, None, None, cu, 2048)

    def loop_for(seconds: float) -> tuple[int, float]:
        n = 0
        t0 = time.perf_counter()
        end = t0 + seconds
        while time.perf_counter() < end:
            step()
            n += 1
        torch.cuda.synchronize()
        return n, time.perf_counter() - t0

    for _ in range(5):
        step()
    torch.cuda.synchronize()
    n, dt = loop_for(3.0)
    res["phases"]["baseline"] = {"iters": n, "seconds": round(dt, 3), "rate": n / dt}
    save()

    # CUDA context and libcupti (the one cupti-python loaded)
    cupti.get_timestamp()
    lib_path, why = find_libcupti()
    if lib_path is None:
        raise RuntimeError(f"libcupti not found: {why}")
    lib = ctypes.CDLL(lib_path)
    libcuda = ctypes.CDLL("libcuda.so.1")
    ctx = ctypes.c_void_p()
    rc = libcuda.cuCtxGetCurrent(ctypes.byref(ctx))
    res["context"] = {"rc": int(rc), "ctx": hex(ctx.value or 0), "libcupti": lib_path}
    sampler = PCSampler(lib, int(ctx.value or 0), period=11)
    t0 = time.perf_counter()
    sampler.enable()
    res["enable_ms"] = round((time.perf_counter() - t0) * 1e3, 2)
    res["stall_reasons"] = len(sampler.reason_names)
    all_rows: list[dict] = []

    def cycles(label: str, k: int) -> dict:
        ranges = []
        it_total, t_phase = 0, time.perf_counter()
        for c in range(k):
            torch.cuda.synchronize()
            t_s = time.perf_counter()
            sampler.start()
            start_ms = (time.perf_counter() - t_s) * 1e3
            n_in, dt_in = loop_for(0.2)
            torch.cuda.synchronize()
            w0, c0 = time.perf_counter(), time.thread_time()
            rows, stats = sampler.stop()
            stop_wall = (time.perf_counter() - w0) * 1e3
            stop_cpu = (time.thread_time() - c0) * 1e3
            t_ns = time.monotonic_ns()
            for r in rows:
                r["t_ns"] = t_ns
                r["phase"] = label
            all_rows.extend(rows)
            n_off, dt_off = loop_for(0.8)
            it_total += n_in + n_off
            ranges.append(
                {
                    "start_ms": round(start_ms, 2),
                    "stop_wall_ms": round(stop_wall, 2),
                    "stop_cpu_ms": round(stop_cpu, 2),
                    "rows": len(rows),
                    "samples_in_rows": sum(r["count"] for r in rows),
                    "kernels": sorted({r["kernel"] for r in rows})[:20],
                    "stats": stats,
                    "rate_in_range": n_in / dt_in,
                    "rate_off": n_off / dt_off,
                }
            )
            print(label, c, json.dumps(ranges[-1], default=str)[:400], flush=True)
        dt = time.perf_counter() - t_phase
        return {"ranges": ranges, "rate": it_total / dt}

    res["phases"]["sampling"] = cycles("sampling", 3)
    save()

    counted = {"records": 0, "buffers": 0}

    def requested():
        return 8 * 1024 * 1024, 0

    def completed(activities):
        counted["buffers"] += 1
        counted["records"] += len(activities)

    try:
        cupti.activity_register_callbacks(requested, completed)
        cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
        res["phases"]["with_activity"] = cycles("with_activity", 2)
        cupti.activity_flush_all(1)
        cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
        cupti.activity_flush_all(1)
        res["phases"]["with_activity"]["kernel_records"] = dict(counted)
    except Exception as e:  # noqa: BLE001
        res["phases"]["with_activity"] = {
            "error": f"{type(e).__name__}: {e}",
            "traceback": traceback.format_exc()[-1500:],
        }
    save()
    sampler.disable()
    n, dt = loop_for(3.0)
    res["phases"]["after"] = {"iters": n, "seconds": round(dt, 3), "rate": n / dt}
    base = res["phases"]["baseline"]["rate"]
    res["rate_vs_baseline_pct"] = {
        k: round(100 * (v["rate"] - base) / base, 2)
        for k, v in res["phases"].items()
        if isinstance(v, dict) and "rate" in v and k != "baseline"
    }
    save()

    # the samples, and the hot lines of the sampled Triton kernels
    df = pd.DataFrame(all_rows)
    if df.empty:
        res["hot_lines"] = []
        return
    df["cubin_crc"] = [cubin.crc_to_i8(c) for c in df["cubin_crc"]]
    import gzip

    with gzip.open(OUT / "pcsamples-h200.json.gz", "wt") as f:
        json.dump(df.to_dict(orient="list"), f)
    names = set(df["kernel"])
    res["sampled_kernels"] = (
        df.groupby("kernel")["count"].sum().sort_values(ascending=False).head(30).to_dict()
    )
    tables = cubin.line_tables_from_triton_cache(names)
    crcs = {int(c) & 0xFFFFFFFFFFFFFFFF for c in df["cubin_crc"]}
    keep = [lt for lt in tables if lt.crc in crcs] or tables
    res["line_tables"] = [
        {"functions": lt.functions, "crc": lt.crc, "has_lines": lt.has_lines, "why": lt.why}
        for lt in keep
    ]
    (OUT / "cubins").mkdir(exist_ok=True)
    for c in cubin.triton_cached_cubins(names):
        data = Path(c.path).read_bytes()
        crc, _ = cubin.cubin_crc(data, lib_path)
        if crc in crcs:
            shutil.copy(c.path, OUT / "cubins" / f"{c.name}-{crc:016x}.cubin")
    sl = pd.concat([pd.DataFrame(cubin.to_rows(lt)) for lt in keep]) if keep else None
    res["hot_lines"] = cubin.hot_lines_by_kernel(df, sl, per_kernel=8)


if __name__ == "__main__":
    sys.exit(main())
