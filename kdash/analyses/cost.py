"""What watching costs the target: an estimate of kdash's slowdown, from the agent's counters.

The user watching a live server has to know whether the numbers on screen are the server's or
the server's plus kdash. The agent cannot time the target without kdash, so this is a model,
shown as an estimate ("kdash cost ≈ N%"), built from what we measured on an NVIDIA H200
(bench/results/graph-cupti-h200.json, bench/results/agent-cost-h200.json):

* each kernel record costs the target about 1.2 µs of GPU-stream time while CUPTI kernel
  activity is on (CUDA-graph replays: 0.8-2.0 µs per kernel over six graphs, 1.04-1.18 µs on
  the decode graphs; eager launches similar). That is why continuous activity cost a
  graph-replayed decode loop of ~243,000 kernels/s about 29%;
* each API record (runtime/driver callback) costs about 1.0 µs of the launching thread;
* the agent's own CPU time in the target's process (its buffer callback, stats key
  `agent_callback_cpu_ns`) is taken from the target: it holds the GIL, so a Python launch
  thread waits for it. So is the time of CUPTI's releases between windows (the
  `cuptiFinalize` inside one of the target's CUDA calls, and the next window's registration,
  which initialises CUPTI again) and of every window's edges (the kinds switched on and
  narrowed, then off, in the live context), counted with it
  (collectors/agents.counters_from_stats). On the H200 an eager decode step lost ~15% of single
  1-s slots, about one slot a window, against its twin on the same CPU (bench/NOTES-agent.md,
  session 10), where its record costs explain a few ms: the edges were not timed then.

The record costs are paid only while activity is on, so the record rates are per second *of
activity* and are scaled by the duty fraction (`on_ms / period_ms`, 1.0 continuous); the
agent's CPU time is already per wall second. The three parts are added, not maxed: from
outside kdash cannot tell whether the GPU stream or the launch thread limits the target, so
the estimate leans high rather than low.
"""

from __future__ import annotations

import math

PC_GPU_SHARE = 0.016  # PC sampling's cost on the GPU while a range runs (H200, at most)
KERNEL_RECORD_S = 1.2e-6  # GPU-stream time per kernel record while activity is on (H200)
API_RECORD_S = 1.0e-6  # launching thread's time per API record (H200)


def duty_fraction(sampling: dict | None) -> float | None:
    """The fraction of time activity is on, from an agent's "sampling" field
    (`{"continuous": bool, "period_ms": int, "on_ms": int}`); None when it has not said."""
    if not sampling:
        return None
    if sampling.get("continuous"):
        return 1.0
    try:
        period, on = float(sampling.get("period_ms", 0)), float(sampling.get("on_ms", 0))
    except (TypeError, ValueError):
        return None
    if period <= 0:
        return None
    return min(1.0, max(0.0, on / period))


def estimated_cost(
    kernels_per_on_s: float,
    api_per_on_s: float,
    duty: float,
    agent_cpu_ns_per_s: float,
) -> float:
    """kdash's estimated slowdown of one target process, as a fraction (0.29 = 29%).

    `kernels_per_on_s` and `api_per_on_s` are records received per second while activity was
    on; `duty` is the fraction of time it is on (1.0 continuous); `agent_cpu_ns_per_s` is the
    agent's CPU time in the target per wall second. Negative inputs (a counter reset) count 0.
    """
    duty = min(1.0, max(0.0, duty))
    per_on_s = max(0.0, kernels_per_on_s) * KERNEL_RECORD_S + max(0.0, api_per_on_s) * API_RECORD_S
    return duty * per_on_s + max(0.0, agent_cpu_ns_per_s) / 1e9


# The default budget sits under the 2% kdash may cost its target because the model read low
# on the H200: at the 10% duty cycle it predicted ~3.3% for the graph-replayed decode loop
# that measured 4.7% against its unattached neighbours (agent-cost-h200.json).
DEFAULT_BUDGET = 0.015
MAX_BUDGET_PERIOD_MS = 10_000  # a longer period than this leaves the timeline mostly gaps
RETUNE_RATIO = 1.25  # a new cycle is asked for only when on/period moves by more than this


