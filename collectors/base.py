"""What every source is: start/poll/stop plus a health line, and never an exception into the app."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from kdash.schema import Batch

log = logging.getLogger("kdash.collectors")


@dataclass(frozen=True)
class Health:
    """A source's health: `state` and the `reason` users read, plus a stable `code` (what the
    panes switch on) and the `fields` the reason was built from (pid, note, ...). `str()` is
    the line users see; the code and fields never change it."""

    # "ok" | "degraded" | "unavailable" | "starting"; "off": a part, or a source off by design
    state: str = "ok"
    reason: str = ""
    code: str = ""  # stable; defaults to the state (see HEALTH_CODES)
    fields: dict[str, Any] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if not self.code:
            object.__setattr__(self, "code", self.state)

    def __str__(self) -> str:
        return self.state if not self.reason else f"{self.state}: {self.reason}"

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    @property
    def trouble(self) -> bool:
        """Not ok, and not off by design (an agent that left a graph process's kernels alone
        is there and working: panes do not mark it as a failure)."""
        return not self.ok and self.code != "graphs_off"

    @classmethod
    def unavailable(cls, why: str, code: str = "", **fields: Any) -> Health:
        return cls("unavailable", why, code, fields)

    @classmethod
    def degraded(cls, why: str, code: str = "", **fields: Any) -> Health:
        return cls("degraded", why, code, fields)

    def to_dict(self) -> dict[str, Any]:
        return {
            "state": self.state,
            "code": self.code,
            "reason": self.reason,
            "fields": dict(self.fields),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Health:
        fields = d.get("fields")
        return cls(
            str(d.get("state", "")),
            str(d.get("reason", "")),
            str(d.get("code", "")),
            dict(fields) if isinstance(fields, dict) else {},
        )


# The codes beyond the four states, and what they tell apart.
HEALTH_CODES = {
    "sampling": "agent: activity on with the duty cycle (ok)",
    "continuous": "agent: activity on continuously (ok)",
    "no_inject": "agent: no agent, injection off by the user (--no-inject)",
    "no_agent": "agent tree: no agent in the target or its children; fields pid, note",
    "no_socket": "one agent client: no agent socket in pid (or a stale one)",
    "connecting": "one agent client: connecting; fields pid",
    "injecting": "agent tree: injecting an agent; fields pid",
    "agent_busy": "one agent: another kdash client is attached to it",
    "agent_waiting": "one agent: the target has not loaded CUDA yet",
    "agent_starting": "agent tree: an agent found, not recording yet; fields pid (when named)",
    "agent_degraded": "agent tree: some agents ok, one not; fields pid",
    "agent_unavailable": "agent tree: no agent records; fields pid",
    "graphs_off": "agent (tree): kernel activity off by design, the target replays CUDA graphs "
    "(`--graph-kernels` records them); fields pid",
    "metrics_off": "sglang: no /metrics (server without --enable-metrics), load fallback",
    "no_pynvml": "nvml: the pynvml module is not importable",
    "nvml_init_failed": "nvml: nvmlInit failed (no driver, no device access)",
    "no_gpu": "nvml: NVML sees no GPU",
    "gpus_not_found": "nvml: some or all of the GPUs asked for are not there; fields gpus",
    "target_exited": "sched: the target process is gone; fields pid",
    "extra_health_failed": "a source's extra_health() raised",
    "pc_off": "PC sampling off",
    "pc_starting": "PC sampling asked for, first range not done",
    "pc_on": "PC sampling ranges run",
    "pc_unavailable_perm": "PC sampling refused: counters restricted to admins",
    "pc_unavailable_other_client": "PC sampling refused: another profiler holds the counters",
    "pc_unavailable": "PC sampling unavailable for another reason",
}

_STATES = ("ok", "degraded", "unavailable", "starting")


def is_pc_part(name: str) -> bool:
    """Whether a health name is a source's PC-sampling part ("pc sampling")."""
    low = name.lower()
    return "pc" in low and "sampl" in low


def _pc_code(low: str) -> str:
    """The code of a PC-sampling line (lower case), for `health_from_text`."""
    if "nvgpuctrperm" in low or "insufficient_privileges" in low:
        return "pc_unavailable_perm"
    if "another" in low or "in use" in low or "not_compatible" in low:
        return "pc_unavailable_other_client"
    for prefix in ("ok", "starting", "off"):
        if low.startswith(prefix):
            return {"ok": "pc_on", "starting": "pc_starting", "off": "pc_off"}[prefix]
    return "pc_unavailable"


