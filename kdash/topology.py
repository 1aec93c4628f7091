"""`Topology`: where the GPUs sit among the CPUs, as the findings judge it.

`kdash.collectors.topology.build_topo` reads it from sysfs (and NVML's affinity where sysfs has
nothing); the recorder keeps one per session, hands it to `kdash.analyses.findings.find_all`
and stores it in each capture's metadata as `topology`.

Every field may be absent: a machine whose sysfs could not be read gives only the GPUs' local
CPUs and a CPU count, old captures may lack any key, and tests hand the findings the few keys
they need. Absent is None and leaves the key out of `to_dict`, so a stored topology reads into
the record and back to the same JSON object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FIELDS = (
    "gpu_local_cpus",
    "gpu_numa_node",
    "cpu_count",
    "online_cpus",
    "core_of_cpu",
    "gpu_of_pid",
)


@dataclass(frozen=True)
class Topology:
    """The machine as the findings need it; keys of the JSON object are the field names."""

    gpu_local_cpus: dict[int, str] | None = None  # GPU index -> cpulist of its local CPUs
    gpu_numa_node: dict[int, int] | None = None  # GPU index -> NUMA node (-1: unknown)
    cpu_count: int | None = None  # online CPUs
    online_cpus: str | None = None  # cpulist
    core_of_cpu: dict[int, tuple[int, int]] | None = None  # CPU -> (package, core): SMT siblings
    # pid -> the GPUs it holds, when known (an empty map: nobody could tell, not "no GPU")
    gpu_of_pid: dict[int, list[int]] | None = None
    # keys no field names, or values that would not read, kept as they came
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Topology | Mapping[str, Any] | None) -> Topology:
        """The record of a topology object (a capture's JSON, where keys are strings, or a
        plain dict); a value of the wrong shape is kept in `extra`, never raised on."""
        if isinstance(d, Topology):
            return d
        values: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in (d or {}).items():
            read = _READERS.get(key)
            if read is None:
                extra[key] = value
                continue
            try:
                values[key] = read(value)
            except (TypeError, ValueError, AttributeError):
                extra[key] = value
        return cls(**values, extra=extra)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object captures store (keys of the inner maps as strings, as JSON has them);
        absent fields left out."""
        out: dict[str, Any] = {}
        if self.gpu_local_cpus is not None:
            out["gpu_local_cpus"] = {str(g): c for g, c in self.gpu_local_cpus.items()}
        if self.gpu_numa_node is not None:
            out["gpu_numa_node"] = {str(g): n for g, n in self.gpu_numa_node.items()}
        if self.cpu_count is not None:
            out["cpu_count"] = self.cpu_count
        if self.online_cpus is not None:
            out["online_cpus"] = self.online_cpus
        if self.core_of_cpu is not None:
            out["core_of_cpu"] = {str(c): list(pc) for c, pc in self.core_of_cpu.items()}
        if self.gpu_of_pid is not None:
            out["gpu_of_pid"] = {str(p): list(gs) for p, gs in self.gpu_of_pid.items()}
        out.update(self.extra)
        return out


def _int_map(d: Mapping, value) -> dict:
    if not isinstance(d, Mapping):
        raise TypeError("not an object")
    return {int(k): value(v) for k, v in d.items()}


def _text(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError("not a string")
    return v


def _count(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError("not an integer")
    return v


def _pair(v: object) -> tuple[int, int]:
    a, b = v  # type: ignore[misc]
    return (_count(a), _count(b))


def _gpus(v: object) -> list[int]:
    if not isinstance(v, list | tuple):
        raise TypeError("not a list")
    return [_count(g) for g in v]


_READERS = {
    "gpu_local_cpus": lambda d: _int_map(d, _text),
    "gpu_numa_node": lambda d: _int_map(d, _count),
    "cpu_count": _count,
    "online_cpus": _text,
    "core_of_cpu": lambda d: _int_map(d, _pair),
    "gpu_of_pid": lambda d: _int_map(d, _gpus),
}
assert set(_READERS) == set(FIELDS)
