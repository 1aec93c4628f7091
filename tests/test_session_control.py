"""The session controller the dashboard asks (kdash.session_control), without Textual: a live
recorder's answers and a capture replay's, each from real parts where they can run here."""

from __future__ import annotations

import os
import re
import threading
import time

import pytest
from conftest import LOCAL_CAPTURE
from kdash.collectors.base import Health
from test_sglang_attach import _recorder, _server

from kdash import clock
from kdash.session import Recorder, RecorderOptions, capture_healths
from kdash.session_control import (
    BUSY_TOAST,
    LIVE_WINDOW_S,
    REPLAY_NOTE,
    LiveSession,
    ReplaySession,
    SessionControl,
    session_for,
)
from kdash.store import Store
from kdash.target import Target


class StandInAgents:
    """Stands in for `AgentTreeSource` (a real one needs an agent with CUPTI, i.e. a GPU):
    the attributes and methods the controller reaches, recording each switch."""

    name = "agent"

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.continuous = False
        self.pc_sampling = False
        self.switched: list[tuple[str, bool]] = []
        self.health = Health("ok", "sampling 10% (100 ms/s)", "sampling") if pids else Health()

    def start(self) -> None: ...

    def poll(self, now_ns: int) -> dict:
        return {}

    def stop(self) -> None: ...

    def active_pids(self) -> list[int]:
        return list(self.pids)

    def set_continuous(self, on: bool) -> None:
        self.switched.append(("continuous", on))
        self.continuous = on
        code = "continuous" if on else "sampling"
        self.health = Health("ok", "continuous" if on else "sampling 10% (100 ms/s)", code)

    def set_pc_sampling(self, on: bool) -> None:
        self.switched.append(("pc", on))
        self.pc_sampling = on

    def cost_estimate(self) -> float | None:
        return 0.25 if self.continuous else 0.02

    def cost_detail(self) -> dict[str, dict]:
        return {}


