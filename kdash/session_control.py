"""What the dashboard asks of the session it shows: a live recorder, or a capture's replay.

The app holds one `SessionControl` and asks it everything that differs between watching a
process and replaying a capture: whether it is live, the target's pid, the sources' health and
findings, the capture state for the status bar, taking a capture (`c`, `C`), switching the
agents' continuous activity (`a`) and PC sampling (`L`), and the time axis (a live view follows
now, a replay's is fixed on the capture's window). `LiveSession` wraps a `Recorder`;
`ReplaySession` a capture's metadata and the store built from it. The commands that start the
dashboard pick one; nothing here imports Textual, so both are tested without a terminal.

What a recorder may offer beyond `Recorder` (the SGLang recorder's server description, its
capture detail and its capture through the server) is declared below as Protocols, as the
sources' optional capabilities are in `collectors.base`.
"""

from __future__ import annotations

import os
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from kdash import clock, schema
from kdash.collectors.base import (
    ActiveAgents,
    ContinuousSwitch,
    CostEstimating,
    Health,
    PcSamplingSwitch,
    Source,
    as_health,
)
from kdash.session import Recorder, capture_healths, source_healths
from kdash.store import Store

LIVE_WINDOW_S = 60.0
MIN_WINDOW_S = 1.0
REPLAY_NOTE = "replay: nothing to capture (captures are taken live)"
REPLAY_TOAST = "This is a replay: captures are taken live, with `kdash attach`."
BUSY_TOAST = "a capture is already being recorded or written"


# -- what a recorder may offer --------------------------------------------------------------------
@runtime_checkable
class DescribesServer(Protocol):
    """A recorder of an SGLang target: the server as its pane shows it (`meta["sglang"]`)."""

    def sglang_meta(self, max_age_s: float = 2.0) -> dict[str, Any]: ...


@runtime_checkable
class CaptureDetail(Protocol):
    """A recorder that adds a few words to the capture state (the server profiling...)."""

    def capture_detail(self) -> str: ...


@runtime_checkable
class ServerCapture(Protocol):
    """A recorder that can take a capture through the server's own profiler: the blocking
    part (`run_server_job`) runs on a worker thread of the app's."""

    server_job: Any

    def trigger_capture(
        self,
        pre_s: float | None = None,
        post_s: float | None = None,
        via_server: bool | None = None,
    ) -> bool: ...

    def run_server_job(self, job: Any) -> None: ...


RECORDER_CAPABILITIES: tuple[type, ...] = (DescribesServer, CaptureDetail, ServerCapture)


# -- answers --------------------------------------------------------------------------------------
def activity_label(agent_health: Health | str) -> str:
    """ "sampled" or "continuous" from the agent source's health (codes "sampling",
    "continuous"); "off (CUDA graphs)" where the agent left kernel activity off in a graph
    process (its PC ranges, if on, still cost: the bar shows the estimate beside it); "" when
    no agent is there to record (the status bar then says nothing of activity or cost)."""
    code = as_health(agent_health, "agent").code
    labels = {"continuous": "continuous", "sampling": "sampled", "graphs_off": "off (CUDA graphs)"}
    return labels.get(code, "")


@dataclass(frozen=True)
class AgentToggle:
    """A switch of every attached agent (continuous activity, PC sampling): how many
    processes it reaches, its state now, and the call that sets it (a socket write per agent
    under the source's lock: call it off the UI thread)."""

    agents: int
    on: bool
    set: Callable[[bool], None]


@dataclass(frozen=True)
class CaptureAnswer:
    """What `c` did: `started`, a toast to show (`severity`), and `note`, one line that
    answers the key in the status bar for a while when nothing could be captured. `job` is
    a capture through the server that the app runs on a worker thread (`run_server_job`)."""

    started: bool
    toast: str = ""
    severity: str = "information"
    note: str = ""
    job: Any = None


@dataclass
class SessionStatus:
    """The session's part of the status bar."""

    capture: str = ""  # "capturing… 3.2 s" / "saved: PATH" / "capture failed: why"
    capture_phase: str = "idle"
    capture_path: str = ""
    sources: dict[str, Health] = field(default_factory=dict)
    poll_ms: float | None = None
    activity: str = ""  # "sampled" | "continuous" | ""
    cost: float | None = None
    dropped: int = 0


