"""kdash's cost estimate (kdash.analyses.cost), the rate bookkeeping behind it
(collectors/agents.py `CostMeter`), and the `--no-inject` decision of the agent tree source."""

import os

import pytest
from kdash.collectors.agents import (
    AgentTreeSource,
    CostMeter,
    counters_from_stats,
    no_agent_reason,
    rates_between,
)

from kdash.analyses.cost import cost_text, duty_fraction, estimated_cost

S = 1_000_000_000
DUTY = {"continuous": False, "period_ms": 1000, "on_ms": 100}
CONT = {"continuous": True, "period_ms": 1000, "on_ms": 100}


# -- the model ---------------------------------------------------------------------------------
def test_measured_decode_loop_continuous_and_sampled():
    # 243,000 graph-replayed kernels/s cost 29% continuous on the H200
    assert estimated_cost(243_000, 0, 1.0, 0) == pytest.approx(0.29, abs=0.01)
    assert estimated_cost(243_000, 0, 0.1, 0) == pytest.approx(0.029, abs=0.002)


def test_api_records_and_agent_cpu_add():
    base = estimated_cost(100_000, 0, 1.0, 0)
    assert estimated_cost(100_000, 50_000, 1.0, 0) == pytest.approx(base + 0.05)
    # 20 ms of agent CPU per wall second is 2%, whatever the duty cycle
    assert estimated_cost(0, 0, 0.1, 20e6) == pytest.approx(0.02)
    assert estimated_cost(-5, -5, 1.0, -1) == 0.0  # a counter reset never reads as a gain


def test_duty_fraction_and_text():
    assert duty_fraction(DUTY) == pytest.approx(0.1)
    assert duty_fraction(CONT) == 1.0
    assert duty_fraction({"period_ms": 0, "on_ms": 0}) is None
    assert duty_fraction(None) is None
    assert cost_text(0.2916) == "kdash cost ≈ 29%"
    assert cost_text(0.004) == "kdash cost ≈ <1%"
    assert cost_text(None) == ""


# -- rates from snapshots ----------------------------------------------------------------------
def stats(kernels, api, on_ns, cpu_ns, sampling=DUTY):
    return {
        "received_rows": kernels + api,
        "agent_sent_rows": {"kernels": kernels, "api": api, "markers": 3},
        "agent_on_ns": on_ns,
        "agent_callback_cpu_ns": cpu_ns,
        "sampling": sampling,
    }


def test_counters_need_a_stats_reply():
    assert counters_from_stats({"dropped_client": 0, "received_rows": 0}, 0) is None
    c = counters_from_stats(stats(10, 5, 7, 9), 123)
    assert (c.kernels, c.api, c.on_ns, c.cpu_ns, c.t_ns) == (10, 5, 7, 9, 123)
    assert c.duty == pytest.approx(0.1)


def test_cupti_releases_count_as_the_targets_time():
    """A release's cuptiFinalize (in the target's CUDA call) and the next window's
    registration are added to the agent's callback CPU: a launch-bound loop pays them each
    window, and an estimate without them read low."""
    a = counters_from_stats(stats(0, 0, 0, 0), 0)
    st = stats(0, 0, int(0.3 * S), 6_000_000)
    st["agent_cupti_release_finalize_ns"] = 30_000_000
    st["agent_cupti_reregister_ns"] = 90_000_000
    b = counters_from_stats(st, 3 * S)
    assert b.cpu_ns == 126_000_000
    assert rates_between(a, b).cpu_ns_per_s == pytest.approx(42e6)  # 4.2% of each second
    st["agent_cupti_reregister_ns"] = None  # an agent that does not say
    assert counters_from_stats(st, 3 * S).cpu_ns == 36_000_000


def test_window_edges_count_as_the_targets_time():
    """Each window's edges (kinds on and narrowed, kinds off) are the target's time too: an
    eager decode step lost ~150 ms a window against its twin on the H200, far more than its
    records explain."""
    st = stats(0, 0, int(0.3 * S), 6_000_000)
    st["agent_cupti_switch_ns"] = 45_000_000
    assert counters_from_stats(st, 3 * S).cpu_ns == 51_000_000
    st["agent_cupti_reregister_ns"] = 9_000_000
    assert counters_from_stats(st, 3 * S).cpu_ns == 60_000_000


