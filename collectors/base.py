"""What every source is: start/poll/stop plus a health line, and never an exception into the app."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from kdash.schema import Batch

log = logging.getLogger("kdash.collectors")


@dataclass(frozen=True)
class Health:
    state: str = "ok"  # "ok" | "degraded" | "unavailable" | "starting"
    reason: str = ""

    def __str__(self) -> str:
        return self.state if not self.reason else f"{self.state}: {self.reason}"

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    @classmethod
    def unavailable(cls, why: str) -> Health:
        return cls("unavailable", why)

    @classmethod
    def degraded(cls, why: str) -> Health:
        return cls("degraded", why)


OK = Health()


@runtime_checkable
class Source(Protocol):
    """A data source. `poll` returns table name -> batch; it must not raise (see `safe_poll`)."""

    name: str
    health: Health

    def start(self) -> None: ...

    def poll(self, now_ns: int) -> dict[str, Batch]: ...

    def stop(self) -> None: ...


def safe_poll(source: Source, now_ns: int) -> dict[str, Batch]:
    """Poll a source; a bug in it degrades that source's health instead of stopping the app."""
    try:
        return source.poll(now_ns) or {}
    except Exception as e:
        log.exception("source %s failed in poll", source.name)
        source.health = Health.degraded(f"poll failed: {type(e).__name__}: {e}")
        return {}


def safe_call(source: Source, method: str) -> None:
    try:
        getattr(source, method)()
    except Exception as e:
        log.exception("source %s failed in %s", source.name, method)
        source.health = Health.unavailable(f"{method} failed: {type(e).__name__}: {e}")
