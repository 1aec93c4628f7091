"""Record the REAL CPU-only torch.profiler trace shipped as tests/data/cpu-mlp.trace.json.gz.

    .venv/bin/python bench/kineto_cpu_trace.py [--out tests/data] [--steps 4]

A small training step, as a CPU-only torch.profiler sees it: a two-layer MLP (Linear, GELU,
Linear), an attention-shaped matmul, a softmax, a layer norm, backward and an SGD step,
`--steps` steps each inside a `record_function("model_step_N")`, their batches made first by a
second thread (`record_function("load_batch_N")`), recorded with
`profile(activities=[ProfilerActivity.CPU], record_shapes=True)` (and `profile_all_threads`,
so the loader thread is in it) and written by `export_chrome_trace`, then gzipped. Beside the
trace, `cpu-mlp.meta.json` says how it was made (torch version, command, events per category,
size).

Each run writes new numbers (times, pids, thread ids): the tests read the trace's own events
to check the import, never numbers copied from one recording. The file is kept under
`LIMIT_BYTES` (200 KB; 4 steps make ~25 KB); steps are halved until it fits. kdash is not
imported here.
"""

from __future__ import annotations

import argparse
import gzip
import json
import platform
import sys
import tempfile
from collections import Counter
from pathlib import Path

LIMIT_BYTES = 200 * 1024
NAME = "cpu-mlp.trace.json.gz"
META = "cpu-mlp.meta.json"


def record(steps: int, path: Path) -> None:
    """One profiled run of `steps` training steps, exported as a Chrome trace at `path`."""
    import threading

    import torch
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.manual_seed(0)
    torch.set_num_threads(1)  # no intra-op pool: the trace's threads are the two below
    mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    norm = nn.LayerNorm(64)
    params = [*mlp.parameters(), *norm.parameters()]
    opt = torch.optim.SGD(params, lr=0.01)
    raw = torch.randn(steps, 16, 64)
    batches: list = []

    def loader() -> None:
        # a second thread preparing the batches, so the trace has two threads' CPU ops
        for i in range(steps):
            with record_function(f"load_batch_{i}"):
                batches.append(torch.nn.functional.normalize(raw[i], dim=-1) * 2.0)

    def step(i: int, x) -> None:
        with record_function(f"model_step_{i}"):
            h = mlp(x)
            scores = torch.matmul(h, h.transpose(0, 1)) / 8.0
            attn = torch.softmax(scores, dim=-1)
            loss = norm(x + torch.matmul(attn, h)).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()

    step(-1, torch.randn(16, 64))  # outside the profile: lazy init is not a step
    # profile_all_threads: torch.profiler otherwise records only the thread that started it
    config = torch.profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(
        activities=[ProfilerActivity.CPU], record_shapes=True, experimental_config=config
    ) as prof:
        t = threading.Thread(target=loader, name="loader")
        t.start()
        t.join()
        for i, x in enumerate(batches):
            step(i, x)
    prof.export_chrome_trace(str(path))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "tests/data")
    ap.add_argument("--steps", type=int, default=4)
    args = ap.parse_args(argv)
    if args.steps < 1:
        print("kineto_cpu_trace: --steps must be at least 1", file=sys.stderr)
        return 2
    import torch

    steps = args.steps
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        while True:
            record(steps, raw)
            data = gzip.compress(raw.read_bytes(), compresslevel=9, mtime=0)
            if len(data) <= LIMIT_BYTES or steps == 1:
                break
            steps = max(1, steps // 2)
        doc = json.loads(raw.read_text())
    if len(data) > LIMIT_BYTES:
        print(f"kineto_cpu_trace: {len(data)} bytes even with one step", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / NAME).write_bytes(data)
    events = doc["traceEvents"]
    meta = {
        "what": (
            "A REAL CPU-only torch.profiler trace: a two-layer MLP, an attention-shaped matmul, "
            "a softmax, a layer norm, backward and SGD, "
            f"{steps} steps each in record_function('model_step_N') after a loader thread made "
            "their batches (record_function('load_batch_N')); "
            "profile(activities=[ProfilerActivity.CPU], record_shapes=True, "
            "experimental_config=_ExperimentalConfig(profile_all_threads=True)), "
            "export_chrome_trace, gzip"
        ),
        "command": f".venv/bin/python bench/kineto_cpu_trace.py --steps {args.steps}",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "steps": steps,
        "events": len(events),
        "events_by_phase_and_category": dict(
            sorted(Counter(f"{e.get('ph')} {e.get('cat', '-')}" for e in events).items())
        ),
        "bytes": len(data),
    }
    (args.out / META).write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {args.out / NAME}: {len(events)} events, {len(data)} bytes, {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
