"""Taking CUPTI out of the target again: cuptiFinalize at the exit of the target's next call.

Why this exists (measured on an H200, driver 580 / CUDA 13.0, against never-attached twins,
bench/results/agent-factors-h200.json and agent-finalize*-h200.json):

* CUPTI attached to a process costs it for as long as it stays attached, whether any activity
  kind is on or not: registering the buffer callbacks alone made a replayed CUDA graph of 50
  tiny kernels 17% slower for the rest of its life (importing cupti-python did nothing).
  Disabling every kind does not undo it; only cuptiFinalize does (+1.2% after it, in the noise).
* cuptiFinalize is safe when called at the exit of one of the target's own CUDA calls (CUPTI's
  advice, and what PyTorch's Kineto does to end its after-profile slowdown), with one
  exception: once kernel activity has been on while the process replayed CUDA graphs, the next
  replay after a finalize fails ("unspecified launch failure") and the process dies. That held
  at an API exit, after a device synchronize, and from another thread alike. So a process that
  replays graphs is asked about first (`ExitHook.probe_graphs`) and kernel activity is never
  switched on in it unless the user says so; see server.CuptiActivity.

The hook is a CUPTI callback subscription enabled for launch and synchronize calls only (the
calls a watched loop makes all the time, none of which runs while a lock of the target's own
allocator is held). Its first call at an API exit unsubscribes and finalizes; until then it costs
nothing but the subscription. cuptiSubscribe fails when another client (torch.profiler, Nsight)
holds CUPTI: then nothing is finalized, as that client's state would go with it.

Standard library and ctypes only (the agent's rule for module-level imports).
"""

from __future__ import annotations

import ctypes
import re
import threading
import time

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

DRIVER_DOMAIN, RUNTIME_DOMAIN = 1, 2  # CUpti_CallbackDomain
API_EXIT = 1  # CUpti_ApiCallbackSite
CALLS = re.compile(
    r"^(cu|cuda)(LaunchKernel|LaunchCooperativeKernel|GraphLaunch|StreamSynchronize|"
    r"CtxSynchronize|DeviceSynchronize|EventSynchronize)"
)
GRAPH_LAUNCH = re.compile(r"^(cu|cuda)GraphLaunch")

_CALLBACK_T = ctypes.CFUNCTYPE(
    None, ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p
)


def callback_ids(cupti_mod: Any, pattern: re.Pattern[str] = CALLS) -> list[tuple[int, int]]:
    """(domain, cbid) of every runtime and driver call whose name matches `pattern`."""
    out = []
    for domain, enum_name in (
        (DRIVER_DOMAIN, "driver_api_trace_cbid"),
        (RUNTIME_DOMAIN, "runtime_api_trace_cbid"),
    ):
        members = getattr(getattr(cupti_mod, enum_name, None), "__members__", None) or {}
        for name, cbid in members.items():
            if pattern.search(name):
                out.append((domain, int(cbid)))
    return out


