"""An L2 evict-first hint on the decode kernels' K/V copies: the Gluon kernels' TMA tile copies
and the Triton kernels' ``cp.async``.

Decode reads every K/V byte once. ``triton.testing.do_bench`` (the bench's ``decode_bw_ratio``)
flushes L2 before each call by zeroing 256 MiB, so a call starts with L2 full of dirty lines,
and the stream evicts them: ~24 MB of write-back inside the timed call at 1 x 64k on an H100
(Nsight Compute; bench/NOTES-kernels.md, sessions 13, 18 and 33). A server's decode meets the
same thing after any kernel that wrote more than L2 holds. With an evict-first policy the
streamed lines are the first L2 gives up, so the dirty ones (and whatever else L2 holds that
others still want) stay: half as many bytes are written back, but while L2 stays mostly dirty
the stream runs 4-7% slower, so past ~268 MB a call the hint loses what it saves.

Neither copy gets the hint from Triton: Gluon in Triton 3.6 (the H200's) has no cache-policy
parameter for TMA, and Triton's ``cp.async`` lowering drops eviction policies. So a
compile-stage hook rewrites the PTX:

- TMA: every ``cp.async.bulk.tensor`` load of a kernel that carries :data:`MARKER` (the Gluon
  kernels emit it, as a PTX comment, when compiled with ``L2_HINT``, a constexpr, so hinted and
  plain binaries never share a cache entry) gets ``.L2::cache_hint`` and an evict-first policy;
- ``cp.async``: in the kernels named in :data:`CP_ASYNC_KERNELS` whose GPU IR asked for
  ``evict_first`` on their async copies (the ``EVICT`` constexpr), every global-to-shared
  ``cp.async`` gets the same.

A hinted ``cp.async`` needs care with ptxas releases before 13.4 (Triton 3.6 bundles 12.8, 3.9
bundles 12.9, CUDA 13.0 to 13.3 alike): they give a hinted ``LDGSTS`` whose shared address is a
register plus a uniform register the uniform-register field 0, so the instruction reads UR0 and
UR1, which nothing wrote, and the GPU stops with an illegal instruction (session 13's fault;
Triton's PR 11660 stopped emitting such policies for the same reason). A copy whose shared
address is a register alone is encoded right by every release, bit for bit as 13.4 encodes it.
So where the probe below finds the fault, the rewrite also makes the kernel's shared-memory base
opaque to ptxas (``base | z``, with ``z = (%dynamic_smem_size >> 31) & %tid.x``, always 0 but not
provably so, and not uniform): no shared address can then be split into a register plus a
uniform one. :func:`cp_async_refusal` compiles the probe through the same rewrite with the
ptxas Triton will use and reads the field back, so a plan asks for the hint only where the
binary will be right; and every hinted kernel's cubin is read back as it is made, and compiled
again without the hint should a copy still name field 0 (never a binary that traps).

The hook is installed only when a plan asks for the hint (:func:`install`), so no other
kernel's compile goes through it before then. After it, Triton 3.7 and later fold the hook's
key into every kernel's cache key (and ask for it at every launch through Triton's own path),
so a kernel launched that way compiles once more; the plans' pointer launchers do not ask.
"""

from __future__ import annotations

import functools
import re
import struct
import subprocess
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

