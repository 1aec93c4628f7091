"""The agent's session state machine, driven in-process: messages in, frames out, against a
fake CUPTI controller (tests/fakes/controller.py: this machine has no GPU and no CUPTI) and a
clock the test moves by hand, so every duty-cycle edge is a step of the test, not a sleep.
The real-process path (socket, sitecustomize, the stand-in cupti module) is test_agent.py's."""

from __future__ import annotations

import os

import pytest
from fakes.controller import FakeController
from kdash.collectors.agent import server, wire
from kdash.collectors.agent.constants import ENV_PC_FIRST_REFRESH
from kdash.collectors.agent.pcrun import REFRESH_MIN_S, PCState
from kdash.collectors.agent.session import Phase, Session

DEFAULTS = ",".join(server.DEFAULT_ACTIVITIES)


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Harness:
    """One agent (not listening) with a fake controller, one session, and what it sent."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.agent = server.Agent("/nonexistent/kdash-test.sock", make_controller=self._controller)
        self.frames: list[bytes] = []
        self.session = Session(self.agent, self.frames.append, wire, clock=self.clock)
        self.decoder = wire.Decoder()
        self.seen: list[wire.Message] = []

    def _controller(self, pid: int) -> FakeController:
        return FakeController(pid, self.clock)

    @property
    def ctl(self) -> FakeController:
        c = self.agent.controller
        assert isinstance(c, FakeController)
        return c

    def send(self, mtype: wire.MsgType, **body) -> None:
        self.session.step(wire.Message(type=mtype, body=body))

    def at(self, t: float) -> None:
        self.clock.t = t
        self.session.step()

    def received(self) -> list[wire.Message]:
        """Every frame sent since the last call, decoded as the client would."""
        for data in self.frames:
            for f in wire.split_frames(data):
                m = self.decoder.decode(f)
                if m.type != wire.MsgType.NAMES:
                    self.seen.append(m)
        self.frames.clear()
        out, self.seen = self.seen, []
        return out

    def lines(self) -> list[str]:
        return [m.body["line"] for m in self.received() if m.type == wire.MsgType.STATUS]


def windows(msgs: list[wire.Message]) -> list[tuple[int, int]]:
    out = []
    for m in msgs:
        if m.type == wire.MsgType.BATCH and m.table == "markers":
            sel = m.body["name"] == server.WINDOW_NAME
            starts, ends = m.body["start_ns"][sel].tolist(), m.body["end_ns"][sel].tolist()
            out += zip(starts, ends, strict=True)
    return out


def test_start_walks_the_duty_cycle_and_stop_detaches():
    h = Harness()
    h.send(wire.MsgType.START)
    assert h.session.phase is Phase.ACTIVE
    assert h.lines() == [
        f"ok: CUPTI activity on, sampling 10% (100 ms/s) ({DEFAULTS.replace(',', ', ')})"
    ]
    h.at(100.05)  # inside the first window: nothing switches
    h.at(100.1)  # its end: paused, and the window goes out as a markers row
    assert windows(h.received()) == [(100_000_000_000, 100_100_000_000)]
    h.at(100.6)
    assert h.ctl.calls[-2:] == ["pause", "release"]
    h.at(101.0)  # the next period: on again
    assert h.ctl.calls[-1] == "resume" and h.session.duty.on
    h.clock.t = 101.05
    h.send(wire.MsgType.STOP)
    got = h.received()
    assert windows(got) == [(101_000_000_000, 101_050_000_000)]
    assert [m.body["line"] for m in got if m.type == wire.MsgType.STATUS] == ["idle: stopped"]
    assert h.ctl.calls == [
        "probe",
        "cancel_hook",
        "probe_graphs",
        f"enable {DEFAULTS}",
        "pause",
        "release",
        "resume",
        "disable",
        "detach",
    ]
    assert h.ctl.kinds_on() == [] and h.ctl.detach_state == "detached"
    assert h.session.phase is Phase.IDLE and h.agent.state == "idle"
    assert h.agent.outbox.windows_sent == 2 and h.agent.outbox.on_ns == 150_000_000


def test_cupti_is_released_after_every_window_and_never_in_a_graph_process():
    """Between windows nothing of CUPTI stays in an eager process: each window's end asks for
    a finalize (at the target's next call) and the next window registers again; no offset read
    meanwhile (it would initialise CUPTI). A process seen launching graphs is never released
    (a finalize after graph kernels were recorded kills it)."""
    h = Harness()
    h.send(wire.MsgType.START)
    for k in range(3):
        h.at(100.1 + k)  # window k ends
        assert h.ctl.calls[-2:] == ["pause", "release"] and h.ctl.released
        h.at(100.6 + k)
        h.at(101.0 + k)  # the next window
        assert h.ctl.calls[-1] == "resume" and not h.ctl.released
    assert h.ctl.releases == 3
    h.ctl.target_calls = False  # an idle target: the release waits, CUPTI stays meanwhile
    h.at(103.1)
    assert not h.ctl.released and h.ctl.release_note.startswith("waiting")
    h.at(104.0)
    h.ctl.target_calls = True
    h.ctl.graphs_seen = True  # a graph launch showed up in the window's API records
    h.at(104.1)
    assert h.ctl.calls[-2:] == ["pause", "release"] and not h.ctl.released
    assert h.ctl.releases == 3 and "graphs" in h.ctl.release_note
    h.send(wire.MsgType.STOP)
    assert h.ctl.calls[-2:] == ["disable", "detach"] and h.ctl.detach_state == "detached"


def test_the_targets_environment_can_keep_cupti_between_windows(monkeypatch):
    """KDASH_AGENT_RELEASE=0 in the target (the A/B bench's `no_release` factor): windows
    pause and resume, and no release is asked for in between."""
    monkeypatch.setenv("KDASH_AGENT_RELEASE", "0")
    h = Harness()
    h.send(wire.MsgType.START)
    for k in range(2):
        h.at(100.1 + k)
        assert h.ctl.calls[-1] == "pause"
        h.at(101.0 + k)
        assert h.ctl.calls[-1] == "resume"
    assert "release" not in h.ctl.calls and h.ctl.releases == 0


def test_the_targets_environment_can_name_the_default_activities(monkeypatch):
    """KDASH_AGENT_ACTIVITIES in the target (the A/B bench's activity factors): a START that
    names no activities switches on those; one that names some still gets what it asked."""
    monkeypatch.setenv("KDASH_AGENT_ACTIVITIES", "kernels,memcpy")
    h = Harness()
    h.send(wire.MsgType.START)
    assert [c for c in h.ctl.calls if c.startswith("enable")] == ["enable kernels,memcpy"]
    h.send(wire.MsgType.STOP)
    h2 = Harness()
    h2.send(wire.MsgType.START, activities=["kernels"])
    assert [c for c in h2.ctl.calls if c.startswith("enable")] == ["enable kernels"]


class _FakeGraph:
    """Stands in for torch.cuda.CUDAGraph (no torch CUDA here): the kinds that were on when
    each replay ran."""

    ctl: FakeController | None = None
    kinds_at_replay: list[list[int]] = []

    def replay(self) -> None:
        assert _FakeGraph.ctl is not None
        _FakeGraph.kinds_at_replay.append(_FakeGraph.ctl.kinds_on())


def _fake_torch_graphs(monkeypatch) -> None:
    import sys
    import types

    graphs = types.SimpleNamespace(CUDAGraph=_FakeGraph)
    monkeypatch.setitem(sys.modules, "torch.cuda.graphs", graphs)


def test_a_graph_replay_after_start_switches_activity_off_before_it_runs(monkeypatch):
    """A server idle while START listened for graphs, whose first torch CUDA-graph replay
    comes later: the guard switches every kind off on the target's thread before that
    replay runs, the session stops at its next tick, CUPTI is detached (no replay's kernel was
    recorded) and the line says the process replays graphs; the class has its own replay
    back. torch.cuda.graphs is a stand-in module here."""
    _fake_torch_graphs(monkeypatch)
    orig = _FakeGraph.__dict__["replay"]
    h = Harness()
    h.send(wire.MsgType.START)
    assert h.session.phase is Phase.ACTIVE and h.ctl.kinds_on()
    assert _FakeGraph.__dict__["replay"] is not orig  # the guard is armed
    monkeypatch.setattr(_FakeGraph, "ctl", h.ctl)
    monkeypatch.setattr(_FakeGraph, "kinds_at_replay", [])
    _FakeGraph().replay()
    _FakeGraph().replay()
    assert _FakeGraph.kinds_at_replay == [[], []]  # every kind was off before the first
    assert h.ctl.calls.count("graph_guard") == 1
    assert _FakeGraph.__dict__["replay"] is orig  # one-shot: the original is back
    h.at(100.05)
    assert h.session.phase is Phase.IDLE
    assert h.ctl.calls[-2:] == ["disable", "detach"] and h.ctl.detach_state == "detached"
    assert "replays CUDA graphs" in h.lines()[-1]
    h.send(wire.MsgType.STOP)


def test_the_graph_guard_is_taken_back_when_the_session_ends(monkeypatch):
    """A session that ends with no replay seen leaves the class as it found it."""
    _fake_torch_graphs(monkeypatch)
    orig = _FakeGraph.__dict__["replay"]
    h = Harness()
    h.send(wire.MsgType.START)
    assert _FakeGraph.__dict__["replay"] is not orig
    h.send(wire.MsgType.STOP)
    assert _FakeGraph.__dict__["replay"] is orig and h.session.graph_guard is None
    assert "graph_guard" not in h.ctl.calls


def test_a_start_waits_for_cuda_and_says_so_once():
    h = Harness()
    h.agent.controller = FakeController(h.agent.pid, h.clock)
    h.ctl.cuda = False
    h.send(wire.MsgType.START, activities=["kernels"])
    h.at(100.2)  # before the next look at /proc/self/maps: no repeat
    h.at(100.6)  # looked again, still no CUDA: the same line is not sent twice
    assert h.lines() == [f"waiting: pid {h.agent.pid} has not loaded CUDA yet"]
    assert h.session.phase is Phase.WAITING and h.ctl.calls == ["precheck", "precheck"]
    h.send(wire.MsgType.START)  # a second START while waiting: the state again, nothing else
    assert h.lines() == [f"waiting: pid {h.agent.pid} has not loaded CUDA yet"]
    h.ctl.cuda = True
    h.at(101.2)
    assert h.session.phase is Phase.ACTIVE and h.ctl.calls[-1] == "enable kernels"
    assert h.lines()[-1].startswith("ok: CUPTI activity on")


def test_another_cupti_client_makes_the_session_step_aside_and_come_back():
    h = Harness()
    h.send(wire.MsgType.START, continuous=False, activities=["kernels", "runtime"])
    h.received()
    h.ctl.held = "torch.profiler is running in this process and holds CUPTI"
    h.at(101.0)
    assert h.session.phase is Phase.WAITING and "step_aside" in h.ctl.calls
    line = h.lines()[-1]
    assert line.startswith("unavailable: torch.profiler") and "kdash paused" in line
    h.ctl.held = None
    h.at(101.5)  # the retry is a second away
    assert h.session.phase is Phase.WAITING
    h.at(102.1)
    assert h.session.phase is Phase.ACTIVE
    assert h.ctl.calls[-1] == "enable kernels,runtime"  # what was on before, again


def test_a_process_that_replays_graphs_gets_no_kernel_activity():
    h = Harness()
    h.agent.controller = FakeController(h.agent.pid, h.clock)
    h.ctl.graph_replays = True
    h.send(wire.MsgType.START)
    assert h.session.phase is Phase.IDLE
    assert h.lines() == [f"off: {_graphs_line(h.agent.pid)}"]
    assert not [c for c in h.ctl.calls if c.startswith("enable")]
    h.send(wire.MsgType.STOP)
    assert h.lines() == ["idle: stopped"]


def _graphs_line(pid: int) -> str:
    from kdash.collectors.agent.session import graphs_line

    return graphs_line(pid)


def test_graph_kernels_recorded_later_stop_kernel_activity_for_good():
    h = Harness()
    h.send(wire.MsgType.START)
    h.ctl.graph_kernels_recorded = True  # a graph began replaying after START
    h.at(100.05)
    assert h.session.phase is Phase.IDLE and h.ctl.calls[-1] == "disable"
    assert h.lines()[-1].startswith(f"off: kernel activity stopped: pid {h.agent.pid}")
    assert h.ctl.detach_state.startswith("attached for good")


def test_probe_failure_gives_up_with_the_reason():
    h = Harness()
    h.agent.controller = FakeController(h.agent.pid, h.clock)
    h.ctl.unavailable = "cupti-python is not importable; pip install it"
    h.send(wire.MsgType.START)
    assert h.session.phase is Phase.IDLE
    assert h.lines() == ["unavailable: cupti-python is not importable; pip install it"]


@pytest.mark.parametrize(
    ("mtype", "body", "line"),
    [
        (wire.MsgType.START, {"activities": "kernels"}, "error: START activities must be a list"),
        (wire.MsgType.START, {"on_ms": 5}, "error: START duty cycle must satisfy"),
        (wire.MsgType.START, {"pc_on_ms": 1, "pc_sampling": True}, "error: START PC sampling"),
        (wire.MsgType.SET, {"period_ms": "1s"}, "error: SET period_ms must be an integer"),
        (wire.MsgType.SET, {"pc_sampling": 1}, "error: SET pc_sampling must be true or false"),
        (wire.MsgType.HELLO, {}, "error: HELLO is not a client message"),
    ],
)
def test_bad_requests_get_an_error_line_and_change_nothing(mtype, body, line):
    h = Harness()
    h.send(mtype, **body)
    got = h.lines()
    assert len(got) == 1 and got[0].startswith(line), got
    assert h.session.phase is Phase.IDLE and h.agent.controller is None


def test_set_switches_to_continuous_and_back():
    h = Harness()
    h.send(wire.MsgType.START)
    h.at(100.1)
    assert not h.session.duty.on
    h.send(wire.MsgType.SET, continuous=True)  # between windows: on at once
    assert h.lines()[-1].startswith("ok: CUPTI activity on, continuous")
    h.at(100.2)
    assert h.session.duty.on and h.ctl.calls[-1] == "resume"
    h.send(wire.MsgType.SET, continuous=False, period_ms=500, on_ms=50)
    assert "sampling 10% (50 ms/0.5 s)" in h.lines()[-1]
    h.at(100.3)  # the running window became the first of the new cycle: 50 ms long
    assert h.ctl.calls[-2:] == ["pause", "release"]


def test_stats_answer_with_the_controllers_counters():
    h = Harness()
    h.send(wire.MsgType.STATS)
    (m,) = h.received()
    assert m.type == wire.MsgType.STATS
    assert m.body["pid"] == os.getpid() and m.body["cupti_state"] == "never attached"
    assert m.body["pc_state"] == "off" and m.body["sampling"]["on_ms"] == server.DUTY_ON_MS
    h.send(wire.MsgType.START)
    h.ctl.records_seen = 1234
    h.send(wire.MsgType.STATS)
    stats = [m for m in h.received() if m.type == wire.MsgType.STATS][0].body
    assert stats["records_seen"] == 1234 and stats["state"] == "active"
    assert stats["enabled"] == list(server.DEFAULT_ACTIVITIES)


def test_the_end_of_a_session_leaves_cupti_as_it_found_it():
    h = Harness()
    h.send(wire.MsgType.START, pc_sampling=True)
    assert h.agent.pc.state is PCState.STARTING
    h.clock.t = 100.05
    h.session.end(closing=False)
    assert h.ctl.calls[-2:] == ["disable", "detach"] and h.ctl.kinds_on() == []
    assert h.agent.pc.state is PCState.OFF
    assert windows(_sent_after_end(h)) == [(100_000_000_000, 100_050_000_000)]

    h2 = Harness()
    h2.send(wire.MsgType.START)
    h2.session.end(closing=True)  # the process exits: no finalize waiting for its next call
    assert h2.ctl.calls[-1] == "disable"


def _sent_after_end(h: Harness) -> list[wire.Message]:
    h.agent.outbox.send(h.frames.append, h.session.strings, 0)
    return h.received()


def test_no_release_between_windows_while_pc_sampling_is_on():
    """PC ranges follow the windows; CUPTI is not finalized under them (a range right after a
    finalize found no active context on the H200): pcrun's own refresh decides instead."""
    h = Harness()
    h.send(wire.MsgType.START, pc_sampling=True)
    h.at(100.1)  # the first window's end
    assert h.session.pc_cfg.on
    assert "pause" in h.ctl.calls and "release" not in h.ctl.calls


def test_a_new_pc_spacing_counts_from_the_last_range_start():
    """The tree source spaces PC ranges to its budget with SET pc_period_ms: the next range
    moves by the change at once, instead of waiting one old period first; a SET that leaves
    the spacing alone (a duty retune) does not move it."""
    h = Harness()
    h.send(wire.MsgType.START, pc_sampling=True)
    h.at(100.1)
    n0 = h.session.next_pc
    assert n0 > 0  # a range was due at START and the next one is scheduled
    h.send(wire.MsgType.SET, pc_sampling=True, pc_period_ms=7000)
    assert h.session.pc_cfg.period_ms == 7000
    assert h.session.next_pc == pytest.approx(n0 + 5.0)
    h.send(wire.MsgType.SET, period_ms=2000, on_ms=100)
    assert h.session.next_pc == pytest.approx(n0 + 5.0)
    h.send(wire.MsgType.SET, pc_period_ms=3000)  # closer again: sooner
    assert h.session.next_pc == pytest.approx(n0 + 1.0)


def _record_ranges(h: Harness) -> list[float]:
    """start_range recorded instead of run (no GPU here): the times ranges were started."""
    started: list[float] = []
    h.agent.pc.start_range = lambda on_s: started.append(h.clock.t)  # type: ignore[method-assign]
    return started


def test_a_first_range_lost_to_the_bucket_is_followed_by_one_right_after_the_refresh():
    """The first range comes after a refresh of CUPTI (the first range on a CUPTI that kernel
    activity started lost every sample on the H200). A range whose samples CUPTI put in its
    non-user bucket asks for a refresh; the next range then comes at the next step the refresh
    may be done in, not a whole PC period later. Only once a session: a target that keeps
    loading modules waits its period."""
    h = Harness()
    pc = h.agent.pc
    started = _record_ranges(h)
    h.send(wire.MsgType.START, pc_sampling=True)
    h.send(wire.MsgType.SET, pc_sampling=True, pc_period_ms=7000)
    h.at(100.1)  # the first window's end: the first range, CUPTI refreshed before it
    assert started == [100.1] and h.ctl.calls.count("refresh_pc") == 1
    assert h.ctl.calls.index("refresh_pc") > h.ctl.calls.index("pause")  # kinds off first
    h.at(100.2)
    assert started == [100.1]  # a clean range: the next one waits for its period
    pc.refresh_wanted = True  # that range landed in the bucket
    h.at(100.3)
    assert started == [100.1]  # refreshes stay REFRESH_MIN_S apart, the first one's included
    t = 100.3
    while len(started) < 2 and t < 105:
        t = round(t + 0.05, 2)
        h.at(t)
    t2 = h.clock.t
    # the retry at the first step with the refresh allowed and activity off (within a period)
    assert 100.1 + REFRESH_MIN_S <= t2 < 100.1 + REFRESH_MIN_S + 2.0
    assert started == [100.1, t2] and h.ctl.calls.count("refresh_pc") == 2
    pc.refresh_wanted = True  # lost again: this time it waits for its period
    pc.last_refresh = -10.0  # (and a refresh would be allowed)
    for t in (t2 + 0.2, t2 + 1, t2 + 3, t2 + 5, t2 + 6.9):
        h.at(t)
    assert started == [100.1, t2]
    h.at(t2 + 7.05)
    assert started == [100.1, t2, t2 + 7.05] and h.ctl.calls.count("refresh_pc") == 3


def test_pc_switched_on_mid_session_refreshes_before_its_first_range_and_the_env_says_not():
    h = Harness()
    started = _record_ranges(h)
    h.send(wire.MsgType.START)
    h.at(100.1)
    assert started == [] and "refresh_pc" not in h.ctl.calls
    h.send(wire.MsgType.SET, pc_sampling=True)
    h.at(100.2)
    assert started == [100.2] and h.ctl.calls.count("refresh_pc") == 1
    h.at(100.3)
    assert started == [100.2]  # the first-range refresh is not the quick retry of a lost one
    # the range's edges go through the controller (on the target's thread where CUPTI can)
    ran: list[int] = []
    assert h.agent.pc.at_call(lambda: ran.append(1)) == "here: no target"
    assert ran == [1] and "edge" in h.ctl.calls

    os.environ[ENV_PC_FIRST_REFRESH] = "0"
    try:
        h2 = Harness()
    finally:
        del os.environ[ENV_PC_FIRST_REFRESH]
    started2 = _record_ranges(h2)
    h2.send(wire.MsgType.START, pc_sampling=True)
    h2.at(100.1)
    assert started2 == [100.1] and "refresh_pc" not in h2.ctl.calls
