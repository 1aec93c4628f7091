"""The CUPTI controller: everything the agent does with CUPTI (probe, enable, pause and resume
for the duty cycle, flush, disable, step aside for another client, detach), through
cupti-python's Activity API only (`activity_enable`, `activity_flush_all`, ...) plus our own
buffer callbacks (buffers.RawBuffers). Never `cuptiSubscribe`: a callback subscriber blinds
torch.profiler for the life of the process, and a profiler the user starts later must still
work once kdash has detached.

Every enable and disable goes through a per-kind ledger (`kinds_on`: empty after a detach);
every callback CUPTI calls catches its own errors and records them (`callback_errors`,
`last_error`), because nothing may raise into the target.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from .buffers import LayoutMismatch, RawBuffers
from .constants import (
    ACTIVITY_KINDS,
    BUFFER_BYTES,
    MAX_NOTE_CHARS,
    MAX_NOTES,
    REQUIRED_ACTIVITY,
)
from .duty import narrowed_ids
from .probes import (
    cuda_loaded,
    dist_version,
    driver_absent,
    driver_cuda_version,
    find_libcupti,
    install_hint,
    other_cupti_client,
    version_mismatch,
)
from .records import RecordConverter, batch_rows

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Batch = dict[str, Any]  # column name -> numpy array (see kdash.schema)


class Unavailable(Exception):
    """CUPTI cannot be used here; the message is the STATUS line (why, and what to do).

    `retry` marks a passing reason (another CUPTI client that will finish) as opposed to a
    lasting one (no driver, no cupti-python).
    """

    def __init__(self, line: str, retry: bool = False) -> None:
        super().__init__(line)
        self.retry = retry


class CuptiActivity:
    """Owns everything the agent does with CUPTI: probe, enable, flush, disable, callbacks.

    Buffer callbacks are (re-)registered at every START (CUPTI keeps only the last
    registration); while no session is active the buffer callback only counts what it throws
    away.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cupti: Any = None
        self.converter: RecordConverter | None = None
        self.enabled: list[tuple[str, int]] = []
        self.last_enabled: list[tuple[str, int]] = []
        self.notes: list[str] = []
        self.offset_ns = 0
        self.offset_gap_ns = 0
        self.driver_cuda: int | None = None
        self.mismatch = ""  # cupti-python/libcupti newer than the driver: what to install
        self._registered = False
        self._lock = threading.Lock()
        # kinds switched by the session's thread (windows) and by the target's own at its first
        # CUDA-graph replay (graph_guard): one at a time
        self._switch_lock = threading.RLock()
        self.graph_guarded = False  # graph_guard switched kernel activity off before a replay
        self._sink: Callable[[dict[str, dict[str, Any]]], None] | None = None
        self.callback_errors = 0
        self.last_error = ""
        self.discarded_records = 0
        self.records_seen = 0
        self.callback_ns = 0  # wall time in our buffer callback (includes waits for the GIL)
        self.callback_cpu_ns = 0  # CPU time of the calling thread in our buffer callback
        self.flush_cpu_ns = 0  # CPU time of our periodic flushes: cupti-python's + ours
        self.dropped_by_cupti = 0
        # how records reach us: "raw" (RawBuffers, the default) or "objects" (cupti-python's)
        self.use_raw = os.environ.get("KDASH_AGENT_RECORDS", "raw") != "objects"
        self.mode = ""
        self.raw: RawBuffers | None = None
        self.raw_note = ""
        self.raw_failed = ""
        self.discarded_bytes = 0
        # duty cycle: the kinds switched off between windows, to switch on again in resume()
        self.paused: list[tuple[str, int]] = []
        # kind -> our enables minus our disables: every kind must be back at 0 after detach
        self.ledger: dict[int, int] = {}
        self.enabled_at_ns = 0  # monotonic ns just before the kinds were (re-)enabled
        self.disabled_at_ns = 0  # monotonic ns just after they were all disabled
        self.narrow_ns = 0  # agent-thread time re-narrowing API records at window starts
        # per API kind, the callback ids switched off by the narrowing, found once: every
        # window's start narrows again, holding the target's GIL
        self._narrow_ids: dict[str, list[int]] = {}
        # wall time of the windows' edges: the kinds switched on and narrowed (resume), off
        # again (pause). CUPTI instruments the live context there, under the driver locks the
        # target's launches take, and the narrowing is a Python loop holding the GIL: the
        # target's time as much as a release's finalize is (the cost estimate counts it)
        self.switch_ns = 0
        self.resumes = 0
        # CUPTI out of the process again after a detach (detach.py says why and when it is
        # safe): the user may ask for kernels of graph replays anyway (START "graph_kernels")
        self.graph_kernels = False
        self.graphs_seen = False  # this process replays CUDA graphs (probe or a kernel record)
        self.graph_probe = ""  # how the last probe asked first: "torch" (no CUPTI) or "cupti"
        self.graph_kernels_recorded = False  # kernel activity was on during graph replays
        self.hook: Any = None  # the detach.ExitHook of the last detach or probe
        self.cupti_detached = 0  # finalized after a detach or a probe
        self.detach_state = "never attached"
        self._lib: Any = None
        # finalized between windows so PC sampling sees modules loaded since its first range
        # (refresh_for_pc): CUPTI then has forgotten our buffer callbacks
        self.needs_register = False
        self.pc_refreshes = 0
        # CUPTI finalized after a duty-cycle window (release_between_windows): nothing of it is
        # in the process until the next window registers the buffer callbacks again
        self.released = False
        self.releases = 0
        # what the releases cost the target: cuptiFinalize runs inside one of its CUDA calls,
        # and the next window's registration initialises CUPTI again
        self.release_finalize_ns = 0
        self.reregister_ns = 0
        self.release_note = ""  # why the last window's release did not happen

    def note(self, text: str) -> None:
        """Add a STATUS note once: the duty cycle repeats enable/narrow every window, and the
        same complaint must not grow the list (and every STATUS frame) without bound; nor may
        many different ones (MAX_NOTES of MAX_NOTE_CHARS at most)."""
        text = text if len(text) <= MAX_NOTE_CHARS else text[: MAX_NOTE_CHARS - 3] + "..."
        if text not in self.notes and len(self.notes) < MAX_NOTES:
            self.notes.append(text)

    def _kind_on(self, kind: Any) -> None:
        self.cupti.activity_enable(kind)
        self.ledger[int(kind)] = self.ledger.get(int(kind), 0) + 1

    def _kind_off(self, kind: int) -> None:
        self.cupti.activity_disable(kind)
        self.ledger[int(kind)] = self.ledger.get(int(kind), 0) - 1

    def kinds_on(self) -> list[int]:
        """Kinds this agent has switched on and not off again (empty after every detach)."""
        return sorted(k for k, n in self.ledger.items() if n > 0)

    # what the process looks like (module functions; a fake controller in the tests answers
    # them itself)
    def cuda_loaded(self) -> bool:
        return cuda_loaded()

    def held_by_other(self) -> str | None:
        return other_cupti_client()

    # probing
    def precheck(self) -> None:
        """Before the target has loaded CUDA: a driver must exist and cupti-python must be
        installed, judged without importing or loading either (Unavailable otherwise)."""
        import importlib.util

        no_driver = driver_absent()
        no_cupti = importlib.util.find_spec("cupti") is None
        if no_driver:
            also = f"; cupti-python is not installed in {sys.executable} either" if no_cupti else ""
            raise Unavailable(f"{no_driver}; kernel activity needs an NVIDIA GPU and driver{also}")
        if no_cupti:
            raise Unavailable(
                f"cupti-python is not installed in {sys.executable} (pid {self.pid}); "
                f"{install_hint(None)}"
            )

    def probe(self) -> None:
        """Import cupti-python and check driver and versions; raise Unavailable with the fix."""
        self.driver_cuda, why = driver_cuda_version()
        if self.driver_cuda is None:
            import importlib.util

            also = ""
            if importlib.util.find_spec("cupti") is None:
                also = f"; cupti-python is not installed in {sys.executable} either"
            raise Unavailable(f"{why}; kernel activity needs an NVIDIA GPU and driver{also}")
        hint = install_hint(self.driver_cuda)
        try:
            from cupti import cupti as cupti_mod
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken cuda-bindings install
            raise Unavailable(
                f"cupti-python is not importable in pid {self.pid} "
                f"({type(e).__name__}: {e}); {hint}"
            ) from None
        self.cupti = cupti_mod
        self.converter = RecordConverter(cupti_mod, self.pid)
        mismatch = version_mismatch(
            self.driver_cuda,
            dist_version("cupti-python"),
            dist_version("nvidia-cuda-cupti") or dist_version("nvidia-cuda-cupti-cu12"),
        )
        if mismatch:
            self.note("warning: " + mismatch)
        self.mismatch = mismatch
        held = other_cupti_client()
        if held:
            raise Unavailable(f"{held}; kdash waits until it ends", retry=True)

    def _describe_error(self, e: BaseException) -> str:
        status = getattr(e, "status", None)
        name = ""
        if status is not None and self.cupti is not None:
            try:
                name = self.cupti.Result(status).name
            except (ValueError, AttributeError):
                name = str(status)
        held = (
            "MULTIPLE_SUBSCRIBERS",
            "OLD_PROFILER_API_INITIALIZED",
            "HARDWARE_BUSY",
            "PROFILER_ALREADY_INITIALIZED",
        )
        if any(h in name for h in held):
            return (
                f"CUPTI is held by another client in this process ({name}: torch.profiler, "
                "Nsight or another tool); kdash stays idle"
            )
        if "INSUFFICIENT_PRIVILEGES" in name:
            return f"CUPTI refused ({name}): profiling is restricted to admins on this machine"
        text = f"{type(e).__name__}: {e}" if not name else f"CUPTI error {name} ({e})"
        return text

    def _with_hint(self, why: str) -> str:
        """A CUPTI failure, plus the version advice when the versions do not match."""
        return f"{why}; likely cause: {self.mismatch}" if self.mismatch else why

    def measure_offset(self) -> None:
        """monotonic_ns - CUPTI time, from the tightest of a few paired reads."""
        best_gap = None
        for _ in range(7):
            a = time.monotonic_ns()
            c = int(self.cupti.get_timestamp())
            b = time.monotonic_ns()
            gap = b - a
            if best_gap is None or gap < best_gap:
                best_gap = gap
                self.offset_ns = (a + b) // 2 - c
        self.offset_gap_ns = int(best_gap or 0)

    # enabling
    def enable(self, activities: list[str], sink: Callable[[dict[str, Batch]], None]) -> None:
        cu = self.cupti
        try:
            self.measure_offset()
        except Exception as e:  # noqa: BLE001
            raise Unavailable(
                f"{self._describe_error(e)}; {install_hint(self.driver_cuda)}"
            ) from None
        with self._lock:
            self._sink = sink
        self._register()
        self.enabled = []
        self.paused = []
        self.enabled_at_ns = time.monotonic_ns()
        for act in activities:
            kind_name = ACTIVITY_KINDS.get(act)
            if kind_name is None:
                self.note(f"unknown activity {act!r} ignored")
                continue
            kind = getattr(cu.ActivityKind, kind_name, None)
            if kind is None:
                self.note(f"{act}: this cupti-python has no {kind_name}")
                continue
            try:
                self._kind_on(kind)
            except Exception as e:  # noqa: BLE001
                if act == REQUIRED_ACTIVITY:
                    self.disable(flush=False)
                    raise Unavailable(self._with_hint(self._describe_error(e))) from None
                self.note(f"{act} not available: {self._describe_error(e)}")
                continue
            self.enabled.append((act, int(kind)))
        self._narrow_api_records(enable=True)
        # CUPTI's own flush period is left as it is: the session flushes every 200 ms.
        if "markers" in [a for a, _ in self.enabled] and not os.environ.get(
            "NVTX_INJECTION64_PATH"
        ):
            self.note(
                "NVTX ranges need `kdash run --nvtx` (NVTX_INJECTION64_PATH=<libcupti.so> "
                "set when the target starts)"
            )

    def _register(self) -> None:
        """Give CUPTI our buffer callbacks (raw buffers, else cupti-python's record objects).

        Done on every START: a profiler that ran in between (torch.profiler) has registered
        its own buffer callbacks and CUPTI keeps only the last registration; and after a
        cuptiFinalize (every detach, detach.py) CUPTI has forgotten ours.
        """
        cu = self.cupti
        self.mode = "objects"
        if self.use_raw and self.converter is not None and self.converter.reader is not None:
            try:
                if self.raw is None:
                    path, why = find_libcupti()
                    if path is None:
                        raise RuntimeError(why)
                    self.raw = RawBuffers(path, self._raw_buffer)
                rc = self.raw.register()
                if rc != 0:
                    raise RuntimeError(f"cuptiActivityRegisterCallbacks returned {rc}")
                self.mode = "raw"
                self._registered = True
            except Exception as e:  # noqa: BLE001 - cupti-python's callbacks still work
                self.use_raw = False
                self.raw_note = f"raw CUPTI buffers not used ({type(e).__name__}: {e})"
        if self.mode != "raw":
            try:
                cu.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
                self._registered = True
            except Exception as e:  # noqa: BLE001
                if not self._registered:
                    with self._lock:
                        self._sink = None
                    raise Unavailable(self._with_hint(self._describe_error(e))) from None
                self.note(f"re-registering buffer callbacks: {self._describe_error(e)}")

    def _narrow_api_records(self, enable: bool) -> None:
        """Keep only launch, synchronize, copy and set API records (enable=True), or put back
        CUPTI's default of every API (enable=False).

        Why: with RUNTIME and DRIVER on, CUPTI writes a record for every API call, and torch
        makes several bookkeeping calls (cudaGetDevice, ...) per op; those records cost the
        target time and say nothing kdash shows. The per-API switch is process-global CUPTI
        state, so it is restored on detach: a torch.profiler run afterwards sees every call.
        """
        cu = self.cupti
        acts = {a for a, _ in (self.enabled if enable else self.last_enabled)}
        plan = (
            ("runtime", "runtime_api_trace_cbid", "activity_enable_runtime_api"),
            ("driver", "driver_api_trace_cbid", "activity_enable_driver_api"),
        )
        for act, enum_name, fn_name in plan:
            if act not in acts:
                continue
            fn = getattr(cu, fn_name, None)
            ids = self._narrow_ids.get(act)
            if ids is None:
                ids = self._narrow_ids[act] = narrowed_ids(getattr(cu, enum_name, None))
            if not ids or fn is None:
                if enable:
                    self.note(f"{act} API records not narrowed: no {fn_name}")
                continue
            refused = []
            for cbid in ids:
                try:
                    fn(cbid, 0 if enable else 1)
                except Exception as e:  # noqa: BLE001 - some cbids are not switchable
                    if not refused and enable:
                        self.note(f"{act} API records partly narrowed: {self._describe_error(e)}")
                    refused.append(cbid)
            if refused:  # they refuse every time: not asked again, each window
                self._narrow_ids[act] = [i for i in ids if i not in set(refused)]

    def pause(self) -> str:
        """End a duty-cycle window: switch every enabled kind off and force-flush, keeping the
        sink (the flushed records still arrive) and the kinds for `resume`; "" or what failed.

        The per-API narrowing is left as it is: switching a kind on again resets CUPTI's
        per-function choices anyway (so `resume` narrows again), and with the kind off they
        record nothing (both seen on a card with CUDA 13.0's CUPTI).
        """
        with self._switch_lock:
            kinds = list(self.enabled)
            errors = self._switch_off(kinds)
            if kinds or not self.graph_guarded:
                self.paused, self.enabled = kinds, []
                self.disabled_at_ns = time.monotonic_ns()  # the window's end, before the flush
        try:
            self.cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        except Exception as e:  # noqa: BLE001
            errors.append(f"flush: {self._describe_error(e)}")
        if errors:
            self.last_error = "; ".join(errors)
        return "; ".join(errors)

    def _switch(
        self, kinds: list[tuple[str, int]], on: bool
    ) -> tuple[list[tuple[str, int]], list[str]]:
        """Switch `kinds` on or off (timed into switch_ns): those switched, and what failed,
        one line each."""
        done, errors = [], []
        flip, verb = (self._kind_on, "enable") if on else (self._kind_off, "disable")
        t0 = time.perf_counter_ns()
        for act, kind in kinds:
            try:
                flip(kind)
            except Exception as e:  # noqa: BLE001
                errors.append(f"{verb} {act}: {self._describe_error(e)}")
                continue
            done.append((act, kind))
        self.switch_ns += time.perf_counter_ns() - t0
        return done, errors

    def _switch_off(self, kinds: list[tuple[str, int]]) -> list[str]:
        return self._switch(kinds, on=False)[1]

    def resume(self) -> str:
        """Start a duty-cycle window: the kinds `pause` switched off go on again, narrowed."""
        errors = []
        if self.needs_register:
            self.needs_register = False
            self.released = False
            t0 = time.perf_counter_ns()
            try:
                self._register()
            except Exception as e:  # noqa: BLE001 - the kinds then record nothing: say so
                errors.append(f"re-registering after a PC refresh: {self._describe_error(e)}")
            self.reregister_ns += time.perf_counter_ns() - t0
        with self._switch_lock:
            if self.graph_guarded:  # the target began replaying graphs: nothing goes on again
                return "; ".join(errors)
            kinds, self.paused = self.paused, []
            self.enabled_at_ns = time.monotonic_ns()
            done, failed = self._switch(kinds, on=True)
            self.enabled.extend(done)
            errors.extend(failed)
            t0 = time.perf_counter_ns()
            self._narrow_api_records(enable=True)  # one call per API id: timed, as it repeats
            t1 = time.perf_counter_ns()
            self.narrow_ns += t1 - t0
            self.switch_ns += t1 - t0
            self.resumes += 1
        if errors:
            self.last_error = "; ".join(errors)
        return "; ".join(errors)

    def graph_guard(self) -> None:
        """On the target's thread, at its first torch CUDA-graph replay and before it runs
        (replaywatch.guard_torch_replays, armed while activity is on): every kind off now, and
        none on again. Kernels of a replay are then never recorded, so CUPTI can still be
        finalized when the client leaves (once they are, that would kill the process: H200,
        agent-finalize-h200.json); the session stops at its next tick and says why."""
        with self._switch_lock:
            self.graph_guarded = True
            self.graphs_seen = True
            kinds = list(self.enabled)
            errors = self._switch_off(kinds)
            if errors:  # the session's disable tries again
                self.last_error = "graph guard: " + "; ".join(errors)
            if kinds:
                self.paused, self.enabled = [*kinds, *self.paused], []
                self.disabled_at_ns = time.monotonic_ns()

    def disable(self, flush: bool = True) -> str:
        """Disable every enabled kind, then force-flush; "" or what went wrong.

        Between duty-cycle windows nothing is enabled (`pause` did it); the flush and the
        sink's release still happen, and `last_enabled` remembers what a resume after another
        CUPTI client should switch on again. After a release (CUPTI finalized between windows)
        no CUPTI call is made at all: any call would initialise CUPTI again, and the detach
        that follows would leave it in the process for good; the window's records went out
        with its end's forced flush already.
        """
        errors = []
        cu = self.cupti
        if self.paused and not self.enabled:
            self.last_enabled, self.paused = list(self.paused), []
        if self.enabled:
            self.last_enabled = list(self.enabled)
            try:
                self._narrow_api_records(enable=False)
            except Exception as e:  # noqa: BLE001
                errors.append(f"restoring API record defaults: {self._describe_error(e)}")
        was_on = bool(self.enabled)
        for act, kind in self.enabled:
            try:
                self._kind_off(kind)
            except Exception as e:  # noqa: BLE001
                errors.append(f"disable {act}: {self._describe_error(e)}")
        self.enabled = []
        if was_on:
            self.disabled_at_ns = time.monotonic_ns()
        released = self.released and not was_on
        if flush and cu is not None and not released:
            try:
                cu.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
            except Exception as e:  # noqa: BLE001
                errors.append(f"flush: {self._describe_error(e)}")
        if not released:
            self.read_dropped()
        with self._lock:
            self._sink = None
        if errors:
            self.last_error = "; ".join(errors)
        return "; ".join(errors)

    def step_aside(self) -> None:
        """Stop taking records without touching CUPTI's global state.

        Used when another client (torch.profiler) started while we were on: it has registered
        its own callbacks and enabled the kinds it needs; disabling "our" kinds now would switch
        off its collection too. Its run may still miss records (CUPTI serves one client at a
        time); the STATUS line says so. We re-register and re-enable when it has ended.
        """
        if self.paused and not self.enabled:
            self.last_enabled, self.paused = list(self.paused), []
        if self.enabled:
            self.last_enabled = list(self.enabled)
            try:  # give the other client CUPTI's default of every API record back
                self._narrow_api_records(enable=False)
            except Exception as e:  # noqa: BLE001
                self.last_error = f"restoring API record defaults: {self._describe_error(e)}"
        self.enabled = []
        with self._lock:
            self._sink = None

    def release_left_behind(self) -> str:
        """Switch off the kinds `step_aside` left on, once the other client has gone.

        While it ran they were its kinds as well; once it has ended, a kind it did not use
        itself (synchronization, markers) would otherwise stay on for the life of the process
        and cost the target on every launch. "" or what failed.
        """
        errors = []
        for kind in self.kinds_on():
            for _ in range(self.ledger.get(kind, 0)):
                try:
                    self._kind_off(kind)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"disable kind {kind}: {self._describe_error(e)}")
                    break
        return "; ".join(errors)

    def flush(self) -> None:
        c0 = time.thread_time_ns()
        try:
            self.cupti.activity_flush_all(0)
        except Exception as e:  # noqa: BLE001
            self.last_error = f"flush: {self._describe_error(e)}"
        self.flush_cpu_ns += time.thread_time_ns() - c0

    def read_dropped(self) -> int:
        if self.cupti is None:
            return self.dropped_by_cupti
        import ctypes

        try:
            d = ctypes.c_size_t(0)
            self.cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(d))
            self.dropped_by_cupti += int(d.value)
        except Exception as e:  # noqa: BLE001
            self.last_error = f"dropped-record count: {self._describe_error(e)}"
        return self.dropped_by_cupti

    # the callbacks CUPTI calls (on its own thread or the flushing one): never raise
    def _raw_buffer(self, addr: int, valid: int) -> None:
        """RawBuffers' completion: read one CUPTI buffer with numpy (never raises)."""
        try:
            t0 = time.perf_counter_ns()
            c0 = time.thread_time_ns()
            with self._lock:
                sink = self._sink
            if sink is None or self.converter is None or self.raw_failed:
                self.discarded_bytes += valid
                return
            try:
                batches = self.converter.batches_raw(addr, valid)
            except LayoutMismatch as e:
                # cannot read this buffer; the session switches to cupti-python's objects
                self.raw_failed = f"raw CUPTI buffer unreadable: {e}"
                self.discarded_bytes += valid
                return
            self.records_seen += sum(batch_rows(b) for b in batches.values())
            self._note_graphs(batches)
            sink(batches)
            self.callback_cpu_ns += time.thread_time_ns() - c0
            self.callback_ns += time.perf_counter_ns() - t0
        except BaseException as e:  # noqa: BLE001 - nothing may raise into CUPTI or the target
            self.callback_errors += 1
            self.last_error = f"raw buffer callback: {type(e).__name__}: {e}"

    def _note_graphs(self, batches: dict[str, Batch]) -> None:
        """A kernel record with a graph id: kernel activity has now been on during a graph
        replay, after which finalizing kills the process (detach.py)."""
        k = batches.get("kernels")
        if k is not None and len(k.get("graph_id", ())) and bool((k["graph_id"] > 0).any()):
            self.graphs_seen = self.graph_kernels_recorded = True
        a = batches.get("api")
        if not self.graphs_seen and a is not None and len(a.get("name", ())):
            # a graph launch whose kernels' records have not come yet: no release may follow.
            # This runs in the buffer callback, holding the target's GIL: the few distinct
            # names are looked at, not every record's.
            names = a["name"]
            distinct = set(names.tolist() if hasattr(names, "tolist") else names)
            self.graphs_seen = any("GraphLaunch" in str(n) for n in distinct)

    # taking CUPTI out again (detach.py)
    def libcupti(self) -> Any:
        """The libcupti that cupti-python loaded, through ctypes (None where none is mapped)."""
        if self._lib is None:
            if self.raw is not None:
                self._lib = self.raw.lib
            else:
                import ctypes

                path, _why = find_libcupti()
                self._lib = ctypes.CDLL(path) if path else None
        return self._lib

    def cancel_hook(self) -> None:
        """A START while a detach still waits for the target's next call: CUPTI stays."""
        if self.hook is not None and self.hook.cancel():
            self.detach_state = "attached (the pending finalize was cancelled by a new client)"

    def probe_graphs(self, seconds: float) -> bool:
        """True when the target launches a CUDA graph within `seconds`. Asked first without
        CUPTI (a torch CUDAGraph.replay, replaywatch.py), so a torch process that replays
        graphs never has CUPTI initialized by kdash; then, for graphs torch does not launch,
        through CUPTI (finalized at that launch's exit)."""
        from . import detach, replaywatch

        if replaywatch.torch_replays_within(seconds):
            self.graph_probe = "torch"
            self.graphs_seen = True
            self.detach_state = "never attached (a torch CUDA-graph replay, seen without CUPTI)"
            return True
        self.graph_probe = "cupti"
        lib = self.libcupti()
        if lib is None or self.cupti is None:
            return False
        hook = detach.probe_graphs(lib, self.cupti, seconds)
        self.hook = hook
        if hook.state.startswith("failed"):
            self.note(f"CUDA-graph probe: {hook.state}")
        if hook.state == "finalized":
            self.cupti_detached += 1
            self.detach_state = "detached (finalized at a graph launch)"
        self.graphs_seen = self.graphs_seen or hook.graph_seen
        return hook.graph_seen

    def detach_cupti(self, wait_s: float) -> str:
        """After every kind is off: finalize CUPTI at the target's next launch or synchronize
        call, unless kernels of graph replays were recorded (then CUPTI must stay). "" or why
        CUPTI stays attached."""
        from . import detach

        if self.cupti is None:
            return ""
        if self.released and not self.kinds_on():  # finalized after the last window already
            self.cupti_detached += 1
            self.detach_state = "detached"
            return ""
        if self.graph_kernels_recorded:
            self.detach_state = "attached for good (kernels of CUDA-graph replays were recorded)"
            return "CUPTI stays attached: kernels of CUDA-graph replays were recorded"
        if self.kinds_on():
            self.detach_state = "attached (kinds still on)"
            return "CUPTI stays attached: activity kinds still on"
        lib = self.libcupti()
        if lib is None:
            self.detach_state = "attached (no libcupti handle)"
            return "CUPTI stays attached: libcupti not found in this process"
        hook = detach.finalize_at_next_call(lib, self.cupti, wait_s)
        self.hook = hook
        if hook.state == "finalized":
            self.cupti_detached += 1
            self.detach_state = "detached"
        elif hook.state == "armed":
            self.detach_state = "detaching at the target's next CUDA call"
        else:
            self.detach_state = f"attached ({hook.state})"
            return f"CUPTI stays attached: {hook.state}"
        return ""

    def release_between_windows(self, wait_s: float) -> str:
        """After a duty-cycle window: finalize CUPTI at the target's next CUDA call, so that
        nothing of it stays in the process until the next window registers again.

        Why: CUPTI initialised in a process costs every launch for as long as it stays, with
        every kind off (bench/NOTES-agent.md: a launch-bound eager loop ran ~8% slower attached
        at a 1% duty cycle, and after detach, where the finalize happens, it did not). Never in
        a process seen replaying CUDA graphs (finalizing after kernel activity was on during
        replays kills it); "finalized" or why not.
        """
        if self.released:
            return "finalized"
        if self.graphs_seen or self.graph_kernels:
            why = "the target replays CUDA graphs"
        else:
            why = self._finalize_for_restart(wait_s)
        if why == "finalized":
            self.released = True
            self.releases += 1
            self.release_note = ""
        else:
            self.release_note = why
        return why

    def _finalize_for_restart(self, wait_s: float) -> str:
        """cuptiFinalize at the target's next CUDA call, the buffer callbacks registered again
        at the next resume: "finalized", or why not (the hook taken back if no call came)."""
        from . import detach

        if self.cupti is None:
            return "no CUPTI"
        if self.graph_kernels_recorded:
            return "kernels of CUDA-graph replays were recorded, so CUPTI cannot be restarted"
        if self.kinds_on():
            return "activity kinds are on"
        lib = self.libcupti()
        if lib is None:
            return "libcupti not found in this process"
        hook = detach.finalize_at_next_call(lib, self.cupti, wait_s)
        self.hook = hook
        if hook.state == "armed" and hook.cancel():
            # the target made no CUDA call meanwhile: no finalize may fire later, in a window
            return "waiting for the target's next CUDA call"
        if hook.state == "finalized":
            self.needs_register = True
            self.release_finalize_ns += hook.finalize_ns
            return "finalized"
        return hook.state

    def run_in_target(self, fn: Any, wait_s: float) -> str:
        """`fn()` on the target's own thread at its next CUDA call (detach.run_in_target)."""
        from . import detach

        return detach.run_in_target(self.libcupti(), self.cupti, fn, wait_s)

    def refresh_for_pc(self, wait_s: float) -> str:
        """Finalize CUPTI between windows so that the next PC-sampling enable starts CUPTI
        afresh and attributes every module loaded by then.

        Why: once PC sampling has been enabled on a context, CUPTI never attributes a module
        loaded while it is disabled (its samples go to the non-user bucket, no PC records),
        and the agent disables it between ranges because kernel activity cannot run beside
        it; a fresh CUPTI attributes all loaded modules at its first enable
        (bench/results/pcs-modules-h200.json). Not done once kernels of CUDA-graph replays
        were recorded (finalizing kills such a process, detach.py) or with a kind on.
        Returns "finalized", or why not (a target that made no CUDA call meanwhile: the hook
        is taken back, and the caller tries again at its next range).
        """
        if self.released:
            self.pc_refreshes += 1
            return "finalized"
        why = self._finalize_for_restart(wait_s)
        if why == "finalized":
            self.pc_refreshes += 1
        return why

    def _buffer_requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities: list[Any]) -> None:
        try:
            t0 = time.perf_counter_ns()
            c0 = time.thread_time_ns()
            n = len(activities)
            with self._lock:
                sink = self._sink
            if sink is None or self.converter is None:
                self.discarded_records += n
                return
            batches = self.converter.batches(activities)
            self.records_seen += n
            self._note_graphs(batches)
            sink(batches)
            self.callback_cpu_ns += time.thread_time_ns() - c0
            self.callback_ns += time.perf_counter_ns() - t0
        except BaseException as e:  # noqa: BLE001 - nothing may raise into CUPTI or the target
            self.callback_errors += 1
            self.last_error = f"buffer callback: {type(e).__name__}: {e}"


# ---- the agent ----------------------------------------------------------------------------------


def reader_name(c: CuptiActivity | None) -> str:
    """How records are read: "raw buffers", "buffer" (cupti-python objects' memory, numpy),
    or "attributes" (one attribute at a time)."""
    if c is None or c.converter is None:
        return ""
    if c.mode == "raw":
        return "raw buffers"
    return "buffer" if c.converter.reader is not None else "attributes"
