"""A compiled Triton kernel launched by the driver's ``cuLaunchKernel``, parameters packed once.

Triton's C launcher parses every argument of every launch from a Python tuple (a decode stage 1
has over twenty), then calls ``cuLaunchKernelEx``. On the H200 that cost 8-13 us a launch where
an empty launch costs 3.5 (bench/NOTES-kernels.md), so a decode step of two launches spent
16-20 us of host time, above the 10 us a plan's ``run`` is allowed. Here every parameter lives in
a fixed slot of a ctypes array built once from the compiled kernel; a launch writes the few
pointers that change (q, the caches, the scales) into their slots and makes one driver call.

What the parameter list is comes from two places that must agree, or no launcher is made (the
caller keeps Triton's): the kernel's specialised signature (which arguments Triton turned into
compile-time constants) and the ``.entry`` of its PTX (how many parameters the GPU code takes, and
of what kind; Triton appends its scratch pointers there, passed as null since the kernels here
need no scratch memory, which is checked).
"""

from __future__ import annotations

import ctypes
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

# One PTX kernel parameter: ``.param .u64 .ptr .global .align 1 name`` or ``.param .u32 name``.
_PARAM = re.compile(r"\.param\s+\.(?P<type>[a-z]+)(?P<bits>\d+)(?P<ptr>\s+\.ptr)?[^,)]*?\s+(\w+)")


class DriverLaunchError(RuntimeError):
    """``cuLaunchKernel`` refused a launch; nothing ran (its CUresult is ``code``)."""

    def __init__(self, code: int) -> None:
        super().__init__(f"cuLaunchKernel failed: CUresult {code}")
        self.code = code


@dataclass(frozen=True)
class PtxParam:
    """One parameter of a PTX kernel entry: ``kind`` is ``ptr``, ``int`` or ``float``."""

    kind: str
    bits: int


def ptx_params(ptx: str, name: str) -> list[PtxParam] | None:
    """The parameters of the ``.entry name(...)`` in ``ptx``, in order; None if it is not there
    or a parameter's type is not one a Triton kernel takes (pointers, integers, fp32/fp64)."""
    m = re.search(r"\.entry\s+" + re.escape(name) + r"\s*\((?P<body>[^)]*)\)", ptx)
    if m is None:
        return None
    out: list[PtxParam] = []
    for p in _PARAM.finditer(m.group("body")):
        t, bits = p.group("type"), int(p.group("bits"))
        if p.group("ptr"):
            if bits != 64:
                return None
            out.append(PtxParam("ptr", 64))
        elif t in ("u", "s", "b") and bits in (32, 64):
            out.append(PtxParam("int", bits))
        elif t == "f" and bits in (32, 64):
            out.append(PtxParam("float", bits))
        else:
            return None
    return out


def kept_arguments(signature: Sequence[str] | None, args: Sequence[Any]) -> list[int] | None:
    """Indices of the runtime arguments that reach the GPU code: those the compiled kernel's
    signature does not mark ``constexpr`` (Triton specialises an integer 1 or a None into a
    constant). None when the signature does not cover the arguments."""
    if signature is None or len(signature) < len(args):
        return None
    return [i for i in range(len(args)) if signature[i] != "constexpr"]


def pack_plan(
    params: Sequence[PtxParam], args: Sequence[Any], kept: Sequence[int]
) -> list[tuple[str, int, Any]] | None:
    """``(ctype, slot, value)`` for every PTX parameter: the kept arguments in order, then
    Triton's trailing scratch pointers as null. None when the two disagree in count or kind
    (a pointer given as anything but an int, an int out of the parameter's range, a float where
    an int is taken), which would launch the kernel on garbage."""
    if len(params) < len(kept):
        return None
    extra = params[len(kept) :]
    if len(extra) > 2 or any(p.kind != "ptr" for p in extra):
        return None
    plan: list[tuple[str, int, Any]] = []
    for slot, (p, i) in enumerate(zip(params, kept, strict=False)):
        v = args[i]
        if isinstance(v, bool):
            return None
        if p.kind == "ptr":
            if not isinstance(v, int) or v < 0 or v >= 1 << 64:
                return None
            plan.append(("u64", slot, v))
        elif p.kind == "int":
            if not isinstance(v, int):
                return None
            if p.bits == 32 and not -(1 << 31) <= v < 1 << 31:
                return None
            plan.append((("i32" if p.bits == 32 else "i64"), slot, v))
        else:
            if not isinstance(v, float):
                return None
            plan.append((("f32" if p.bits == 32 else "f64"), slot, v))
    for k in range(len(kept), len(params)):
        plan.append(("u64", k, 0))
    return plan