def duty_for_budget(
    kernels_per_on_s: float,
    api_per_on_s: float,
    cpu_ns_per_s: float,
    duty_now: float,
    budget: float,
    period_ms: int,
    on_ms: int,
    min_on_ms: int,
) -> tuple[int, int] | None:
    """The duty cycle (period_ms, on_ms) that keeps the estimated cost at `budget`, never more
    on than the default (`on_ms` of `period_ms`, which is also what it returns to when the
    load drops), or None when the current cycle is close enough (within RETUNE_RATIO).

    The agent's CPU time is paid while activity is on, so it is scaled from the duty it was
    measured at (`duty_now`) to the cost of one second of activity. The window keeps its
    length and the period stretches (up to MAX_BUDGET_PERIOD_MS); past that the window
    shrinks, to `min_on_ms` at the least.
    """
    if budget <= 0 or duty_now <= 0:
        return None
    per_on_s = (
        max(0.0, kernels_per_on_s) * KERNEL_RECORD_S
        + max(0.0, api_per_on_s) * API_RECORD_S
        + max(0.0, cpu_ns_per_s) / 1e9 / duty_now
    )
    default = on_ms / period_ms
    want = default if per_on_s <= 0 else min(default, budget / per_on_s)
    if max(want, duty_now) / max(min(want, duty_now), 1e-9) <= RETUNE_RATIO:
        return None
    if want >= default:
        return period_ms, on_ms
    # Fewer windows rather than shorter ones: on the H200 the 5% cycle made of 50 ms windows
    # cost the decode graph no less than the 10% one of 100 ms windows, both once a second
    # (agent-cost-h200.json), so part of the cost comes with each window (enable, flush,
    # disable), and only a longer period cuts that part too.
    period = 100 * math.ceil(on_ms / want / 100)  # whole tenths of a second: readable cycles
    if period <= MAX_BUDGET_PERIOD_MS:
        return period, on_ms
    return MAX_BUDGET_PERIOD_MS, max(min_on_ms, round(MAX_BUDGET_PERIOD_MS * want))


# PC sampling is asked for by the user, who wants line heat, so its ranges get a budget of
# their own, larger than the activity's: each range holds the target for a fixed time (its
# enable and start, Stop's decoding, its disable: 340 ms a range on the H200 decode loop,
# bench/results/pcs-agent-h200-s8-steady.json), which a range every 2 s turned into a 24%
# slowdown; spacing the ranges is the only lever, as the held time does not shrink with them.
PC_BUDGET = 0.05
MAX_PC_PERIOD_MS = 30_000  # a hot line refreshed less often than this looks stuck
# A PC range costs a launch-bound target more than the time it holds the GIL: meanwhile the GPU
# drains the queue the loop had filled ahead, and the loop then waits for it to refill. Against
# a never-attached twin the eager matmul loop lost 10.4% and 8.1% while its ranges were spaced
# to a 5% estimate (6% with activity's share; bench/results/agent-ab-h200-pc-spaced.json), so
# the held time counts this many times, in the estimate and in the spacing alike.
PC_HOLD_FACTOR = 1.6


def pc_period_for_budget(
    held_ms: float,
    on_ms: int,
    period_ms: int,
    budget: float,
    min_period_ms: int,
    max_period_ms: int = MAX_PC_PERIOD_MS,
) -> int | None:
    """The PC-range period (ms) that keeps PC sampling's estimated cost at `budget`, or None
    when the current `period_ms` is close enough (within RETUNE_RATIO) or nothing is known.

    A range of `on_ms` costs the target `held_ms` (the agent's measured wall time in calls
    that hold its GIL) times PC_HOLD_FACTOR plus PC_GPU_SHARE of the range on the GPU, once
    per period; the period
    never drops under `min_period_ms` (the default cycle) nor goes past `max_period_ms`.
    """
    if budget <= 0 or held_ms <= 0 or period_ms <= 0:
        return None
    per_range_ms = PC_HOLD_FACTOR * held_ms + PC_GPU_SHARE * max(0, on_ms)
    want = 100 * math.ceil(per_range_ms / budget / 100)  # whole tenths of a second
    want = int(min(max_period_ms, max(min_period_ms, 2 * on_ms, want)))
    if max(want, period_ms) / min(want, period_ms) <= RETUNE_RATIO:
        return None
    return want


def cost_text(fraction: float | None) -> str:
    """ "kdash cost ≈ 3%" for the status bar ("" when unknown); under 1% reads "<1%" so a
    small cost is not shown as zero."""
    if fraction is None:
        return ""
    pct = 100 * fraction
    shown = "<1" if pct < 1 else f"{pct:.0f}"
    return f"kdash cost ≈ {shown}%"
