"""Record REAL Kineto traces on the GPU machine, named like SGLang's (run ON the GPU machine).

    python3 bench/gpu_kineto_record.py [--out DIR] [--steps 4] [--device 0]

A small decode-server-shaped workload — bf16 matmuls, a softmax, an elementwise op, a
host-to-device copy, a memset and (when triton imports and a GPU is there) a Triton kernel —
runs for `--steps` steps per stage under `torch.profiler(activities=[CPU, CUDA])`, each step in
a `record_function("forward_step_N")`. Two stages, as SGLang's `profile_by_stage` writes them:

    $OUT/kdash-<profile_id>-TP-0-EXTEND.trace.json.gz   (prefill-shaped: long sequences)
    $OUT/kdash-<profile_id>-TP-0-DECODE.trace.json.gz   (decode-shaped: one token per request)

`<profile_id>` is `str(time.time())`, as SGLang's. Each file is checked to be < 2 MB (steps are
halved and the stage re-recorded when it is not), and `$OUT/gpu-kineto-record.json` says what
was recorded (torch/triton versions, GPU, kernels per file, sizes). These files go to
tests/data so tests/test_kineto.py checks the kernel fields on a real GPU trace.

Needs torch with CUDA; kdash is not imported (it runs with nothing but torch and, optionally,
triton). Exit status 0 on success, 2 without a usable CUDA GPU.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import sys
import time
from pathlib import Path

LIMIT_BYTES = 2 * 1024 * 1024


def _triton_kernel():
    """A Triton softmax-like row kernel, or None when triton is not usable here."""
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - optional: any import failure means "no Triton kernel"
        return None, None

    @triton.jit
    def kdash_row_scale(X, Y, N, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < N
        x = tl.load(X + row * N + offs, mask=mask, other=0.0)
        y = x * 0.5 + 1.0
        tl.store(Y + row * N + offs, y, mask=mask)

    def launch(x, y):
        n = x.shape[1]
        block = triton.next_power_of_2(n)
        kdash_row_scale[(x.shape[0],)](x, y, n, BLOCK=block, num_warps=4)

    return launch, triton.__version__


def _record(stage: str, steps: int, device: int, path: Path, triton_launch) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    dev = torch.device("cuda", device)
    torch.manual_seed(0)
    if stage == "EXTEND":
        tokens, hidden = 2048, 1024
    else:
        tokens, hidden = 32, 1024
    w1 = torch.randn(hidden, 4 * hidden, device=dev, dtype=torch.bfloat16)
    w2 = torch.randn(4 * hidden, hidden, device=dev, dtype=torch.bfloat16)
    host = torch.randn(tokens, hidden, pin_memory=True)
    scratch = torch.empty(tokens, hidden, device=dev)

    def step(i: int) -> None:
        x = host.to(dev, non_blocking=True).to(torch.bfloat16)  # HtoD copy + cast kernel
        h = torch.nn.functional.gelu(x @ w1)
        y = h @ w2
        p = torch.softmax(y.float(), dim=-1)
        scratch.zero_()  # memset
        if triton_launch is not None:
            triton_launch(p, scratch)
        _ = p.sum().item()  # a sync, as a sampler's .item() is

    for i in range(2):  # warm up (cuBLAS handles, Triton compile) outside the trace
        step(i)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            with record_function(f"forward_step_{i}"):
                step(i)
        torch.cuda.synchronize(dev)
    prof.export_chrome_trace(str(path))
    with gzip.open(path, "rt") as fh:
        doc = json.load(fh)
    cats: dict[str, int] = {}
    for ev in doc.get("traceEvents", []):
        c = ev.get("cat", "")
        cats[c] = cats.get(c, 0) + 1
    kernels = [ev["name"] for ev in doc["traceEvents"] if ev.get("cat") == "kernel"]
    return {
        "file": path.name,
        "bytes": path.stat().st_size,
        "steps": steps,
        "categories": cats,
        "kernels": len(kernels),
        "distinct_kernels": sorted(set(kernels))[:40],
        "triton_kernel_seen": any("kdash_row_scale" in k for k in kernels),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("torch is not installed here", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    launch, triton_version = _triton_kernel()
    triton_note = None
    if launch is not None:
        # Triton compiles on first launch (needs a C compiler and the CUDA headers); a machine
        # that cannot still records the torch kernels.
        try:
            x = torch.randn(4, 100, device=f"cuda:{args.device}")
            y = torch.empty_like(x)
            launch(x, y)
            torch.cuda.synchronize(args.device)
            if not torch.allclose(y, x * 0.5 + 1.0):
                raise RuntimeError("wrong result")
        except Exception as e:  # noqa: BLE001 - report and go on without the Triton kernel
            triton_note = f"Triton kernel left out: {type(e).__name__}: {str(e)[:200]}"
            print(triton_note, file=sys.stderr)
            launch = None
    profile_id = str(time.time())
    files = []
    for stage in ("EXTEND", "DECODE"):
        steps = args.steps
        while True:
            path = args.out / f"kdash-{profile_id}-TP-0-{stage}.trace.json.gz"
            rec = _record(stage, steps, args.device, path, launch)
            if rec["bytes"] < LIMIT_BYTES or steps == 1:
                break
            steps = max(1, steps // 2)
        files.append(rec)
        print(f"{rec['file']}: {rec['bytes'] / 1e6:.2f} MB, {rec['kernels']} kernels")
    summary = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {
            "host": platform.node(),
            "gpu": torch.cuda.get_device_name(args.device),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "triton": triton_version,
            "triton_note": triton_note,
            "python": platform.python_version(),
        },
        "profile_id": profile_id,
        "files": files,
    }
    (args.out / "gpu-kineto-record.json").write_text(json.dumps(summary, indent=1))
    ok = all(f["kernels"] > 0 and f["bytes"] < LIMIT_BYTES for f in files)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
