"""An L2 eviction hint that survives Triton's software pipelining.

Decode streams every K/V byte once, so its loads ask for ``eviction_policy="evict_first"``: a
streamed line should be the first one L2 gives up, not a line some other kernel still wants (or
a dirty line whose write-back then competes with the stream). Triton keeps the request up to its
GPU IR (``ttg.async_copy_global_to_local ... evictionPolicy = evict_first``) but drops it when it
lowers those copies to ``cp.async`` (3.6 and 3.9 alike; see bench/NOTES-kernels.md). This module
puts it back: a compile-stage hook that, for a kernel whose every async copy asked for
``evict_first``, rewrites each ``cp.async`` of its PTX to carry ``.L2::cache_hint`` with an
evict-first policy made once at the kernel's entry (``createpolicy.fractional``). Kernels that
did not ask are left byte for byte as Triton made them.

The rewrite is recorded in the kernel's metadata (``kdash_l2_evict_first``: how many copies it
hinted), so what ran can be checked (:func:`hinted`). Triton's cache key does not include stage
hooks: :func:`install` runs when :mod:`kdash.kernels.decode_plan` is imported, before any decode
kernel compiles, and a kernel compiled without the hook simply reads 0.
"""

from __future__ import annotations

import os
import re
from typing import Any

META_KEY = "kdash_l2_evict_first"
ENV_OFF = "KDASH_L2_HINT"  # "0": no hook, every kernel exactly as Triton makes it
POLICY_REG = "%rdkdashl2"
_MAKE = f"createpolicy.fractional.L2::evict_first.b64 \t{POLICY_REG}, 1.0"

_ASYNC_COPY = "ttg.async_copy_global_to_local"
_EVICT_FIRST = "evictionPolicy = evict_first"
# One cp.async (global -> shared), optionally predicated: the opcode, then its operands.
_CP_ASYNC = re.compile(r"(@!?%\w+\s+)?\bcp\.async\.(ca|cg)\.shared\.global(\s+[^;]*);")
_ENTRY_OPEN = re.compile(r"^\.(?:visible\s+)?\.entry\b[^{]*?^\{[ \t]*$", re.M | re.S)


def wants_evict_first(ttgir: str) -> bool:
    """True when the GPU IR has async copies and every one of them asked for evict-first."""
    copies = [line for line in ttgir.splitlines() if _ASYNC_COPY in line]
    return bool(copies) and all(_EVICT_FIRST in line for line in copies)


def hint_ptx(ptx: str) -> tuple[str, int]:
    """``ptx`` with every global -> shared ``cp.async`` carrying an evict-first L2 policy, and
    how many were rewritten. The policy register is declared at the kernel's opening brace and
    made right before each copy: one policy made at the entry and kept alive across the loop
    cost stage 1 35 registers (120 -> 155 at 32/8/128, sm_90, Triton 3.6), one program an SM.
    PTX with no copy, or not one entry, is returned unchanged with 0."""
    entries = list(_ENTRY_OPEN.finditer(ptx))
    if len(entries) != 1 or not _CP_ASYNC.search(ptx):
        return ptx, 0
    body_at = entries[0].end()
    head = f"\n\t.reg .b64 \t{POLICY_REG};"
    if os.environ.get("KDASH_L2_MODE") == "entry":
        head += f"\n\t{_MAKE};"
        body, count = _CP_ASYNC.subn(lambda m: _hinted_copy(m)[len(_MAKE) + 3 :], ptx[body_at:])
        return ptx[:body_at] + head + body, count
    body, count = _CP_ASYNC.subn(_hinted_copy, ptx[body_at:])
    return ptx[:body_at] + head + body, count


def _hinted_copy(m: re.Match) -> str:
    # A predicate guards the copy only: the policy is made unconditionally on the line before.
    pred, level, operands = m.group(1) or "", m.group(2), m.group(3)
    copy = f"{pred}cp.async.{level}.shared.global.L2::cache_hint{operands}, {POLICY_REG};"
    return f"{_MAKE};\n\t{copy}"


def _hook(backend: Any, stages: dict, options: Any, language: Any, capability: Any) -> None:
    if "llir" not in stages or "ptx" not in stages:
        return
    make_llir, make_ptx = stages["llir"], stages["ptx"]

    def llir(src, metadata):
        # The stage's input is the GPU IR after pipelining: the last place the request shows.
        metadata[META_KEY] = -1 if wants_evict_first(str(src)) else 0
        return make_llir(src, metadata)

    def ptx(src, metadata):
        out = make_ptx(src, metadata)
        if metadata.get(META_KEY) == -1:
            out, metadata[META_KEY] = hint_ptx(out)
        return out

    stages["llir"], stages["ptx"] = llir, ptx


def _chain(first, second):
    def both(*args):
        first(*args)
        second(*args)

    both._kdash_l2 = True  # type: ignore[attr-defined]
    return both


def install() -> bool:
    """Add the hook to Triton's compile stages (once; another hook already there still runs,
    before this one). False where this Triton has no stage hook (nothing is hinted then)."""
    if os.environ.get(ENV_OFF) == "0":
        return False
    try:
        from triton import knobs
    except ImportError:
        return False
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "add_stages_inspection_hook"):
        return False
    current = runtime.add_stages_inspection_hook
    if current is _hook or getattr(current, "_kdash_l2", False):
        return True
    runtime.add_stages_inspection_hook = _hook if current is None else _chain(current, _hook)
    return True


def hinted(compiled: Any) -> int:
    """How many ``cp.async`` of a compiled kernel carry the evict-first policy (0: none, or
    compiled without the hook)."""
    meta = getattr(compiled, "metadata", None)
    return max(0, int(getattr(meta, META_KEY, 0) or 0))
