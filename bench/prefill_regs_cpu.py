"""Registers, spills and shared memory of the prefill kernels compiled for sm_90, without a GPU.

``triton.compile`` runs the whole pipeline on the CPU; the PTX is then handed to Triton's bundled
``ptxas -v`` for sm_90a, whose report gives registers and spill bytes (the cubin alone has no spill
figure), and the PTX is searched for what each variant is meant to change: TMA tile copies
(``cp.async.bulk.tensor``), ``cp.async``, ``wgmma``, mbarrier waits, and ``setmaxnreg`` (which
Triton emits per warp-specialised partition; none is expected). Compiled: the pointer kernel
(kernels/prefill_attention.py, the fallback) at its H200 configs and every variant of
kernels/prefill_hopper.py at its own, for the bench's
prefill shapes (no prefix), plus ``--with-prefix`` for the extend path.

The H200 runs Triton 3.6; put that one first on the path:
``PYTHONPATH=/tmp/kb/t36 python bench/prefill_regs_cpu.py [--json out.json]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kdash-regs-"))

import torch
import triton
from kdash.kernels import prefill_attention as pa
from kdash.kernels import prefill_hopper as ph
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

CASES = [(64, True), (64, False), (128, True), (128, False)]
COMMON = ("KC", "VC", "PT", "PREFIX", "CU", "Out")
STRIDES = ("stride_qt", "stride_qh", "stride_knt", "stride_knh", "stride_vnt", "stride_vnh")
STRIDES += ("stride_kcp", "stride_kcs", "stride_kch", "stride_vcp", "stride_vcs", "stride_vch")
STRIDES += ("stride_ptb", "stride_ot", "stride_oh")


def ptxas_report(ptx: str, kernel: str) -> dict[str, int]:
    """Registers and spill bytes from Triton's bundled ptxas (``-v``) for sm_90a."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{kernel}.ptx"
        src.write_text(ptx)
        res = subprocess.run(
            [str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
            capture_output=True,
            text=True,
            check=False,
        )
    text = res.stdout + res.stderr
    if res.returncode != 0:
        raise RuntimeError(f"ptxas failed: {text.strip().splitlines()[-1][:200]}")
    regs = re.search(r"Used (\d+) registers", text)
    stores = re.search(r"(\d+) bytes spill stores", text)
    loads = re.search(r"(\d+) bytes spill loads", text)
    return {
        "registers": int(regs.group(1)) if regs else -1,
        "spill_store_bytes": int(stores.group(1)) if stores else 0,
        "spill_load_bytes": int(loads.group(1)) if loads else 0,
    }


def ptx_counts(ptx: str) -> dict[str, int]:
    return {
        "tma_copies": ptx.count("cp.async.bulk.tensor"),
        "cp_async": len(re.findall(r"cp\.async\.(ca|cg)", ptx)),
        "wgmma": ptx.count("wgmma.mma_async"),
        "mbarrier_waits": len(re.findall(r"mbarrier\.try_wait", ptx)),
        "setmaxnreg": ptx.count("setmaxnreg"),
        "setmaxnreg_values": sorted(
            {int(v) for v in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)}
        ),
        "ex2": ptx.count("ex2.approx"),
    }


def compile_default(d: int, causal: bool, prefix: bool):
    cfg = pa.default_config(d, causal, torch.device("cuda"))
    sig = {"Q": "*bf16", "KN": "*bf16", "VN": "*bf16", "KC": "*bf16", "VC": "*bf16"}
    sig.update(PT="*i32", PREFIX="*i32", CU="*i32", Out="*bf16", qk_scale="fp32")
    sig.update({s: "i32" for s in STRIDES})
    const = dict(GROUP=1, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    const.update(PAGE=16 if prefix else 1, CAUSAL=causal, UPCAST=False)
    return _compile(pa._extend_kernel, sig, const, cfg.num_warps, cfg.num_stages), asdict(cfg)


def compile_variant(name: str, d: int, causal: bool, prefix: bool):
    cfg = ph.variant_config(name, d, causal)
    sig = {"Q": "*bf16", "KN": "*bf16", "VN": "*bf16"}
    if cfg.descriptors == "host":
        sig["QD"] = f"tensordesc<bf16[{cfg.block_m}, {d}]>"
        sig["KD"] = sig["VD"] = f"tensordesc<bf16[{cfg.block_n}, {d}]>"
    else:
        sig.update(QD="*bf16", KD="*bf16", VD="*bf16")
    sig.update({n: "*bf16" for n in ("KC", "VC")})
    sig.update(PT="*i32", PREFIX="*i32", CU="*i32", Out="*bf16", qk_scale="fp32")
    sig.update({s: "i32" for s in STRIDES})
    const = dict(GROUP=1, HEAD_DIM=d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n)
    const.update(PAGE=16 if prefix else 1, CAUSAL=causal, UPCAST=False)
    const.update(DESC=cfg.descriptors == "host", HAS_PREFIX=prefix)
    return _compile(ph._hopper_kernel, sig, const, cfg.num_warps, cfg.num_stages), asdict(cfg)


def _compile(fn, sig: dict, const: dict, num_warps: int, num_stages: int):
    sig = dict(sig)
    sig.update({k: "constexpr" for k in const})
    # Pointers and strides 16-divisible, as packed [T, H, D] bf16 tensors at the bench's shapes.
    div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(fn, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(
        src,
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )
    ptx = k.asm["ptx"]
    row = {"shared_bytes": int(k.metadata.shared), "num_warps": int(k.metadata.num_warps)}
    row.update(ptxas_report(ptx, k.metadata.name))
    row.update(ptx_counts(ptx))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--with-prefix", action="store_true", help="compile the extend path too")
    args = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90a (ptxas -v)")
    rows = []
    prefixes = (False, True) if args.with_prefix else (False,)
    for prefix in prefixes:
        for d, causal in CASES:
            for name in ("pointer", *ph.VARIANTS):
                mode = ("causal" if causal else "full  ") + (" prefix" if prefix else "")
                tag = f"{name:>8} d{d} {mode}"
                try:
                    if name == "pointer":
                        r, cfg = compile_default(d, causal, prefix)
                    else:
                        r, cfg = compile_variant(name, d, causal, prefix)
                except Exception as e:  # noqa: BLE001 - one kernel that does not compile is reported
                    print(f"{tag}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
                    rows.append({"variant": name, "d": d, "causal": causal, "error": str(e)[:300]})
                    continue
                cfg_s = (
                    f"{cfg['block_m']}x{cfg['block_n']}/{cfg['num_warps']}w/{cfg['num_stages']}s"
                )
                print(
                    f"{tag} {cfg_s:>14}: {r['registers']} regs, spills {r['spill_store_bytes']}/"
                    f"{r['spill_load_bytes']} B, smem {r['shared_bytes']} B | tma {r['tma_copies']}"
                    f" cp.async {r['cp_async']} wgmma {r['wgmma']} mbar.wait {r['mbarrier_waits']}"
                    f" setmaxnreg {r['setmaxnreg_values'] or 0}"
                )
                rows.append(
                    {
                        "variant": name,
                        "d": d,
                        "causal": causal,
                        "prefix": prefix,
                        "config": cfg,
                        **r,
                    }
                )
    if args.json:
        args.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
