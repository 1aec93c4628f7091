"""A torch.compile'd transformer-ish block in a loop, for PC-sampling runs (GPU machine):
inductor's fused layernorm / gelu / softmax Triton kernels beside cuBLAS GEMMs, launched
eagerly (default mode, no CUDA graphs). Prints `ready` once compiled, then steps/s.

`python bench/compile_target.py SECONDS`
"""

from __future__ import annotations

import sys
import time

import torch


class Block(torch.nn.Module):
    def __init__(self, d: int = 2048) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(torch.nn.functional.gelu(self.up(self.ln(x))))
        return torch.softmax(h.float(), dim=-1).to(x.dtype) + x


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 60.0
    blk = Block().to("cuda", torch.bfloat16)
    f = torch.compile(blk)
    x = torch.randn(4096, 2048, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        for _ in range(3):
            f(x)
        torch.cuda.synchronize()
        print("ready", flush=True)
        t0 = last = time.monotonic()
        n = 0
        while (now := time.monotonic()) - t0 < seconds:
            f(x)
            n += 1
            if now - last >= 2.0:
                torch.cuda.synchronize()
                print(f"steps/s {n / (now - last):.1f}", flush=True)
                n, last = 0, now
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
