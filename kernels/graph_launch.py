"""A plan's launches held as one CUDA graph and started with one driver call.

A decode step on the plan's pointer launchers still costs the host one ``cuLaunchKernelEx`` per
kernel (two on the two-launch path), several microseconds each on the H200's host
(bench/NOTES-kernels.md). A :class:`GraphSlot` captures the plan's launches, with their
arguments, into a CUDA graph (on a stream of its own: nothing runs while capturing) and starts
that graph on the caller's stream with one ``cuGraphLaunch``. The graph's kernel arguments are
fixed at capture, so a graph serves one *key*: the pointers a run passes (q, the caches, the
scales); everything else a plan keeps fixed, and a plan that rebinds drops its slot. A slot
holds a graph per key, up to ``MAX_GRAPHS`` (the oldest goes first): one plan serves every layer
of a step, each layer with its own caches.

When to capture: the second time a key is seen (a server that reuses its q buffer, or whose
allocator hands the same blocks back every step, pays one capture per layer; one whose pointers
change every call never captures, and after ``MAX_CAPTURES`` captures the slot stops trying).
A run on a stream that is being captured (the caller's own graph) or a stream that cannot say
whether it is launches the kernels as usual, so the caller's graph holds kernel nodes.

The CUDA driver is reached through ctypes (``libcuda``): :class:`Driver`. The policy is kept
apart from it (``GraphSlot`` takes the driver as an argument) so that it can be tested where
there is no GPU.
"""

from __future__ import annotations

import ctypes
import threading
import weakref
from collections.abc import Callable
from typing import Any

# Whether plans launch through a graph (set from bench/NOTES-kernels.md's figures).
GRAPH_LAUNCH_DEFAULT = True
# Graphs a slot holds (keys: a model's layers, times the few q buffers an allocator hands out).
MAX_GRAPHS = 128
# Captures a slot makes before it gives up (its keys kept changing).
MAX_CAPTURES = 2 * MAX_GRAPHS

_CAPTURE_THREAD_LOCAL = 1  # CUstreamCaptureMode: only this thread's unsafe calls are refused
_CAPTURE_NONE = 0  # CUstreamCaptureStatus: the stream is not being captured


class DriverError(RuntimeError):
    """A CUDA driver call failed: its name and result code."""


# CUfunction_attribute: the most dynamic shared memory a launch of the function may ask for.
_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Driver:
    """The few CUDA driver calls kdash's kernels make, through ctypes: a graph slot's, and the
    shared-memory limit a residency cap raises (:class:`kdash.kernels.launch.BoundKernel`)."""

    def __init__(self, lib: Any = None) -> None:
        lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
        vp, u64 = ctypes.c_void_p, ctypes.c_ulonglong

        def fn(name: str, *argtypes) -> Any:
            f = getattr(lib, name)
            f.argtypes = list(argtypes)
            f.restype = ctypes.c_int
            return f

        self._begin = fn("cuStreamBeginCapture_v2", vp, ctypes.c_int)
        self._end = fn("cuStreamEndCapture", vp, ctypes.POINTER(vp))
        self._instantiate = fn("cuGraphInstantiateWithFlags", ctypes.POINTER(vp), vp, u64)
        self._graph_destroy = fn("cuGraphDestroy", vp)
        self._exec_destroy = fn("cuGraphExecDestroy", vp)
        self._is_capturing = fn("cuStreamIsCapturing", vp, ctypes.POINTER(ctypes.c_int))
        self._launch = fn("cuGraphLaunch", vp, vp)
        self._set_attribute = fn("cuFuncSetAttribute", vp, ctypes.c_int, ctypes.c_int)
        self._status = ctypes.c_int(0)
        self._status_ref = ctypes.byref(self._status)

    @staticmethod
    def _check(name: str, rc: int) -> None:
        if rc:
            raise DriverError(f"{name} returned CUDA error {rc}")

    def capture(self, stream: int, launches: Callable[[int], None]) -> int:
        """The exec handle of a graph of what ``launches(stream)`` enqueues on ``stream``."""
        self._check("cuStreamBeginCapture", self._begin(stream, _CAPTURE_THREAD_LOCAL))
        graph = ctypes.c_void_p()
        try:
            launches(stream)
        finally:
            # Ends the capture whatever happened, so the stream is usable again.
            rc_end = self._end(stream, ctypes.byref(graph))
        self._check("cuStreamEndCapture", rc_end)
        exe = ctypes.c_void_p()
        rc = self._instantiate(ctypes.byref(exe), graph, 0)
        self._graph_destroy(graph)  # the exec keeps what it needs
        self._check("cuGraphInstantiate", rc)
        return int(exe.value or 0)

    def launch(self, exe: int, stream: int) -> None:
        self._check("cuGraphLaunch", self._launch(exe, stream))

    def start(self, exe: int, stream: int) -> bool:
        """:meth:`launch` unless ``stream`` is being captured (or cannot say): then False. One
        Python frame around both driver calls, as it runs on every decode step."""
        if self._is_capturing(stream, self._status_ref) or self._status.value != _CAPTURE_NONE:
            return False
        rc = self._launch(exe, stream)
        if rc:
            raise DriverError(f"cuGraphLaunch returned CUDA error {rc}")
        return True

    def capturing(self, stream: int) -> bool:
        """Whether ``stream`` is being captured, or cannot say (a legacy stream during another
        thread's global capture): either way no graph may be started on it."""
        rc = self._is_capturing(stream, self._status_ref)
        return bool(rc) or self._status.value != _CAPTURE_NONE

    def destroy(self, exe: int) -> None:
        self._exec_destroy(exe)

    def allow_dynamic_shared(self, function: int, nbytes: int) -> None:
        """Let launches of the CUDA ``function`` ask for ``nbytes`` of dynamic shared memory
        (past 48 KiB the driver wants this said first; Triton says it only for kernels that
        need it)."""
        rc = self._set_attribute(function, _MAX_DYNAMIC_SHARED_SIZE_BYTES, nbytes)
        self._check(f"cuFuncSetAttribute({nbytes} bytes of shared memory)", rc)