MARKER = "// kdash:l2-evict-first"
# The Gluon kernels' inline PTX for the marker: a comment and a move ptxas drops.
MARKER_ASM = MARKER + "\n\tmov.b32 $0, $1;"
META_KEY = "kdash_l2_evict_first"
POLICY_REG = "%rdkdashl2"
_MAKE = f"createpolicy.fractional.L2::evict_first.b64 \t{POLICY_REG}, 1.0;"
# One TMA tile load (global -> shared, completing on an mbarrier), optionally predicated.
# (Triton 3.6 writes the destination as shared::cluster, later ones as shared::cta.)
_TMA_LOAD = re.compile(
    r"(@!?%\w+\s+)?\bcp\.async\.bulk\.tensor\.(\d)d\.(shared::cluster|shared::cta)\.global"
    r"\.mbarrier::complete_tx::bytes(\s+[^;]*);"
)
_ENTRY_OPEN = re.compile(r"^\.(?:visible\s+)?\.entry\b[^{]*?^\{[ \t]*$", re.M | re.S)
_HOOK_KEY = ("kdash.kernels.l2_hint", "tma-and-cp-async-evict-first-v3")
# The Triton decode kernels whose cp.async copies the hook hints when their GPU IR asked for it.
CP_ASYNC_KERNELS = frozenset(
    {
        "_decode_stage1",
        "_decode_stage1_fp8_pairs",
        "_decode_stage1_fp8_cvt",
        "_decode_fused",
        "_decode_persistent",
    }
)
# A global -> shared cp.async without a cache hint, optionally predicated.
_CP_ASYNC = re.compile(r"(@!?%\w+\s+)?\bcp\.async\.(ca|cg)\.shared\.global(\s+[^;]*);")
_ASYNC_COPY = "async_copy_global_to_local"
_ASKED = "kdash_l2_cp_async_asked"
_CP_HINTED = "kdash_l2_cp_async_hinted"
# Metadata of a kernel whose hinted copies ptxas still encoded wrong, compiled again without them.
DROPPED_KEY = "kdash_l2_cp_async_dropped"
# The shared-memory base made opaque: z is 0 (a dynamic shared size is below 2**31) but ptxas
# cannot prove it, and the AND with the thread index keeps z (and the base) off the uniform path.
_Z, _W = "%rkdashl2z", "%rkdashl2w"
_OPAQUE_HEAD = (
    f"\n\t.reg .b32 \t{_Z};\n\t.reg .b32 \t{_W};"
    f"\n\tmov.u32 \t{_Z}, %dynamic_smem_size;\n\tshr.u32 \t{_Z}, {_Z}, 31;"
    f"\n\tmov.u32 \t{_W}, %tid.x;\n\tand.b32 \t{_Z}, {_Z}, {_W};"
)
_EXTERN_SHARED = re.compile(r"^\.extern\s+\.shared\s+(?:\.align\s+\d+\s+)?\.b8\s+(\w+)\[\]", re.M)
_HINTED_CP_ASYNC = re.compile(
    r"\bcp\.async\.(ca|cg)\.shared\.global\.L2::cache_hint(\s+[^;]*), "
    + re.escape(POLICY_REG)
    + ";"
)


def hint_ptx(ptx: str) -> tuple[str, int]:
    """``ptx`` with every TMA tile load carrying the evict-first policy, and how many were
    rewritten; PTX without :data:`MARKER`, without such a load or with other than one kernel
    entry is returned unchanged, with 0."""
    if MARKER not in ptx:
        return ptx, 0
    entries = list(_ENTRY_OPEN.finditer(ptx))
    if len(entries) != 1:
        return ptx, 0
    at = entries[0].end()

    def hinted(m: re.Match) -> str:
        pred, dims, space, operands = m.group(1) or "", m.group(2), m.group(3), m.group(4)
        return (
            f"{pred}cp.async.bulk.tensor.{dims}d.{space}.global"
            f".mbarrier::complete_tx::bytes.L2::cache_hint{operands}, {POLICY_REG};"
        )

    body, count = _TMA_LOAD.subn(hinted, ptx[at:])
    if not count:
        return ptx, 0
    return f"{ptx[:at]}\n\t.reg .b64 \t{POLICY_REG};\n\t{_MAKE}{body}", count


def wants_evict_first(ttgir: str) -> bool:
    """Whether any async copy of the GPU IR (after pipelining) asked for evict-first (Triton 3.6
    prints ``evictionPolicy = evict_first``, 3.9 a cache-policy attribute)."""
    return any(_ASYNC_COPY in line and "evict_first" in line for line in ttgir.splitlines())


