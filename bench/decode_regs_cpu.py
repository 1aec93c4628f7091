"""Registers and shared memory of the decode kernels compiled for sm_90, on a machine without a GPU.

``triton.compile`` runs the whole pipeline on the CPU (Triton IR, PTX, Triton's bundled ptxas);
the register count is read from the cubin (the high byte of the ``sh_info`` of the kernel's
``.text.<name>`` section, where the CUDA ELF keeps it). For each head layout of the bench, stage
1 alone (the two-launch path), the fused kernel (kernels/decode_fused.py) and the persistent one
(kernels/decode_persist.py: fp8 there is the ``cvt`` conversion under the plan's register cap;
its registers and spill bytes from ``ptxas -v`` on the PTX), so a change to any of them shows
whether it keeps as many programs per SM. The H200 runs Triton 3.6; another
Triton can be put first on the path (``PYTHONPATH=/some/triton-3.6 python ...``).

Run: python bench/decode_regs_cpu.py   (prints one line per layout; a private Triton cache)
     python bench/decode_regs_cpu.py --kmma   (fp8: K converted against K to the fp8 MMA)
     python bench/decode_regs_cpu.py --hint   (the K/V copies with kdash's L2 evict-first hint,
                                               as the GPU's default plans compile them)
     python bench/decode_regs_cpu.py --hint --opaque-heads   (bf16: stage 1 and the one-launch
                                            kernel with decode_fused.OPAQUE_HEADS)
     python bench/decode_regs_cpu.py --hint --warm=0   (bf16: the one-launch kernel without
                                            its L2 prefetch, decode_fused.WARM_TILES = 0)
"""

from __future__ import annotations

import os
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compile, do not interpret
os.environ.setdefault("TRITON_CACHE_DIR", tempfile.mkdtemp(prefix="kdash-regs-"))

import triton
from kdash.kernels import decode_attention as da
from kdash.kernels import decode_fp8 as df8
from kdash.kernels import decode_fused as df
from kdash.kernels import decode_persist as dp
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

STRIDES = ("stride_qb", "stride_qh", "stride_kp", "stride_ks", "stride_kh", "stride_vp")
STRIDES += ("stride_vs", "stride_vh", "stride_ptb")
EVICT = "evict_first" if "--hint" in sys.argv[1:] else ""
OPAQUE = "--opaque-heads" in sys.argv[1:]  # decode_fused.OPAQUE_HEADS (stage 1 and fused)
# --warm=N: the one-launch bf16 kernel's L2 prefetch of N tiles (default decode_fused.WARM_TILES)
WARM = [int(a.split("=", 1)[1]) for a in sys.argv[1:] if a.startswith("--warm=")]
# (name, KV kind, head_dim, query heads per KV head, page size, tokens per tile)
LAYOUTS = [
    ("bf16 32/8/128 p16", "bf16", 128, 4, 16, 64),
    ("bf16 64/8/128 p16", "bf16", 128, 8, 16, 64),
    ("bf16 32/32/64 p16", "bf16", 64, 1, 16, 64),
    ("fp8 pairs 32/8/128 p16", "pairs", 128, 4, 16, 128),
    ("fp8 pairs 64/8/128 p1", "pairs", 128, 8, 1, 128),
]