class ExitHook:
    """One subscription that finalizes CUPTI at the exit of the next matching call.

    States: "new", "armed" (subscribed, waiting for a call), "finalized" (or "ran": an `action`
    instead of the finalize), "cancelled" (the subscription was taken back before any call
    came), "failed: <why>". `graph_seen` is set when the call that fired was a graph launch
    (`probe_graphs`).
    """

    def __init__(
        self,
        lib: Any,
        ids: list[tuple[int, int]],
        graph_ids: set[int] | None = None,
        action: Callable[[], None] | None = None,
    ):
        self.lib = lib
        # what runs at the call's exit instead of cuptiFinalize (run_at_next_call); its
        # exception, if any, is kept in `raised` for the thread that armed the hook
        self.action = action
        self.raised: BaseException | None = None
        self.ids = ids
        self.graph_ids = graph_ids or set()
        self.state = "new"
        self.rc: int | None = None
        self.finalize_ns = 0  # the target's thread waited this long in cuptiFinalize
        self.graph_seen = False
        self.errors = 0
        self.last_error = ""
        self._sub = ctypes.c_void_p(0)
        self._lock = threading.Lock()
        self._fired = threading.Event()
        self._cb = _CALLBACK_T(self._callback)  # referenced for as long as CUPTI may call it
        self._declare()

    def _declare(self) -> None:
        ct = ctypes
        for name, args in (
            ("cuptiSubscribe", [ct.POINTER(ct.c_void_p), ct.c_void_p, ct.c_void_p]),
            ("cuptiUnsubscribe", [ct.c_void_p]),
            ("cuptiEnableCallback", [ct.c_uint32, ct.c_void_p, ct.c_int, ct.c_uint32]),
            ("cuptiFinalize", []),
        ):
            fn = getattr(self.lib, name, None)
            if fn is None:  # an old or stand-in libcupti: nothing to arm
                self.state = f"failed: this libcupti has no {name}"
                return
            if hasattr(fn, "argtypes"):
                fn.argtypes = args
                fn.restype = ct.c_int

    def arm(self) -> str:
        """Subscribe and enable the callback; "" or why not (nothing is left subscribed then)."""
        with self._lock:
            if self.state.startswith("failed"):
                return self.state
            if self.state != "new":
                return f"already {self.state}"
            rc = int(
                self.lib.cuptiSubscribe(
                    ctypes.byref(self._sub), ctypes.cast(self._cb, ctypes.c_void_p), None
                )
            )
            if rc != 0:
                self.state = f"failed: cuptiSubscribe returned {rc}"
                return self.state
            for domain, cbid in self.ids:
                if int(self.lib.cuptiEnableCallback(1, self._sub, domain, cbid)) != 0:
                    self.errors += 1
            self.state = "armed"
        return ""

    def _callback(self, userdata: Any, domain: int, cbid: int, cbdata: Any) -> None:
        """CUPTI calls this on the target's thread, inside its CUDA call: never raise."""
        try:
            if self._fired.is_set() or not cbdata:
                return
            if ctypes.c_int.from_address(cbdata).value != API_EXIT:
                return
            with self._lock:
                if self.state != "armed":
                    return
                self.graph_seen = int(cbid) in self.graph_ids
                self.lib.cuptiUnsubscribe(self._sub)
                t0 = time.perf_counter_ns()
                if self.action is not None:
                    try:
                        self.action()
                        self.state = "ran"
                    except BaseException as e:  # noqa: BLE001 - handed to the arming thread
                        self.raised, self.state = e, f"failed: {type(e).__name__}: {e}"
                    self.finalize_ns = time.perf_counter_ns() - t0
                    self._fired.set()
                    return
                self.rc = int(self.lib.cuptiFinalize())
                self.finalize_ns = time.perf_counter_ns() - t0
                self.state = "finalized" if self.rc == 0 else f"failed: cuptiFinalize {self.rc}"
                self._fired.set()
        except BaseException as e:  # noqa: BLE001 - nothing may raise into the target's call
            self.errors += 1
            self.last_error = f"{type(e).__name__}: {e}"
            self._fired.set()

    def wait(self, timeout: float) -> bool:
        """True once the hook has fired (finalized or failed in the callback)."""
        return self._fired.wait(timeout)

    def cancel(self) -> bool:
        """Take the subscription back if no call has fired it yet; True if it was cancelled."""
        with self._lock:
            if self.state != "armed":
                return False
            self.lib.cuptiUnsubscribe(self._sub)
            self.state = "cancelled"
            return True


def finalize_at_next_call(lib: Any, cupti_mod: Any, wait_s: float) -> ExitHook:
    """Arm a hook that finalizes at the next launch or synchronize exit, and wait a little for
    it. A target that makes no such call meanwhile (an idle server) stays armed: it is
    finalized at its next call, or the hook is cancelled by the next START."""
    hook = ExitHook(lib, callback_ids(cupti_mod))
    if not hook.arm():
        hook.wait(wait_s)
    return hook


def run_at_next_call(
    lib: Any, cupti_mod: Any, action: Callable[[], None], wait_s: float
) -> ExitHook:
    """Run `action` on the target's own thread at the exit of its next launch or synchronize
    call, and wait up to `wait_s` for that. State "ran" (or "failed: ..." with `raised`), or
    "cancelled" when no call came (nothing ran), or "failed: ..." when the hook could not be
    armed (another CUPTI subscriber): the caller then decides what to do itself.

    Why: CUPTI's PC-sampling calls made from another thread while the target is inside a
    launch hung the target on the H200 (bench/NOTES-agent.md). Holding the GIL keeps torch's
    launches out, but not launches made with the GIL released (Triton's launcher releases it).
    At the exit of the target's own call, no launch of that thread is in flight."""
    hook = ExitHook(lib, callback_ids(cupti_mod), action=action)
    if not hook.arm() and not hook.wait(wait_s):
        hook.cancel()  # False when it fired meanwhile: the lock waits for the action to end
    return hook


def run_in_target(lib: Any, cupti_mod: Any, fn: Callable[[], None], wait_s: float) -> str:
    """`fn()` on the target's own thread at the exit of its next launch or synchronize call
    (run_at_next_call): "target"; or on this thread: "here: <why>" (no call came within
    `wait_s`, an idle target with no launch in flight; the hook could not be armed, e.g.
    another CUPTI subscriber; no libcupti handle). `fn`'s exception is raised here either way."""
    if lib is None or cupti_mod is None:
        fn()
        return "here: no libcupti handle"
    hook = run_at_next_call(lib, cupti_mod, fn, wait_s)
    if hook.state == "ran":
        return "target"
    if hook.raised is not None:
        raise hook.raised
    fn()
    return f"here: {hook.state}"


def probe_graphs(lib: Any, cupti_mod: Any, seconds: float) -> ExitHook:
    """Does the target replay CUDA graphs? The hook listens to graph launches only; the first
    one's exit finalizes CUPTI at once (`graph_seen`), so the process is left as it was. None
    within `seconds`: the subscription is taken back and CUPTI stays initialized."""
    ids = callback_ids(cupti_mod, GRAPH_LAUNCH)
    hook = ExitHook(lib, ids, graph_ids={cbid for _, cbid in ids})
    if not hook.arm() and not hook.wait(seconds):
        hook.cancel()
    return hook
