"""Seeing a torch CUDA-graph replay without CUPTI: the first call of `CUDAGraph.replay`.

Why: a process that replays CUDA graphs gets no kernel activity from the agent (a finalize
after graph kernels were recorded kills it, detach.py says why), so the agent first asks
whether the target replays graphs. The CUPTI way to ask (detach.probe_graphs: a callback
subscription on graph launches, finalized at the first one's exit) initializes CUPTI in a
process kdash will then leave alone, and on the H200 a tiny-kernel graph ran ~2-3% slower
after it than its never-attached twin (bench/NOTES-agent.md, session 8). SGLang, vLLM and
inductor's cudagraph trees all replay through `torch.cuda.CUDAGraph.replay`, so for them the
question can be answered in Python: the class's `replay` is replaced by a wrapper that, at its
first call, puts the original back and then makes the call. After that (or when the watch is
disarmed unfired) the class holds the very same function object as before, and no call ever
pays more than one extra Python frame.

What this cannot see: graphs launched from C++ or other libraries (`cudaGraphLaunch` directly),
and a `replay` bound before the watch was armed (`f = g.replay`). The CUPTI probe stays behind
it for those. Standard library only; torch is read from sys.modules, never imported.
"""

from __future__ import annotations

import sys
import threading

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def torch_graph_class() -> type | None:
    """torch.cuda.CUDAGraph if the target has imported torch's CUDA graphs, else None."""
    graphs = sys.modules.get("torch.cuda.graphs")
    cls = getattr(graphs, "CUDAGraph", None)
    return cls if isinstance(cls, type) else None


class ReplayWatch:
    """A one-shot wrapper on `cls.<name>`; `seen` is set by its first call.

    States: "new", "armed", "fired" (a call came; the original is back), "disarmed" (taken
    back before any call), "failed: <why>" (nothing was changed).
    """

    def __init__(
        self, cls: type, name: str = "replay", on_fire: Callable[[], None] | None = None
    ) -> None:
        self.cls, self.name = cls, name
        # run once, on the target's thread, at the first call and before the original runs
        self.on_fire = on_fire
        self.fire_error = ""  # what on_fire raised (it never reaches the target)
        self.state = "new"
        self.seen = threading.Event()
        self._lock = threading.Lock()
        self._orig: Any = None
        self._wrapper: Any = None

    @classmethod
    def for_torch(cls, on_fire: Callable[[], None] | None = None) -> ReplayWatch | None:
        graph = torch_graph_class()
        return cls(graph, on_fire=on_fire) if graph is not None else None

    def arm(self) -> bool:
        """Put the wrapper in place; False (and nothing changed) when `name` is not a plain
        function defined on the class itself."""
        with self._lock:
            if self.state != "new":
                return False
            orig = self.cls.__dict__.get(self.name)
            if not callable(orig) or isinstance(orig, (staticmethod, classmethod)):
                self.state = f"failed: {self.cls.__qualname__}.{self.name} is not a method here"
                return False
            watch = self

            def wrapper(*args: Any, **kwargs: Any) -> Any:
                watch._fire()
                return orig(*args, **kwargs)

            wrapper.__name__ = getattr(orig, "__name__", self.name)
            wrapper.__qualname__ = getattr(orig, "__qualname__", self.name)
            wrapper.__doc__ = getattr(orig, "__doc__", None)
            self._orig, self._wrapper = orig, wrapper
            setattr(self.cls, self.name, wrapper)
            self.state = "armed"
            return True

    def _fire(self) -> None:
        """On the target's thread, inside its call: put the original back, never raise."""
        first = False
        with self._lock:
            if self.state == "armed":
                self._restore()
                self.state = "fired"
                first = True
        if first and self.on_fire is not None:
            try:
                self.on_fire()
            except BaseException as e:  # noqa: BLE001 - never into the target's replay
                self.fire_error = f"{type(e).__name__}: {e}"
        self.seen.set()

    def _restore(self) -> None:
        # only our own wrapper is taken out: if someone replaced it since, theirs stays
        if self.cls.__dict__.get(self.name) is self._wrapper:
            setattr(self.cls, self.name, self._orig)

    def wait(self, timeout: float) -> bool:
        return self.seen.wait(timeout)

    def disarm(self) -> None:
        """Take the wrapper back if no call came (idempotent)."""
        with self._lock:
            if self.state == "armed":
                self._restore()
                self.state = "disarmed"


def torch_replays_within(seconds: float) -> bool | None:
    """True when the target replays a torch CUDA graph within `seconds`, False when it did
    not, None when it cannot be told this way (no torch CUDA graphs imported, or the class
    looks unlike torch's): then only CUPTI can tell."""
    watch = ReplayWatch.for_torch()
    if watch is None or not watch.arm():
        return None
    try:
        return watch.wait(seconds)
    finally:
        watch.disarm()


def guard_torch_replays(on_fire: Callable[[], None]) -> ReplayWatch | None:
    """A watch that stays armed until the caller disarms it: `on_fire` runs on the target's
    thread at its first torch CUDA-graph replay, before the replay itself. The agent switches
    kernel activity off there, so that a process that began replaying graphs after START (a
    server idle while the probe listened) never has a replay's kernel recorded, and CUPTI can
    still leave it. None when torch's CUDA graphs are not imported (nothing to guard)."""
    watch = ReplayWatch.for_torch(on_fire)
    if watch is None or not watch.arm():
        return None
    return watch
