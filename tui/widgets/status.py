"""The status bar: target, live/replay, capture state, drops, each source's health, poll cost.

Live with an agent recording it also says the kernel-activity mode (`a` switches it) and
kdash's estimated cost to the target ("activity sampled, kdash cost ≈ 3%", from
`kdash.analyses.cost`); "≈" because it is a model of measured per-record costs, not a
measurement of this target. What watching costs is what a user of a production server asks
first, so it outranks everything but the capture state and the mode. The window shown (what
pan and zoom changed) outranks a source's state, whose reason the panes say anyway.

Always one line. The bar is a row of segments, each with one or more forms (longest first) and
a rank per form; while the line is too wide for the bar, the shown form with the lowest rank
gives way to its next shorter form, or the segment goes. `? keys` is never dropped and keeps
its place at the end. When only the segments that must stay are left and the line is still too
wide, the capture state (then the note) is cut with an ellipsis: a saved path from its left, so
the file name stays. The whole line is the bar's `content` (and its tooltip when cut); what is
drawn is fitted to the width on every render, so a resize refits it.

Rebuilt by the app on every redraw tick (also while paused: collection and captures go on, so
the countdown must too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kdash.collectors.base import Health, as_health
from rich.cells import cell_len
from rich.style import Style
from rich.text import Text
from textual.widgets import Static

from kdash.analyses.cost import cost_text

from .fit import cut_end, cut_path

KEYS_HINT = "? keys"
SEP = " │ "
MIN_SQUEEZED = 12  # cells a cut capture state or note keeps at least (with its ellipsis)


@dataclass
class StatusInfo:
    mode: str  # "live" | "replay"
    target: str  # "pid 1234 python serve.py"
    capture: str = ""  # "capturing… 3.2 s" / "saved: PATH" / "capture failed: why"
    capture_phase: str = "idle"
    capture_path: str = ""  # the saved file (inside `capture`): cut from its left when long
    dropped: int = 0
    sources: dict[str, Health | str] = field(default_factory=dict)
    poll_ms: float | None = None
    paused: bool = False
    window: str = ""  # "window 60 s" / "0.0–15.0 s of 15.0 s"
    note: str = ""  # e.g. "target exited"
    activity: str = ""  # "sampled" | "continuous" | "" (no agent recording)
    cost: float | None = None  # kdash's estimated slowdown of the target, a fraction


@dataclass
class Segment:
    """One part of the bar. `forms[i]` is shown until it is the lowest-ranked form shown and
    the line is too wide; then `forms[i + 1]`, and after the last the segment is dropped unless
    `keep`. `joiner` goes before it when something precedes it."""

    forms: list[str]
    ranks: list[int]
    style: Style | None = None
    keep: bool = False
    joiner: str = SEP
    squeeze: int = 0  # >0: may be cut with an ellipsis as a last resort (lower goes first)
    path: str = ""  # a path inside the form, cut from its left when squeezed


def segments(info: StatusInfo, st) -> list[Segment]:
    """The bar's segments for `info`, in display order; `st(component)` gives a style."""
    segs: list[Segment] = []
    if info.paused:
        segs.append(Segment([" PAUSED "], [100], st("status-bar--paused"), keep=True))
    segs.append(Segment([info.mode.upper()], [100], st("status-bar--mode"), keep=True, joiner=" "))
    pid = info.target.split(" ", 2)
    short = " ".join(pid[:2])
    target_forms = [info.target] if short == info.target else [info.target, short]
    segs.append(Segment(target_forms, [35, 65][-len(target_forms) :], joiner=" "))
    if info.note:
        segs.append(Segment([info.note], [90], st("status-bar--failed"), keep=True, squeeze=2))
    if info.capture:
        style = {
            "saved": "status-bar--saved",
            "failed": "status-bar--failed",
        }.get(info.capture_phase, "status-bar--capture")
        path = info.capture_path if info.capture_path in info.capture else ""
        segs.append(Segment([info.capture], [95], st(style), keep=True, squeeze=1, path=path))
    if info.window:
        segs.append(Segment([info.window], [62]))
    bad = st("status-bar--bad") if info.dropped else None
    segs.append(Segment([f"dropped {info.dropped}"], [70 if info.dropped else 20], bad))
    for name, value in info.sources.items():
        health = as_health(value, name)
        full = f"{name} {cut_end(str(health), 70)}"
        short_form = f"{name} {health.state}"
        forms = [full] if full == short_form else [full, short_form]
        if not health.trouble:
            segs.append(Segment(forms, [25, 12][-len(forms) :]))
        else:
            segs.append(Segment(forms, [30, 60][-len(forms) :], st("status-bar--bad")))
    if info.activity:
        cost = cost_text(info.cost)
        segs.append(Segment([f"activity {info.activity}" + (f", {cost}" if cost else "")], [80]))
    if info.poll_ms is not None:
        segs.append(Segment([f"poll {info.poll_ms:.1f} ms"], [15]))
    segs.append(Segment([KEYS_HINT], [1000], st("status-bar--dim"), keep=True))
    return segs


