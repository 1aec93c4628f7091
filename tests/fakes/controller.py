"""A stand-in for the agent's CUPTI controller (controller.CuptiActivity), for driving a
session in-process: no CUPTI, no threads, no clock of its own. It keeps the interface the
session and the agent's STATS use, records every call in `calls`, and takes its times from
the test's clock, so a test can walk the duty cycle edge by edge. A fixture, not CUPTI: what
it answers is what the test sets (`cuda`, `held`, `unavailable`, `graph_replays`)."""

from __future__ import annotations

from collections.abc import Callable

from kdash.collectors.agent.controller import Unavailable


class FakeController:
    def __init__(self, pid: int, clock: Callable[[], float]) -> None:
        self.pid = pid
        self.clock = clock
        self.calls: list[str] = []
        self.flushes = self.offsets_measured = 0
        # what the process looks like; the test changes these
        self.cuda = True  # the target has loaded CUDA
        self.held: str | None = None  # another CUPTI client holds CUPTI
        self.unavailable: str | None = None  # probe() fails for good with this line
        self.graph_replays = False  # the graph probe sees a CUDA-graph launch
        # the controller's state, as CuptiActivity keeps it
        self.cupti: object | None = None
        self.converter = None
        self.raw = None
        self.notes: list[str] = []
        self.raw_note = self.raw_failed = ""
        self.mode = "raw"
        self.use_raw = True
        self.enabled: list[tuple[str, int]] = []
        self.paused: list[tuple[str, int]] = []
        self.last_enabled: list[tuple[str, int]] = []
        self.enabled_at_ns = self.disabled_at_ns = 0
        self.graph_kernels = self.graphs_seen = self.graph_kernels_recorded = False
        self.detach_state = "never attached"
        self.last_error = ""
        self.ledger: dict[int, int] = {}
        self.sink = None
        self.offset_ns = self.offset_gap_ns = 0
        self.narrow_ns = self.resumes = 0
        self.dropped_by_cupti = self.discarded_records = self.records_seen = 0
        self.callback_ns = self.callback_cpu_ns = self.flush_cpu_ns = self.callback_errors = 0
        self.discarded_bytes = self.cupti_detached = 0
        self.released = False
        self.releases = 0
        self.release_note = ""
        self.target_calls = True  # the target makes CUDA calls (a release can fire)

    def _ns(self) -> int:
        return int(self.clock() * 1e9)

    def _switch(self, kinds: list[tuple[str, int]], by: int) -> None:
        for _act, kind in kinds:
            self.ledger[kind] = self.ledger.get(kind, 0) + by

    def kinds_on(self) -> list[int]:
        return sorted(k for k, n in self.ledger.items() if n > 0)

    def cuda_loaded(self) -> bool:
        return self.cuda

    def held_by_other(self) -> str | None:
        return self.held

    def precheck(self) -> None:
        self.calls.append("precheck")

    def probe(self) -> None:
        self.calls.append("probe")
        if self.unavailable:
            raise Unavailable(self.unavailable)
        if self.held:
            raise Unavailable(f"{self.held}; kdash waits until it ends", retry=True)
        self.cupti = object()

    def cancel_hook(self) -> None:
        self.calls.append("cancel_hook")

    def probe_graphs(self, seconds: float) -> bool:
        self.calls.append("probe_graphs")
        self.graphs_seen = self.graph_replays
        return self.graph_replays

    def enable(self, activities: list[str], sink) -> None:
        self.calls.append("enable " + ",".join(activities))
        self.sink = sink
        self.enabled_at_ns = self._ns()
        self.enabled = [(a, i) for i, a in enumerate(activities)]
        self.paused = []
        self._switch(self.enabled, +1)

    def pause(self) -> str:
        self.calls.append("pause")
        self._switch(self.enabled, -1)
        self.paused, self.enabled = self.enabled, []
        self.disabled_at_ns = self._ns()
        return ""

    def resume(self) -> str:
        self.calls.append("resume")
        self.released = False
        self.enabled_at_ns = self._ns()
        self.enabled, self.paused = self.paused, []
        self._switch(self.enabled, +1)
        self.resumes += 1
        return ""

    def disable(self, flush: bool = True) -> str:
        self.calls.append("disable")
        if self.paused and not self.enabled:
            self.last_enabled, self.paused = self.paused, []
        if self.enabled:
            self.last_enabled = list(self.enabled)
            self._switch(self.enabled, -1)
            self.disabled_at_ns = self._ns()
        self.enabled = []
        self.sink = None
        return ""

    def step_aside(self) -> None:
        self.calls.append("step_aside")
        if self.paused and not self.enabled:
            self.last_enabled, self.paused = self.paused, []
        if self.enabled:
            self.last_enabled = list(self.enabled)
        self.enabled = []
        self.sink = None

    def release_left_behind(self) -> str:
        self.calls.append("release_left_behind")
        self.ledger = {}
        return ""

    # periodic work, counted apart from `calls` (which says what switched what)
    def flush(self) -> None:
        self.flushes += 1

    def measure_offset(self) -> None:
        assert not self.released, "the offset read would initialise CUPTI again"
        self.offsets_measured += 1

    def read_dropped(self) -> int:
        return self.dropped_by_cupti

    graph_guarded = False

    def graph_guard(self) -> None:
        """As CuptiActivity's, called on the target's thread at its first graph replay."""
        self.calls.append("graph_guard")
        self.graph_guarded = self.graphs_seen = True
        if self.enabled:
            self._switch(self.enabled, -1)
            self.paused, self.enabled = [*self.enabled, *self.paused], []
            self.disabled_at_ns = self._ns()

    def detach_cupti(self, wait_s: float) -> str:
        self.calls.append("detach")
        if self.released and not self.kinds_on():
            self.cupti_detached += 1
            self.detach_state = "detached"
            return ""
        if self.kinds_on():
            return "CUPTI stays attached: activity kinds still on"
        self.cupti_detached += 1
        self.detach_state = "detached"
        return ""

    def refresh_for_pc(self, wait_s: float) -> str:
        """As CuptiActivity's, for a target that makes CUDA calls: CUPTI finalized."""
        self.calls.append("refresh_pc")
        return "finalized"

    def run_in_target(self, fn, wait_s: float) -> str:
        """As CuptiActivity's where no CUPTI callback can fire (no target here): fn runs on
        the calling thread."""
        self.calls.append("edge")
        fn()
        return "here: no target"

    def release_between_windows(self, wait_s: float) -> str:
        """As CuptiActivity's: finalized unless graphs were seen, a kind is on, or the target
        made no CUDA call (`target_calls`)."""
        self.calls.append("release")
        if self.released:
            return "finalized"
        if self.graphs_seen or self.graph_kernels:
            why = "the target replays CUDA graphs"
        elif self.graph_kernels_recorded:
            why = "kernels of CUDA-graph replays were recorded, so CUPTI cannot be restarted"
        elif self.kinds_on():
            why = "activity kinds are on"
        elif not self.target_calls:
            why = "waiting for the target's next CUDA call"
        else:
            why = "finalized"
        if why == "finalized":
            self.released = True
            self.releases += 1
        self.release_note = "" if why == "finalized" else why
        return why
