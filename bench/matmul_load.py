"""A plain GPU load for recording real captures: a bf16 matmul loop, started without kdash.

    python3 bench/matmul_load.py --seconds 20 [--n 8192] [--sync-every 1]

Prints iterations/s each second on stdout so a run can be compared with kdash on and off.
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--sync-every", type=int, default=4)
    a = ap.parse_args()
    x = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
    y = torch.randn(a.n, a.n, device="cuda", dtype=torch.bfloat16)
    t_end = time.monotonic() + a.seconds
    it = 0
    last = time.monotonic()
    last_it = 0
    while time.monotonic() < t_end:
        z = x @ y
        it += 1
        if it % a.sync_every == 0:
            torch.cuda.synchronize()
        now = time.monotonic()
        if now - last >= 1.0:
            rate = (it - last_it) / (now - last)
            tflops = rate * 2 * a.n**3 / 1e12
            print(f"matmul {rate:.1f} it/s {tflops:.0f} TFLOP/s", flush=True)
            last, last_it = now, it
    del z
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
