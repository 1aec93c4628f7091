"""Which CUDA graphs does CUPTI kernel activity slow down, and by how much? (GPU machine)

bench/gpu_agent_cost.py saw a graph-replayed decode step of the demo model go from 772 to 11
steps/s with kernel activity on, while a graph of 50 tiny Triton kernels only halved. This
script takes kdash's agent out of the picture: plain cupti-python in one process, a Python
buffer callback that only counts records, and one graph per kind of node:

* `tiny`: 50 one-block-row Triton axpy kernels;  * `matmul`: 20 bf16 cuBLAS matmuls
  (32x2048 @ 2048x6144);  * `attn`: 8 calls of kdash's split-KV decode attention (B=32, 2k
  context, 16/4 heads, D=128);  * `elementwise`: 8 RMSNorms in torch ops;
* `decode1`, `decode8`: the demo model's decode step with 1 and 8 layers.

Per graph: milliseconds per replay+synchronize (median) with activity off, with
CONCURRENT_KERNEL on, and off again; and the kernels per replay. (GRAPH_TRACE, one record per
graph launch, is not tried: enabling it in a live process after kernel activity segfaulted the
first replay, H200, CUPTI 13.0.) Writes $OUT/graph-cupti-h200.json.
Run: `python bench/gpu_graph_cupti.py` from the repository root, kdash and cupti-python importable.
"""

from __future__ import annotations

import faulthandler
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from cupti import cupti

OUT = Path(os.environ.get("OUT") or Path(__file__).resolve().parent / "results")
counted = {"records": 0, "kernels": 0, "graph": 0}


def _requested():
    return 8 * 1024 * 1024, 0


def _completed(activities):
    counted["records"] += len(activities)
    for a in activities:
        k = int(a.kind)
        if k == int(cupti.ActivityKind.CONCURRENT_KERNEL):
            counted["kernels"] += 1
        elif k == int(cupti.ActivityKind.GRAPH_TRACE):
            counted["graph"] += 1


@triton.jit
def axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = alpha * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
    tl.store(out_ptr + offs, v, mask=m)


def build_bodies():
    from kdash.kernels.decode_attention import decode_attention
    from kdash.kernels.kv_cache import write_kv
    from kdash.kernels.workload import Engine, ModelConfig

    dev = "cuda"
    x = torch.randn(1 << 16, device=dev)
    y = torch.randn(1 << 16, device=dev)
    out = torch.empty_like(x)
    n = x.numel()
    a = torch.randn(32, 2048, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2048, 6144, device=dev, dtype=torch.bfloat16)
    B, CTX, PAGE = 32, 2048, 16
    engines = {}
    for layers in (1, 8):
        engines[layers] = Engine(
            ModelConfig(layers=layers),
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
    eng1 = engines[1]
    q = torch.randn(B, 16, 128, device=dev, dtype=torch.bfloat16)
    h0 = torch.randn(B, 2048, device=dev, dtype=torch.bfloat16)

    def tiny():
        for _ in range(50):
            axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)

    def matmul():
        for _ in range(20):
            a @ w

    def attn():
        for _ in range(8):
            decode_attention(
                q,
                eng1.k_cache[0],
                eng1.v_cache[0],
                pt,
                lens,
                max_seq_len=CTX,
                total_tokens=B * CTX,
            )

    def elementwise():
        for _ in range(8):
            eng1._rms(h0, eng1.layers[0]["n1"])

    def decode(eng):
        tokens = torch.randint(0, eng.cfg.vocab, (B,), device=dev)

        def body():
            h = eng.embed[tokens]
            for i, lw in enumerate(eng.layers):
                qq, k, v = eng._qkv(h, lw)
                write_kv(eng.k_cache[i], eng.v_cache[i], pt, req, pos, k, v, None, None)
                o = decode_attention(
                    qq.contiguous(),
                    eng.k_cache[i],
                    eng.v_cache[i],
                    pt,
                    lens,
                    max_seq_len=CTX,
                    total_tokens=B * CTX,
                )
                h = h + o.view(B, -1) @ lw["wo"]
                h = eng._mlp(h, lw)
            return (eng._rms(h, 1.0) @ eng.embed.T).argmax(-1)

        return body

    return {
        "tiny": tiny,
        "matmul": matmul,
        "attn": attn,
        "elementwise": elementwise,
        "decode1": decode(engines[1]),
        "decode8": decode(engines[8]),
    }