def _width(segs: list[Segment], shown: list[str | None]) -> int:
    total, first = 0, True
    for seg, text in zip(segs, shown, strict=True):
        if text is None:
            continue
        total += cell_len(text) + (0 if first else cell_len(seg.joiner))
        first = False
    return total


def fit(segs: list[Segment], width: int) -> list[str | None]:
    """The form each segment shows (None: dropped) so the line fits `width` cells if it can."""
    state = [0] * len(segs)

    def shown() -> list[str | None]:
        return [s.forms[i] if i < len(s.forms) else None for s, i in zip(segs, state, strict=True)]

    while _width(segs, shown()) > width:
        # the lowest-ranked form that can give way; on a tie the later segment goes first
        can = [i for i, s in enumerate(segs) if state[i] < len(s.forms) - (1 if s.keep else 0)]
        if not can:
            break
        i = min(can, key=lambda i: (segs[i].ranks[state[i]], -i))
        state[i] += 1
    out = shown()
    over = _width(segs, out) - width
    for i in sorted((i for i, s in enumerate(segs) if s.squeeze), key=lambda i: segs[i].squeeze):
        text = out[i]
        if over <= 0 or text is None:
            break
        room = max(MIN_SQUEEZED, cell_len(text) - over)
        out[i] = _squeeze(segs[i], text, room)
        over = _width(segs, out) - width
    return out


def _squeeze(seg: Segment, text: str, room: int) -> str:
    """`text` cut to `room` cells: around its path, the path from its left, else at the end."""
    if cell_len(text) <= room:
        return text
    if seg.path and seg.path in text:
        head, tail = text.split(seg.path, 1)
        left = room - cell_len(head) - cell_len(tail)
        if left >= MIN_SQUEEZED // 2:
            return head + cut_path(seg.path, left) + tail
        if room - cell_len(head) >= MIN_SQUEEZED // 2:
            return head + cut_path(seg.path, room - cell_len(head))
    return cut_end(text, room)


def assemble(segs: list[Segment], shown: list[str | None]) -> Text:
    out = Text(no_wrap=True, overflow="ellipsis", end="")
    dim = next((s.style for s in segs if s.forms == [KEYS_HINT]), None)
    first = True
    for seg, text in zip(segs, shown, strict=True):
        if text is None:
            continue
        if not first:
            out.append(seg.joiner, dim if seg.joiner == SEP else None)
        out.append(text, seg.style)
        first = False
    return out


class StatusBar(Static):
    COMPONENT_CLASSES = {
        "status-bar--mode",
        "status-bar--capture",
        "status-bar--saved",
        "status-bar--failed",
        "status-bar--paused",
        "status-bar--bad",
        "status-bar--dim",
    }

    def __init__(self, **kwargs) -> None:
        super().__init__("", markup=False, **kwargs)
        self.info: StatusInfo | None = None
        self._segs: list[Segment] = []
        self._fitted: tuple[int, Text] | None = None  # (width, line): render and tooltip share it

    def show(self, info: StatusInfo) -> None:
        """Take new state: the whole line becomes `content`; `render` fits it to the width."""
        self.info = info
        self._segs = segments(info, self.get_component_rich_style)
        self._fitted = None
        self.update(assemble(self._segs, [s.forms[0] for s in self._segs]), layout=False)
        self._update_tooltip()

    def fitted(self, width: int) -> Text:
        """The line as drawn in `width` cells."""
        if self._fitted is None or self._fitted[0] != width:
            self._fitted = (width, assemble(self._segs, fit(self._segs, width)))
        return self._fitted[1]

    def render(self) -> Text:
        return self.fitted(self.content_size.width)

    def on_resize(self) -> None:
        self._update_tooltip()

    def _update_tooltip(self) -> None:
        """The whole line as the tooltip while the drawn one is cut (hover to read it)."""
        whole = self.content.plain if isinstance(self.content, Text) else str(self.content)
        width = self.content_size.width
        tip = whole if width > 0 and self.fitted(width).plain != whole else None
        if self.tooltip != tip:
            self.tooltip = tip
