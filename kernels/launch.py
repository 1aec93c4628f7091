"""A Triton kernel bound to one grid and one set of compile-time values, launched cheaply.

Triton's ``kernel[grid](...)`` runs its JIT binder on every call: it inspects every argument,
builds a specialisation key, looks the compiled kernel up and only then launches. For the decode
kernels that is tens of microseconds of host time per call (bench/NOTES-kernels.md), more than a
64k-token decode takes on the GPU. A :class:`BoundKernel` goes through that path once, keeps the
compiled kernel it returns, and afterwards hands the arguments straight to the compiled kernel's
launcher, as Triton itself does at the end of its own path (every parameter in signature order,
the compile-time ones included; the launcher skips those).

That shortcut is only right while the arguments would have produced the same specialisation, so
the caller must keep the scalar arguments fixed (a plan does) and the fast path is left whenever a
pointer argument loses the 16-byte alignment the compiled kernel assumed, or a launch hook (a
profiler such as proton) is installed: those calls take Triton's own path. In the CPU interpreter
every call takes Triton's own path.

A caller that launches the same kernel many times with most arguments fixed (a decode plan) can
go one step further with :meth:`BoundKernel.launcher`: a function of the stream and the leading
arguments only, the fixed ones and the constexpr tail packed once. Pointers may be passed there
as integers (``data_ptr()``), which every Triton CUDA launcher accepts: it then skips the
``data_ptr()`` call and the ``cuPointerGetAttribute`` driver query it makes for each tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import triton

from ._common import interpreting


def _hook_set(hook: Any) -> bool:
    """Whether a launch hook would do anything. Triton keeps each hook as a HookChain object
    that is there whether or not anything was added to it (3.6 and 3.9 alike): only a chain with
    calls in it, or a plain callable, is a hook."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if isinstance(calls, list) else True


try:  # Triton >= 3.4 keeps the launch hooks in its knobs
    from triton import knobs as _knobs

    _CHAIN = getattr(_knobs, "HookChain", None)

    def _hooks_installed() -> bool:
        rt = _knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        if _CHAIN is not None and type(enter) is _CHAIN and type(leave) is _CHAIN:
            return bool(enter.calls) or bool(leave.calls)  # the usual case, checked per run
        return _hook_set(enter) or _hook_set(leave)

except ImportError:  # pragma: no cover - older Triton keeps them on CompiledKernel

    def _hooks_installed() -> bool:
        from triton.compiler import CompiledKernel

        ck: Any = CompiledKernel
        return _hook_set(getattr(ck, "launch_enter_hook", None)) or _hook_set(
            getattr(ck, "launch_exit_hook", None)
        )


class BoundKernel:
    """``fn`` at ``grid`` with the compile-time keywords ``meta`` (constexprs and launch options).

    Call it with the runtime arguments only, positionally, in the kernel's parameter order. Every
    runtime parameter must come before every constexpr one (true of the kernels here; checked).
    """

    __slots__ = (
        "fn", "grid", "meta", "_compiled", "_tail", "_stream", "_device", "_g", "_direct",
        "scratch", "scratch_per_program", "shared", "shared_refused", "_packed",
    )  # fmt: skip

    def __init__(
        self,
        fn,
        grid: tuple[int, ...],
        meta: dict[str, Any],
        scratch=None,
        per_program: int = 0,
        shared: int = 0,
    ) -> None:
        """``scratch``: a device buffer of ``per_program`` bytes for each program of the grid,
        for a kernel that needs global scratch memory (in-kernel TMA descriptors): the direct
        launches pass it instead of Triton allocating one per launch. A kernel needing more
        than ``per_program`` keeps Triton's path. ``shared``: dynamic shared memory each launch
        after the first asks for at least (bytes), which caps the programs an SM holds
        (:func:`kdash.kernels.residency.shared_for_cap`); where the driver refuses it,
        ``shared_refused`` says why and the kernel's own figure stays."""
        self.fn, self.grid, self.meta = fn, tuple(grid), dict(meta)
        self.scratch, self.scratch_per_program = scratch, per_program
        self.shared, self.shared_refused = int(shared), None
        self._packed = None
        g = (*self.grid, 1, 1)
        self._g = (int(g[0]), int(g[1]), int(g[2]))
        self._compiled = None
        self._tail: tuple | None = None
        self._stream = None
        self._device = 0
        self._direct: tuple | None = None

    def _constexpr_tail(self, n_runtime: int) -> tuple | None:
        """The constexpr values in signature order, or None when the layout is not as assumed."""
        params = getattr(self.fn, "params", None)
        if params is None:
            return None
        runtime = [p for p in params if not p.is_constexpr]
        if len(runtime) != n_runtime or any(p.is_constexpr for p in params[:n_runtime]):
            return None
        tail = []
        for p in params[n_runtime:]:
            if p.name in self.meta:
                tail.append(self.meta[p.name])
            elif getattr(p, "has_default", False):
                tail.append(p.default)
            else:
                return None
        return tuple(tail)

    def jit(self, *args):
        """Launch through Triton's own path (compiles on first use)."""
        return self.fn[self.grid](*args, **self.meta)

    def __call__(self, *args) -> None:
        ck = self._compiled
        if ck is not None and not _hooks_installed():
            g0, g1, g2 = self._g
            d = self._direct
            if d is not None:
                d(self._stream(self._device), *args)
                return
            ck.run(
                g0,
                g1,
                g2,
                self._stream(self._device),
                ck.function,
                self._packed,
                None,
                None,
                None,
                *args,
                *self._tail,
            )
            return
        compiled = self.jit(*args)
        if ck is None and compiled is not None and not interpreting_args(args):
            self._arm(compiled, len(args))

    def _arm(self, compiled, n_runtime: int) -> None:
        tail = self._constexpr_tail(n_runtime)
        if tail is None:
            return
        try:
            import torch

            self._device = torch.cuda.current_device()
            self._stream = triton.runtime.driver.active.get_current_stream
            compiled.run  # noqa: B018 - loads the module now, not inside a later capture
            compiled.function  # noqa: B018
            packed = compiled.packed_metadata
        except Exception:  # noqa: BLE001 - a Triton without these attributes keeps the JIT path
            return
        self._packed = self._padded(compiled, packed)
        self._tail = tail
        self._compiled = compiled
        self._direct = _direct_entry(compiled, self._g, tail, self._scratch_ptr(), self._packed)

    def _padded(self, compiled, packed: tuple) -> tuple:
        """``packed`` (Triton's (warps, CTAs, shared bytes)) asking for :attr:`shared` bytes,
        once the driver allows that much dynamic shared memory; else as it is, and why."""
        if self.shared <= int(compiled.metadata.shared):
            return packed
        if len(packed) != 3:
            self.shared_refused = f"launch metadata of {len(packed)} fields, not 3"
            return packed
        from . import graph_launch  # the process's ctypes driver

        drv = graph_launch.driver()
        if drv is None:
            self.shared_refused = graph_launch.driver_refused()
            return packed
        try:
            drv.allow_dynamic_shared(compiled.function, self.shared)
        except graph_launch.DriverError as e:
            self.shared_refused = str(e)
            return packed
        return (packed[0], packed[1], self.shared)

    def _scratch_ptr(self) -> tuple[int, int] | None:
        """``(pointer, bytes a program)`` of the caller's scratch buffer, if any."""
        if self.scratch is None:
            return None
        return self.scratch.data_ptr(), self.scratch_per_program

    @property
    def fast(self) -> bool:
        """Whether calls now go straight to the compiled kernel's launcher."""
        return self._compiled is not None

    def launcher(self, fixed: tuple) -> Callable[..., None] | None:
        """``fire(stream, *head)``: this kernel launched on ``stream`` with the runtime
        arguments ``head + fixed``, through the launcher's C entry point, or None while there is
        none (not armed yet: no call went through :meth:`__call__`; another Triton; a kernel
        that needs scratch memory). Pointers in ``head`` and ``fixed`` may be ints.

        Nothing is checked per call: the caller keeps the specialisation the kernel was armed
        with (the same scalars, 16-byte aligned pointers) and checks :func:`hooks_installed`.
        """
        if self._compiled is None or self._direct is None:
            return None
        tail = (*fixed, *self._tail)
        return _direct_entry(self._compiled, self._g, tail, self._scratch_ptr(), self._packed)

    def stream_reader(self) -> Callable[[], int]:
        """A callable giving the current stream of the device this kernel was armed on (call
        after arming); a partial of Triton's getter, so reading it adds no Python frame."""
        return functools.partial(self._stream, self._device)


