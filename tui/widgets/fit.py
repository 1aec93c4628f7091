"""Text cut to a width with an ellipsis: paths from the left, anything else at the end.

Pure string functions on terminal cells (`rich.cells`), shared by the status bar and the
toasts: a saved capture's file name is what a user looks for, so a path that does not fit keeps
its last components (`…/captures/run-1201.kdash`) rather than being split mid-word.
"""

from __future__ import annotations

import re

from rich.cells import cell_len

ELLIPSIS = "…"


def cut_end(text: str, width: int) -> str:
    """`text` whole if it fits in `width` cells, else its start and "…"."""
    if cell_len(text) <= width:
        return text
    if width <= 0:
        return ""
    out, used = [], 0
    for ch in text:
        w = cell_len(ch)
        if used + w > width - 1:
            break
        out.append(ch)
        used += w
    return "".join(out) + ELLIPSIS


def cut_start(text: str, width: int) -> str:
    """`text` whole if it fits in `width` cells, else "…" and its end."""
    if cell_len(text) <= width:
        return text
    if width <= 0:
        return ""
    out, used = [], 0
    for ch in reversed(text):
        w = cell_len(ch)
        if used + w > width - 1:
            break
        out.append(ch)
        used += w
    return ELLIPSIS + "".join(reversed(out))


def cut_path(path: str, width: int) -> str:
    """A path whole if it fits, else "…/" and as many of its last components as fit whole;
    only a file name that alone is too wide is cut (from its left: its end is the extension
    and the distinguishing part, e.g. a run number)."""
    if cell_len(path) <= width:
        return path
    if "/" not in path.rstrip("/"):
        return cut_start(path, width)
    parts = path.split("/")
    tail = parts[-1]
    for part in reversed(parts[1:-1]):
        longer = f"{part}/{tail}"
        if cell_len(ELLIPSIS + "/" + longer) > width:
            break
        tail = longer
    shown = ELLIPSIS + "/" + tail
    return shown if cell_len(shown) <= width else cut_start(tail, width)


_WORD = re.compile(r"\S+")


def fit_words(message: str, width: int) -> str:
    """Every word of `message` that is wider than `width` cut to it, so wrapping at `width`
    only breaks between words: a word with a "/" as a path (its end kept), any other at its
    end. Spaces and line breaks are kept as they are."""
    if width <= 0:
        return message

    def fit(m: re.Match[str]) -> str:
        word = m.group(0)
        if cell_len(word) <= width:
            return word
        return cut_path(word, width) if "/" in word else cut_end(word, width)

    return _WORD.sub(fit, message)
