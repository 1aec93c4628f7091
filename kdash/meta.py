"""A capture's metadata (`kdash.json`) as a typed record, and the one place it is built.

Recorded captures (kdash.session) and imported traces (kdash.kineto) both build theirs with
`build_meta`; the record is written as the JSON object captures have always held
(`to_dict`: the same keys, a key whose value is unknown left out rather than written as null,
except those every capture has). `from_dict` reads any capture kdash ever wrote: a key that is
missing takes its default, and keys this record does not name (what a later kdash may add, or
what a command adds for the dashboard, such as `capture_path`) are kept in `extra` and written
back as they were.

Types are not checked here: `kdash.capture` checks a file's `kdash.json` against its spec
before anything reads it.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kdash.topology import Topology

MONOTONIC = "host monotonic ns"
WALL = "unix wall ns"


@dataclass(frozen=True)
class Window:
    """The span of time a capture holds, on its clock."""

    start_ns: int = 0
    end_ns: int = 0
    seconds: float = 0.0
    trigger_ns: int | None = None  # when the capture key was pressed (None: no key)

    @classmethod
    def of(
        cls, start_ns: int, end_ns: int, trigger_ns: int | None = None, digits: int = 3
    ) -> Window:
        return cls(
            start_ns=int(start_ns),
            end_ns=int(end_ns),
            seconds=round((end_ns - start_ns) / 1e9, digits),
            trigger_ns=int(trigger_ns) if trigger_ns is not None else None,
        )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Window:
        d = d or {}
        return cls(
            start_ns=d.get("start_ns") or 0,
            end_ns=d.get("end_ns") or 0,
            seconds=d.get("seconds") or 0.0,
            trigger_ns=d.get("trigger_ns"),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "start_ns": self.start_ns,
            "end_ns": self.end_ns,
            "seconds": self.seconds,
            "trigger_ns": self.trigger_ns,
        }


@dataclass(frozen=True)
class ClockInfo:
    """The clock a capture's timestamps are on, and how to reach wall time from it."""

    domain: str = MONOTONIC
    wall_offset_ns: int = 0  # wall ns = timestamp + wall_offset_ns
    derived_from: str | None = None  # written as "from": how an import got its timestamps

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> ClockInfo:
        d = d or {}
        return cls(
            domain=d.get("domain") or MONOTONIC,
            wall_offset_ns=d.get("wall_offset_ns") or 0,
            derived_from=d.get("from"),
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"domain": self.domain, "wall_offset_ns": self.wall_offset_ns}
        if self.derived_from is not None:
            out["from"] = self.derived_from
        return out


@dataclass(frozen=True)
class CaptureMeta:
    """What `kdash.json` holds. Field names are its keys (`clock` and `window` are records)."""

    kdash_version: str | None = None
    created_wall_ns: int | None = None
    title: str | None = None
    origin: str | None = None  # "kineto-import" for imported traces
    target: dict[str, Any] = field(default_factory=dict)  # pid, cmdline, host (Target.describe)
    host: dict[str, Any] = field(default_factory=dict)
    gpus: list[dict[str, Any]] = field(default_factory=list)
    driver: str | None = None
    clock: ClockInfo = field(default_factory=ClockInfo)
    window: Window = field(default_factory=Window)
    sources: dict[str, str] = field(default_factory=dict)  # name -> the line users read
    sources_health: dict[str, dict[str, Any]] | None = None  # name -> Health.to_dict()
    overflowed_rows: int | None = None
    interval_s: float | None = None
    topology: Topology | None = None
    traces: list[dict[str, Any]] | None = None  # the imported (or server-side) Kineto traces
    cost_estimate: dict[str, float | None] | None = None
    sglang: dict[str, Any] | None = None
    # written by kdash.capture.write_capture
    format: str | None = None
    schema_version: int | None = None
    tables: dict[str, int] | None = None
    # keys no field above names, kept as they came
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> CaptureMeta:
        """The record of a capture's metadata, old or new (missing keys: their defaults)."""
        named = {f.name for f in fields(cls)} - {"extra", "clock", "window"}
        values: dict[str, Any] = {k: d[k] for k in named if d.get(k) is not None}
        if isinstance(values.get("topology"), Mapping):
            values["topology"] = Topology.from_dict(values["topology"])
        return cls(
            **values,
            clock=ClockInfo.from_dict(d.get("clock")),
            window=Window.from_dict(d.get("window")),
            extra={k: v for k, v in d.items() if k not in named | {"clock", "window"}},
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object of `kdash.json` (what `from_dict` reads back)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if isinstance(value, Window | ClockInfo | Topology):
                value = value.to_dict()
            if value is not None or f.name in _ALWAYS:
                out[f.name] = value
        out.update(self.extra)
        return out

    def merged(self, more: Mapping[str, Any] | None) -> CaptureMeta:
        """This record with the keys of `more` set (as `dict.update` would on the JSON)."""
        if not more:
            return self
        return CaptureMeta.from_dict({**self.to_dict(), **more})


# Keys every capture has written, null or not.
_ALWAYS = frozenset({"target", "host", "gpus", "driver", "clock", "window", "sources"})


def this_host() -> dict[str, Any]:
    """The recording machine, as a capture names it."""
    return {
        "hostname": socket.gethostname(),
        "kernel": platform.release(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }


def build_meta(
    *,
    target: Mapping[str, Any] | None,
    gpus: list[dict[str, Any]],
    window: Window,
    clock: ClockInfo,
    sources: Mapping[str, str],
    sources_health: Mapping[str, dict[str, Any]] | None = None,
    host: Mapping[str, Any] | None = None,
    created_wall_ns: int | None = None,
    title: str | None = None,
    origin: str | None = None,
    overflowed_rows: int | None = None,
    interval_s: float | None = None,
    topology: Topology | None = None,
    traces: list[dict[str, Any]] | None = None,
) -> CaptureMeta:
    """A new capture's metadata: the one builder, for recordings and imports alike.

    `target` None: no process (its host is this machine's); `host` None: this machine; the
    driver is the first GPU's that names one.
    """
    from kdash import __version__

    driver = next((g.get("driver_version") for g in gpus if g.get("driver_version")), None)
    return CaptureMeta(
        kdash_version=__version__,
        created_wall_ns=created_wall_ns,
        title=title,
        origin=origin,
        target=dict(target)
        if target is not None
        else {"pid": None, "cmdline": "", "host": socket.gethostname()},
        host=dict(host) if host is not None else this_host(),
        gpus=list(gpus),
        driver=driver,
        clock=clock,
        window=window,
        sources=dict(sources),
        sources_health=dict(sources_health) if sources_health is not None else None,
        overflowed_rows=overflowed_rows,
        interval_s=interval_s,
        topology=topology,
        traces=traces,
    )