def test_the_controller_times_its_window_edges():
    """The real controller times what a window's start (enables, narrowing) and end
    (disables) take: the stand-in CUPTI below takes 5 ms per switch (no CUPTI here)."""
    import time
    import types

    from kdash.collectors.agent.controller import CuptiActivity

    calls = []

    def switch(what):
        def f(kind):
            calls.append((what, int(kind)))
            time.sleep(0.005)

        return f

    c = CuptiActivity(1)
    c.cupti = types.SimpleNamespace(
        activity_enable=switch("on"),
        activity_disable=switch("off"),
        activity_flush_all=lambda flag: calls.append(("flush", flag)),
    )
    c.paused = [("kernels", 10), ("memcpy", 1)]
    assert c.resume() == ""
    on_ns = c.switch_ns
    assert on_ns >= 10_000_000 and c.resumes == 1
    assert c.pause() == ""
    assert c.switch_ns - on_ns >= 10_000_000
    assert calls == [("on", 10), ("on", 1), ("off", 10), ("off", 1), ("flush", 1)]
    assert c.kinds_on() == []


def test_rates_are_per_second_of_activity():
    a = counters_from_stats(stats(0, 0, 0, 0), 0)
    # 3 s of wall time, 0.3 s of it with activity on, 72,900 kernels recorded in it
    b = counters_from_stats(stats(72_900, 300, int(0.3 * S), 6_000_000), 3 * S)
    r = rates_between(a, b)
    assert r.kernels_per_on_s == pytest.approx(243_000)
    assert r.api_per_on_s == pytest.approx(1_000)
    assert r.cpu_ns_per_s == pytest.approx(2e6)
    assert rates_between(b, b) is None  # activity never on in between
    assert rates_between(b, a) is None  # counters went back


def test_meter_learns_over_a_span_and_follows_the_mode():
    m = CostMeter(min_span_s=2.0)
    m.update(7, {"received_rows": 0}, 0)  # before the first STATS reply: nothing
    assert m.estimate() is None
    m.update(7, stats(0, 0, 0, 0), 0)
    m.update(7, stats(24_300, 0, int(0.1 * S), 0), 1 * S)  # span too short to learn from
    assert m.estimate() is None
    m.update(7, stats(48_600, 0, int(0.2 * S), 0), 2 * S)
    assert m.estimate() == pytest.approx(0.029, abs=0.002)
    # the same STATS reply seen by later polls is not new data
    m.update(7, stats(48_600, 0, int(0.2 * S), 0), 3 * S)
    assert m.estimate() == pytest.approx(0.029, abs=0.002)
    # switched to continuous (STATUS says so before new counters): the estimate follows at once
    m.update(7, stats(48_600, 0, int(0.2 * S), 0, CONT), 3 * S)
    assert m.estimate() == pytest.approx(0.29, abs=0.01)


def test_meter_takes_the_slowest_process_and_forgets_gone_ones():
    m = CostMeter(min_span_s=1.0)
    for pid, k in ((1, 10_000), (2, 200_000)):
        m.update(pid, stats(0, 0, 0, 0, CONT), 0)
        m.update(pid, stats(k, 0, S, 0, CONT), S)
    assert m.estimate() == pytest.approx(0.24)
    m.retain([1])
    assert m.estimate() == pytest.approx(0.012)
    m.retain([])
    assert m.estimate() is None