def hint_cp_async(ptx: str, opaque_base: bool = False) -> tuple[str, int]:
    """``ptx`` with every global -> shared ``cp.async`` carrying the evict-first policy, and how
    many were rewritten. The policy is made on the line before each copy (a uniform value:
    ptxas makes it once; one made at the entry and kept across the loop cost stage 1 35
    registers in session 13); a predicated copy keeps its predicate. With ``opaque_base``, each
    move of an ``.extern .shared`` array's address is ORed with a zero ptxas cannot see through
    (for ptxas before 13.4: the module's docstring). PTX without such a copy, or with other than
    one kernel entry, is returned unchanged, with 0."""
    entries = list(_ENTRY_OPEN.finditer(ptx))
    if len(entries) != 1 or not _CP_ASYNC.search(ptx):
        return ptx, 0
    at = entries[0].end()

    def hinted(m: re.Match) -> str:
        pred, level, operands = m.group(1) or "", m.group(2), m.group(3)
        copy = f"{pred}cp.async.{level}.shared.global.L2::cache_hint{operands}, {POLICY_REG};"
        return f"{_MAKE}\n\t{copy}"

    body, count = _CP_ASYNC.subn(hinted, ptx[at:])
    decl = f"\n\t.reg .b64 \t{POLICY_REG};"
    head = "" if decl in ptx else decl
    if opaque_base and _Z not in ptx:
        symbols = _EXTERN_SHARED.findall(ptx[: entries[0].start()])
        if symbols:
            moves = re.compile(
                rf"^([ \t]*)mov\.[bu]32\s+(%r\w+),\s*({'|'.join(map(re.escape, symbols))});[ \t]*$",
                re.M,
            )
            body = moves.sub(lambda m: f"{m.group(0)}\n{m.group(1)}or.b32 \t{m.group(2)}, "
                             f"{m.group(2)}, {_Z};", body)  # fmt: skip
            head += _OPAQUE_HEAD
    return f"{ptx[:at]}{head}{body}", count


def unhint_cp_async(ptx: str) -> str:
    """``ptx`` with the policy :func:`hint_cp_async` gave its copies taken off again."""
    return _HINTED_CP_ASYNC.sub(r"cp.async.\1.shared.global\2;", ptx)


def _hook(*args: Any) -> Any:
    if not args:  # Triton >= 3.7 asks every launch for a key of the custom stages
        return _HOOK_KEY[0], _HOOK_KEY[1]
    stages = args[1]
    make_llir, make_ptx = stages.get("llir"), stages.get("ptx")
    if make_ptx is None:
        return None
    if make_llir is not None:

        def llir(src, metadata):
            # The stage's input is the GPU IR after pipelining: the last place the ask shows.
            if wants_evict_first(str(src)):
                metadata[_ASKED] = True
            return make_llir(src, metadata)

        stages["llir"] = llir

    def ptx(src, metadata):
        out, count = hint_ptx(make_ptx(src, metadata))
        if metadata.pop(_ASKED, False) and metadata.get("name") in CP_ASYNC_KERNELS:
            tool = triton_ptxas()
            opaque = tool is not None and cp_async_form(tool[0])[0]
            out, copies = hint_cp_async(out, opaque_base=opaque)
            count += copies
            if copies:
                metadata[_CP_HINTED] = copies
        if count:
            metadata[META_KEY] = count
        return out

    make_cubin = stages.get("cubin")
    if make_cubin is not None:

        def cubin(src, metadata):
            out = make_cubin(src, metadata)
            copies = metadata.pop(_CP_HINTED, 0)
            if copies and misencoded(text_sections(out).get(metadata.get("name"), b"")):
                # the copies would trap: the kernel without them rather than a fault
                left = metadata.get(META_KEY, 0) - copies
                if left > 0:
                    metadata[META_KEY] = left
                else:
                    metadata.pop(META_KEY, None)
                metadata[DROPPED_KEY] = copies
                out = make_cubin(unhint_cp_async(src), metadata)
            return out

        stages["cubin"] = cubin

    stages["ptx"] = ptx
    return None


