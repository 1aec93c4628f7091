"""Where `decode_host_us` jumps: the host time of each `DecodePlan.run` in a long run of calls
without synchronisation, and the bench's figure at several run lengths. (GPU machine)

The bench's `decode_host_us` is the highest, over 24 shape x KV rows, of a median of 7 runs of
100 calls in a row without synchronisation (kernels/bench_timing.py `bench_host_nosync_us`).
Most rows read 4-9 us; single rows read 10-24 us from one table to the next (bench/NOTES-kernels.md,
sessions 18-22). If the jumps come from the calls getting ahead of the GPU (a launch queue that
fills, so a call waits for the GPU), the per-call times of one long run show it: flat, then a
step at the call where the queue is full, to about the GPU time a call. If they come from the
host itself, they are scattered.

Per shape (default plans, as the bench makes them): the GPU us a call (graph replay), the host
us of each of 400 calls in a row after a drain (medians over windows of the run, the first call
over 3x the first 20's median), the bench's figure at 10, 25, 50 and 100 calls a run (twice
each), and the drained figure (`bench_host_us`). Writes $OUT/decode-hostq.json.
With ``--probe N``: one shape (1 x 64k bf16, 32/8), N runs of 100 calls, each run's mean,
median and slowest call, its calls over 50 us, the CPU the thread ran on before and after it
(/proc/self/stat) and the steal ticks the hypervisor took meanwhile (/proc/stat): whether a run
whose mean jumps (to 80 us a call on the H100's host, session 23) has every call slow (the GPU
holding the host back) or a few very slow ones (the host's thread not running).
Run: python bench/gpu_decode_hostq.py [--probe N]
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

import torch
from kdash.kernels import bench
from kdash.kernels.bench_timing import (
    bench_graph_ms,
    bench_host_nosync_us,
    bench_host_us,
    host_call_times,
)
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig

SHAPES = [
    ([65536], 32, 8, False),
    ([65536], 32, 8, True),
    ([65536], 64, 8, True),
    ([16384] * 8, 32, 8, True),
    ([131072], 32, 8, True),
    ([4096] * 32, 32, 8, False),
    ([1024] * 128, 32, 8, True),
]
WINDOWS = [(0, 20), (20, 50), (50, 100), (100, 200), (200, 400)]


def row_for(lens, hq, hkv, fp8) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, fp8)
    fn, splits = case.fn(DEFAULT_FP8_CONFIG if fp8 else DecodeConfig())
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    row: dict = {"lens": f"{len(lens)} x {lens[0]}", "heads": f"{hq}/{hkv}",
                 "kv": "fp8" if fp8 else "bf16", "path": case.last_plan.path, "splits": splits,
                 "gpu_us_graph": bench_graph_ms(fn) * 1e3}  # fmt: skip
    runs = [host_call_times(fn, 400) for _ in range(3)]
    row["per_call"] = []
    for times in runs:
        base = statistics.median(times[:20])
        step = next((i for i, t in enumerate(times) if t > 3 * base), None)
        row["per_call"].append({
            "windows": {f"{a}-{b}": round(statistics.median(times[a:b]), 2) for a, b in WINDOWS},
            "p90": round(sorted(times)[int(0.9 * len(times))], 2),
            "first_over_3x": step,
        })  # fmt: skip
    row["nosync"] = {
        str(n): [round(bench_host_nosync_us(fn, calls=n), 2) for _ in range(2)]
        for n in (10, 25, 50, 100)
    }
    row["drained"] = round(bench_host_us(fn), 2)
    return row


def this_cpu() -> int:
    """The CPU this process last ran on (field 39 of /proc/self/stat)."""
    stat = Path("/proc/self/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[36])


def steal_ticks() -> int:
    """Ticks the hypervisor took from this machine's CPUs (/proc/stat's ``steal``)."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return int(fields[8]) if len(fields) > 8 else 0


def probe(runs: int) -> int:
    case = bench.DecodeCase([65536], 32, 8, 128, False)
    fn, _ = case.fn(DecodeConfig())
    for _ in range(5):
        fn()
    got = []
    for _ in range(runs):
        torch.cuda.synchronize()
        before, steal = this_cpu(), steal_ticks()
        times = host_call_times(fn, 100)
        got.append({
            "mean": round(statistics.fmean(times), 2), "median": round(statistics.median(times), 2),
            "max": round(max(times), 1), "over_50us": sum(t > 50 for t in times),
            "cpu_before": before, "cpu_after": this_cpu(), "steal_ticks": steal_ticks() - steal,
        })  # fmt: skip
    print(json.dumps({"affinity": sorted(os.sched_getaffinity(0)), "runs": got}))
    return 0


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_decode_hostq.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if len(sys.argv) == 3 and sys.argv[1] == "--probe" and sys.argv[2].isdigit():
        return probe(int(sys.argv[2]))
    if len(sys.argv) > 1:
        print("usage: gpu_decode_hostq.py [--probe N]", file=sys.stderr)
        return 2
    res: dict = {"command": "python bench/gpu_decode_hostq.py",
                 "gpu": torch.cuda.get_device_name(0), "rows": []}  # fmt: skip
    dest = Path(os.environ.get("OUT") or ".") / "decode-hostq.json"
    for shape in SHAPES:
        try:
            row = row_for(*shape)
        except Exception as exc:  # noqa: BLE001 - recorded; the other shapes still run
            row = {"shape": str(shape)[:80], "error": f"{type(exc).__name__}: {exc}"[:400]}
        res["rows"].append(row)
        dest.write_text(json.dumps(res, indent=1))
        print(json.dumps({k: row[k] for k in row if k != "per_call"}), flush=True)
        for pc in row.get("per_call", []):
            print("   ", json.dumps(pc), flush=True)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
