"""The Gluon prefill kernel compiled for sm_90a on a machine without a GPU: registers, spills,
shared memory and what the PTX holds (TMA copies, wgmma, setmaxnreg per partition).

``triton.compile`` runs the whole pipeline on the CPU; Triton's bundled ``ptxas -v`` gives the
registers and spills. The H200 runs Triton 3.6; put that one first on the path:
``PYTHONPATH=/tmp/kb/t36 python bench/prefill_gluon_cpu.py [--json out.json] [--ptx DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kdash-gluon-"))

import triton
from triton.backends.compiler import GPUTarget

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kdash.kernels import prefill_gluon as pg
from prefill_regs_cpu import ptx_counts, ptxas_report


def compile_case(head_dim: int, causal: bool, cfg: pg.GluonConfig, group: int = 4):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    q_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, head_dim], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, head_dim], gl.bfloat16)
    sig = {
        "Q": "*bf16",
        "K": "*bf16",
        "V": "*bf16",
        "Out": "*bf16",
        "CU": "*i32",
        "COUNTER": "*i32",
        "qk_scale": "fp32",
        "stride_qt": "i32",
        "stride_kt": "i32",
        "stride_vt": "i32",
        "stride_ot": "i32",
        "total": "i32",
        "nblk": "i32",
        "q_heads": "i32",
    }
    const = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "STAGES": cfg.stages,
        "CAUSAL": causal,
        "PINGPONG": cfg.pingpong,
        "Q_LAYOUT": q_layout,
        "KV_LAYOUT": kv_layout,
    }
    for k in const:
        sig[k] = "constexpr"
    const = {(list(sig).index(k),): v for k, v in const.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8, 9, 10)}
    src = GluonASTSource(pg._prefill_ws_kernel, sig, const, attrs=attrs)
    return triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168}
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ptx", type=Path, help="write each case's PTX here")
    ap.add_argument("--pingpong", action="store_true", help="the consumers take turns")
    args = ap.parse_args()
    rows = []
    for head_dim in (128, 64):
        for causal in (False, True):
            cfg = replace(
                pg.GLUON_DEFAULTS.get(head_dim, pg.DEFAULT_CONFIG), pingpong=args.pingpong
            )
            k = compile_case(head_dim, causal, cfg)
            ptx = k.asm["ptx"]
            if args.ptx:
                args.ptx.mkdir(parents=True, exist_ok=True)
                (args.ptx / f"gluon_d{head_dim}_{'causal' if causal else 'full'}.ptx").write_text(
                    ptx
                )
            row = {
                "head_dim": head_dim,
                "causal": causal,
                "config": repr(cfg),
                "shared_bytes": k.metadata.shared,
                "num_warps": k.metadata.num_warps,
                **ptxas_report(ptx, k.metadata.name),
                **ptx_counts(ptx),
            }
            rows.append(row)
            print(json.dumps(row))
    if args.json:
        args.json.write_text(
            json.dumps({"triton": triton.__version__, "target": "sm_90a", "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
