"""Kernel activity from every kdash agent in the target's process tree, as one source.

SGLang-like servers do their GPU work in spawned child processes, so the pid the user names is
rarely the one that launches kernels. This source rescans the tree (once a second), connects an
`AgentSource` to every process that has an agent socket, and merges their batches. Processes
that have an agent but no CUDA context yet (a tokenizer, a detokenizer) stay "starting" and do
not count against health.
"""

from __future__ import annotations

import threading
import time

from kdash.collectors.agent.client import AgentSource, agent_failure_note, find_agent_socket
from kdash.collectors.base import OK, Health, safe_call, safe_poll

from kdash import schema
from kdash.schema import Batch
from kdash.target import Target


class AgentTreeSource:
    name = "agent"

    def __init__(self, target: Target, rescan_s: float = 1.0, interval_s: float = 0.25) -> None:
        self.target = target
        self.rescan_s = rescan_s
        self.interval_s = interval_s
        self.agents: dict[int, AgentSource] = {}
        self.health: Health = Health("starting", "looking for kdash agents in the target")
        self._next_scan = 0.0
        self.paused = False
        self.continuous = False  # every agent samples (duty cycle) unless the user asks
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
        for pid in self.target.pids():
            if pid in self.agents or find_agent_socket(pid) is None:
                continue
            src = AgentSource(pid, continuous=self.continuous)
            safe_call(src, "start")
            self.agents[pid] = src
        self._update_health()

    def poll(self, now_ns: int) -> dict[str, Batch]:
        with self._lock:
            if time.monotonic() >= self._next_scan:
                self._scan()
            parts: dict[str, list[Batch]] = {}
            for src in self.agents.values():
                for table, batch in safe_poll(src, now_ns).items():
                    parts.setdefault(table, []).append(batch)
            if not self.paused:
                self._update_health()
        return {t: schema.concat(t, bs) for t, bs in parts.items()}

    def stop(self) -> None:
        with self._lock:
            for src in self.agents.values():
                safe_call(src, "stop")

    def dropped(self) -> int:
        return sum(src.dropped() for src in self.agents.values())

    def _update_health(self) -> None:
        pid = self.target.pid
        if not self.agents:
            note = agent_failure_note(pid)
            why = f": {note}" if note else " (start the target with `kdash run -- CMD`)"
            self.health = Health.unavailable(f"no kdash agent in pid {pid} or its children{why}")
            return
        states = {p: s.health for p, s in self.agents.items()}
        active = [p for p, h in states.items() if h.ok]
        bad = {p: h for p, h in states.items() if h.state in ("unavailable", "degraded")}
        if active and not bad:
            sampling = self.agents[active[0]].sampling()
            self.health = Health("ok", sampling) if sampling else OK
        elif active:
            p, h = next(iter(bad.items()))
            self.health = Health.degraded(f"{len(active)} process(es) ok; pid {p}: {h.reason}")
        elif bad:
            p, h = next(iter(bad.items()))
            self.health = Health.unavailable(f"pid {p}: {h.reason}")
        else:
            p, h = next(iter(states.items()))
            self.health = Health("starting", h.reason or f"waiting for CUDA in pid {p}")