def install() -> str | None:
    """Put the hook in Triton's compile stages (once); None when it is there, else why not
    (a Triton without stage hooks, or another hook already installed, which this one will not
    displace)."""
    try:
        from triton import knobs
    except ImportError:
        return "this Triton has no knobs (no compile-stage hooks)"
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        return "this Triton has no compile-stage hooks"
    current = runtime.add_stages_inspection_hook
    if current is _hook:
        return None
    if current is not None:
        return f"another compile-stage hook is installed ({current!r})"
    runtime.add_stages_inspection_hook = _hook
    return None


def uninstall() -> None:
    """Take the hook out again (tests; a process that is done with hinted kernels)."""
    from triton import knobs

    if knobs.runtime.add_stages_inspection_hook is _hook:
        knobs.runtime.add_stages_inspection_hook = None


def hinted(compiled: Any) -> int:
    """How many copies (TMA loads or ``cp.async``) of a compiled kernel carry the policy (0:
    none, or compiled without the hook)."""
    meta = getattr(compiled, "metadata", None)
    return max(0, int(getattr(meta, META_KEY, 0) or 0))


# -- whether a ptxas encodes a hinted cp.async -----------------------------------------------

# One copy a thread in a loop, which :func:`hint_cp_async` hints as it hints the kernels: the
# shared address is the thread's offset plus the array's base, which ptxas keeps in a uniform
# register, the form it encodes wrongly before 13.4 (unless the base is made opaque).
_PROBE_PTX = """.version 8.0
.target sm_90
.address_size 64
.extern .shared .align 16 .b8 kdash_smem[];
.visible .entry kdash_l2_probe(.param .u64 src, .param .u32 n)
{
\t.reg .b64 %rd<8>;
\t.reg .b32 %r<8>;
\t.reg .pred %p<2>;
\tld.param.u64 %rd1, [src];
\tld.param.u32 %r1, [n];
\tmov.u32 %r2, %tid.x;
\tshl.b32 %r3, %r2, 4;
\tmov.u32 %r4, kdash_smem;
\tadd.u32 %r5, %r4, %r3;
\tcvt.u64.u32 %rd2, %r3;
\tadd.u64 %rd3, %rd1, %rd2;
\tmov.u32 %r6, 0;
LOOP:
\tcp.async.cg.shared.global [%r5], [%rd3], 16;
\tcp.async.commit_group;
\tcp.async.wait_group 0;
\tadd.u64 %rd3, %rd3, 4096;
\tadd.u32 %r6, %r6, 1;
\tsetp.lt.u32 %p1, %r6, %r1;
\t@%p1 bra LOOP;
\tret;
}
"""
_RZ = 255


def text_sections(cubin: bytes) -> dict[str, bytes]:
    """The code of each kernel of a 64-bit CUDA ELF, by name (the ``.text.<name>`` sections);
    empty for bytes that are not one."""
    if cubin[:4] != b"\x7fELF" or cubin[4] != 2:
        return {}
    (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
    size, count, names_at = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * size) for i in range(count)]
    strtab = heads[names_at][4]
    out = {}
    for h in heads:
        name = cubin[strtab + h[0] : cubin.index(b"\0", strtab + h[0])].decode()
        if name.startswith(".text."):
            out[name[6:]] = cubin[h[4] : h[4] + h[5]]
    return out


class Copy(NamedTuple):
    """One ``LDGSTS`` of a kernel's code."""

    offset: int  # bytes from the kernel's first instruction
    uniform_base: bool  # the shared address has a uniform register part
    address_reg: int  # the shared address's register (255: none, a uniform address alone)
    field: int  # the uniform register field: the address's uniform part and the memory
    # descriptor after it (with ``uniform_base``), else the descriptor alone