def capture(body):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def time_replays(g, max_reps=40, max_s=2.5, mean: bool = False) -> float:
    """ms per replay+synchronize: median, or mean (stalls included) with `mean`."""
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    ts = []
    end = time.monotonic() + max_s
    while len(ts) < max_reps and time.monotonic() < end:
        t0 = time.perf_counter()
        g.replay()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return round((statistics.fmean(ts) if mean else statistics.median(ts)) * 1e3, 4)


def main() -> int:
    faulthandler.enable()
    OUT.mkdir(parents=True, exist_ok=True)
    res: dict = {
        "command": "python bench/gpu_graph_cupti.py",
        "machine": {
            "gpu": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "python": platform.python_version(),
        },
        "graphs": {},
    }
    bodies = build_bodies()  # CUDA is initialised before CUPTI is touched, as in a target
    torch.cuda.synchronize()
    cupti.activity_register_callbacks(_requested, _completed)
    ck = cupti.ActivityKind.CONCURRENT_KERNEL
    graphs = {}
    for name, body in bodies.items():
        g = capture(body)
        r: dict = {"off_ms": time_replays(g)}
        counted.update(records=0, kernels=0, graph=0)
        cupti.activity_enable(ck)
        r["kernel_activity_ms"] = time_replays(g)
        g.replay()
        torch.cuda.synchronize()
        cupti.activity_flush_all(1)
        counted.update(records=0, kernels=0, graph=0)
        g.replay()
        torch.cuda.synchronize()
        cupti.activity_flush_all(1)
        r["kernels_per_replay"] = counted["kernels"]
        cupti.activity_disable(ck)
        cupti.activity_flush_all(1)
        r["off_again_ms"] = time_replays(g)
        r["slowdown_x"] = round(r["kernel_activity_ms"] / r["off_ms"], 2)
        r["added_us_per_kernel"] = (
            round((r["kernel_activity_ms"] - r["off_ms"]) * 1e3 / r["kernels_per_replay"], 3)
            if r["kernels_per_replay"]
            else None
        )
        res["graphs"][name] = r
        print(name, json.dumps(r), flush=True)
        (OUT / "graph-cupti-h200.json").write_text(json.dumps(res, indent=2) + "\n")
        if name in ("tiny", "decode8"):
            graphs[name] = g
    # The agent's pattern: a second thread flushing while the target replays
    res["flush_variants"] = {}
    for name, g in graphs.items():
        v: dict = {"off_ms": time_replays(g, 100000, 3.0, mean=True)}
        cupti.activity_enable(ck)
        v["on_no_flush_ms"] = time_replays(g, 100000, 3.0, mean=True)
        for label, flag, every in (("flush0_every_200ms", 0, 0.2), ("forced_every_1s", 1, 1.0)):
            v[label + "_ms"], v[label + "_call_ms"] = with_flusher(g, flag, every)
        cupti.activity_flush_period(200)
        v["cupti_flush_period_200ms_ms"] = time_replays(g, 100000, 3.0, mean=True)
        cupti.activity_flush_period(0)
        cupti.activity_disable(ck)
        cupti.activity_flush_all(1)
        res["flush_variants"][name] = v
        print(name, "flush", json.dumps(v), flush=True)
        (OUT / "graph-cupti-h200.json").write_text(json.dumps(res, indent=2) + "\n")
    return 0


def with_flusher(g, flag: int, every: float) -> tuple[float, dict]:
    """Replay timing while another thread calls cuptiActivityFlushAll(flag) every `every` s;
    and how long those calls took (median, max ms)."""
    import threading

    stop = threading.Event()
    calls: list[float] = []

    def loop() -> None:
        while not stop.wait(every):
            t0 = time.perf_counter()
            cupti.activity_flush_all(flag)
            calls.append((time.perf_counter() - t0) * 1e3)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    ms = time_replays(g, max_reps=100000, max_s=3.0, mean=True)
    stop.set()
    t.join()
    took = {
        "n": len(calls),
        "median": round(statistics.median(calls), 3) if calls else None,
        "max": round(max(calls), 3) if calls else None,
    }
    return ms, took


if __name__ == "__main__":
    sys.exit(main())
