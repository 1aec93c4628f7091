"""What every pane shares: the view it is drawn for, and the empty-pane convention.

A pane is a read-only view over the store. The app builds one `View` per redraw (the time
window, the mode, the sources' health, the findings, the target's pid) and hands it to each
visible pane's `show(view)`; panes never poll a source or touch the recorder (or the app's
session) themselves, and they never run on the poll thread.

A pane with nothing to show says why in one line and gets the `-empty` class, which the
stylesheet uses to collapse it to that line so the panes with data get the room.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd
from kdash.collectors.base import Health, as_health
from textual.containers import Vertical
from textual.widgets import Static

from kdash.store import Store


@dataclass
class View:
    """Everything a pane may draw from, for one redraw."""

    store: Store
    since_ns: int
    until_ns: int
    mode: str  # "live" | "replay"
    anchor_ns: int  # time 0 of the axis labels: capture start in replay, window end live
    health: dict[str, str] = field(default_factory=dict)  # source name -> "ok" / "unavailable: …"
    findings: pd.DataFrame | None = None
    gpus: list[dict] = field(default_factory=list)  # describe() of the GPUs, may be empty
    sglang: dict | None = None  # meta["sglang"]: the server's tree and args (SGLang targets)
    # the same health as data (codes and fields), by name; a name missing here has its text
    # in `health` read by `collectors.base.health_from_text`
    healths: dict[str, Health] = field(default_factory=dict)
    # the pid of the process watched now (live); None in a replay and without a target
    target_pid: int | None = None

    def health_of(self, name: str) -> Health | None:
        """Source `name`'s health as data, None when there is no such source."""
        h = self.healths.get(name, self.health.get(name))
        return None if h is None else as_health(h, name)

    def health_data(self) -> dict[str, Health]:
        """Every source's health as data, by name."""
        return {k: h for k in {**self.health, **self.healths} if (h := self.health_of(k))}

    @property
    def seconds(self) -> float:
        return (self.until_ns - self.since_ns) / 1e9

    def rel(self, t_ns: int) -> float:
        """Seconds of `t_ns` on the axis: from the capture start (replay) or before now (live)."""
        return (t_ns - self.anchor_ns) / 1e9

    def axis(self, width: int) -> str:
        """A one-line time axis of `width` characters: start label left, end label right."""
        if self.mode == "live":
            left = f"-{self.seconds:.0f}s" if self.seconds >= 10 else f"-{self.seconds:.1f}s"
            right = "now" if self.until_ns >= self.anchor_ns else f"{self.rel(self.until_ns):.1f}s"
            if self.until_ns < self.anchor_ns:
                left = f"{self.rel(self.since_ns):.1f}s"
        else:
            left = f"{self.rel(self.since_ns):.1f}s"
            right = f"{self.rel(self.until_ns):.1f}s"
        gap = max(1, width - len(left) - len(right))
        return (left + "─" * gap + right)[: max(0, width)]


class Pane(Vertical, can_focus=True):
    """A titled, focusable pane; subclasses implement `show(view)`.

    Focusable so `tab` can move between panes even when a pane holds no table; a pane with a
    table forwards focus to it (`focus_target`).
    """

    key: str = ""  # "1".."4": the key that maximises it
    title: str = ""
    waiting: str = "waiting for data"  # the one line shown before the first redraw

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.border_title = f"{self.key} {self.title}"
        # Set here, not in on_mount: the app's first redraw may run before a pane's on_mount.
        self.empty_line = Static(self.waiting, classes="empty-line", markup=False)
        self._empty_why: str | None = self.waiting
        self.add_class("-empty")

    def focus_target(self):
        return self

    def on_resize(self) -> None:
        # Drawn content is sized to the pane (sparkline bins, cut lines): redraw at the new size.
        request = getattr(self.app, "request_redraw", None)
        if request is not None:
            request()

    def set_empty(self, why: str | None) -> None:
        """Collapse to one line saying `why` (or restore the full pane when None)."""
        self.set_class(why is not None, "-empty")
        # An unchanged line is not set again: each update costs Textual a layout pass.
        if why is not None and why != self._empty_why:
            self._empty_why = why
            self.empty_line.update(why)

    def show(self, view: View) -> None:  # pragma: no cover - abstract
        raise NotImplementedError
