"""The duty cycle: how much of the time CUPTI activity is on, and the clock that switches it.

After START, activity is on for `on_ms` of every `period_ms` (default 100 of 1000): at each
window's end every kind is disabled and the buffers are force-flushed, at the next period's
start they are enabled (and the API records narrowed) again. Why: continuous activity cost the
H200 targets 12.7% (eager) and 59% (CUDA-graph replays of tiny kernels), against a 2% floor.
Each window's [start, end] goes to the client as a markers row (domain "kdash", name
"activity on"; start taken before the first enable, end after the last disable), so a
timeline can tell "not recorded" from "GPU idle". START `continuous: true`, or SET at any
time, switches to continuous (a row per period still marks the recorded span) and back.

Also here: what a START or SET may ask for (activities, PC-sampling ranges), checked as data.
"""

from __future__ import annotations

import time

from .constants import (
    ACTIVITY_KINDS,
    API_KEEP,
    DEFAULT_ACTIVITIES,
    DUTY_ON_MS,
    DUTY_PERIOD_MS,
    MAX_ACTIVITIES,
    MAX_PERIOD_MS,
    MIN_ON_MS,
    PC_MAX_ON_MS,
    PC_MIN_ON_MS,
    PC_ON_MS,
    PC_PERIOD_MS,
    POLL_S,
)

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


def parse_activities(value: Any) -> tuple[list[str] | None, str]:
    """The activities a START asks for (None or empty: the defaults) and a note naming the
    unknown ones, which are ignored; or None and why the list is refused. At most
    MAX_ACTIVITIES names: each is one CUPTI kind, and a list of thousands must cost the
    agent neither a long loop nor a note per name."""
    if not value:
        return list(DEFAULT_ACTIVITIES), ""
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        return None, "activities must be a list of names"
    if len(value) > MAX_ACTIVITIES:
        return None, f"activities: {len(value)} names, at most {MAX_ACTIVITIES}"
    known = [a for a in value if a in ACTIVITY_KINDS]
    unknown = [a for a in value if a not in ACTIVITY_KINDS]
    if not known:
        return None, f"activities: none known (known: {', '.join(ACTIVITY_KINDS)})"
    why = ""
    if unknown:
        shown = ", ".join(repr(a[:40]) for a in unknown[:4])
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        why = f"unknown activities ignored: {shown}{more}"
    return list(dict.fromkeys(known)), why


def narrowed_ids(enum: Any) -> list[int]:
    """The callback ids of a cupti-python cbid enum whose API records the narrowing switches
    off: all but the launches, waits, copies and sets (API_KEEP) and the enum's markers."""
    import re

    members = getattr(enum, "__members__", None)
    if not members:
        return []
    keep = re.compile(API_KEEP)
    return [
        int(cbid)
        for name, cbid in members.items()
        if name not in ("INVALID", "SIZE", "FORCE_INT") and not keep.search(name)
    ]


def sampling_text(sampling: dict | None) -> str:
    """ "sampling 10% (100 ms/s)" or "continuous" for a STATUS/STATS "sampling" field."""
    if not sampling:
        return ""
    if sampling.get("continuous"):
        return "continuous"
    period, on = int(sampling.get("period_ms", 0)), int(sampling.get("on_ms", 0))
    if period <= 0:
        return ""
    per = "s" if period == 1000 else f"{period / 1000:g} s"
    return f"sampling {100 * on / period:.0f}% ({on} ms/{per})"


class DutyCycle:
    """How much of the time CUPTI activity is on: `on_ms` of every `period_ms`, or always.

    Continuous activity cost the H200 targets far more than the 2% floor (the numbers are at
    DUTY_PERIOD_MS), so the default is 100 ms of every second; kernels
    that run between windows are not recorded, and the windows are sent so that the timeline
    can tell "not recorded" from "GPU idle". In continuous mode a window row is still sent
    every period, so a live timeline sees the recorded span grow.
    """

    def __init__(
        self, continuous: bool = False, period_ms: int = DUTY_PERIOD_MS, on_ms: int = DUTY_ON_MS
    ) -> None:
        self.continuous = continuous or on_ms >= period_ms
        self.period_ms = period_ms
        self.on_ms = min(on_ms, period_ms)

    @property
    def period_s(self) -> float:
        return self.period_ms / 1000

    @property
    def on_s(self) -> float:
        return self.on_ms / 1000

    def describe(self) -> dict:
        return {"continuous": self.continuous, "period_ms": self.period_ms, "on_ms": self.on_ms}

    @classmethod
    def parse(cls, body: dict, base: DutyCycle) -> tuple[DutyCycle | None, str]:
        """The cycle a START or SET body asks for (fields it leaves out keep `base`'s), or
        None and what is wrong with it. Only plain JSON values are read."""
        cont = body.get("continuous", base.continuous)
        period = body.get("period_ms", base.period_ms)
        on = body.get("on_ms", base.on_ms)
        if not isinstance(cont, bool):
            return None, "continuous must be true or false"
        for name, v in (("period_ms", period), ("on_ms", on)):
            if isinstance(v, bool) or not isinstance(v, int):
                return None, f"{name} must be an integer"
        if not MIN_ON_MS <= on <= period <= MAX_PERIOD_MS:
            return None, (
                f"duty cycle must satisfy {MIN_ON_MS} <= on_ms <= period_ms <= {MAX_PERIOD_MS} "
                f"(got on_ms={on}, period_ms={period})"
            )
        return cls(cont, period, on), ""


