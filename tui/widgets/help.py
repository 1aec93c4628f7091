"""The help screen (`?`): every key of the dashboard, generated from the app's bindings.

Generated rather than hand-written so a key added to the app cannot be missing here; the
keys that tables handle themselves (cursor movement) are listed from `EXTRA_KEYS`.
"""

from __future__ import annotations

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

EXTRA_KEYS: list[tuple[str, str]] = [
    ("↑ ↓ pgup pgdn home end", "move in the focused table"),
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
}


def key_label(keys: str) -> str:
    return " ".join(KEY_NAMES.get(k.strip(), k.strip()) for k in keys.split(","))


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
        for b in self._keys:
            if b.description:
                table.add_row(key_label(b.key), b.description)
        for k, d in EXTRA_KEYS:
            table.add_row(k, d)
        with Vertical(id="help-box"):
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
