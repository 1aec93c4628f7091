"""Registers, spills, shared memory and SASS mix of the fp8 stage-1 kernels, compiled for sm_90
on a machine without a GPU (the approach of bench/decode_regs_cpu.py: ``triton.compile`` with
Triton's bundled ptxas; here ptxas is run once more with ``-v`` on the same PTX for the spill
counts, and nvdisasm gives the instruction mix).

For the conversion kernel (kernels/decode_fp8.py, the default) and the integer-op one
(``pairs_asm``), at the bench's
head layouts and the launch configs the GPU script times, one line: registers, spill bytes,
shared memory, programs per SM (kernels/residency.py's rule on an H200: 64K registers, 228 KB
of shared memory, 2048 threads) and, in the SASS, the conversion instructions (F2FP), integer
logic (LOP3/SHF/PRMT), MMAs (HMMA), shared loads (LDSM/LDS) and async copies (LDGSTS).

Run with the H200's Triton first on the path:
    PYTHONPATH=/tmp/kb/t36 .venv/bin/python bench/fp8_regs_cpu.py [--fused] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kdash-fp8regs-"))

import triton
from kdash.kernels import decode_attention as da
from kdash.kernels import decode_fp8 as d8
from kdash.kernels import decode_fused as df
from kdash.kernels.residency import programs_per_sm
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

STRIDES = ("stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp")
STRIDES += ("stride_vs", "stride_vh", "stride_ptb")
# (name, query heads per KV head, page size): the bench's fp8 layouts (head_dim 128)
LAYOUTS = [("32/8/128 p16", 4, 16), ("64/8/128 p16", 8, 16), ("32/8/128 p1", 4, 1)]
# (fp8_compute, block_n, num_warps, num_stages, maxnreg): what bench/gpu_fp8_variants.py times
CONFIGS = [
    ("pairs_asm", 128, 4, 2, None),
    ("pairs_asm", 128, 4, 3, None),
    ("pairs_asm", 64, 4, 3, None),
    ("pairs_asm", 128, 4, 2, 128),
    ("cvt", 128, 4, 2, None),
    ("cvt", 128, 4, 3, None),
    ("cvt", 64, 4, 3, None),
    ("cvt", 64, 4, 4, None),
    ("cvt", 128, 8, 2, None),
    ("cvt", 128, 4, 2, 128),
    ("cvt", 64, 2, 3, None),
    ("cvt", 32, 1, 3, None),
    ("cvt", 32, 1, 4, None),
    ("pairs_asm", 32, 1, 3, None),
]
SASS_GROUPS = {
    "F2FP": r"\bF2FP\b",
    "LOP3/SHF/PRMT": r"\b(LOP3|SHF|PRMT)\b",
    "HMMA": r"\bHMMA\b",
    "LDSM": r"\bLDSM\b",
    "LDS": r"\bLDS\b",
    "LDGSTS": r"\bLDGSTS\b",
}


def tool(name: str) -> str:
    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def compile_one(
    mode: str, group: int, page: int, block_n: int, warps: int, stages: int, reg, fused=False
):
    sig = {"Q": "*bf16", "K": "*fp8e4nv", "V": "*fp8e4nv", "PT": "*i32", "LENS": "*i32"}
    sig.update(KS="*fp32", VS="*fp32", OP="*fp32", LSEP="*fp32")
    if fused:
        sig.update(Out="*bf16", LSE="*fp32", FLAGS="*i32")
    sig.update(qk_scale="fp32", num_splits="i32", split_len_hint="i32", capacity="i32")
    sig.update({s: "i32" for s in STRIDES + (("stride_outb", "stride_outh") if fused else ())})
    const = dict(GROUP=group, BLOCK_H=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=128)
    const.update(BLOCK_N=block_n, PAGE=page, EVICT="", ASM=True, UPCAST=False, PREFETCH=True)
    const.update(DEVICE_PLAN=True, TARGET_VARLEN=132 * 12, MIN_SPLIT=256, BLOCK_B=16)
    const.update(MAX_SPLITS=256, MERGE=4, SEARCH=256)
    fn = da._decode_stage1_fp8_pairs if mode == "pairs_asm" else d8._decode_stage1_fp8_cvt
    if fused:
        fn = df._decode_fused
        const.update(PAIRS=True, IS_FP8=True, FP8_FP16=True)
        const.update(CHUNK=df.merge_chunk(128), CVT=mode == "cvt", POLL_NS=64)
    sig.update({k: "constexpr" for k in const})
    div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(fn, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    opts = {"num_warps": warps, "num_stages": stages}
    if reg is not None:
        opts["maxnreg"] = reg
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
        ptx.write_text(k.asm["ptx"])
        cubin.write_bytes(k.asm["cubin"])
        log = subprocess.run(
            [tool("ptxas"), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(d) / "v.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
        sass = subprocess.run(
            [tool("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    spills = int(stores.group(1)) + int(loads.group(1)) if stores and loads else 0
    shared = int(k.metadata.shared)
    per_sm, by = programs_per_sm(regs, shared, warps)
    mix = {g: len(re.findall(p, sass)) for g, p in SASS_GROUPS.items()}
    return dict(registers=regs, spill_bytes=spills, shared=shared, per_sm=per_sm, by=by, sass=mix)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the rows here")
    ap.add_argument("--only", help="fp8_compute value to compile (default: every config)")
    ap.add_argument("--fused", action="store_true", help="the fused kernel instead of stage 1")
    a = ap.parse_args(argv)
    print(f"triton {triton.__version__}, sm_90 (ptxas -v on Triton's PTX)")
    rows = []
    for mode, bn, warps, stages, reg in CONFIGS:
        if a.only and mode != a.only:
            continue
        for name, group, page in LAYOUTS:
            tag = f"{mode} {bn}/{warps}w/{stages}s" + (f"/maxnreg {reg}" if reg else "")
            tag += " fused" if a.fused else ""
            try:
                r = compile_one(mode, group, page, bn, warps, stages, reg, a.fused)
            except Exception as e:  # noqa: BLE001 - one config that does not compile is reported
                print(f"{tag:>34} {name}: {type(e).__name__}: {str(e)[:200]}")
                continue
            rows.append(dict(config=tag, layout=name, **r))
            mix = " ".join(f"{g} {n}" for g, n in r["sass"].items())
            print(
                f"{tag:>34} {name}: {r['registers']} regs, {r['spill_bytes']} B spilled, "
                f"{r['shared']} B shared -> {r['per_sm']}/SM ({r['by']}) | {mix}",
                flush=True,
            )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
