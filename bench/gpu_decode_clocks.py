"""What clocks, power and throttle reasons a decode step runs under. (GPU machine)

Nsight Compute's runs of session 23 (clocks uncontrolled) counted 173,604 cycles in 96.77 us for
the Triton stage 1 (1.79 GHz) and 185,689 in 93.15 us for the copy-only TMA reader (1.99 GHz):
the kernel that does the math ran at a 10% lower SM clock. If the L2 and the crossbar slow
with it, a bandwidth-bound kernel pays for its own power. This script runs each workload back
to back for a few seconds while a thread reads NVML every 10 ms (SM and memory clocks, power,
the enforced power limit, temperature, the clock-event (throttle) reasons), and times the
calls by CUDA events in the same window:
- ``plan_graph``: the default plan at 1 x 64k (64/8 and 32/8 bf16) replayed from a CUDA graph;
- ``plan_dobench``: the same plan eagerly after a 256 MiB memset each call (do_bench's flush;
  its us per call include the memset);
- ``stage1_graph``: the two-launch plan's stage 1 alone, replayed;
- ``tma_copies``: the copy-only TMA reader of bench/gpu_kv_tma.py on the same cache;
- ``torch_copy``: a 1 GiB device-to-device copy; ``idle``: nothing.
One JSON line a workload to ``--out``. Nothing on the GPU's settings is changed.
Run: python bench/gpu_decode_clocks.py [--seconds 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling scripts

from kdash.kernels import bench
from kdash.kernels._common import ensure_allocator
from kdash.kernels.decode_attention import DecodeConfig

# NVML clock-event reason bits (nvml.h, nvmlClocksEventReason*)
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal",
    0x40: "hw_thermal",
    0x80: "hw_power_brake",
    0x100: "display_clocks",
}


class Sampler:
    """NVML readings every ``period`` s on a thread, between ``start`` and ``stop``."""

    def __init__(self, period: float = 0.01) -> None:
        import pynvml

        self.nv = pynvml
        pynvml.nvmlInit()
        self.h = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
        self.period = period
        self.rows: list[tuple] = []
        self._stop = threading.Event()
        self._t: threading.Thread | None = None

    def _reasons(self) -> int:
        nv = self.nv
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None)
        fn = fn or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(self.h))

    def _run(self) -> None:
        nv, h = self.nv, self.h
        while not self._stop.is_set():
            self.rows.append(
                (
                    nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM),
                    nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                    nv.nvmlDeviceGetPowerUsage(h) / 1000.0,
                    nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                    self._reasons(),
                )
            )
            time.sleep(self.period)

    def start(self) -> None:
        self.rows.clear()
        self._stop.clear()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def stop(self) -> dict:
        self._stop.set()
        assert self._t is not None
        self._t.join()
        rows = self.rows[len(self.rows) // 5 :]  # the first fifth: clocks still settling
        if not rows:
            return {"samples": 0}
        sm, mem, pw, temp, why = zip(*rows, strict=True)
        seen: dict[str, float] = {}
        for bit, name in REASONS.items():
            n = sum(1 for r in why if r & bit)
            if n:
                seen[name] = round(n / len(why), 3)
        return {
            "samples": len(rows),
            "sm_MHz_median": statistics.median(sm),
            "sm_MHz_min": min(sm),
            "sm_MHz_max": max(sm),
            "mem_MHz_median": statistics.median(mem),
            "power_W_median": statistics.median(pw),
            "power_W_max": max(pw),
            "temp_C_max": max(temp),
            "reasons_share": seen,
        }

    def limits(self) -> dict:
        nv, h = self.nv, self.h
        return {
            "power_limit_W": nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0,
            "sm_MHz_max_boost": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM),
            "mem_MHz_max": nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_MEM),
        }


def run_for(fn, seconds: float, sampler: Sampler, per_call: int = 1) -> dict:
    """``fn`` back to back for ``seconds`` (after a warm-up), sampled; us per call by events
    (``per_call`` steps a call of ``fn``)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    sampler.start()
    times = []
    t_end = time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / per_call)
    got = sampler.stop()
    got["us_per_step_median"] = statistics.median(times)
    got["calls"] = len(times)
    return got


def graph_of(fn, steps: int):
    """A CUDA graph of ``steps`` calls of ``fn``; its replay."""
    fn()  # compiles and arms outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(steps):
            fn()
    return g.replay


def copy_row(seconds: float, sampler: Sampler) -> dict:
    src = torch.empty(1024**3, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return run_for(lambda: dst.copy_(src), seconds, sampler)


def decode_rows(heads: str, flush: torch.Tensor, seconds: float, sampler: Sampler) -> list[dict]:
    """The workloads of one head layout at 1 x 64k bf16 (module docstring)."""
    hq, hkv = (int(x) for x in heads.split("/"))
    case = bench.DecodeCase([65536], hq, hkv, 128, False)
    q, k, v = case.q, case.k, case.v
    plan = case.plan(DecodeConfig())

    def step() -> None:
        plan.run(q, k, v)

    def eager() -> None:
        flush.zero_()
        plan.run(q, k, v)

    tag = {"shape": f"1x65536 {heads}", "path": plan.path, "splits": plan.num_splits}
    rows = [
        {"workload": "plan_graph", **tag, **run_for(graph_of(step, 20), seconds, sampler, 20)},
        {"workload": "plan_dobench", **tag, **run_for(eager, seconds, sampler)},
    ]
    two = case.plan(DecodeConfig(), fused=False)
    two.run(q, k, v)
    args = (q, k, v, case.page_table, case.seq_lens, two._ks, two._vs, *two._rest1)

    def stage1() -> None:
        two._s1(*args)

    tag1 = {"shape": f"1x65536 {heads}", "splits": two.num_splits}
    rows.append(
        {"workload": "stage1_graph", **tag1, **run_for(graph_of(stage1, 20), seconds, sampler, 20)}
    )
    if heads == "64/8":
        from gpu_kv_tma import reader

        fn, _, _ = reader(case, "per_head", 64, 2, 3, 1)
        rows.append({"workload": "tma_copies", "shape": "1x65536 8 KV heads",
                     **run_for(graph_of(fn, 20), seconds, sampler, 20)})  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "clocks.jsonl")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_decode_clocks.py needs a CUDA GPU", file=sys.stderr)
        return 2
    ensure_allocator()  # the TMA reader's descriptors are made in the kernel
    sampler = Sampler()

    def emit(row: dict) -> None:
        print(json.dumps(row), flush=True)
        with a.out.open("a") as fh:
            fh.write(json.dumps(row) + "\n")

    emit({"command": "python bench/gpu_decode_clocks.py " + " ".join(argv or sys.argv[1:]),
          "machine": bench.machine(), **sampler.limits()})  # fmt: skip
    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    time.sleep(1.0)
    sampler.start()
    time.sleep(a.seconds / 2)
    emit({"workload": "idle", **sampler.stop()})
    emit({"workload": "torch_copy", **copy_row(a.seconds, sampler)})
    for heads in ("64/8", "32/8"):
        for row in decode_rows(heads, flush, a.seconds, sampler):
            emit(row)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