# Whether a launch hook is installed now (then every launch must take Triton's path).
hooks_installed = _hooks_installed


# Triton releases whose CUDA launcher object was read for :func:`_direct_entry`. Two layouts of
# its C ``launch``: (grid x3, stream, function, cooperative, pdl, global scratch, profile
# scratch, packed metadata, launch metadata, enter hook, exit hook, *kernel args) up to 3.6; with
# the argument annotations (3.9): (grid x3, stream, function, cooperative, pdl, packed metadata,
# launch metadata, enter hook, exit hook, global scratch, profile scratch, annotations,
# signature, kernel args as one tuple).
_DIRECT_VERSIONS = ("3.6.", "3.9.")


def _direct_entry(
    compiled,
    grid: tuple[int, int, int],
    tail: tuple,
    scratch: tuple[int, int] | None = None,
    packed: tuple | None = None,
) -> Callable[..., None] | None:
    """``fire(stream, *head)``: the launcher object's C ``launch`` called with what the object
    itself would add (global scratch: ``scratch``'s buffer, ``(pointer, bytes a program)``,
    when the kernel needs some and it is large enough, else None is returned; no profile
    scratch, launch metadata or hooks), for the runtime arguments ``head + tail``; None when the
    layout is not known. ``packed``: the launch metadata, the kernel's own when None."""
    if not triton.__version__.startswith(_DIRECT_VERSIONS):
        return None
    try:
        launcher = compiled.run
        launch = launcher.launch
        if launcher.profile_scratch_size:
            return None
        need = launcher.global_scratch_size * getattr(launcher, "num_ctas", 1)
        gs = None
        if need:
            if scratch is None or scratch[1] < need:
                return None
            gs = scratch[0]
        if getattr(launcher, "gsan_enabled", False):
            return None
        function = compiled.function
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        packed = packed if packed is not None else compiled.packed_metadata
        annotations = getattr(launcher, "arg_annotations", None)
        signature = getattr(launcher, "kernel_signature", None)
    except AttributeError:
        return None
    g0, g1, g2 = grid
    if annotations is not None and signature is not None:

        def fire(stream, *head) -> None:
            launch(
                g0, g1, g2, stream, function, coop, pdl, packed, None, None, None, gs, None,
                annotations, signature, (*head, *tail),
            )  # fmt: skip

        return fire

    def fire_flat(stream, *head) -> None:
        launch(
            g0, g1, g2, stream, function, coop, pdl, gs, None, packed, None, None, None,
            *head, *tail,
        )  # fmt: skip

    return fire_flat


def interpreting_args(args) -> bool:
    """True when the kernel runs in Triton's CPU interpreter (no compiled kernel to keep)."""
    for a in args:
        if hasattr(a, "device"):
            return interpreting(a)
    return True