def cubin_registers(cubin: bytes, kernel: str) -> int | None:
    """Registers per thread of ``kernel`` in a 64-bit CUDA ELF, or None if not found: the
    ``EIATTR_REGCOUNT`` (0x2f) entry of the ``.nv.info`` section for the kernel's symbol (the
    ``sh_info`` of its ``.text.<name>`` section)."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return None
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_off = heads[shstrndx][4]

    def name(h: tuple) -> str:
        start = names_off + h[0]
        return cubin[start : cubin.index(b"\0", start)].decode()

    by_name = {name(h): h for h in heads}
    text, info = by_name.get(f".text.{kernel}"), by_name.get(".nv.info")
    if text is None or info is None:
        return None
    data = cubin[info[4] : info[4] + info[5]]
    at = 0
    while at + 4 <= len(data):
        fmt, attr = data[at], data[at + 1]
        if fmt != 4:  # no payload beyond the 2-byte value
            at += 4
            continue
        (size,) = struct.unpack_from("<H", data, at + 2)
        if attr == 0x2F and size == 8:
            sym, count = struct.unpack_from("<II", data, at + 4)
            if sym == text[7]:
                return count
        at += 4 + size
    return None


def compile_one(
    fused: bool,
    kind: str,
    head_dim: int,
    group: int,
    page: int,
    block_n: int,
    *,
    ptx=None,
    cubin=None,
):
    """``(registers, shared bytes)`` of stage 1 (or the fused kernel) for ``kind``: ``"bf16"``,
    ``"pairs"`` (fp8, integer-op conversion), ``"cvt"`` or ``"kmma"`` (decode_fp8's kernel: K
    converted, or K's bytes to the fp8 tensor cores; V's addresses from K's row offsets, as a
    plan compiles it for caches of one layout) or ``"cvt-vstrides"`` (``"cvt"`` with V's own
    strides). ``ptx``, ``cubin``: lists the PTX and the
    cubin are appended to."""
    fp8, pairs = kind != "bf16", kind == "pairs"
    cvt, same = kind in ("cvt", "kmma", "cvt-vstrides"), kind != "cvt-vstrides"
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = {"Q": "*bf16", "K": kv, "V": kv, "PT": "*i32", "LENS": "*i32", "KS": "*fp32"}
    sig.update(VS="*fp32", OP="*fp32", LSEP="*fp32")
    if fused:
        sig.update(Out="*bf16", LSE="*fp32", FLAGS="*i32")
    sig.update(qk_scale="fp32", num_splits="i32", split_len_hint="i32", capacity="i32")
    strides = STRIDES + (("stride_outb", "stride_outh") if fused else ())
    sig.update({s: "i32" for s in strides})
    const = dict(GROUP=group, BLOCK_H=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim)
    const.update(BLOCK_N=block_n, PAGE=page, EVICT=EVICT, UPCAST=False, PREFETCH=True)
    const.update(DEVICE_PLAN=True, TARGET_VARLEN=132 * 12, MIN_SPLIT=256, BLOCK_B=16)
    const.update(MAX_SPLITS=256, MERGE=4, SEARCH=256)
    if fused:
        fn = df._decode_fused
        const.update(PAIRS=pairs or cvt, IS_FP8=fp8, FP8_FP16=True, ASM=pairs or cvt)
        const.update(CHUNK=df.merge_chunk(head_dim), POLL_NS=64)
        if cvt:
            const.update(CVT=True, KMMA=kind == "kmma", KV_SAME=same)
    elif cvt:
        fn = df8._decode_stage1_fp8_cvt
        const.update(ASM=True, KMMA=kind == "kmma", KV_SAME=same)
    elif pairs:
        fn, const["ASM"] = da._decode_stage1_fp8_pairs, True
    else:
        fn = da._decode_stage1
        const.update(IS_FP8=fp8, FP8_FP16=True)
    if kind == "bf16":
        const.update(OPAQUE_HEADS=OPAQUE)
        warm = WARM[-1] if WARM else df.WARM_TILES
        if fused and warm:
            const.update(WARM=warm, WARM_LINES=max(1, head_dim * 2 // 128))
    # the constexprs left out take their defaults (Triton 3.9 wants every one named)
    const.update({p.name: p.default for p in fn.params if p.is_constexpr and p.name not in const})
    sig.update({k: "constexpr" for k in const})
    # Pointers and strides 16-divisible, as the plan's buffers and the workload's caches are.
    div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(fn, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in div})
    k = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2}
    )
    if ptx is not None:
        ptx.append(k.asm["ptx"])
    if cubin is not None:
        cubin.append(k.asm["cubin"])
    return cubin_registers(k.asm["cubin"], k.metadata.name), k.metadata.shared


# PTX instructions counted by --kmma (static counts over the whole kernel).
PTX_COUNTS = {
    "cvt e4m3->f16": r"cvt\.rn\.f16x2\.e4m3x2",
    "ldmatrix": r"ldmatrix",
    "st.shared": r"st\.shared",
    "ld.shared": r"ld\.shared",
    "bar.sync": r"bar\.sync",
    "mma.sync": r"mma\.sync",
    "wgmma": r"wgmma\.mma_async",
}


def main_loop_ops(cubin: bytes) -> tuple[int, dict[str, int]]:
    """The SASS of the innermost loop that issues the cache's ``LDGSTS`` copies (the KV loop):
    its instruction count and opcode histogram (cuobjdump from Triton's bundle), ``(0, {})``
    when none is found."""
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True)
    rows = []
    for line in sass.stdout.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            rows.append((int(m.group(1), 16), m.group(2)))
    loops = []
    for at, text in rows:
        m = re.search(r"\bBRA\b[^;]*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < at:
            lo = int(m.group(1), 16)
            body = [t for a, t in rows if lo <= a <= at]
            if any(t.startswith("LDGSTS") or " LDGSTS" in t for t in body):
                loops.append(body)
    if not loops:
        return 0, {}
    body = min(loops, key=len)
    ops: dict[str, int] = {}
    for t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
        ops[op] = ops.get(op, 0) + 1
    return len(body), dict(sorted(ops.items(), key=lambda kv: -kv[1]))


def kmma_lines() -> list[str]:
    """fp8 stage 1 and the fused kernel at the fp8 config (128 tokens a tile), K converted
    (``cvt``; ``cvt-vstrides``: V's addresses from its own strides) against K's bytes to the fp8
    tensor cores (``kmma``): registers, shared memory, the PTX's instruction counts and the KV
    loop's SASS."""
    lines = []
    for group in (4, 8):
        for fused in (False, True):
            for kind in ("cvt-vstrides", "cvt", "kmma"):
                ptx: list[str] = []
                cubin: list[bytes] = []
                regs, shared = compile_one(fused, kind, 128, group, 16, 128, ptx=ptx, cubin=cubin)
                found = {n: len(re.findall(p, ptx[0])) for n, p in PTX_COUNTS.items()}
                counts = ", ".join(f"{n} {c}" for n, c in found.items())
                name = f"{'fused' if fused else 'stage 1'} {kind} {group * 8}/8/128"
                lines.append(f"{name:>24}: {regs} registers, {shared} B shared | {counts}")
                n, ops = main_loop_ops(cubin[0])
                top = ", ".join(f"{k} {v}" for k, v in list(ops.items())[:14])
                lines.append(f"{'':>24}  KV loop: {n} SASS instructions | {top}")
    return lines


def compile_persistent(kind: str, head_dim: int, group: int, page: int, block_n: int):
    """``(registers, spill bytes, shared bytes)`` of the persistent kernel at the plan's
    compile-time values (fp8: the ``cvt`` conversion and ``FP8_MAXNREG``)."""
    fp8 = kind != "bf16"
    kv = "*fp8e4nv" if fp8 else "*bf16"
    sig = {"Q": "*bf16", "K": kv, "V": kv, "PT": "*i32", "LENS": "*i32", "KS": "*fp32"}
    sig.update(VS="*fp32", OP="*fp32", LSEP="*fp32", Out="*bf16", LSE="*fp32", COUNTERS="*i32")
    sig.update(qk_scale="fp32", num_splits="i32", split_len_hint="i32", capacity="i32")
    sig.update({s: "i32" for s in STRIDES + ("stride_outb", "stride_outh")})
    sig.update(batch="i32", kv_heads="i32")
    const = dict(GROUP=group, BLOCK_H=max(16, 1 << (group - 1).bit_length()), HEAD_DIM=head_dim)
    const.update(BLOCK_N=block_n, PAGE=page, IS_FP8=fp8, ASM=fp8, EVICT="", UPCAST=False)
    const.update(PREFETCH=True, DEVICE_PLAN=True, TARGET_VARLEN=132 * 12, MIN_SPLIT=256)
    const.update(BLOCK_B=16, MAX_SPLITS=256, MERGE=4, SEARCH=256, POLL_NS=64)
    const.update(dp.merge_meta(group, head_dim))
    params = dp._decode_persistent.params
    const.update({p.name: p.default for p in params if p.is_constexpr and p.name not in const})
    sig.update({k: "constexpr" for k in const})
    div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n.startswith("stride")]
    src = ASTSource(dp._decode_persistent, sig, const,
                    attrs={(i,): [["tt.divisibility", 16]] for i in div})  # fmt: skip
    opts = {"num_warps": 4, "num_stages": 2}
    if fp8:
        opts["maxnreg"] = dp.FP8_MAXNREG
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as d:
        ptx = Path(d) / "k.ptx"
        ptx.write_text(k.asm["ptx"])
        log = subprocess.run(
            [str(ptxas), "-v", "--gpu-name=sm_90a", str(ptx), "-o", str(Path(d) / "k.cubin")],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    spills = sum(int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", log))
    return regs, spills, k.metadata.shared


def main() -> int:
    print(f"triton {triton.__version__}, sm_90, 4 warps, 2 stages (the configs' defaults)")
    if EVICT:
        from kdash.kernels import l2_hint

        refused = l2_hint.install()
        if refused:
            print(f"--hint: {refused}", file=sys.stderr)
            return 2
        print("stage 1 and fused with the L2 evict-first hint (persistent without)")
    if "--kmma" in sys.argv[1:]:
        print("\n".join(kmma_lines()))
        return 0
    for name, kind, d, group, page, bn in LAYOUTS:
        try:
            r1, s1 = compile_one(False, kind, d, group, page, bn)
            r2, s2 = compile_one(True, kind, d, group, page, bn)
            r3, sp3, s3 = compile_persistent(kind, d, group, page, bn)
        except Exception as e:  # noqa: BLE001 - one layout that does not compile is reported
            print(f"{name:>24}: {type(e).__name__}: {str(e)[:200]}")
            continue
        print(
            f"{name:>24}: stage 1 {r1} registers, {s1} B shared | fused {r2}, {s2} B | "
            f"persistent{' (cvt)' if kind != 'bf16' else ''} {r3}, {sp3} B spilled, {s3} B"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
