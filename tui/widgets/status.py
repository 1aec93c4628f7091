"""The status bar: target, live/replay, capture state, drops, each source's health, poll cost.

Live with an agent recording it also says the kernel-activity mode (`a` switches it) and
kdash's estimated cost to the target ("activity sampled, kdash cost ≈ 3%", from
`kdash.analyses.cost`); "≈" because it is a model of measured per-record costs, not a
measurement of this target. It is shown at 80 columns too, where the agent's own health
reason is cut: what watching costs is what a user of a production server asks first.

Rebuilt by the app on every redraw tick (also while paused: collection and captures go on, so
the countdown must too). Kept to one or two lines: each segment is short and the bar wraps at
80 columns rather than truncating the capture state, which is what a user waits for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text
from textual.widgets import Static

from kdash.analyses.cost import cost_text


@dataclass
class StatusInfo:
    mode: str  # "live" | "replay"
    target: str  # "pid 1234 python serve.py"
    capture: str = ""  # "capturing… 3.2 s" / "saved: PATH" / "capture failed: why"
    capture_phase: str = "idle"
    dropped: int = 0
    sources: dict[str, str] = field(default_factory=dict)
    poll_ms: float | None = None
    paused: bool = False
    window: str = ""  # "window 60 s" / "0.0–15.0 s of 15.0 s"
    note: str = ""  # e.g. "target exited"
    compact: bool = False  # 80 columns: sources' states only (the reasons are in the panes)
    activity: str = ""  # "sampled" | "continuous" | "" (no agent recording)
    cost: float | None = None  # kdash's estimated slowdown of the target, a fraction


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

    def show(self, info: StatusInfo) -> None:
        self.info = info
        st = self.get_component_rich_style
        sep = (" │ ", st("status-bar--dim"))
        out = Text(overflow="fold")
        if info.paused:
            out.append(" PAUSED ", st("status-bar--paused"))
            out.append(" ")
        out.append(info.mode.upper(), st("status-bar--mode"))
        out.append(f" {info.target}")
        if info.note:
            out.append(*sep)
            out.append(info.note, st("status-bar--failed"))
        if info.capture:
            out.append(*sep)
            style = {
                "saved": "status-bar--saved",
                "failed": "status-bar--failed",
            }.get(info.capture_phase, "status-bar--capture")
            out.append(info.capture, st(style))
        if info.window:
            out.append(*sep)
            out.append(info.window)
        out.append(*sep)
        out.append(f"dropped {info.dropped}", st("status-bar--bad") if info.dropped else None)
        for name, health in info.sources.items():
            out.append(*sep)
            ok = health.startswith("ok")
            shown = health.split(":", 1)[0] if info.compact else _cut(health, 70)
            out.append(f"{name} {shown}", None if ok else st("status-bar--bad"))
        if info.activity:
            out.append(*sep)
            cost = cost_text(info.cost)
            out.append(f"activity {info.activity}" + (f", {cost}" if cost else ""))
        if info.poll_ms is not None:
            out.append(*sep)
            out.append(f"poll {info.poll_ms:.1f} ms")
        out.append(*sep)
        out.append("? keys", st("status-bar--dim"))
        self.update(out)


def _cut(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"
