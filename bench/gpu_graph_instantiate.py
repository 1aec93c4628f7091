"""Does CUPTI record the kernels of a CUDA graph made while CUPTI was attached but kernel
activity was off? (GPU machine; one fresh process per variant.)

`kdash demo` with graph-replayed decode and `--graph-kernels` showed no graph kernels at all:
its graphs are captured while the agent's duty cycle has kernel activity off between windows.
Plain cupti-python, a Triton graph of 10 axpy kernels, 20 replays with kernel activity on:

* `before`: graph made before any CUPTI call;
* `registered`: buffer callbacks registered (CUPTI initialised), no kind ever on, then the graph;
* `off_after_on`: kernel activity on (one eager kernel), off, then the graph;
* `on_during`: the graph made while kernel activity is on;
* `off_then_finalize`: as `off_after_on`, then cuptiFinalize and callbacks registered again;
* `off_then_new_graph`: as `off_after_on`, then the same body captured again while on.

Prints kernels recorded per variant (expected 200 graph kernels + 1 eager marker kernel) as
JSON, also to $OUT/graph-instantiate-h200.json.
Run: python bench/gpu_graph_instantiate.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

VARIANTS = [
    "before",
    "registered",
    "off_after_on",
    "on_during",
    "off_then_finalize",
    "off_then_new_graph",
]


def child(variant: str) -> dict:
    import torch
    import triton
    import triton.language as tl
    from cupti import cupti

    names: list[str] = []

    def requested():
        return 8 * 1024 * 1024, 0

    def completed(acts):
        for a in acts:
            if int(a.kind) == int(cupti.ActivityKind.CONCURRENT_KERNEL):
                names.append(str(a.name))

    @triton.jit
    def axpy(x, y, o, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(o + offs, 2.0 * tl.load(x + offs, mask=m) + tl.load(y + offs, mask=m), mask=m)

    x = torch.randn(1 << 14, device="cuda")
    y = torch.randn_like(x)
    o = torch.empty_like(x)
    n = x.numel()

    def body():
        for _ in range(10):
            axpy[(n // 1024,)](x, y, o, n, BLOCK=1024)

    body()
    torch.cuda.synchronize()
    kind = cupti.ActivityKind.CONCURRENT_KERNEL

    def make_graph():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            body()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            body()
        torch.cuda.synchronize()
        return g

    def on_off():
        cupti.activity_enable(kind)
        torch.zeros(4, device="cuda")
        torch.cuda.synchronize()
        cupti.activity_disable(kind)
        cupti.activity_flush_all(1)

    g = None
    if variant == "before":
        g = make_graph()
        cupti.activity_register_callbacks(requested, completed)
    else:
        cupti.activity_register_callbacks(requested, completed)
        if variant == "registered":
            g = make_graph()
        elif variant == "on_during":
            cupti.activity_enable(kind)
            g = make_graph()
            cupti.activity_disable(kind)
            cupti.activity_flush_all(1)
        else:
            on_off()
            g = make_graph()
            if variant == "off_then_finalize":
                cupti.finalize()
                cupti.activity_register_callbacks(requested, completed)
            elif variant == "off_then_new_graph":
                cupti.activity_enable(kind)
                g = make_graph()
                cupti.activity_disable(kind)
                cupti.activity_flush_all(1)
    names.clear()
    cupti.activity_enable(kind)
    for _ in range(20):
        g.replay()
    axpy[(1,)](x, y, o, 8, BLOCK=1024)  # one eager kernel: activity itself works
    torch.cuda.synchronize()
    cupti.activity_disable(kind)
    cupti.activity_flush_all(1)
    return {"kernels": len(names), "axpy": sum("axpy" in s for s in names)}


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print("RESULT " + json.dumps(child(sys.argv[2])), flush=True)
        return
    res = {}
    for v in VARIANTS:
        p = subprocess.run(
            [sys.executable, __file__, "--child", v], capture_output=True, text=True, timeout=120
        )
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        res[v] = json.loads(line[-1][7:]) if line else {"rc": p.returncode, "err": p.stderr[-600:]}
        print(v, res[v], flush=True)
    doc = {"command": "python bench/gpu_graph_instantiate.py", "expected": 201, "variants": res}
    dest = Path(os.environ.get("OUT") or ".") / "graph-instantiate-h200.json"
    dest.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
