"""Source pane: the hottest kernel's source with its hot lines (PC sampling, a later issue).

Until the agent's PC sampling delivers `pc_samples`, the pane is one line saying so; once rows
exist it lists the hottest (kernel, pc offset) pairs, a placeholder for the syntax-highlighted
source view the source-pane issue builds.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import Static

from kdash import schema

from .base import Pane, View

NO_SAMPLES = (
    "Source: the hottest kernel's source and hot lines appear here once the agent's PC "
    "sampling is on (a later issue)"
)


class SourcePane(Pane):
    key = "4"
    title = "Source"
    waiting = NO_SAMPLES

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.body = Static("", markup=False)

    def compose(self) -> ComposeResult:
        yield self.empty_line
        yield self.body

    def show(self, view: View) -> None:
        batch = view.store.get("pc_samples", view.since_ns, view.until_ns)
        pcs = schema.to_frame("pc_samples", batch) if len(batch["t_ns"]) else None
        if pcs is None:
            self.set_empty(NO_SAMPLES)
            return
        self.set_empty(None)
        hot = (
            pcs.groupby(["kernel", "pc_offset"], sort=False)["count"]
            .sum()
            .sort_values(ascending=False)
            .head(20)
        )
        total = float(pcs["count"].sum()) or 1.0
        out = Text("hottest PCs (source lines arrive with the source-pane issue)\n")
        for (kernel, pc), n in hot.items():
            out.append(f"{100 * n / total:5.1f}%  {kernel}  +0x{int(pc):x}\n")
        self.body.update(out)
