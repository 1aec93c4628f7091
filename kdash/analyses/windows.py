"""A duty-cycled agent's recording windows placed side by side: the kernel pane's window view.

The agent keeps CUPTI activity on for a short window of every period and writes each window as
a markers row (domain "kdash", name "activity on"); at its default budget 2-5% of the time is
recorded. Drawn on a continuous axis, a minute of that is a strip of "not recorded" with a few
specks. Packing keeps the last recorded windows of the shown time range and gives each its own
slice of the strip: time runs left to right inside a slice, and one column (a cut) separates
two slices, so every column of the strip holds recorded time.

Pure numpy. `Packing.positions` maps times to strip columns (bin units), which is all the lane
binning needs: the same one-pass coverage then works on a packed strip as on a continuous one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kdash.analyses.kernels import ACTIVITY_DOMAIN, ACTIVITY_NAME

PACK_BELOW = 0.2  # the window view is the default when less of the shown range was recorded
MIN_SLICE = 12  # columns per window at least: its start label ("-12.3s") and some shape
MIN_COLUMNS = 4  # a window clipped by the range's edge still gets this many columns


def window_rows(markers: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(starts, ends) of the agent's "activity on" rows in a markers batch, as int64."""
    if not len(markers["start_ns"]):
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty
    win = (markers["domain"] == ACTIVITY_DOMAIN) & (markers["name"] == ACTIVITY_NAME)
    return (
        markers["start_ns"][win].astype(np.int64),
        markers["end_ns"][win].astype(np.int64),
    )


def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows sorted by start, overlapping or touching ones merged into one, empty ones
    dropped: the strictly increasing boundaries `Packing.positions` interpolates over."""
    s = np.asarray(starts, dtype=np.int64)
    e = np.asarray(ends, dtype=np.int64)
    keep = e > s
    s, e = s[keep], e[keep]
    if len(s) == 0:
        return s, e
    order = np.argsort(s, kind="stable")
    s, e = s[order], np.maximum.accumulate(e[order])
    # a window starts a new run when it begins after every earlier one has ended
    new = np.ones(len(s), dtype=bool)
    new[1:] = s[1:] > e[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:], len(s)) - 1
    return s[first], e[last]


def clip(
    starts: np.ndarray, ends: np.ndarray, since_ns: int, until_ns: int
) -> tuple[np.ndarray, np.ndarray]:
    """The merged windows' parts inside [since_ns, until_ns)."""
    s, e = merge(starts, ends)
    s, e = np.maximum(s, since_ns), np.minimum(e, until_ns)
    keep = e > s
    return s[keep], e[keep]


def recorded_share(starts: np.ndarray, ends: np.ndarray, since_ns: int, until_ns: int) -> float:
    """Share (0..1) of [since_ns, until_ns) that some window covers."""
    s, e = clip(starts, ends, since_ns, until_ns)
    return float((e - s).sum()) / max(1, until_ns - since_ns)


def with_open_window(
    starts: np.ndarray,
    ends: np.ndarray,
    kernel_starts: np.ndarray,
    kernel_ends: np.ndarray,
    until_ns: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The windows plus the one still open live: the agent writes a window's row when the
    window closes, and its kernels arrive first. Kernels that start after the last window's
    end (all of them, with no window yet) make a window from the first of them to the last
    one's end (no further: how long the window stays open is not known until its row comes).
    """
    k = np.asarray(kernel_starts, dtype=np.int64)
    ke = np.asarray(kernel_ends, dtype=np.int64)
    tail = k < until_ns
    if len(ends):
        tail &= k > int(ends.max())
    if not tail.any():
        return starts, ends
    return (
        np.append(starts.astype(np.int64), int(k[tail].min())),
        np.append(ends.astype(np.int64), min(int(until_ns), int(ke[tail].max()))),
    )


@dataclass(frozen=True)
class Packing:
    """The shown windows and the columns each holds: slice i is columns
    [first[i], first[i] + widths[i]), and the column before each slice but the first is a cut.
    """

    starts: np.ndarray  # int64 ns, the shown windows (clipped to the range), oldest first
    ends: np.ndarray
    first: np.ndarray  # int64, each slice's first column
    widths: np.ndarray  # int64, each slice's columns
    bins: int  # columns of the strip, cuts included
    in_range: int  # windows the shown range holds (the last len(starts) of them are shown)
    in_range_ns: int  # recorded time in the shown range, all its windows

    @property
    def cuts(self) -> np.ndarray:
        """Columns of the cuts between slices."""
        return self.first[1:] - 1

    def positions(self, t: np.ndarray) -> np.ndarray:
        """Strip positions (float, bin units) of times `t`: linear inside a slice; a time
        between two windows falls on the cut between their slices, one before the first
        window on column 0, one after the last on the strip's end."""
        base = int(self.starts[0])
        xp = np.empty(2 * len(self.starts))
        xp[0::2] = self.starts - base
        xp[1::2] = self.ends - base
        fp = np.empty(len(xp))
        fp[0::2] = self.first
        fp[1::2] = self.first + self.widths
        rel = (np.asarray(t, dtype=np.int64) - base).astype(np.float64)
        return np.interp(rel, xp, fp)

    def slice_of(self, column: int) -> int:
        """Index of the slice that holds `column` (-1 for a cut or past the strip)."""
        i = int(np.searchsorted(self.first, column, side="right")) - 1
        if i < 0 or column >= self.first[i] + self.widths[i]:
            return -1
        return i


def allot(durations: np.ndarray, columns: int, floor: int = MIN_COLUMNS) -> np.ndarray:
    """Columns per window: `floor` each, the rest shared in proportion to their durations
    (largest remainders first), summing to `columns` exactly."""
    n = len(durations)
    floor = max(1, min(floor, columns // max(1, n)))
    spare = columns - floor * n
    d = np.asarray(durations, dtype=np.float64)
    share = d / d.sum() * spare if d.sum() > 0 else np.full(n, spare / max(1, n))
    out = np.floor(share).astype(np.int64)
    left = spare - int(out.sum())
    if left > 0:
        # ties go to the later window: the newest is what a live user looks at
        order = np.lexsort((-np.arange(n), -(share - out)))
        out[order[:left]] += 1
    return out + floor


def pack(
    starts: np.ndarray,
    ends: np.ndarray,
    since_ns: int,
    until_ns: int,
    bins: int,
    min_slice: int = MIN_SLICE,
) -> Packing | None:
    """The last windows of [since_ns, until_ns) that fit `bins` columns at `min_slice`
    columns each (and one cut between two), side by side; None when the range holds none."""
    cs, ce = clip(starts, ends, since_ns, until_ns)
    if len(cs) == 0 or bins <= 0:
        return None
    fit = max(1, (bins + 1) // (min_slice + 1))
    n = min(fit, len(cs))
    s, e = cs[-n:], ce[-n:]
    widths = allot(e - s, bins - (n - 1))
    first = np.concatenate([[0], np.cumsum(widths[:-1] + 1)]).astype(np.int64)
    return Packing(s, e, first, widths, bins, len(cs), int((ce - cs).sum()))


def packed_axis(packing: Packing, label, cut: str = "┼") -> str:
    """The strip's axis: each slice starts with its window's start time (`label(ns)`, e.g.
    "12.3s"), cuts are marked, the rest is rule."""
    chars = ["─"] * packing.bins
    for c in packing.cuts.tolist():
        chars[c] = cut
    for start, first, width in zip(
        packing.starts.tolist(), packing.first.tolist(), packing.widths.tolist(), strict=True
    ):
        text = label(start)
        if len(text) <= width:
            chars[first : first + len(text)] = text
    return "".join(chars)