# -- the controller -------------------------------------------------------------------------------
class SessionControl(ABC):
    """The questions the app asks; `LiveSession` and `ReplaySession` answer them."""

    mode: str = ""
    # A live view ends at now and moves with it; a replay's window stands on the capture.
    follows_now: bool = False

    @property
    def live(self) -> bool:
        return self.mode == "live"

    # life cycle
    @abstractmethod
    def subscribe(self, callback: Callable[[str, object], None]) -> None:
        """Have `callback(event, payload)` called (on the poll thread) for the recorder's
        events: capture-started, capture-saved, capture-failed, target-exited."""

    @abstractmethod
    def run(self) -> None:
        """Poll until `stop()` (blocking: the app runs it on a worker thread)."""

    @abstractmethod
    def stop(self) -> None:
        """Stop polling (and the sources)."""

    # what is watched
    def target_pid(self) -> int | None:
        """The pid of the process watched now; None in a replay (its pid is history, in the
        capture's meta) and live without a target process."""
        return None

    def target_cmdline(self) -> str:
        return ""

    @abstractmethod
    def healths(self) -> dict[str, Health]: ...

    def findings(self) -> Any:
        return None

    def sglang_meta(self) -> dict[str, Any] | None:
        """The server as it is now (live SGLang target); None where only the meta has it."""
        return None

    @abstractmethod
    def status(self, now_ns: int) -> SessionStatus: ...

    # what the keys do
    @abstractmethod
    def capture(self, via_server: bool = False) -> CaptureAnswer: ...

    @abstractmethod
    def run_server_job(self, job: Any) -> None:
        """Blocking: the capture through the server that `capture` handed out."""

    def continuous_toggle(self) -> AgentToggle | None:
        """The agents' continuous-activity switch; None when no agent is attached."""
        return None

    def pc_sampling_toggle(self) -> AgentToggle | None:
        """The agents' PC-sampling switch; None when no agent is attached."""
        return None

    # the time axis
    @abstractmethod
    def end_ns(self, frozen_ns: int | None) -> int:
        """Where the view's window ends before any pan (`frozen_ns`: now when paused)."""

    @abstractmethod
    def anchor_ns(self, end_ns: int) -> int:
        """Time 0 of the axis labels."""

    @abstractmethod
    def max_window_s(self) -> float: ...

    @abstractmethod
    def default_window_s(self) -> float: ...

    @abstractmethod
    def window_label(
        self, since_ns: int, until_ns: int, window_s: float, offset_s: float
    ) -> str: ...

    @abstractmethod
    def titles(self, meta: dict, title: str | None) -> tuple[str, str]: ...


def short_cmdline(cmd: str, width: int = 32) -> str:
    """A command line cut to `width` characters, its program without its folder."""
    parts = cmd.split()
    if not parts:
        return ""
    parts[0] = os.path.basename(parts[0])
    s = " ".join(parts)
    return s if len(s) <= width else s[: width - 1] + "…"