class PCConfig:
    """Whether PC sampling is asked for, and its range length and period (START/SET fields
    `pc_sampling`, `pc_on_ms`, `pc_period_ms`; fields left out keep the current values)."""

    def __init__(self, on: bool = False, on_ms: int = PC_ON_MS, period_ms: int = PC_PERIOD_MS):
        self.on, self.on_ms, self.period_ms = on, on_ms, period_ms

    def describe(self) -> dict:
        return {"on": self.on, "on_ms": self.on_ms, "period_ms": self.period_ms}

    @classmethod
    def parse(cls, body: dict, base: PCConfig) -> tuple[PCConfig | None, str]:
        on = body.get("pc_sampling", base.on)
        on_ms = body.get("pc_on_ms", base.on_ms)
        period = body.get("pc_period_ms", base.period_ms)
        if not isinstance(on, bool):
            return None, "pc_sampling must be true or false"
        for name, v in (("pc_on_ms", on_ms), ("pc_period_ms", period)):
            if isinstance(v, bool) or not isinstance(v, int):
                return None, f"{name} must be an integer"
        if not PC_MIN_ON_MS <= on_ms <= PC_MAX_ON_MS or not 2 * on_ms <= period <= MAX_PERIOD_MS:
            return None, (
                f"PC sampling must satisfy {PC_MIN_ON_MS} <= pc_on_ms <= {PC_MAX_ON_MS} and "
                f"2 * pc_on_ms <= pc_period_ms <= {MAX_PERIOD_MS} "
                f"(got pc_on_ms={on_ms}, pc_period_ms={period})"
            )
        return cls(on, on_ms, period), ""


class DutyClock:
    """The duty cycle while CUPTI is on: is the current window on, since when, and when the
    next edge (a window's end or start) is due. Windows go to `add_window(start_ns, end_ns)`
    (monotonic ns; a third argument False when activity stays on past the row's end, as in
    continuous recording); `ctl` is the CUPTI controller (controller.CuptiActivity)."""

    def __init__(self, add_window: Callable[..., None]) -> None:
        self.add_window = add_window
        self.cycle = DutyCycle()
        self.on = False  # the current window is on
        self.start_ns = 0  # when it began
        self.period_start = 0.0
        self.next_edge = 0.0

    def begin(self, now: float, ctl: Any) -> None:
        """CUPTI has just been switched on: the first window starts."""
        self.on = True
        self.start_ns = ctl.enabled_at_ns if ctl is not None else time.monotonic_ns()
        self.period_start = now
        d = self.cycle
        self.next_edge = now + (d.period_s if d.continuous else d.on_s)

    def end(self, off_ns: int) -> None:
        """Activity was switched off for good at `off_ns` (STOP, another client)."""
        if self.on:
            self.add_window(self.start_ns, off_ns)
        self.on = False

    def cut(self, ctl: Any) -> bool:
        """Switch activity off now, between edges (a PC-sampling range needs it off); True if
        it was on."""
        if not self.on:
            return False
        ctl.pause()
        self.add_window(self.start_ns, ctl.disabled_at_ns)
        self.on = False
        return True

    def edge(self, now: float, ctl: Any, pc_busy: bool) -> None:
        """Close or open a window, its time having come."""
        d = self.cycle
        if not self.on and pc_busy:
            self.next_edge = now + POLL_S  # CUPTI refuses activity during a PC range
            return
        if d.continuous:
            if not self.on:  # SET continuous arrived between windows
                ctl.resume()
                self.begin(now, ctl)
                return
            # one row per period, so the timeline sees activity while it lasts
            t = time.monotonic_ns()
            self.add_window(self.start_ns, t, False)  # activity stays on: nothing was cut
            self.start_ns, self.next_edge = t, now + d.period_s
        elif self.on:
            ctl.pause()
            self.add_window(self.start_ns, ctl.disabled_at_ns)
            self.on = False
            self.next_edge = self.period_start + d.period_s
            if self.next_edge <= now:  # this thread was held up: no catching up in bursts
                self.next_edge = now + d.period_s - d.on_s
        else:
            ctl.resume()
            self.begin(now, ctl)

    def retime(self, now: float, cycle: DutyCycle) -> None:
        """A SET changed the cycle while CUPTI is on."""
        self.cycle = cycle
        if cycle.continuous and self.on:
            self.next_edge = now + cycle.period_s
        elif cycle.continuous or not self.on:
            self.next_edge = now  # switch on at once
        else:  # this window becomes the first of the new cycle
            self.period_start, self.next_edge = now, now + cycle.on_s