def test_meter_restarts_after_a_counter_reset():
    m = CostMeter(min_span_s=1.0)
    m.update(1, stats(1_000_000, 0, 10 * S, 0, CONT), 0)
    m.update(1, stats(100, 0, S // 10, 0, CONT), S)  # a new agent in a reused pid
    assert m.estimate() is None  # no rate from a negative delta
    m.update(1, stats(100_100, 0, S + S // 10, 0, CONT), 2 * S)
    assert m.estimate() == pytest.approx(0.12)


# -- --no-inject -------------------------------------------------------------------------------
def test_no_agent_reason_names_the_flag_only_when_given():
    off = no_agent_reason(42, None, inject_allowed=False)
    assert off.startswith("no agent in pid 42 (injection off: --no-inject)")
    assert "kdash run" in off
    on = no_agent_reason(42, None, inject_allowed=True)
    assert "--no-inject" not in on and on.startswith("no kdash agent in pid 42")
    noted = no_agent_reason(42, "cupti-python missing", inject_allowed=False)
    assert "--no-inject" in noted and "cupti-python missing" in noted


class _Tree:
    """A target with no agent anywhere: this test process (it has none)."""

    pid = os.getpid()

    def pids(self):
        return [self.pid]


@pytest.mark.parametrize("allowed", [True, False])
def test_tree_source_health_under_no_inject(allowed):
    src = AgentTreeSource(_Tree(), inject_allowed=allowed)
    src.start()
    src.poll(0)
    reason = str(src.health)
    assert reason.startswith("unavailable: ")
    assert ("injection off: --no-inject" in reason) is (not allowed), reason
    assert src.cost_estimate() is None


# -- the budget ---------------------------------------------------------------------------------
def test_budget_lowers_the_graph_decode_cycle_and_leaves_light_loads_alone():
    from kdash.analyses.cost import MAX_BUDGET_PERIOD_MS, duty_for_budget

    # the H200 decode graph: 243k kernels per second of activity, 2 ms/s of agent CPU at 10%;
    # the window keeps its 100 ms and the period stretches (fewer windows, each costs too)
    period, on = duty_for_budget(243_000, 2_000, 2e6, 0.1, 0.015, 1000, 100, 10)
    assert on == 100 and 1800 <= period <= 2300
    d = on / period
    assert estimated_cost(243_000, 2_000, d, 2e6 * d / 0.1) == pytest.approx(0.015, rel=0.05)
    # an eager loop (5k kernels/s): the default stays
    assert duty_for_budget(5_000, 5_000, 1e5, 0.1, 0.015, 1000, 100, 10) is None
    # close to the wanted cycle already: no retune (no flapping on noise)
    assert duty_for_budget(243_000, 2_000, 1e6, 0.05, 0.015, 1000, 100, 10) is None
    # so heavy that 100 ms every 10 s is too much: the window shrinks at the longest period
    assert duty_for_budget(2e6, 0, 0, 0.1, 0.015, 1000, 100, 10) == (
        MAX_BUDGET_PERIOD_MS,
        62,
    )  # 2e6 x 1.2 us: 1.5% / 2.4
    assert duty_for_budget(1e9, 0, 0, 0.1, 0.015, 1000, 100, 10) == (MAX_BUDGET_PERIOD_MS, 10)
    # the load dropped while lowered: back to the default, never above it
    assert duty_for_budget(1_000, 0, 0, 0.01, 0.015, 1000, 100, 10) == (1000, 100)
    # no budget, or no measured duty: nothing to do
    assert duty_for_budget(243_000, 0, 0, 0.1, 0, 1000, 100, 10) is None
    assert duty_for_budget(243_000, 0, 0, 0.0, 0.015, 1000, 100, 10) is None


def test_pc_sampling_cost_is_its_cpu_per_range_over_the_period():
    from kdash.collectors.agents import pc_sampling_cost

    from kdash.analyses.cost import PC_GPU_SHARE, PC_HOLD_FACTOR

    on = {"pc_on": True, "agent_pc_state": "ok", "pc_on_ms": 200, "pc_period_ms": 2000,
          "agent_pc_cpu_ms_per_range": 80.0}  # fmt: skip
    # 80 ms of GIL-held decode every 2 s (counted PC_HOLD_FACTOR times, as the twin A/B
    # measured), plus the GPU-side share while a range runs
    assert PC_HOLD_FACTOR > 1
    assert pc_sampling_cost(on) == pytest.approx(PC_HOLD_FACTOR * 0.04 + PC_GPU_SHARE * 0.1)
    assert pc_sampling_cost({**on, "pc_on": False}) == 0.0
    assert pc_sampling_cost({**on, "agent_pc_state": "unavailable: no GPU"}) == 0.0
    assert pc_sampling_cost({**on, "pc_period_ms": 0}) == 0.0
    # the GIL-held wall time per range counts when it is longer than the CPU time (the driver
    # waits of a synchronize or an enable are not CPU)
    held = {**on, "agent_pc_held_ms_per_range": 400.0}
    assert pc_sampling_cost(held) == pytest.approx(PC_HOLD_FACTOR * 0.2 + PC_GPU_SHARE * 0.1)
    # the meter adds it to the activity estimate at once, without a new span
    m = CostMeter(min_span_s=1.0)
    m.update(1, stats(0, 0, 0, 0, CONT), 0)
    m.update(1, stats(10_000, 0, S, 0, CONT), S)
    base = m.estimate()
    m.update(1, {**stats(10_000, 0, S, 0, CONT), **on}, 2 * S)
    assert m.estimate() == pytest.approx(base + pc_sampling_cost(on))


def test_pc_ranges_are_spaced_to_their_budget():
    from kdash.analyses.cost import (
        MAX_PC_PERIOD_MS,
        PC_GPU_SHARE,
        PC_HOLD_FACTOR,
        pc_period_for_budget,
    )

    # the H200 decode loop: 344 ms held per 200-ms range; at 5% the ranges go ~11 s apart
    p = pc_period_for_budget(344.0, 200, 2000, 0.05, 2000)
    assert p is not None and p % 100 == 0 and 10_000 < p < 12_000
    per_range = PC_HOLD_FACTOR * 344.0 + PC_GPU_SHARE * 200
    assert per_range / p <= 0.05 < per_range / (p - 100)  # the shortest that keeps the budget
    # already there (within the retune ratio): nothing to ask
    assert pc_period_for_budget(344.0, 200, p, 0.05, 2000) is None
    assert pc_period_for_budget(300.0, 200, p, 0.05, 2000) is None
    # a cheap range: never faster than the default cycle, and back to it when it got cheap
    assert pc_period_for_budget(5.0, 200, 2000, 0.05, 2000) is None
    assert pc_period_for_budget(5.0, 200, 9000, 0.05, 2000) == 2000
    # a very dear range: capped, so the hot line still refreshes
    assert pc_period_for_budget(5000.0, 200, 2000, 0.05, 2000) == MAX_PC_PERIOD_MS
    # nothing measured, or no budget: nothing to do
    assert pc_period_for_budget(0.0, 200, 2000, 0.05, 2000) is None
    assert pc_period_for_budget(344.0, 200, 2000, 0.0, 2000) is None


class _GraphAgent:
    """Stand-in for an AgentSource (only the fields cost_estimate reads)."""

    def __init__(self, stats: dict, pc: bool = False) -> None:
        self.stats = stats
        self.pc_sampling, self.pc_on_ms, self.pc_period_ms = pc, 200, 2000


def test_cost_detail_gives_each_agents_counters_for_the_capture():
    """The counters behind the estimate, per agent pid, as a capture keeps them (what a
    measured cost is read against); keys the agent did not send are None."""
    from kdash.collectors.agents import COST_DETAIL_KEYS

    from kdash.session import agent_cost

    st = stats(10, 5, int(0.3 * S), 6_000_000)
    st["agent_cupti_switch_ns"] = 45_000_000
    src = AgentTreeSource(_Tree(), inject_allowed=False)
    src.agents = {7: _GraphAgent(st)}
    detail = src.cost_detail()
    assert list(detail) == ["7"] and set(detail["7"]) == set(COST_DETAIL_KEYS)
    assert detail["7"]["cupti_switch_ns"] == 45_000_000
    assert detail["7"]["sent_rows"] == {"kernels": 10, "api": 5, "markers": 3}
    assert detail["7"]["cupti_releases"] is None
    cost = agent_cost([object(), src])
    assert cost == {"estimate": src.cost_estimate(), "agents": detail}
    assert agent_cost([object()]) is None


def test_an_agent_that_records_nothing_in_a_graph_process_estimates_its_pc_share_only():
    from kdash.collectors.agents import pc_sampling_cost

    graph = {"agent_graphs_seen": True, "agent_graph_kernels_recorded": False,
             "agent_enabled": []}  # fmt: skip
    src = AgentTreeSource(_Tree(), inject_allowed=False)
    src.agents = {1: _GraphAgent(graph)}
    assert src.cost_estimate() == 0.0  # shown as "<1%", not left blank
    pc = {**graph, "agent_pc_state": "ok", "agent_pc_held_ms_per_range": 100.0}
    src.agents = {1: _GraphAgent(pc, pc=True)}
    want = pc_sampling_cost({**pc, "pc_on": True, "pc_on_ms": 200, "pc_period_ms": 2000})
    assert want > 0.04 and src.cost_estimate() == pytest.approx(want)
    # kernels of graph replays recorded (`--graph-kernels`), or activity on: the record
    # rates decide, and none are known yet
    for stats in ({**graph, "agent_graph_kernels_recorded": True},
                  {**graph, "agent_enabled": ["kernel"]}, {}):  # fmt: skip
        src.agents = {1: _GraphAgent(stats)}
        assert src.cost_estimate() is None