class LiveSession(SessionControl):
    """A recorder polling a live target."""

    mode = "live"
    follows_now = True

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder

    def subscribe(self, callback: Callable[[str, object], None]) -> None:
        previous = self.recorder.on_event

        def on_event(event: str, payload: object) -> None:
            callback(event, payload)
            if previous is not None:
                previous(event, payload)

        self.recorder.on_event = on_event

    def run(self) -> None:
        self.recorder.run_forever()

    def stop(self) -> None:
        self.recorder.stop()

    def target_pid(self) -> int | None:
        target = self.recorder.target
        return None if target is None else int(target.pid)

    def target_cmdline(self) -> str:
        target = self.recorder.target
        return "" if target is None else " ".join(target.cmdline)

    def healths(self) -> dict[str, Health]:
        return source_healths(self.recorder.sources)

    def findings(self) -> Any:
        return self.recorder.findings

    def sglang_meta(self) -> dict[str, Any] | None:
        rec = self.recorder
        return rec.sglang_meta() if isinstance(rec, DescribesServer) else None

    def _capture_text(self, now_ns: int) -> str:
        rec = self.recorder
        cap = rec.capture
        text = ""
        if cap.phase == "recording":
            text = f"capturing… {cap.remaining_s(now_ns):.1f} s"
        elif cap.phase == "writing":
            text = "writing capture…"
        extra = rec.capture_detail() if isinstance(rec, CaptureDetail) else ""
        if extra and cap.phase == "saved":  # e.g. the DP ranks that had no step
            return f"saved: {cap.path} ({extra})"
        if extra:
            return f"{text} ({extra})"
        if cap.phase == "saved":
            return f"saved: {cap.path}"
        if cap.phase == "failed":
            return f"capture failed: {cap.error}"
        return text

    def status(self, now_ns: int) -> SessionStatus:
        rec = self.recorder
        cap = rec.capture
        st = SessionStatus(
            capture=self._capture_text(now_ns),
            capture_phase=cap.phase,
            capture_path=str(cap.path) if cap.phase == "saved" else "",
            sources={s.name: s.health for s in rec.sources},
            poll_ms=rec.poll_cost_ms,
            dropped=rec.store.overflowed(),
        )
        agent = self._agent_tree()
        if agent is not None:
            st.activity = activity_label(agent.health)
            if st.activity and isinstance(agent, CostEstimating):
                st.cost = agent.cost_estimate()
        return st

    def capture(self, via_server: bool = False) -> CaptureAnswer:
        rec = self.recorder
        if via_server and isinstance(rec, ServerCapture):
            started = rec.trigger_capture(via_server=True)
        else:
            started = rec.trigger_capture()
        # The job of this capture (or of the one still running, whose worker then only waits).
        job = rec.server_job if isinstance(rec, ServerCapture) else None
        if job is not None and job.seq != rec.capture.seq:
            job = None
        toast = "" if started else BUSY_TOAST
        return CaptureAnswer(started, toast, "warning" if toast else "information", job=job)

    def run_server_job(self, job: Any) -> None:
        rec = self.recorder
        if isinstance(rec, ServerCapture):
            rec.run_server_job(job)

    def _agent_tree(self) -> Source | None:
        """The agent source that can switch its agents (the tree of `AgentTreeSource`)."""
        for src in self.recorder.sources:
            if src.name == "agent" and isinstance(src, ContinuousSwitch):
                return src
        return None

    def _attached(self) -> tuple[Source | None, int]:
        src = self._agent_tree()
        pids = src.active_pids() if isinstance(src, ActiveAgents) else []
        return (src, len(pids)) if pids else (None, 0)

    def continuous_toggle(self) -> AgentToggle | None:
        src, n = self._attached()
        if not isinstance(src, ContinuousSwitch):
            return None
        return AgentToggle(n, bool(src.continuous), src.set_continuous)

    def pc_sampling_toggle(self) -> AgentToggle | None:
        src, n = self._attached()
        if not isinstance(src, PcSamplingSwitch):
            return None
        return AgentToggle(n, bool(src.pc_sampling), src.set_pc_sampling)

    def end_ns(self, frozen_ns: int | None) -> int:
        return clock.now_ns() if frozen_ns is None else frozen_ns

    def anchor_ns(self, end_ns: int) -> int:
        return end_ns

    def max_window_s(self) -> float:
        return max(MIN_WINDOW_S, self.recorder.store.retention_ns / 1e9)

    def default_window_s(self) -> float:
        return LIVE_WINDOW_S

    def window_label(self, since_ns: int, until_ns: int, window_s: float, offset_s: float) -> str:
        label = f"window {window_s:g} s"
        if offset_s:
            label += f", ending {offset_s:g} s ago"
        return label

    def titles(self, meta: dict, title: str | None) -> tuple[str, str]:
        target = meta.get("target") or {}
        cmd = short_cmdline(str(target.get("cmdline") or ""))
        head = title or meta.get("title") or "kdash"
        return head, f"live · pid {target.get('pid', '?')} {cmd}".rstrip()