def _wait(cond, timeout: float = 20.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def test_live_session_takes_a_capture_and_says_so(tmp_path):
    """A real Recorder of this process with a real sched source: the controller's target,
    health and capture answers, from the key to the saved file."""
    from kdash.collectors.sched import SchedSource

    target = Target.from_pid(os.getpid())
    opts = RecorderOptions(interval_s=0.05, pre_s=0.2, post_s=0.3, capture_dir=tmp_path)
    store = Store(retention_s=30)
    rec = Recorder([SchedSource(target, interval_s=0.05)], store, target, opts)
    session = LiveSession(rec)
    events: list[str] = []
    session.subscribe(lambda event, payload: events.append(event))
    assert session.live and session.follows_now and session.mode == "live"
    assert session.target_pid() == os.getpid()
    assert session.target_cmdline() == " ".join(target.cmdline) != ""
    worker = threading.Thread(target=session.run, daemon=True)
    worker.start()
    try:
        assert _wait(lambda: store.stats()["threads"]["rows"] > 0)
        assert "sched" in session.healths()
        first = session.capture()
        assert first.started and not first.note and first.job is None
        m = re.fullmatch(r"capturing… (\d+\.\d) s", session.status(clock.now_ns()).capture)
        assert m and 0 <= float(m.group(1)) <= 0.3
        again = session.capture()
        assert not again.started and again.toast == BUSY_TOAST and again.severity == "warning"
        assert _wait(lambda: rec.capture.phase in ("saved", "failed"))
        st = session.status(0)
        assert rec.capture.phase == "saved", rec.capture.error
        assert st.capture == f"saved: {rec.capture.path}" and st.capture_path == str(
            rec.capture.path
        )
        assert st.capture_phase == "saved" and st.poll_ms is not None
        assert st.activity == "" and st.cost is None  # no agent: nothing to say of cost
        assert rec.capture.path.exists()
    finally:
        session.stop()
        worker.join(timeout=10)
    assert not worker.is_alive()
    assert events[:2] == ["capture-started", "capture-saved"]
    # no agent source: the switches are not there
    assert session.continuous_toggle() is None and session.pc_sampling_toggle() is None


def test_live_session_switches_the_agents_and_reads_their_cost(tmp_path):
    agents = StandInAgents([11, 12])
    rec = Recorder([agents], Store(retention_s=30), None, RecorderOptions(capture_dir=tmp_path))
    session = LiveSession(rec)
    assert session.target_pid() is None and session.target_cmdline() == ""
    st = session.status(0)
    assert st.activity == "sampled" and st.cost == pytest.approx(0.02)
    toggle = session.continuous_toggle()
    assert toggle is not None and toggle.agents == 2 and toggle.on is False
    toggle.set(True)
    assert agents.switched == [("continuous", True)]
    assert session.continuous_toggle().on is True
    st = session.status(0)
    assert st.activity == "continuous" and st.cost == pytest.approx(0.25)
    pc = session.pc_sampling_toggle()
    assert pc is not None and pc.on is False
    pc.set(True)
    assert agents.switched[-1] == ("pc", True) and session.pc_sampling_toggle().on is True
    # agents that are there but not recording: nothing to switch
    agents.pids = []
    assert session.continuous_toggle() is None and session.pc_sampling_toggle() is None


def test_live_session_of_an_sglang_recorder_asks_the_server(tmp_path):
    """The SGLang recorder's capabilities (server description, capture through the server)
    reached through the controller; a server without an HTTP port fails the job in one line."""
    rec = _recorder(tmp_path, _server(None))
    session = LiveSession(rec)
    meta = session.sglang_meta()
    assert meta is not None and len(meta["schedulers"]) == 2
    answer = session.capture(via_server=True)
    assert answer.started and answer.job is rec.server_job
    session.run_server_job(answer.job)  # already settled: returns without waiting
    assert answer.job.done.is_set() and "no HTTP port" in answer.job.failure()
    # a plain recorder has none of it: `C` is `c`
    plain = LiveSession(Recorder([], Store(), None, RecorderOptions(capture_dir=tmp_path)))
    assert plain.sglang_meta() is None
    answer = plain.capture(via_server=True)
    assert answer.started and answer.job is None


def test_live_session_time_axis_follows_now():
    store = Store(retention_s=90)
    session = LiveSession(Recorder([], store, None))
    t0 = time.monotonic_ns()
    end = session.end_ns(None)
    assert end >= t0 and session.end_ns(123) == 123  # paused: the frozen end
    assert session.anchor_ns(end) == end
    assert session.max_window_s() == 90.0 and session.default_window_s() == LIVE_WINDOW_S
    assert session.window_label(0, 0, 30, 0) == "window 30 s"
    assert session.window_label(0, 0, 30, 15) == "window 30 s, ending 15 s ago"
    title, sub = session.titles({"target": {"pid": 7, "cmdline": "/usr/bin/python serve.py"}}, None)
    assert (title, sub) == ("kdash", "live · pid 7 python serve.py")


def test_replay_session_answers_from_the_capture(local_capture, capture_store):
    meta = dict(local_capture.meta)
    meta["capture_path"] = str(LOCAL_CAPTURE)
    session = ReplaySession(meta, capture_store)
    assert not session.live and not session.follows_now and session.mode == "replay"
    assert session.target_pid() is None  # the capture's process is history
    assert session.healths() == capture_healths(meta)
    assert session.findings() is None and session.sglang_meta() is None
    st = session.status(0)
    assert st.sources == capture_healths(meta)
    assert st.dropped == int(meta.get("overflowed_rows") or 0)
    assert st.capture == "" and st.poll_ms is None and st.activity == ""
    answer = session.capture()
    assert not answer.started and answer.note == REPLAY_NOTE and "replay" in answer.toast
    assert answer.job is None
    assert session.continuous_toggle() is None and session.pc_sampling_toggle() is None
    win = meta["window"]
    span = (win["end_ns"] - win["start_ns"]) / 1e9
    assert session.end_ns(None) == win["end_ns"] == session.end_ns(5)  # pause changes nothing
    assert session.anchor_ns(session.end_ns(None)) == win["start_ns"]
    assert session.max_window_s() == pytest.approx(span) == session.default_window_s()
    label = session.window_label(win["start_ns"], win["end_ns"], span, 0.0)
    assert label == f"t 0.0–{span:.1f} s of {span:.1f} s"
    title, sub = session.titles(meta, None)
    assert title == "kdash replay" and LOCAL_CAPTURE.name in sub


def test_replay_session_without_a_window_spans_its_data(local_capture, capture_store):
    """An old capture without `window` in its meta: the axis spans the rows it holds."""
    meta = {k: v for k, v in local_capture.meta.items() if k != "window"}
    session = ReplaySession(meta, capture_store)
    threads = capture_store.get("threads")["t_ns"]
    assert session.data_start_ns <= int(threads.min())
    assert session.data_end_ns >= int(threads.max())
    empty = ReplaySession({}, Store())
    assert empty.max_window_s() == pytest.approx(1.0)


def test_session_for_picks_the_implementation():
    store = Store()
    rec = Recorder([], store, None)
    assert isinstance(session_for(rec, "live", {}, store), LiveSession)
    assert isinstance(session_for(None, "replay", {}, store), ReplaySession)
    with pytest.raises(ValueError, match="needs a recorder"):
        session_for(None, "live", {}, store)
    with pytest.raises(ValueError, match="'demo'"):
        session_for(rec, "demo", {}, store)
    assert issubclass(LiveSession, SessionControl) and issubclass(ReplaySession, SessionControl)


def test_the_controller_never_loads_textual():
    from test_layering import modules_after_import

    mods = modules_after_import("kdash.session_control")
    assert not [m for m in mods if m == "textual" or m.startswith("textual.")]
    assert not [m for m in mods if m.startswith("kdash.tui")]