_CTYPES = {
    "u64": ctypes.c_uint64,
    "i32": ctypes.c_int32,
    "i64": ctypes.c_int64,
    "f32": ctypes.c_float,
    "f64": ctypes.c_double,
}


class ParamBlock:
    """The kernel parameters as ctypes values, and the ``void*[]`` the driver reads them
    through. Slot ``i`` holds parameter ``i``; :meth:`setter` gives a pointer slot's writer."""

    def __init__(self, plan: Sequence[tuple[str, int, Any]]) -> None:
        self.values = [_CTYPES[t](v) for t, _, v in plan]
        n = len(self.values)
        self.array = (ctypes.c_void_p * max(n, 1))(
            *(ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in self.values)
        )

    def slot(self, i: int) -> ctypes._SimpleCData:
        return self.values[i]


def _driver() -> Any:
    """``cuLaunchKernel`` of the process's libcuda (already loaded by torch/Triton)."""
    lib = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the GIL stays held for a call of microseconds
    fn = lib.cuLaunchKernel
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    return fn


_LAUNCH: list[Any] = []


def signature_of(compiled: Any) -> list[str] | None:
    """The specialised signature of a compiled kernel, one type per parameter in order
    (``constexpr`` for the specialised ones), or None when this Triton does not keep it."""
    src = getattr(compiled, "src", None)
    sig = getattr(src, "signature", None)
    if isinstance(sig, dict):
        return [str(t) for t in sig.values()]
    return None


def launcher_for(
    compiled: Any,
    grid: tuple[int, int, int],
    args: Sequence[Any],
    live: Sequence[int],
) -> Callable[..., None] | None:
    """``fire(stream, *values)``: ``compiled`` launched by the driver over ``grid`` with the
    runtime arguments ``args``, those at the indices ``live`` replaced by ``values`` at each
    launch (pointers, as ints). None when this kernel cannot be launched this way: cooperative,
    PDL or cluster launches, scratch memory, or a parameter list the two sources disagree on.

    ``args`` are the runtime arguments only (no constexprs), with every pointer as an int.
    """
    md = getattr(compiled, "metadata", None)
    try:
        if md.global_scratch_size or md.profile_scratch_size:
            return None
        if md.launch_cooperative_grid or md.launch_pdl or md.num_ctas != 1:
            return None
        name, shared, threads = md.name, int(md.shared), int(md.num_warps) * 32
        ptx = compiled.asm["ptx"]
        function = compiled.function
    except (AttributeError, KeyError, TypeError):
        return None
    params = ptx_params(ptx, name)
    kept = kept_arguments(signature_of(compiled), args)
    if params is None or kept is None:
        return None
    plan = pack_plan(params, args, kept)
    if plan is None:
        return None
    # A live argument must be a pointer parameter that reaches the GPU code, so that writing its
    # slot is all a new value needs.
    slot_of = {arg: slot for slot, arg in enumerate(kept)}
    if any(i not in slot_of or params[slot_of[i]].kind != "ptr" for i in live):
        return None
    block = ParamBlock(plan)
    if not _LAUNCH:
        try:
            _LAUNCH.append(_driver())
        except (OSError, AttributeError):  # no libcuda here: Triton's launcher stays
            return None
    launch = _LAUNCH[0]
    g0, g1, g2 = (int(x) for x in grid)
    array = block.array
    fn_handle = ctypes.c_void_p(function)
    slots = tuple(block.slot(slot_of[i]) for i in live)

    def fire(stream: int, *values: int) -> None:
        for s, v in zip(slots, values, strict=True):
            s.value = v
        rc = launch(fn_handle, g0, g1, g2, threads, 1, 1, shared, stream, array, None)
        if rc:
            raise DriverLaunchError(rc)

    fire.block = block  # type: ignore[attr-defined]  # kept alive with the closure; for tests
    return fire
