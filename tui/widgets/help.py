"""The help screen (`?`): every key of the dashboard, generated from the app's bindings.

Generated rather than hand-written so a key added to the app cannot be missing here; the
keys that tables handle themselves (cursor movement) are listed from `EXTRA_KEYS`.
"""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

EXTRA_KEYS: list[tuple[str, str]] = [
    ("↑ ↓ pgup pgdn", "move in the focused table (or scroll this help)"),
    ("← →", "focused kernel table: scroll to the columns out of view"),
]

KEY_NAMES = {
    "question_mark": "?",
    "plus": "+",
    "minus": "-",
    "equals_sign": "=",
    "left": "←",
    "right": "→",
    "escape": "esc",
    "shift+tab": "shift+tab",
    "slash": "/",
}


def key_label(keys: str) -> str:
    return " ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in keys.split(","))


def help_rows(bindings: list[Binding]) -> list[tuple[str, str]]:
    """(keys, what they do) rows: bindings of one action with different arguments share a row
    (`1 2 3 4` maximise a pane, `← →` pan), so the list fits an 80x24 terminal.

    A shared row's description is the common text before ":" of its bindings' descriptions
    followed by each binding's part after it, e.g. "maximise: 1 kernels, 2 clocks, …".
    """
    groups: dict[str, list[Binding]] = {}
    for b in bindings:
        if b.description:
            groups.setdefault(b.action.split("(")[0], []).append(b)
    rows = []
    for group in groups.values():
        keys = " ".join(key_label(b.key) for b in group)
        if len(group) == 1:
            rows.append((keys, group[0].description))
            continue
        heads = {b.description.split(":", 1)[0] for b in group}
        if len({b.description for b in group}) == 1:
            rows.append((keys, group[0].description))
        elif len(heads) == 1 and all(":" in b.description for b in group):
            parts = ", ".join(
                f"{key_label(b.key)} {b.description.split(':', 1)[1].strip()}" for b in group
            )
            rows.append((keys, f"{heads.pop()}: {parts}"))
        else:
            rows.append((keys, " / ".join(b.description for b in group)))
    return rows


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,q,question_mark", "dismiss", "close help"),
    ]

    def __init__(
        self, bindings: list[Binding], mode: str, sources: dict[str, str] | None = None
    ) -> None:
        super().__init__()
        self._keys = bindings
        self._mode = mode
        self._sources = sources or {}

    def compose(self) -> ComposeResult:
        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold", no_wrap=True)
        table.add_column()
        for keys, what in help_rows(self._keys):
            table.add_row(keys, what)
        for k, d in EXTRA_KEYS:
            table.add_row(k, d)
        with VerticalScroll(id="help-box"):
            yield Static(f"kdash keys ({self._mode})   esc, q or ? closes", id="help-title")
            yield Static(table, id="help-table")
            if self._sources:
                src = Table.grid(padding=(0, 2))
                src.add_column(style="bold", no_wrap=True)
                src.add_column()
                for name, health in self._sources.items():
                    src.add_row(name, health)
                yield Static("sources", id="help-sources-title")
                yield Static(src, id="help-sources")