_driver: Driver | None = None
_driver_refused: str | None = None


def driver() -> Driver | None:
    """The process's :class:`Driver`, or None where libcuda cannot be loaded
    (:func:`driver_refused` says why)."""
    global _driver, _driver_refused
    if _driver is None and _driver_refused is None:
        try:
            _driver = Driver()
        except (OSError, AttributeError) as e:
            _driver_refused = f"libcuda: {e}"
    return _driver


def driver_refused() -> str | None:
    return _driver_refused


_streams = threading.local()


def capture_stream(device: Any) -> int:
    """A stream of this thread's on ``device`` for slots to capture on (one per thread, as a
    capture holds its stream until it ends)."""
    import torch

    held = getattr(_streams, "by_device", None)
    if held is None:
        held = _streams.by_device = {}
    dev = torch.device(device)
    s = held.get(dev)
    if s is None:
        s = held[dev] = torch.cuda.Stream(dev)
    return s.cuda_stream


class GraphSlot:
    """One plan's graphs: ``launch(stream, key)`` starts the graph captured for ``key`` and says
    True, or says False (the caller then launches its kernels itself).

    ``fire(stream, *key)`` enqueues the plan's launches; ``capture_stream`` is a stream the slot
    captures on (not the caller's: the caller's may be the legacy default stream, which cannot
    be captured)."""

    def __init__(
        self,
        fire: Callable[..., None],
        capture_stream: int,
        drv: Driver,
        max_captures: int = MAX_CAPTURES,
        max_graphs: int = MAX_GRAPHS,
    ) -> None:
        self._fire = fire
        self._cap_stream = capture_stream
        self._drv = drv
        self._start = drv.start
        self._max = max_captures
        self._max_graphs = max_graphs
        # key -> exec handle, oldest first; the finalizer destroys what is left in it
        self.graphs: dict[tuple, int] = {}
        self._seen: set[tuple] = set()  # keys run once without a graph
        self.captures = 0
        # Why the slot stopped launching graphs (a driver error while capturing), or None.
        self.refused: str | None = None
        weakref.finalize(self, _release, drv, self.graphs)

    def launch(self, stream: int, key: tuple) -> bool:
        exe = self.graphs.get(key)
        if exe is not None:
            return self._start(exe, stream)
        drv = self._drv
        if key not in self._seen:
            if len(self._seen) >= 4 * self._max_graphs:
                self._seen.clear()
            self._seen.add(key)
            return False
        if self.refused is not None or self.captures >= self._max or drv.capturing(stream):
            return False
        fire = self._fire
        try:
            exe = drv.capture(self._cap_stream, lambda s: fire(s, *key))
        except DriverError as e:
            self.refused = str(e)
            return False
        self.captures += 1
        self._seen.discard(key)
        if len(self.graphs) >= self._max_graphs:
            oldest = next(iter(self.graphs))
            drv.destroy(self.graphs.pop(oldest))
        self.graphs[key] = exe
        drv.launch(exe, stream)
        return True

    def close(self) -> None:
        """Destroy the graphs held (the slot captures again for keys seen twice more)."""
        held = list(self.graphs.values())
        self.graphs.clear()
        self._seen.clear()
        for exe in held:
            self._drv.destroy(exe)


def _release(drv: Driver, graphs: dict[tuple, int]) -> None:
    for exe in graphs.values():
        drv.destroy(exe)


def slot_for(enabled: bool, fire: Callable[..., None], device: Any) -> GraphSlot | None:
    """A graph slot for a plan's ``fire`` on ``device``, or None where the plan does not launch
    through graphs (``enabled`` false; no CUDA driver)."""
    if not enabled:
        return None
    drv = driver()
    if drv is None:
        return None
    return GraphSlot(fire, capture_stream(device), drv)


def refusal(enabled: bool, armed: bool, slot: GraphSlot | None) -> str | None:
    """Why a plan's runs launch kernels rather than its graphs: None while they may take them
    (or before ``armed``: the plan's first run), else the reason."""
    if not enabled:
        return "off for this plan (graph=False)"
    if armed and slot is None:
        return driver_refused() or "no CUDA driver"
    return slot.refused if slot is not None else None