def ldgsts(code: bytes) -> list[Copy]:
    """The sm_90 ``LDGSTS`` (cp.async) instructions of a kernel's code. An instruction is 16
    bytes; ``LDGSTS`` is the one whose low 9 bits are 0x1ae (checked against cuobjdump on 400
    Hopper cubins, 8,540 of them), bit 9 clear in the form whose shared address adds a uniform
    register (``[R+URn], desc[URn+1]``; set: ``[R], desc[URn]``), bits 16-23 its shared address
    register, bits 64-69 its uniform field. Every ``LDGSTS`` names a memory descriptor; a cache
    policy is in the descriptor's value, not in the instruction's bits."""
    out = []
    for at in range(0, len(code) - 15, 16):
        lo, hi = struct.unpack_from("<QQ", code, at)
        if lo & 0x1FF == 0x1AE:
            out.append(Copy(at, not lo & 0x200, (lo >> 16) & 0xFF, hi & 0x3F))
    return out


def misencoded(code: bytes) -> int:
    """How many ``LDGSTS`` of a kernel's code address shared memory as a register plus a
    uniform register while naming uniform field 0: what ptxas before 13.4 emits for hinted
    copies of that form (the field should name the pair it filled)."""
    return sum(1 for c in ldgsts(code) if c.uniform_base and c.address_reg != _RZ and c.field == 0)


def triton_ptxas() -> tuple[str, str] | None:
    """``(path, release)`` of the ptxas Triton compiles sm_90 kernels with, or None."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
    except ImportError:
        return None
    try:
        tool = get_ptxas(90)
    except Exception:  # noqa: BLE001 - a Triton whose tool lookup fails has no ptxas to ask
        return None
    return (tool.path, tool.version) if tool is not None else None


@functools.lru_cache(maxsize=16)
def probe(ptxas: str, opaque_base: bool = False) -> str | None:
    """None when ``ptxas`` encodes the probe's copy as :func:`hint_cp_async` hints it (with
    ``opaque_base`` or not) with the uniform field right, else why not (the probe compiled and
    its fields read back)."""
    ptx, copies = hint_cp_async(_PROBE_PTX, opaque_base=opaque_base)
    assert copies == 1, "the probe's copy was not hinted"
    with tempfile.TemporaryDirectory(prefix="kdash-l2-") as d:
        src, out = Path(d) / "probe.ptx", Path(d) / "probe.cubin"
        src.write_text(ptx)
        try:
            res = subprocess.run(
                [ptxas, "--gpu-name=sm_90", str(src), "-o", str(out)],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
        except (OSError, subprocess.SubprocessError) as e:
            return f"ptxas could not be run ({e})"
        if res.returncode != 0:
            return f"ptxas failed on the probe: {(res.stderr or res.stdout).strip()[-200:]}"
        code = text_sections(out.read_bytes()).get("kdash_l2_probe", b"")
    if not ldgsts(code):
        return "the probe's cp.async did not compile to an LDGSTS"
    if misencoded(code):
        return "it encodes a hinted cp.async with the wrong uniform register (fixed in ptxas 13.4)"
    return None


def cp_async_form(ptxas: str) -> tuple[bool, str | None]:
    """``(opaque_base, why not)`` for hinted copies compiled by ``ptxas``: the plain rewrite
    where it encodes it right, else the one with the shared base made opaque where that is
    right, else a reason to leave the copies unhinted."""
    why = probe(ptxas)
    if why is None:
        return False, None
    if probe(ptxas, opaque_base=True) is None:
        return True, None
    return False, why


def cp_async_refusal() -> str | None:
    """None when the Triton kernels' cp.async may carry the hint here (Triton's ptxas encodes
    it, as it is or with the shared base made opaque, and the hook is in), else why not."""
    tool = triton_ptxas()
    if tool is None:
        return "this Triton has no ptxas for sm_90 to ask"
    why = cp_async_form(tool[0])[1]
    if why:
        return (
            f"ptxas {tool[1]} ({tool[0]}): {why}; TRITON_PTXAS_PATH can name a ptxas 13.4 or later"
        )
    return install()
