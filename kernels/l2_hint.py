"""An L2 evict-first hint on the TMA tile copies of the Gluon decode kernels.

Decode reads every K/V byte once. ``triton.testing.do_bench`` (the bench's ``decode_bw_ratio``)
flushes L2 before each call by zeroing 256 MiB, so a call starts with L2 full of dirty lines,
and the stream evicts them: ~50 MB of write-back inside the timed call (bench/NOTES-kernels.md,
sessions 13 and 18). A server's decode meets the same thing after any kernel that wrote more
than L2 holds. With an evict-first policy the streamed lines are the first L2 gives up, so the
dirty ones (and whatever else L2 holds that others still want) stay.

Triton's ``cp.async`` lowering drops eviction policies, and ``cp.async`` with a cache hint hits
a ptxas fault on sm_90 (session 13). The TMA tile copy takes a hint without trouble (its SASS,
``UTMALDG ... desc[URn]``, carries the policy in a uniform register pair), but Gluon in Triton
3.6 (the H200's) has no parameter for it. So this module rewrites the PTX: a compile-stage
hook adds ``.L2::cache_hint`` and an evict-first policy (made once at the kernel's entry) to
every ``cp.async.bulk.tensor`` load of a kernel that carries :data:`MARKER` (the Gluon kernels
emit it, as a PTX comment, when compiled with ``L2_HINT``). Kernels without the marker are left
byte for byte as Triton made them; ``L2_HINT`` is a constexpr, so hinted and plain binaries
never share a cache entry.

The hook is installed only when a plan asks for the hint (:func:`install`), so no other
kernel's compile goes through it before then. After it, Triton 3.7 and later fold the hook's
key into every kernel's cache key (and ask for it at every launch through Triton's own path),
so a kernel launched that way compiles once more; the plans' pointer launchers do not ask.
"""

from __future__ import annotations

import re
from typing import Any

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
_HOOK_KEY = ("kdash.kernels.l2_hint", "tma-evict-first-v1")


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


def _hook(*args: Any) -> Any:
    if not args:  # Triton >= 3.7 asks every launch for a key of the custom stages
        return _HOOK_KEY[0], _HOOK_KEY[1]
    stages = args[1]
    make_ptx = stages.get("ptx")
    if make_ptx is None:
        return None

    def ptx(src, metadata):
        out, count = hint_ptx(make_ptx(src, metadata))
        if count:
            metadata[META_KEY] = count
        return out

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
    """How many TMA loads of a compiled kernel carry the policy (0: none, or not hinted)."""
    meta = getattr(compiled, "metadata", None)
    return max(0, int(getattr(meta, META_KEY, 0) or 0))
