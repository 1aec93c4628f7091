"""The agent starts CUPTI afresh when PC samples land in CUPTI's non-user bucket, in process.

What it rests on was measured on the H200 (bench/results/pcs-modules-h200.json,
pcs-session-h200.json): a module loaded while PC sampling is disabled, after its first enable,
is never attributed; a cuptiFinalize followed by the next enable attributes it again. Here no
GPU runs, so the sampler (`StubRanges`) and libcupti's callback API (`test_detach.FakeLib`)
are stand-ins; the runner, the controller's refresh and their guards are the real code.
"""

from __future__ import annotations

import threading
import time

import numpy as np
from kdash.collectors.agent import pcrun
from kdash.collectors.agent.controller import CuptiActivity
from kdash.collectors.agent.outbox import Outbox
from test_detach import CUPTI, LAUNCH, RT, FakeLib


class StubRanges:
    """Stand-in for pcsampling.SamplingRanges (no GPU here): each run returns one row and
    the totals it was given."""

    def __init__(self, totals: list[tuple[int, int]]) -> None:
        self.totals = list(totals)
        self.ranges = 0
        self.cpu_ms_total = 0.0

    def run(self, on_s, cut_short=None, at_call=None):
        total, non_user = self.totals.pop(0)
        self.ranges += 1
        cols = {
            "kernel": np.array(["k"], dtype=object),
            "cubin_crc": np.array([1], dtype=np.int64),
            "pc_offset": np.array([16], dtype=np.int64),
            "stall_reason": np.array(["selected"], dtype=object),
            "count": np.array([total - non_user], dtype=np.int64),
        }
        return cols, {"total_samples": total, "non_user_samples": non_user}


PATIENCE_S = 60.0  # a safety net for a hung test; a loaded machine passes long before it


def run_range(r: pcrun.PCRunner) -> None:
    r.start_range(0.01)
    assert r._thread is not None
    r._thread.join(PATIENCE_S)
    assert not r.busy


def make_runner(totals):
    r = pcrun.PCRunner(Outbox(pid=1))
    r._pc = StubRanges(totals)
    return r


def test_a_range_with_non_user_samples_asks_for_a_refresh_and_a_clean_one_does_not():
    r = make_runner([(1000, 0), (1000, 900), (1000, 10)])
    run_range(r)
    assert r.state is pcrun.PCState.OK and r.non_user_share == 0.0
    assert not r.refresh_wanted and not r.refresh_due(1e9)
    run_range(r)
    assert r.non_user_share == 0.9 and r.refresh_wanted
    assert r.refresh_due(1e9)
    r.refreshed("finalized", now=100.0)
    assert not r.refresh_wanted and r.refresh_note == ""
    run_range(r)  # 1% non-user: under REFRESH_SHARE
    assert not r.refresh_wanted


def test_refreshes_are_spaced_and_a_refusal_is_kept_as_the_note():
    r = make_runner([(1000, 500), (1000, 500)])
    run_range(r)
    r.refreshed("kernels of CUDA-graph replays were recorded, so CUPTI cannot be restarted", 50.0)
    run_range(r)
    assert r.refresh_wanted
    assert not r.refresh_due(50.0 + pcrun.REFRESH_MIN_S - 1)
    assert r.refresh_due(50.0 + pcrun.REFRESH_MIN_S)
    assert r.refresh_note.startswith("kernels of CUDA-graph replays")


def controller_with(lib: FakeLib) -> CuptiActivity:
    c = CuptiActivity(pid=1)
    c.cupti = CUPTI
    c._lib = lib
    return c


def test_refresh_finalizes_at_the_targets_next_call_and_registers_again_at_the_next_window():
    lib = FakeLib()
    c = controller_with(lib)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("r", c.refresh_for_pc(PATIENCE_S)))
    t.start()
    end = time.monotonic() + PATIENCE_S

    def armed() -> bool:
        return lib.cb is not None and (RT, LAUNCH) in lib.enabled

    while not armed() and time.monotonic() < end:  # the hook listens: then the call
        time.sleep(0.005)
    assert armed(), "the refresh never listened for a launch"
    lib.call(RT, LAUNCH)  # the target's next launch reaches CUPTI
    t.join(PATIENCE_S)
    assert out["r"] == "finalized"
    assert lib.events == ["subscribe", "unsubscribe", "finalize"]
    assert c.needs_register and c.pc_refreshes == 1
    registered = []
    c._register = lambda: registered.append(True)  # no cupti-python here: count the call
    c.paused = []
    c._narrow_api_records = lambda enable: None
    assert c.resume() == ""
    assert registered == [True] and not c.needs_register


def test_refresh_is_refused_after_graph_kernels_with_kinds_on_and_taken_back_when_idle():
    lib = FakeLib()
    c = controller_with(lib)
    c.graph_kernels_recorded = True
    assert "CUDA-graph" in c.refresh_for_pc(0.01)
    c.graph_kernels_recorded = False
    c.ledger = {10: 1}
    assert c.refresh_for_pc(0.01) == "activity kinds are on"
    c.ledger = {10: 0}
    # a target that makes no CUDA call: the hook is cancelled, nothing finalizes later
    assert c.refresh_for_pc(0.05).startswith("waiting for the target")
    assert lib.events == ["subscribe", "unsubscribe"]
    lib.call(RT, LAUNCH)
    assert "finalize" not in lib.events and not c.needs_register


