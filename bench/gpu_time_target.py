"""A launch-bound loop for the GPU-time check (bench/gpu_time_check.py): many small kernels a
step, an 8 MiB host-to-device copy every 20th step and a mid-size matmul every 10th, so busy
time is small, made of kernels and copies, and idle time is mostly gaps under 100 us.

Steps are paced (`--pace-ms`, default 3): step i starts at i * pace, so two twins do the same
GPU work per second whatever a profiler costs their host side (torch.profiler slows the launch
path several-fold), and their busy shares can be compared.

`python bench/gpu_time_target.py SECONDS [--profile TRACE.json --from S --to S]`: with
--profile, torch.profiler (CPU + CUDA) records between those seconds of the run and writes a
Chrome trace; it prints `ready` once warm, then one line of steps per second.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("seconds", type=float)
    ap.add_argument("--profile")
    ap.add_argument("--from", dest="t_from", type=float, default=2.0)
    ap.add_argument("--to", dest="t_to", type=float, default=6.0)
    ap.add_argument("--pace-ms", type=float, default=3.0)
    a = ap.parse_args()
    x = torch.ones(1 << 20, device="cuda")
    m = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    host = torch.empty(2 << 20, dtype=torch.float32).pin_memory()
    dev = torch.empty_like(host, device="cuda")

    def step(i: int) -> None:
        nonlocal x
        for _ in range(60):
            x = x * 1.0001 + 0.5
        if i % 10 == 0:
            _ = m @ m
        if i % 20 == 0:
            dev.copy_(host, non_blocking=True)

    for i in range(50):
        step(i)
    torch.cuda.synchronize()
    print("ready", flush=True)
    prof = None
    t0 = time.monotonic()
    last, n, i, late = t0, 0, 0, 0
    pace = a.pace_ms / 1e3
    due = t0
    while (now := time.monotonic()) - t0 < a.seconds:
        if now < due:
            time.sleep(due - now)
        elif now > due + 10 * pace:  # held up (the trace export): no catching up in a burst
            due = now
            late += 1
        due += pace
        if a.profile and prof is None and now - t0 >= a.t_from:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
        if prof is not None and now - t0 >= a.t_to:
            torch.cuda.synchronize()
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(a.profile)
            print("profiled", flush=True)
            prof, a.profile = None, None
        step(i)
        i += 1
        n += 1
        if now - last >= 1.0:
            torch.cuda.synchronize()
            print(f"steps {n / (now - last):.1f} late {late}", flush=True)
            last, n = now, 0
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
