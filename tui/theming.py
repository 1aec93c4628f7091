"""The dashboard's themes: their Textual palettes, which are installed, and which one starts.

A kdash theme NAME is two things, kept in step here:

1. a Textual `Theme` registered as `kdash-NAME`: the palette every stock widget (header, tables,
   scrollbars) takes its `$variables` from, and
2. `themes/NAME.tcss` (package data of `kdash.themes`): kdash's own semantic colours (finding
   severities, sparklines, the throttle band, the status bar), every rule scoped under the App
   class `.theme-NAME`.

All theme files are loaded at start; switching (`t`, or `--theme`) swaps the App class and the
Textual theme, so no stylesheet is re-parsed. `mono` is the no-colour theme (ANSI default
colours, emphasis by bold/reverse/underline only); it is the default under `NO_COLOR`, and
Textual's own NO_COLOR filter strips any colour left. A theme is listed when both its `.tcss`
file and its palette exist; `resolve_theme` checks a name for the CLI before the app starts.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

from textual.theme import Theme

from kdash.config import Config
from kdash.errors import UserError

THEME_ORDER = ("dark", "light", "mono")

PALETTES: dict[str, Theme] = {
    "dark": Theme(
        name="kdash-dark",
        primary="#5fafff",
        secondary="#87afaf",
        accent="#ffaf5f",
        warning="#ffd75f",
        error="#ff5f5f",
        success="#87d787",
        foreground="#d0d0d0",
        background="#121212",
        surface="#1c1c1c",
        panel="#262626",
        dark=True,
    ),
    "light": Theme(
        name="kdash-light",
        primary="#005faf",
        secondary="#5f8787",
        accent="#af5f00",
        warning="#af8700",
        error="#d70000",
        success="#008700",
        foreground="#1c1c1c",
        background="#f5f5f5",
        surface="#eeeeee",
        panel="#e4e4e4",
        dark=False,
    ),
    "mono": Theme(
        name="kdash-mono",
        primary="ansi_default",
        secondary="ansi_default",
        accent="ansi_default",
        warning="ansi_default",
        error="ansi_default",
        success="ansi_default",
        foreground="ansi_default",
        background="ansi_default",
        surface="ansi_default",
        panel="ansi_default",
        boost="ansi_default",
        dark=True,
        ansi=True,
        variables={
            "ansi-background": "ansi_default",
            "ansi-foreground": "ansi_default",
            "border": "ansi_default",
            "border-blurred": "ansi_default",
            "block-cursor-foreground": "ansi_default",
            "block-cursor-background": "ansi_default",
            "block-cursor-text-style": "reverse",
            "block-cursor-blurred-text-style": "underline",
            "scrollbar": "ansi_default",
            "scrollbar-hover": "ansi_default",
            "scrollbar-active": "ansi_default",
            "scrollbar-background": "ansi_default",
            "scrollbar-background-hover": "ansi_default",
            "scrollbar-background-active": "ansi_default",
            "scrollbar-corner-color": "ansi_default",
            "footer-key-foreground": "ansi_default",
            "screen-selection-background": "ansi_default",
            "screen-selection-foreground": "ansi_default",
        },
    ),
}


def theme_dir() -> Path:
    return Path(str(resources.files("kdash.themes")))


def available_themes() -> list[str]:
    """Theme names that have both a `.tcss` file and a palette, in cycling order."""
    files = {p.stem for p in theme_dir().glob("*.tcss")}
    names = [n for n in THEME_ORDER if n in files and n in PALETTES]
    names += sorted((files & set(PALETTES)) - set(names))
    return names


def resolve_theme(name: str) -> str:
    """Check a theme name (from `--theme` or the config file); return it normalised.

    Raises `UserError("unknown theme X (have: dark, light, mono)")` so the CLI can say so in
    one line before the app starts.
    """
    have = available_themes()
    key = (name or "").strip().lower()
    if key not in have:
        raise UserError(f"unknown theme {name} (have: {', '.join(have)})")
    return key


def default_theme(config: Config) -> str:
    """`NO_COLOR` wins over the saved choice; an unusable saved name falls back to dark."""
    if os.environ.get("NO_COLOR"):
        return "mono"
    try:
        return resolve_theme(config.theme)
    except UserError:
        return "dark"
