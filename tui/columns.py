"""The kernel table's columns and how many of them fit a pane (pure; no Textual).

The name column takes the width the other columns leave, up to what the longest name needs.
The other columns have priorities: when the pane is too narrow for all of them the lowest go
first (out of view to the right, where `←`/`→` scroll the table to them), and the time share
and total columns stay longest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

PAD = 2  # a DataTable cell's padding, one column each side
NAME_MIN = 28  # the name column shrinks no further to make room for another column
NAME_FALLBACK = 8  # in a pane narrower than that, the name still gets a few columns


@dataclass(frozen=True)
class Column:
    key: str
    label: str
    priority: int  # 0 stays longest


# Table order, left to right, after the name.
KERNEL_COLUMNS: tuple[Column, ...] = (
    Column("calls", "calls", 2),
    Column("total_ms", "total ms", 1),
    Column("pct", "%", 0),
    Column("mean", "mean µs", 3),
    Column("p50", "p50 µs", 7),
    Column("p99", "p99 µs", 4),
    Column("grid", "grid", 5),
    Column("block", "block", 6),
    Column("regs", "regs", 8),
    Column("smem", "smem", 9),
)


@dataclass(frozen=True)
class Fit:
    """The name column's width, the columns in view (table order) and those scrolled out of
    view to their right (table order too)."""

    name_width: int
    shown: tuple[int, ...]
    hidden: tuple[int, ...]

    @property
    def order(self) -> tuple[int, ...]:
        return self.shown + self.hidden


def fit_columns(
    avail: int,
    name_need: int,
    widths: Sequence[int],
    priorities: Sequence[int],
    name_min: int = NAME_MIN,
) -> Fit:
    """Which columns (content `widths`, `priorities` as in `Column`) fit beside the name in
    `avail` columns, in priority order until the first that does not fit (a lower-priority
    column never shows while a higher one is out of view), and the name's width: what the
    shown columns leave, at least min(name_need, name_min), at most `name_need`."""
    floor = min(name_need, name_min)
    if avail - PAD < floor:
        floor = max(min(name_need, NAME_FALLBACK), avail - PAD)
    used = floor + PAD
    shown: list[int] = []
    for i in sorted(range(len(widths)), key=lambda i: (priorities[i], i)):
        if used + widths[i] + PAD > avail:
            break
        shown.append(i)
        used += widths[i] + PAD
    free = avail - PAD - sum(widths[i] + PAD for i in shown)
    name_width = max(floor, min(name_need, free))
    hidden = [i for i in range(len(widths)) if i not in shown]
    return Fit(name_width, tuple(sorted(shown)), tuple(hidden))