REPLAY_WITHIN = 24  # a replay's title says "replay" within its first this many characters


class ReplaySession(SessionControl):
    """A capture shown again: `meta` is its metadata, `store` holds its tables."""

    mode = "replay"
    follows_now = False

    def __init__(self, meta: dict, store: Store) -> None:
        self.meta = meta
        self.store = store
        self.data_start_ns, self.data_end_ns = self._data_range()

    def _data_range(self) -> tuple[int, int]:
        """The capture's window; else the span of its data; else the last second."""
        win = self.meta.get("window") or {}
        start, end = win.get("start_ns"), win.get("end_ns")
        if isinstance(start, int) and isinstance(end, int) and end > start:
            return start, end
        lo, hi = None, 0
        for t in schema.TABLES:
            col = self.store.get(t)[schema.TIME_COLUMN[t]]
            if len(col):
                lo = int(col.min()) if lo is None else min(lo, int(col.min()))
                hi = max(hi, int(col.max()))
        if lo is None:
            now = clock.now_ns()
            return now - int(1e9), now
        return lo, max(hi, lo + int(1e9))

    def subscribe(self, callback: Callable[[str, object], None]) -> None:
        """A capture has no events: nothing is recorded."""

    def run(self) -> None:
        """Nothing to poll: returns at once."""

    def stop(self) -> None:
        """Nothing runs."""

    def healths(self) -> dict[str, Health]:
        return capture_healths(self.meta)

    def status(self, now_ns: int) -> SessionStatus:
        return SessionStatus(
            sources=dict(self.healths()), dropped=int(self.meta.get("overflowed_rows") or 0)
        )

    def capture(self, via_server: bool = False) -> CaptureAnswer:
        return CaptureAnswer(False, REPLAY_TOAST, note=REPLAY_NOTE)

    def run_server_job(self, job: Any) -> None:
        """A replay hands out no job."""

    def end_ns(self, frozen_ns: int | None) -> int:
        return self.data_end_ns

    def anchor_ns(self, end_ns: int) -> int:
        return self.data_start_ns

    def max_window_s(self) -> float:
        return max(MIN_WINDOW_S, (self.data_end_ns - self.data_start_ns) / 1e9)

    def default_window_s(self) -> float:
        return self.max_window_s()

    def window_label(self, since_ns: int, until_ns: int, window_s: float, offset_s: float) -> str:
        full = (self.data_end_ns - self.data_start_ns) / 1e9
        a = (since_ns - self.data_start_ns) / 1e9
        b = (until_ns - self.data_start_ns) / 1e9
        return f"t {a:.1f}–{b:.1f} s of {full:.1f} s"

    def titles(self, meta: dict, title: str | None) -> tuple[str, str]:
        target = meta.get("target") or {}
        cmd = short_cmdline(str(target.get("cmdline") or ""))
        head = title or meta.get("title") or ""
        # "replay" near the start: a narrow header cuts a long title at its end.
        at = head.lower().find("replay")
        if at < 0 or at > REPLAY_WITHIN:
            head = f"kdash replay — {head}" if head else "kdash replay"
        bits = []
        if meta.get("capture_path"):
            bits.append(Path(str(meta["capture_path"])).name)
        host = target.get("host") or (meta.get("host") or {}).get("hostname")
        what = cmd or (f"pid {target.get('pid')}" if target.get("pid") else "")
        if what:
            bits.append(f"{what} on {host}" if host else what)
        created = meta.get("created_wall_ns")
        if isinstance(created, int):
            bits.append(time.strftime("recorded %Y-%m-%d %H:%M UTC", time.gmtime(created / 1e9)))
        return head, " · ".join(bits)


def session_for(recorder: Recorder | None, mode: str, meta: dict, store: Store) -> SessionControl:
    """The controller for `mode` ("live" needs the recorder; "replay" has none)."""
    if mode == "live":
        if recorder is None:
            raise ValueError("live mode needs a recorder")
        return LiveSession(recorder)
    if mode == "replay":
        return ReplaySession(meta, store)
    raise ValueError(f"mode must be 'live' or 'replay', not {mode!r}")