def health_from_text(line: str, name: str = "") -> Health:
    """A Health from its text form: the lines older captures stored (`meta["sources"]`), and
    the agent's wire text for its PC-sampling state. This is the ONE place that parses health
    text; its codes are a best effort (`name` says which source or part the line is of).
    `str()` of the result gives `line` back."""
    state, _, reason = line.partition(": ")
    if is_pc_part(name):
        return Health(state, reason, _pc_code(line.lower()))
    fields: dict[str, Any] = {}
    code = state
    if name == "sglang" and "metrics off" in line:
        code = "metrics_off"
    if name == "agent":
        pid = re.search(r"\bpid (\d+)", reason)
        if "--no-inject" in line:
            code = "no_inject"
        elif "CUDA graphs" in line and ("activity off" in line or "activity stopped" in line):
            code = "graphs_off"
            if pid:
                fields["pid"] = int(pid.group(1))
        elif "or its children" in line:
            code = "no_agent"
            note = line.split("or its children: ", 1)
            if len(note) == 2:
                fields["note"] = note[1]
        elif line.startswith("ok: continuous"):
            code = "continuous"
        elif line.startswith("ok: sampling"):
            code = "sampling"
        elif state in _STATES and pid and "no kdash agent" not in reason:
            code = f"agent_{state}" if state != "ok" else "ok"
            fields["pid"] = int(pid.group(1))
        elif "no kdash agent" in reason:
            code = "no_socket"
    return Health(state, reason, code, fields)


def as_health(value: Health | str, name: str = "") -> Health:
    """`value` if it is a Health with a code of its own; else (a text line, or a Health made
    without a code, whose code is then only its state) the Health its text stands for."""
    if isinstance(value, Health):
        if value.code != value.state:
            return value
        h = health_from_text(str(value), name)
        return Health(value.state, value.reason, h.code, {**h.fields, **value.fields})
    return health_from_text(str(value), name)


OK = Health()


@runtime_checkable
class Source(Protocol):
    """A data source. `poll` returns table name -> batch; it must not raise (see `safe_poll`)."""

    name: str
    health: Health

    def start(self) -> None: ...

    def poll(self, now_ns: int) -> dict[str, Batch]: ...

    def stop(self) -> None: ...


# -- what a source may offer beyond `Source` ----------------------------------------------------
# Callers test these with `isinstance` and then call the method by its name; nothing looks a
# method up by a computed name. tests/test_capabilities.py checks every class in collectors/
# that has one of these methods against its Protocol, so a renamed method fails a test.


@runtime_checkable
class Paced(Protocol):
    """A source with its own poll interval (the recorder's default interval otherwise)."""

    interval_s: float


@runtime_checkable
class DescribesGpus(Protocol):
    """A source that can say which GPUs it sees (NVML): a capture's `gpus` metadata."""

    def describe(self) -> list[dict[str, Any]]: ...


@runtime_checkable
class ExtraHealth(Protocol):
    """A source that reports the health of parts of itself (the agents' PC sampling)."""

    def extra_health(self) -> dict[str, Health]: ...


@runtime_checkable
class CostEstimating(Protocol):
    """A source that estimates what watching costs the target (a fraction; None unknown), and
    gives the counters behind the estimate per process (`cost_detail`: pid -> counters), which
    a capture keeps so that a cost can be read back against a measured one."""

    def cost_estimate(self) -> float | None: ...

    def cost_detail(self) -> dict[str, dict]: ...


@runtime_checkable
class ActiveAgents(Protocol):
    """A source over in-process agents: the pids whose agent records now."""

    def active_pids(self) -> list[int]: ...


@runtime_checkable
class ContinuousSwitch(Protocol):
    """Agents that switch between their duty cycle and continuous kernel activity."""

    continuous: bool

    def set_continuous(self, on: bool) -> None: ...


@runtime_checkable
class PcSamplingSwitch(Protocol):
    """Agents that switch PC-sampling ranges on and off."""

    pc_sampling: bool

    def set_pc_sampling(self, on: bool) -> None: ...


@runtime_checkable
class PcSamplingStatus(Protocol):
    """An agent that says its PC-sampling state in one line ("off", "ok", "unavailable: …")."""

    def pc_status(self) -> str: ...


@runtime_checkable
class PausableAgents(Protocol):
    """Agents that can all be let go (so another CUPTI client can record) and taken back;
    `agents` holds the connected ones by pid."""

    agents: dict[int, Any]

    def pause(self) -> list[int]: ...

    def resume(self) -> None: ...


# Every optional capability above, for the test that checks the classes against them.
CAPABILITIES: tuple[type, ...] = (
    Paced,
    DescribesGpus,
    ExtraHealth,
    CostEstimating,
    ActiveAgents,
    ContinuousSwitch,
    PcSamplingSwitch,
    PcSamplingStatus,
    PausableAgents,
)


def safe_poll(source: Source, now_ns: int) -> dict[str, Batch]:
    """Poll a source; a bug in it degrades that source's health instead of stopping the app."""
    try:
        return source.poll(now_ns) or {}
    except Exception as e:
        log.exception("source %s failed in poll", source.name)
        source.health = Health.degraded(f"poll failed: {type(e).__name__}: {e}")
        return {}


def safe_call(source: Source, method: Literal["start", "stop"]) -> None:
    """`source.start()` or `source.stop()`; a bug in it makes the source unavailable."""
    call = source.start if method == "start" else source.stop
    try:
        call()
    except Exception as e:
        log.exception("source %s failed in %s", source.name, method)
        source.health = Health.unavailable(f"{method} failed: {type(e).__name__}: {e}")