class NoContextThenRanges:
    """Stand-in sampler (no GPU here): the first build finds no CUDA context, as the real
    pcsampling.CudaContext does in a compile worker that maps libcuda; later builds sample."""

    builds = 0

    def __new__(cls):
        from kdash.collectors.agent import pcsampling

        cls.builds += 1
        if cls.builds == 1:
            raise pcsampling.NoActiveContext("cuDevicePrimaryCtxGetState (no device)", -1)
        return StubRanges([(1000, 0)])


def test_a_process_without_a_cuda_context_keeps_starting_and_samples_once_it_has_one(
    monkeypatch,
):
    r = pcrun.PCRunner(Outbox(pid=1))
    r.reset(pcrun.PCState.STARTING)

    def sampler():  # the real _sampler builds pcsampling.SamplingRanges once and keeps it
        if r._pc is None:
            r._pc = NoContextThenRanges()
        return r._pc

    monkeypatch.setattr(r, "_sampler", sampler)
    run_range(r)
    assert r.state is pcrun.PCState.STARTING and not r.unavailable
    assert r.text() == "starting: no CUDA context in this process yet"
    assert r._pc is None  # built again at the next range
    run_range(r)
    assert r.state is pcrun.PCState.OK and r.ranges == 1 and r.text() == "ok"


def test_any_other_range_failure_makes_sampling_unavailable_for_the_session():
    r = make_runner([])  # StubRanges with nothing left: its run raises IndexError
    run_range(r)
    assert r.unavailable and r.text().startswith("unavailable: ")


class PcAgent:
    """Stand-in for one AgentSource (no agent process here): only what pc_status reads."""

    def __init__(self, state: str) -> None:
        from kdash.collectors.base import Health

        self.health = Health("ok", "sampling", "sampling")
        self.state = state

    def pc_status(self) -> str:
        return self.state


def test_the_tree_shows_the_agent_that_samples_not_a_context_less_child():
    from kdash.collectors.agents import AgentTreeSource
    from kdash.collectors.base import health_from_text

    from kdash.target import Target

    tree = AgentTreeSource(Target.from_pid(1), try_inject=False)
    worker = "unavailable: cuDevicePrimaryCtxGetState (no device with an active context)"
    tree.agents = {11: PcAgent(worker), 12: PcAgent("ok: 3 ranges, 4 ms of the target's CPU each")}
    assert tree.pc_status().startswith("ok: 3 ranges")
    tree.agents = {11: PcAgent(worker), 12: PcAgent("starting")}
    assert tree.pc_status() == "starting"
    tree.agents = {11: PcAgent(worker), 12: PcAgent("unavailable: counters")}
    line = tree.pc_status()
    assert line.endswith("(pid 11, 2 processes)") and line.startswith("unavailable: ")
    assert health_from_text(line, "pc sampling").code == "pc_unavailable"
    tree.agents = {11: PcAgent(worker)}
    assert tree.pc_status() == worker


class BudgetAgent:
    """Stand-in for an AgentSource: only what the tree's PC budget reads and asks."""

    def __init__(self, held_ms, state: str = "ok") -> None:
        from kdash.collectors.base import Health

        self.health = Health("ok", "sampling", "sampling")
        self.pc_sampling = True
        self.pc_on_ms, self.pc_period_ms = 200, 2000
        self.stats = {"agent_pc_state": state, "agent_pc_held_ms_per_range": held_ms}
        self.asked: list[int] = []

    def set_pc_period(self, period_ms: int) -> None:
        self.asked.append(period_ms)
        self.pc_period_ms = period_ms


def test_the_tree_spaces_pc_ranges_by_what_each_holds_the_target():
    from kdash.collectors.agents import AgentTreeSource

    from kdash.analyses.cost import PC_BUDGET
    from kdash.target import Target

    tree = AgentTreeSource(Target.from_pid(1), try_inject=False)
    dear = BudgetAgent(344.0)
    tree._keep_pc_budget(dear)
    assert len(dear.asked) == 1 and 344.0 / dear.asked[0] <= PC_BUDGET
    tree._keep_pc_budget(dear)  # the same figure again: asked once only
    assert len(dear.asked) == 1
    for held, state in ((344.0, "starting"), (None, "ok"), ("junk", "ok")):
        quiet = BudgetAgent(held, state)
        tree._keep_pc_budget(quiet)
        assert quiet.asked == []
    # a cost budget of 0 (`--cost-budget 0`) keeps the fixed cycle
    fixed = AgentTreeSource(Target.from_pid(1), try_inject=False, cost_budget=0)
    dear = BudgetAgent(344.0)
    fixed._keep_pc_budget(dear)
    assert dear.asked == []
