"""Kernel activity from every kdash agent in the target's process tree, as one source.

SGLang-like servers do their GPU work in spawned child processes, so the pid the user names is
rarely the one that launches kernels. This source rescans the tree (once a second), connects an
`AgentSource` to every process that has an agent socket, and merges their batches. Processes
that have an agent but no CUDA context yet (a tokenizer, a detokenizer) stay "starting" and do
not count against health.

It also keeps the rate bookkeeping behind the status bar's "kdash cost ≈ N%" (`CostMeter`):
the agents' counters are cumulative, so rates come from deltas between successive STATS
snapshots; the model that turns rates into a slowdown is `kdash.analyses.cost`.

Where a process of the tree has no agent, the source puts one in (so `attach --pid` reaches
kernel data from an agent already there, else by injection): into every process of
the tree that has the CUDA driver mapped (the ones that can launch kernels), or into the
named process itself when none has yet. Each pid is tried once, on a thread of its own
(`inject.inject`: ptrace on Python 3.10-3.13, `sys.remote_exec` on 3.14+; a fraction of a
second), after `inject.check_injectable` has said which precondition fails if one does; that
reason is the pane's line. `kdash attach --no-inject` reaches this source as
`inject_allowed=False`: nothing is injected, and the one line for "no agent" says so (see
`no_agent_reason`) rather than suggesting what the user has ruled out.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from kdash.collectors.agent import server
from kdash.collectors.agent.client import (
    AgentSource,
    agent_failure_note,
    find_agent_socket,
    socket_problems,
    unavailable_note,
)
from kdash.collectors.base import (
    OK,
    Health,
    PcSamplingStatus,
    health_from_text,
    safe_call,
    safe_poll,
)

from kdash import schema, target_python
from kdash.analyses.cost import (
    DEFAULT_BUDGET,
    PC_BUDGET,
    PC_GPU_SHARE,
    PC_HOLD_FACTOR,
    duty_for_budget,
    duty_fraction,
    estimated_cost,
    pc_period_for_budget,
)
from kdash.schema import Batch
from kdash.target import Target

NO_INJECT = "injection off: --no-inject"
# the agent's STATS counters behind the cost estimate, kept in captures (cost_detail)
COST_DETAIL_KEYS = (
    "sampling",
    "sent_rows",
    "on_ns",
    "windows_sent",
    "callback_cpu_ns",
    "cupti_releases",
    "cupti_release_finalize_ns",
    "cupti_reregister_ns",
    "cupti_switch_ns",
    "narrow_us_per_window",
    "switch_us_per_window",
    "pc_held_ms_per_range",
    "pc_ranges",
)


def holds_cuda(pid: int) -> bool:
    """Has this process mapped the CUDA driver (libcuda), i.e. can it launch kernels?"""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return any(b"libcuda.so" in line for line in f)
    except OSError:
        return False


def no_agent_reason(pid: int, note: str | None, inject_allowed: bool) -> str:
    """The one line for a tree with no agent. Under `--no-inject` it names the flag, so the
    user knows the kernel pane is empty by their choice; the start-up hook's failure note, if
    any, still comes first (it says why an agent that was armed did not start)."""
    if not inject_allowed:
        why = f"; {note}" if note else "; start the target with `kdash run -- CMD`"
        return f"no agent in pid {pid} ({NO_INJECT}){why}"
    why = f": {note}" if note else " (start the target with `kdash run -- CMD`)"
    return f"no kdash agent in pid {pid} or its children{why}"


def _pc_rank(state: str) -> int:
    """Order of PC-sampling states, best first: sampling, starting, off, unavailable."""
    if state.startswith("ok"):
        return 0
    if state.startswith("starting"):
        return 1
    if state.startswith("off"):
        return 2
    return 3


def _pid_field(pid: int, h: Health) -> dict[str, int]:
    """{"pid": pid} for an agent that is there, {} when its client found no agent socket."""
    return {} if h.code == "no_socket" else {"pid": pid}


@dataclass(frozen=True)
class AgentCounters:
    """One agent's cumulative counters from a STATS snapshot, stamped with the poll time
    (monotonic ns) at which this snapshot was first seen."""

    t_ns: int
    kernels: int  # kernel rows the agent sent, all sessions
    api: int  # API rows the agent sent
    on_ns: int  # total time activity was on
    cpu_ns: int  # the target's time taken by the agent: callback CPU, CUPTI releases
    duty: float | None  # fraction of time activity is on now (None: not said yet)
    pc_share: float = 0.0  # PC sampling's cost now: agent CPU per range / range period

    def same_counts(self, other: AgentCounters) -> bool:
        return (self.kernels, self.api, self.on_ns, self.cpu_ns) == (
            other.kernels,
            other.api,
            other.on_ns,
            other.cpu_ns,
        )


def counters_from_stats(stats: dict[str, Any], t_ns: int) -> AgentCounters | None:
    """The counters of an `AgentSource.stats` dict, or None before the first STATS reply.

    The mode comes from the STATUS "sampling" field when there is one (it follows a switch at
    once), else from the last STATS reply's.
    """
    sent = stats.get("agent_sent_rows")
    on_ns, cpu_ns = stats.get("agent_on_ns"), stats.get("agent_callback_cpu_ns")
    if not isinstance(sent, dict) or on_ns is None or cpu_ns is None:
        return None
    try:
        # A release's cuptiFinalize runs inside one of the target's CUDA calls, the next
        # window's registration initialises CUPTI again while the target launches, and each
        # window's edges switch kinds on and off in the live context: all the target's time,
        # counted like the callbacks' (older agents do not say: 0).
        held_ns = sum(
            int(stats.get(k) or 0)
            for k in (
                "agent_cupti_release_finalize_ns",
                "agent_cupti_reregister_ns",
                "agent_cupti_switch_ns",
            )
        )
        return AgentCounters(
            t_ns=int(t_ns),
            kernels=int(sent.get("kernels", 0)),
            api=int(sent.get("api", 0)),
            on_ns=int(on_ns),
            cpu_ns=int(cpu_ns) + max(0, held_ns),
            duty=duty_fraction(stats.get("sampling") or stats.get("agent_sampling")),
            pc_share=pc_sampling_cost(stats),
        )
    except (TypeError, ValueError):
        return None


def activity_off_for_good(stats: dict[str, Any]) -> bool:
    """Whether an agent's STATS say it will record no kernels in its process: it saw CUDA-graph
    replays and kernel activity was never switched on there (no `--graph-kernels`)."""
    return (
        stats.get("agent_graphs_seen") is True
        and stats.get("agent_graph_kernels_recorded") is not True
        and not stats.get("agent_enabled")
    )


def pc_sampling_cost(stats: dict[str, Any]) -> float:
    """What PC sampling costs the target now, as a fraction: 0 unless its ranges run.

    Each range holds the target's GIL through its CUPTI and driver calls (the agent's measured
    wall ms per range, `pc_held_ms_per_range`: a synchronize, enable, start, Stop's decoding,
    disable; older agents only give Stop's CPU, `pc_cpu_ms_per_range`), once per
    `pc_period_ms`; on the GPU, sampling cost at most PC_GPU_SHARE while a range runs (H200,
    periods 8-20). On the H200 an eager launch-bound loop lost 29-58% per 2-s bin to ranges of
    200 ms every 2 s (bench/results/agent-ab-h200-s6-pc.json), which CPU time alone put at <1%.
    """
    if stats.get("pc_on") is not True or stats.get("agent_pc_state") != "ok":
        return 0.0
    try:
        period = float(stats.get("pc_period_ms") or 0)
        on = float(stats.get("pc_on_ms") or 0)
        cpu_ms = max(
            float(stats.get("agent_pc_cpu_ms_per_range") or 0),
            float(stats.get("agent_pc_held_ms_per_range") or 0),
        )
    except (TypeError, ValueError):
        return 0.0
    if period <= 0:
        return 0.0
    held = PC_HOLD_FACTOR * max(0.0, cpu_ms)
    return held / period + PC_GPU_SHARE * min(1.0, max(0.0, on / period))


@dataclass(frozen=True)
class AgentRates:
    kernels_per_on_s: float  # kernel records per second of activity
    api_per_on_s: float  # API records per second of activity
    cpu_ns_per_s: float  # agent CPU ns per wall second


def rates_between(a: AgentCounters, b: AgentCounters) -> AgentRates | None:
    """Rates over the span from snapshot `a` to the later `b`; None when activity was not on
    in between (no record rate to learn) or a counter went back (the agent restarted)."""
    d_on, d_t = b.on_ns - a.on_ns, b.t_ns - a.t_ns
    d_k, d_api, d_cpu = b.kernels - a.kernels, b.api - a.api, b.cpu_ns - a.cpu_ns
    if d_on <= 0 or d_t <= 0 or min(d_k, d_api, d_cpu) < 0:
        return None
    on_s = d_on / 1e9
    return AgentRates(d_k / on_s, d_api / on_s, d_cpu / (d_t / 1e9))


class CostMeter:
    """Per-agent rates from successive stats snapshots, and the tree's cost estimate.

    Rates are learnt over spans of at least `min_span_s`: the agent's counters move in steps
    (STATS once a second, on-time added when a duty window closes), so a shorter span would
    swing between 0 and twice the truth. Record rates are per second of activity, so a switch
    between sampling and continuous changes the estimate at once (the duty fraction is read
    from the newest snapshot) without waiting for a new span. A snapshot identical to the
    last one is the same STATS reply seen again by a later poll and is skipped, so that its
    wall time is when it first arrived.
    """

    def __init__(self, min_span_s: float = 2.0) -> None:
        self.min_span_ns = int(min_span_s * 1e9)
        self._base: dict[int, AgentCounters] = {}
        self._last: dict[int, AgentCounters] = {}
        self._rates: dict[int, AgentRates] = {}

    def update(self, pid: int, stats: dict[str, Any], t_ns: int) -> None:
        snap = counters_from_stats(stats, t_ns)
        if snap is None:
            return
        last = self._last.get(pid)
        if last is not None and last.same_counts(snap):
            if (snap.duty, snap.pc_share) != (last.duty, last.pc_share):
                # a mode switch (activity, PC sampling): keep the first-seen time
                self._last[pid] = replace(last, duty=snap.duty, pc_share=snap.pc_share)
            return
        self._last[pid] = snap
        base = self._base.get(pid)
        if base is None or min(snap.kernels - base.kernels, snap.on_ns - base.on_ns) < 0:
            self._base[pid] = snap  # first snapshot, or the counters restarted
            return
        if snap.t_ns - base.t_ns < self.min_span_ns:
            return
        rates = rates_between(base, snap)
        if rates is not None:
            self._rates[pid] = rates
            self._base[pid] = snap

    def retain(self, pids: Iterable[int]) -> None:
        """Forget agents that are gone (or paused away)."""
        keep = set(pids)
        for d in (self._base, self._last, self._rates):
            for pid in [p for p in d if p not in keep]:
                del d[pid]

    def current(self, pid: int) -> tuple[AgentRates, float] | None:
        """The newest rates of one agent and its duty fraction, or None while unknown."""
        r, last = self._rates.get(pid), self._last.get(pid)
        if r is None or last is None or last.duty is None:
            return None
        return r, last.duty

    def estimate(self) -> float | None:
        """The largest per-process estimate (a TP server runs as fast as its slowest rank),
        or None while no agent has rates and a mode yet."""
        costs = []
        for pid, r in self._rates.items():
            last = self._last.get(pid)
            if last is None or last.duty is None:
                continue
            costs.append(
                estimated_cost(r.kernels_per_on_s, r.api_per_on_s, last.duty, r.cpu_ns_per_s)
                + last.pc_share
            )
        return max(costs) if costs else None


class AgentTreeSource:
    name = "agent"

    def __init__(
        self,
        target: Target,
        rescan_s: float = 1.0,
        interval_s: float = 0.25,
        inject_allowed: bool = True,
        try_inject: bool = True,
        pc_sampling: bool = False,
        cost_budget: float | None = DEFAULT_BUDGET,
        graph_kernels: bool = False,
    ) -> None:
        self.target = target
        # record kernels in processes that replay CUDA graphs too (server.CuptiActivity says
        # why that is not the default)
        self.graph_kernels = graph_kernels
        # While sampling, each agent's duty cycle is lowered (never raised past the default)
        # so that the cost estimate stays at this fraction; None or 0: the fixed default.
        self.cost_budget = cost_budget or None
        self._tuned_on: dict[int, AgentRates] = {}  # pid -> the rates its cycle was set from
        self.inject_allowed = inject_allowed  # False: `attach --no-inject`
        # False under `kdash run`: every Python process there starts its own agent, and an
        # injection racing a child's start-up hook would only be wasted ptrace work
        self.try_inject = try_inject and inject_allowed
        self.cost = CostMeter()
        self.rescan_s = rescan_s
        self.interval_s = interval_s
        self.agents: dict[int, AgentSource] = {}
        self.health: Health = Health("starting", "looking for kdash agents in the target")
        self._next_scan = 0.0
        self.paused = False
        self.continuous = False  # every agent samples (duty cycle) unless the user asks
        self.pc_sampling = pc_sampling  # PC-sampling ranges in every agent (`L`, --pc-sampling)
        # pid -> "injecting" | "ok" | the one-line reason it failed (tried once per pid)
        self.injections: dict[int, str] = {}
        # why the tree has no agent, read at each rescan rather than at every poll
        self._no_agent_note: str | None = None
        # pause() comes from a capture worker thread while poll() runs on the poll thread.
        self._lock = threading.RLock()

    def start(self) -> None:
        with self._lock:
            self._scan()

    def active_pids(self) -> list[int]:
        """Pids whose agent has CUPTI activity on (their health is ok)."""
        with self._lock:
            return sorted(p for p, s in self.agents.items() if s.health.ok)

    def pause(self) -> list[int]:
        """Disconnect every agent (each turns its CUPTI activity off when its client goes)
        and stop rescanning, so another CUPTI client — the server's own torch.profiler — can
        record kernels. Returns the pids that were connected. `resume()` undoes it."""
        with self._lock:
            self.paused = True
            old, self.agents = self.agents, {}
            self.health = Health("starting", "agents paused while the server profiles")
        # Stopped outside the lock: a stop joins its reader thread (up to 2 s), and the poll
        # loop must not wait on that.
        for src in old.values():
            safe_call(src, "stop")
        return sorted(old)

    def set_pc_sampling(self, on: bool) -> None:
        """PC-sampling ranges on (True) or off in every agent of the tree, now and later."""
        with self._lock:
            self.pc_sampling = on
            for src in self.agents.values():
                src.set_pc_sampling(on)

    def pc_status(self) -> str:
        """One line for the source pane: the best PC-sampling state among the tree's agents
        ("" if none). A tree holds processes that map libcuda but never make a context (a
        compile worker pool): their "unavailable" must not hide the process that samples, so
        sampling beats starting beats off beats unavailable, and a state that is not the only
        agent's names its pid."""
        with self._lock:
            states = [
                (pid, src.pc_status())
                for pid, src in self.agents.items()
                if src.health.ok and isinstance(src, PcSamplingStatus)
            ]
        states = [(pid, st) for pid, st in states if st]
        if not states:
            return ""
        pid, best = min(states, key=lambda ps: _pc_rank(ps[1]))
        if len(states) > 1 and _pc_rank(best) == 3:
            return f"{best} (pid {pid}, {len(states)} processes)"
        return best

    def extra_health(self) -> dict[str, Health]:
        """ "pc sampling": the agents' PC-sampling state, for the source pane's one line (the
        agent says it as text on the wire)."""
        state = self.pc_status()
        return {"pc sampling": health_from_text(state, "pc sampling")} if state else {}

    def set_continuous(self, on: bool) -> None:
        """Continuous activity (True) or the agents' duty cycle (False), for every agent of
        the tree, including those found later."""
        with self._lock:
            self.continuous = on
            for src in self.agents.values():
                src.set_continuous(on)

    def resume(self) -> None:
        """Reconnect on the next poll (fresh clients: a stopped one is not restarted)."""
        with self._lock:
            self.paused = False
            self._next_scan = 0.0

    def _scan(self) -> None:
        self._next_scan = time.monotonic() + self.rescan_s
        if self.paused:
            return
        pids = self.target.pids()
        for pid in pids:
            if pid in self.agents or find_agent_socket(pid) is None:
                continue
            src = AgentSource(
                pid,
                continuous=self.continuous,
                pc_sampling=self.pc_sampling,
                graph_kernels=self.graph_kernels,
            )
            safe_call(src, "start")
            self.agents[pid] = src
        if self.try_inject:
            self._inject_where_missing(pids)
        self._no_agent_note = None if self.agents else self._why_no_agent(pids)
        self._update_health()

    def _why_no_agent(self, pids: list[int]) -> str | None:
        """The start-up hook's note, an injection's failure, or, for a tree `kdash run`
        started, what in the tree keeps its Python from starting an agent."""
        pid = self.target.pid
        root = target_python.target_python(pid)
        if target_python.armed(root, server.ENV_FLAG):
            note = unavailable_note(pid)
            if note is not None:
                return note
            tree = [root] + [target_python.target_python(p) for p in pids if p != pid]
            return target_python.tree_note(pid, tree, server.ENV_FLAG, socket_problems())
        failed = [st for st in self.injections.values() if st not in ("injecting", "ok")]
        return agent_failure_note(pid) or (failed[0] if failed else None)

    def _inject_where_missing(self, pids: list[int]) -> None:
        """Start an injection for each CUDA-holding process of the tree without an agent
        (or the named process, when none holds CUDA yet); each pid once."""
        me = os.getpid()  # kdash's own process (a test's target): nothing to trace
        todo = [p for p in pids if p != me and p not in self.agents and p not in self.injections]
        todo = [p for p in todo if not find_agent_socket(p)]
        if not todo:  # the steady state: no /proc/PID/maps read on the poll thread
            return
        wanted = [p for p in todo if holds_cuda(p)]
        if not wanted and not self.agents and not self.injections and self.target.pid in todo:
            wanted = [self.target.pid]  # nothing holds CUDA yet: the named process
        for pid in wanted:
            self.injections[pid] = "injecting"
            threading.Thread(
                target=self._inject_one, args=(pid,), name=f"kdash-inject-{pid}", daemon=True
            ).start()

    def _inject_one(self, pid: int) -> None:
        try:
            from kdash.collectors.agent import inject

            why = inject.inject(pid)
        except Exception as e:  # noqa: BLE001 - the reason becomes the pane's line
            why = f"injection into pid {pid} failed: {type(e).__name__}: {e}"
        if why is not None:  # its install advice for the interpreter the target really runs
            why = target_python.for_target(why, target_python.target_python(pid))
        with self._lock:
            self.injections[pid] = "ok" if why is None else why
            self._next_scan = 0.0  # connect at the next poll

    def poll(self, now_ns: int) -> dict[str, Batch]:
        with self._lock:
            if time.monotonic() >= self._next_scan:
                self._scan()
            parts: dict[str, list[Batch]] = {}
            mono_ns = time.monotonic_ns()
            for pid, src in self.agents.items():
                for table, batch in safe_poll(src, now_ns).items():
                    parts.setdefault(table, []).append(batch)
                pc = {"pc_on": src.pc_sampling, "pc_on_ms": src.pc_on_ms}
                pc["pc_period_ms"] = src.pc_period_ms
                self.cost.update(pid, {**src.stats, **pc}, mono_ns)
                self._keep_budget(pid, src)
                self._keep_pc_budget(src)
            self.cost.retain(self.agents)
            for pid in [p for p in self._tuned_on if p not in self.agents]:
                del self._tuned_on[pid]
            if not self.paused:
                self._update_health()
        return {t: schema.concat(t, bs) for t, bs in parts.items()}

    def _keep_budget(self, pid: int, src: AgentSource) -> None:
        """Retune one agent's duty cycle to the cost budget, once per new rate estimate."""
        if self.cost_budget is None or self.continuous or not src.health.ok:
            return
        cur = self.cost.current(pid)
        if cur is None or self._tuned_on.get(pid) is cur[0]:
            return
        rates, duty = cur
        self._tuned_on[pid] = rates
        if abs(duty - src.on_ms / src.period_ms) > 1e-6:
            return  # the agent has not yet applied the last cycle asked of it
        cycle = duty_for_budget(
            rates.kernels_per_on_s,
            rates.api_per_on_s,
            rates.cpu_ns_per_s,
            duty,
            self.cost_budget,
            server.DUTY_PERIOD_MS,
            server.DUTY_ON_MS,
            server.MIN_ON_MS,
        )
        if cycle is not None and cycle != (src.period_ms, src.on_ms):
            src.set_duty(*cycle)

    def _keep_pc_budget(self, src: AgentSource) -> None:
        """Space one agent's PC ranges so that what each one holds the target (measured by the
        agent) stays within PC_BUDGET, or the cost budget where that is larger; a cost budget
        of 0 keeps the fixed cycle."""
        if self.cost_budget is None or not src.pc_sampling or not src.health.ok:
            return
        stats = src.stats
        if stats.get("agent_pc_state") != "ok":
            return
        try:
            held = float(stats.get("agent_pc_held_ms_per_range") or 0)
        except (TypeError, ValueError):
            return
        period = pc_period_for_budget(
            held,
            src.pc_on_ms,
            src.pc_period_ms,
            max(PC_BUDGET, self.cost_budget),
            server.PC_PERIOD_MS,
        )
        if period is not None:
            src.set_pc_period(period)

    def stop(self) -> None:
        with self._lock:
            for src in self.agents.values():
                safe_call(src, "stop")

    def cost_detail(self) -> dict[str, dict]:
        """Per agent pid, the STATS counters the estimate is made of (COST_DETAIL_KEYS),
        as the agent last reported them."""
        with self._lock:
            return {
                str(pid): {k: src.stats.get(f"agent_{k}") for k in COST_DETAIL_KEYS}
                for pid, src in self.agents.items()
            }

    def cost_estimate(self) -> float | None:
        """kdash's estimated slowdown of the target (a fraction), None while unknown.

        An agent whose process replays CUDA graphs records nothing (kernel activity off for
        good, CUPTI untouched or taken out again), so it learns no record rates; what it costs
        is then only its PC ranges, if any (on the H200 decode graph: +0.06% attached against
        its twin, bench/results/agent-ab-h200-s8-decode.json)."""
        with self._lock:
            if not self.agents:
                return None
            est = self.cost.estimate()
            off = [
                pc_sampling_cost(
                    {
                        **src.stats,
                        "pc_on": src.pc_sampling,
                        "pc_on_ms": src.pc_on_ms,
                        "pc_period_ms": src.pc_period_ms,
                    }
                )  # fmt: skip
                for src in self.agents.values()
                if activity_off_for_good(src.stats)
            ]
            if not off:
                return est
            return max(max(off), est or 0.0)

    def dropped(self) -> int:
        return sum(src.dropped() for src in self.agents.values())

    def _update_health(self) -> None:
        pid = self.target.pid
        if not self.agents:
            running = [p for p, st in self.injections.items() if st == "injecting"]
            if running:
                self.health = Health(
                    "starting",
                    f"injecting the kdash agent into pid {running[0]}",
                    "injecting",
                    {"pid": running[0]},
                )
                return
            note = self._no_agent_note
            self.health = Health.unavailable(
                no_agent_reason(pid, note, self.inject_allowed),
                "no_agent" if self.inject_allowed else "no_inject",
                pid=pid,
                **({"note": note} if note else {}),
            )
            return
        states = {p: s.health for p, s in self.agents.items()}
        active = [p for p, h in states.items() if h.ok]
        bad = {p: h for p, h in states.items() if h.state in ("unavailable", "degraded")}
        if active and not bad:
            first = self.agents[active[0]]
            sampling = first.sampling()
            budgeted = (first.period_ms, first.on_ms) != (server.DUTY_PERIOD_MS, server.DUTY_ON_MS)
            if sampling and budgeted and not first.continuous and self.cost_budget:
                sampling += f", lowered to keep kdash's cost ≈ {100 * self.cost_budget:g}%"
            code = "continuous" if sampling.startswith("continuous") else "sampling"
            self.health = Health("ok", sampling, code) if sampling else OK
        elif active:
            p, h = next(iter(bad.items()))
            self.health = Health.degraded(
                f"{len(active)} process(es) ok; pid {p}: {h.reason}",
                "agent_degraded",
                **_pid_field(p, h),
            )
        elif off := {p: h for p, h in states.items() if h.code == "graphs_off"}:
            # the process that does the work replays CUDA graphs, and kdash left its kernels
            # alone by design: that, not a helper process's trouble, is why the pane is empty
            p, h = next(iter(off.items()))
            self.health = Health("off", h.reason, "graphs_off", {"pid": p})
        elif bad:
            p, h = next(iter(bad.items()))
            self.health = Health.unavailable(
                f"pid {p}: {h.reason}", "agent_unavailable", **_pid_field(p, h)
            )
        else:
            p, h = next(iter(states.items()))
            # the pid is named where the agent's reason names it (or there is none but ours)
            named = not h.reason or h.code in ("connecting", "agent_waiting")
            self.health = Health(
                "starting",
                h.reason or f"waiting for CUDA in pid {p}",
                "agent_starting",
                {"pid": p} if named else {},
            )
