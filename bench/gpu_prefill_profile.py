"""One prefill call of ours and one of SDPA's cuDNN backend, each in an NVTX range, for Nsight
Compute (bench/device_prefill_ncu.sh runs it under ncu). h2048 D=128 full at S=4096 x 4 and
GQA 32/8/128 full at 8192 x 2: the classes furthest from cuDNN (bench/results/kernels-h200.json).
Run: python bench/gpu_prefill_profile.py [h2048|gqa] [SEQ]   (a CUDA GPU; kdash importable; SEQ
sets h2048's length, 16k tokens in all)
"""

from __future__ import annotations

import sys

import torch
from kdash.kernels import bench
from kdash.kernels.prefill_attention import chosen_config
from torch.nn.attention import SDPBackend


def main() -> int:
    which = sys.argv[1] if len(sys.argv) > 1 else "h2048"
    seq = int(sys.argv[2]) if len(sys.argv) > 2 else 4096
    case = (
        bench.PrefillCase(seq, 16, 16, 128, False)
        if which == "h2048"
        else bench.PrefillCase(8192, 32, 8, 128, False)
    )
    ours = case.ours(None)
    cudnn = case.sdpa(SDPBackend.CUDNN_ATTENTION)
    for _ in range(3):
        ours()
        cudnn()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("ours")
    ours()
    torch.cuda.nvtx.range_pop()
    torch.cuda.nvtx.range_push("cudnn")
    cudnn()
    torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    print(which, "config", chosen_config(case.d, case.causal, case.q.device), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
