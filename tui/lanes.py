"""The kernel timeline's strip as Rich text: NVTX lanes, a lane per (GPU, stream), an idle
lane per GPU, the axis and the notes line.

Pure functions of store batches (numpy and Rich, no Textual): the kernel pane and
bench/timeline_redraw.py call the same code.

* Time the agent did not record (its duty cycle keeps CUPTI activity on a few % of the time and
  says when with "activity on" markers rows) is drawn as a dim "·", never as a blank: a blank
  would read as "GPU idle". Busy shades are then the share of the *recorded* part of a bin.
  With no window rows at all (continuous activity, older captures) everything counts as
  recorded.
* The window view (`kdash.analyses.windows`): given a `Packing`, the strip holds the last
  recorded windows side by side instead of continuous time, a cut column "┊" between two, and
  the axis labels each slice with its window's start.
* The redraw has to stay under 20 ms with 100,000 kernels in the window: all lanes are binned
  in one pass of `np.bincount` over the rows (no boolean mask and sort per lane).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from rich.style import Style
from rich.text import Text

from kdash.analyses.kernel_findings import CAUSES
from kdash.analyses.kernels import ACTIVITY_DOMAIN, ACTIVITY_NAME
from kdash.analyses.windows import Packing, packed_axis

from .widgets.spark import SHADES

MAX_LANES = 8
MAX_NVTX_LANES = 3  # NVTX domains drawn as lanes; more are counted on one line
LABEL_W = 12
UNRECORDED = "·"
CUT = "┊"  # the column between two recorded windows in the window view
IDLE_MARK_SHARE = 0.05  # a bin gets a cause letter when that cause idled >= 5% of it
CAUSE_LETTERS = np.array([c[0] for c in CAUSES])


def lane_bins(width: int) -> int:
    """Bins (columns) of the lanes for a strip `width` characters wide."""
    return max(1, max(10, width) - LABEL_W)


@dataclass(frozen=True)
class LaneStyles:
    """The Rich styles of the strip (from the pane's component classes; plain in the bench)."""

    lane: Style = Style()
    label: Style = Style()
    note: Style = Style()
    unrecorded: Style = Style(dim=True)
    nvtx: Style = Style()


class Scale:
    """Times to strip positions (float, bin units): continuous over [since_ns, until_ns), or
    through a `Packing` (the window view)."""

    def __init__(self, since_ns: int, until_ns: int, bins: int, packing: Packing | None = None):
        self.since_ns, self.until_ns, self.bins, self.packing = since_ns, until_ns, bins, packing

    def __call__(self, t: np.ndarray) -> np.ndarray:
        if self.packing is not None:
            return self.packing.positions(t)
        scale = self.bins / max(1, self.until_ns - self.since_ns)
        return (np.clip(t, self.since_ns, self.until_ns) - self.since_ns) * scale


def coverage_of(
    codes: np.ndarray, n_lanes: int, ps: np.ndarray, pe: np.ndarray, bins: int
) -> np.ndarray:
    """Covered share (0..1) of each of `bins` bins, per lane, for intervals already in bin
    units ([ps, pe), 0..bins): an (n_lanes, bins) array.

    One pass over all rows, whatever the number of lanes: the covered length up to a bin edge
    g is the sum over intervals of clamp(g - start, 0, end - start) = g·#(start < g) −
    Σ(start < g) − (the same for ends), and the counts and sums by bin come from four
    `np.bincount` calls on (lane, bin) keys. Overlapping intervals on one lane count once per
    bin up to 1.0 (the result is clipped).
    """
    if bins <= 0 or n_lanes == 0 or len(ps) == 0:
        return np.zeros((n_lanes, max(0, bins)))
    pe = np.maximum(pe, ps)
    stride = bins + 2
    base = codes.astype(np.int64) * stride
    size = n_lanes * stride
    grid = np.arange(bins + 1, dtype=np.float64)
    covered = np.zeros((n_lanes, bins + 1))
    for pos, sign in ((ps, 1.0), (pe, -1.0)):
        # Key floor(pos)+1: an exclusive cumulative sum then counts the positions < g exactly.
        key = base + np.minimum(pos.astype(np.int64), bins) + 1
        n = np.bincount(key, minlength=size).reshape(n_lanes, stride).cumsum(axis=1)
        s = np.bincount(key, weights=pos, minlength=size).reshape(n_lanes, stride).cumsum(axis=1)
        covered += sign * (grid * n[:, : bins + 1] - s[:, : bins + 1])
    return np.clip(np.diff(covered, axis=1), 0.0, 1.0)


def coverage(
    codes: np.ndarray,
    n_lanes: int,
    starts: np.ndarray,
    ends: np.ndarray,
    since_ns: int,
    until_ns: int,
    bins: int,
    packing: Packing | None = None,
) -> np.ndarray:
    """`coverage_of` for intervals in ns over [since_ns, until_ns) (or a packed strip)."""
    if bins <= 0 or n_lanes == 0 or len(starts) == 0:
        return np.zeros((n_lanes, max(0, bins)))
    scale = Scale(since_ns, until_ns, bins, packing)
    return coverage_of(codes, n_lanes, scale(starts), scale(ends), bins)


FRAC_EPS = 1e-9


def lane_chars(
    frac: np.ndarray, unrecorded: np.ndarray | None, cuts: np.ndarray | None = None
) -> str:
    """Busy share per bin as shade characters (vectorised `spark.shade`); "·" where the bin
    was not recorded at all, "┊" on the window view's cuts."""
    top = len(SHADES) - 1
    # FRAC_EPS, not 0: a kernel that ends on a bin's edge leaves float residue (~1e-12) in the
    # next bin once times go through the window view's interpolation; a real kernel covers
    # more than a billionth of any bin a lane draws
    idx = np.where(frac > FRAC_EPS, np.clip(np.ceil(frac * top), 1, top), 0).astype(np.int64)
    chars = np.array(list(SHADES))[idx]
    if unrecorded is not None:
        chars[unrecorded] = UNRECORDED
    if cuts is not None and len(cuts):
        chars[cuts] = CUT
    return "".join(chars.tolist())


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `mask`."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist(), strict=True))


def _factorize(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, sorted unique keys) in O(n): np.unique's sort was the slow part of a redraw.

    Integer keys of a small range (device and stream ids are small) go through a bincount
    lookup table; anything else through pandas' hash table.
    """
    if keys.dtype.kind == "i" and len(keys):
        lo, hi = int(keys.min()), int(keys.max())
        if hi - lo < 1 << 16:
            present = np.bincount(keys - lo, minlength=hi - lo + 1) > 0
            table = np.cumsum(present) - 1
            return table[keys - lo], np.flatnonzero(present) + lo
    codes, uniques = pd.factorize(keys, sort=True)
    return np.asarray(codes, dtype=np.int64), np.asarray(uniques)


def cause_codes(causes: np.ndarray) -> np.ndarray:
    """Cause names as indexes into CAUSES (an unknown name counts as the last, "unknown")."""
    index = {c: i for i, c in enumerate(CAUSES)}
    return np.array([index.get(str(c), len(CAUSES) - 1) for c in causes], dtype=np.int64)


def idle_chars(
    idle: dict[str, np.ndarray],
    device: int,
    since_ns: int,
    until_ns: int,
    bins: int,
    packing: Packing | None = None,
) -> str:
    """One GPU's idle lane: per bin, the first letter of the cause that idled it most.

    `idle`: device, start_ns, end_ns and either "code" (`cause_codes`, what the pane passes)
    or "cause" names."""
    m = idle["device"] == device
    if not m.any():
        return " " * bins
    codes = idle["code"][m] if "code" in idle else cause_codes(idle["cause"][m])
    frac = coverage(
        codes, len(CAUSES), idle["start_ns"][m], idle["end_ns"][m], since_ns, until_ns, bins,
        packing,
    )  # fmt: skip
    marked = frac.max(axis=0) >= IDLE_MARK_SHARE
    chars = np.where(marked, CAUSE_LETTERS[frac.argmax(axis=0)], " ")
    if packing is not None:
        chars[packing.cuts] = CUT
    return "".join(chars)


def window_note(packing: Packing, seconds: float) -> str:
    """The window view's legend: what the slices are and how much of the range was recorded."""
    each = float(np.median((packing.ends - packing.starts) / 1e6))
    share = 100 * packing.in_range_ns / max(1.0, seconds * 1e9)
    shown = len(packing.starts)
    if shown < packing.in_range:
        what = f"last {shown} of {packing.in_range} recorded windows"
    else:
        what = f"{shown} recorded window{'s' if shown > 1 else ''}"
    what = f"{CUT} cut: {what} side by side" if shown > 1 else f"{what} only"
    span = f"{seconds:.{0 if seconds >= 10 else 1}f} s"
    each_ms = f"~{each:.0f} ms{' each' if shown > 1 else ''}"
    return f"{what}, {each_ms} ({share:.1f}% of {span} recorded; w: continuous time)"


def render_lanes(
    kernels: dict[str, np.ndarray],
    markers: dict[str, np.ndarray] | None,
    since_ns: int,
    until_ns: int,
    width: int,
    axis: Callable[[int], str],
    styles: LaneStyles | None = None,
    notes: str | None = None,
    duty_cycled: bool | None = None,
    idle: dict[str, np.ndarray] | None = None,
    packing: Packing | None = None,
    label: Callable[[int], str] | None = None,
) -> Text:
    """The strip: NVTX lanes, kernel lanes (one per GPU and stream), an idle lane per GPU
    (`idle`: its explained gaps, each bin lettered by the cause that idled it most: h host,
    s sync, q quiet, g gpu, u unknown), the axis, the notes.

    `kernels` and `markers` are store batches (column -> array); `markers` may hold rows that
    start before `since_ns` (a window or range reaching into the view). `axis(bins)` draws
    the time axis line. `duty_cycled`: whether the agent wrote recording windows anywhere in
    the data (None: whether `markers` holds any) — a view zoomed into the gap between two
    windows holds none of them, yet nothing in it was recorded.

    `packing` (the window view, `lane_bins(width)` columns): the strip holds those windows
    side by side; `label(ns)` writes a slice's start time on the axis (e.g. "12.3s").
    """
    st = styles or LaneStyles()
    bins = packing.bins if packing is not None else lane_bins(width)
    scale = Scale(since_ns, until_ns, bins, packing)
    cuts = packing.cuts if packing is not None else None
    out = Text(no_wrap=True, overflow="ellipsis")
    rows: list[tuple[str, str, Style, list[tuple[int, int]]]] = []

    recorded, nvtx_rows = _recorded(markers, duty_cycled, packing, since_ns, until_ns, bins)
    extra_note = ""
    if nvtx_rows is not None and nvtx_rows.any():
        extra_note = _nvtx_lanes(rows, markers, nvtx_rows, scale, bins, cuts, st)

    keys, n_pairs, shown, busy = _kernel_busy(kernels, scale, bins)
    unrec_runs: list[tuple[int, int]] = []
    unrecorded = None
    if recorded is not None:
        # A bin with a kernel was recorded whatever the windows say (the live tail: a window's
        # row is sent when it closes, its kernels may come first).
        unrecorded = (recorded <= 0) & (busy.sum(axis=0) <= 0)
        unrec_runs = _runs(unrecorded)
        with np.errstate(divide="ignore", invalid="ignore"):
            busy = np.where(recorded > 0, np.minimum(1.0, busy / recorded), busy)
    if cuts is not None and len(cuts):
        unrec_runs = [(int(c), int(c) + 1) for c in cuts]  # the cuts are drawn dim too
    for n in range(shown):
        k = int(keys[n])
        name = f"GPU{k >> 40} s{k - ((k >> 40) << 40) - 1}"
        rows.append((name, lane_chars(busy[n], unrecorded, cuts), st.lane, unrec_runs))
    if idle is not None and len(idle["start_ns"]):
        for d in sorted({int(k) >> 40 for k in keys[:shown]}):
            chars = idle_chars(idle, d, since_ns, until_ns, bins, packing)
            if chars.replace(CUT, " ").strip():
                rows.append((f"GPU{d} idle", chars, st.note, []))

    _append_rows(out, rows, st)
    if n_pairs > MAX_LANES:
        out.append(f"\n… {n_pairs - MAX_LANES} more streams", st.note)
    if extra_note:
        out.append("\n" + extra_note, st.note)
    if packing is not None:
        line_axis = packed_axis(packing, label or (lambda t: f"{(t - since_ns) / 1e9:.1f}s"))
    else:
        line_axis = axis(bins)
    out.append("\n" + " " * LABEL_W + line_axis, st.note)
    line = _note_parts(packing, recorded, notes, since_ns, until_ns)
    if line:
        out.append("\n" + " · ".join(line), st.note)
    return out


def _recorded(
    markers: dict[str, np.ndarray] | None,
    duty_cycled: bool | None,
    packing: Packing | None,
    since_ns: int,
    until_ns: int,
    bins: int,
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Recorded time per bin from the agent's "activity on" windows (None: no windows, all
    recorded; in the window view every column but the cuts is recorded time), and which
    marker rows are NVTX ranges (None without markers)."""
    recorded = None
    nvtx_rows = None
    if markers is not None and len(markers["start_ns"]):
        domain, name = markers["domain"], markers["name"]
        own = domain == ACTIVITY_DOMAIN
        win = own & (name == ACTIVITY_NAME)
        if duty_cycled is None:
            duty_cycled = bool(win.any())
        if duty_cycled and packing is None:
            recorded = coverage(
                np.zeros(int(win.sum()), dtype=np.int64), 1,
                markers["start_ns"][win], markers["end_ns"][win], since_ns, until_ns, bins,
            )[0]  # fmt: skip
        nvtx_rows = ~own
    elif duty_cycled and packing is None:
        recorded = np.zeros(bins)
    return recorded, nvtx_rows


def _nvtx_lanes(
    rows: list[tuple[str, str, Style, list[tuple[int, int]]]],
    markers: dict[str, np.ndarray],
    nvtx_rows: np.ndarray,
    scale: Scale,
    bins: int,
    cuts: np.ndarray | None,
    st: LaneStyles,
) -> str:
    """NVTX lanes into `rows`: one per domain (most rows first), shaded where any range
    covers the bin. Returns the note on the domains left out ("" when none were)."""
    doms = markers["domain"][nvtx_rows].astype(str)
    codes, uniq = _factorize(doms)
    order = np.argsort(-np.bincount(codes, minlength=len(uniq)), kind="stable")
    keep = order[:MAX_NVTX_LANES]
    remap = np.full(len(uniq), -1, dtype=np.int64)
    remap[keep] = np.arange(len(keep))
    lane = remap[codes]
    sel = lane >= 0
    s = markers["start_ns"][nvtx_rows][sel].astype(np.int64)
    e = markers["end_ns"][nvtx_rows][sel].astype(np.int64)
    e = np.maximum(e, s + 1)  # an instant marker still marks its bin
    frac = coverage_of(lane[sel], len(keep), scale(s), scale(e), bins)
    for i, d in enumerate(uniq[keep]):
        rows.append((f"nvtx {d}", lane_chars(frac[i], None, cuts), st.nvtx, []))
    if len(uniq) > MAX_NVTX_LANES:
        return f"… {len(uniq) - MAX_NVTX_LANES} more NVTX domains"
    return ""


def _kernel_busy(
    kernels: dict[str, np.ndarray], scale: Scale, bins: int
) -> tuple[np.ndarray, int, int, np.ndarray]:
    """Kernel lanes' busy share per bin: the (device, stream) keys, how many pairs there are,
    how many are shown, and the busy matrix (shown x bins)."""
    # One int64 key per (device, stream); stream + 1 keeps -1 (n/a) >= 0.
    dev = kernels["device"].astype(np.int64)
    stream = kernels["stream"].astype(np.int64, copy=False)
    # Dense keys when the stream ids are a small range (the usual case): the O(n) table path.
    s_lo = int(stream.min()) if len(stream) else 0
    s_span = (int(stream.max()) - s_lo + 1) if len(stream) else 1
    dense = (
        s_span * (int(dev.max()) + 1 if len(dev) else 1) < 1 << 16 and int(dev.min(initial=0)) >= 0
    )
    codes, keys = _factorize(
        dev * s_span + (stream - s_lo) if dense else (dev << 40) + (stream + 1)
    )
    if dense:
        keys = (keys // s_span << 40) + (keys % s_span + s_lo + 1)
    n_pairs = len(keys)
    shown = min(n_pairs, MAX_LANES)
    starts = kernels["start_ns"].astype(np.int64, copy=False)
    ends = kernels["end_ns"].astype(np.int64, copy=False)
    if n_pairs > shown:
        sel = codes < shown
        codes, starts, ends = codes[sel], starts[sel], ends[sel]
    busy = (
        coverage_of(codes, shown, scale(starts), scale(ends), bins)
        if len(starts)
        else np.zeros((shown, bins))
    )
    return keys, n_pairs, shown, busy


def _append_rows(
    out: Text, rows: list[tuple[str, str, Style, list[tuple[int, int]]]], st: LaneStyles
) -> None:
    """Each lane as a label and its characters, its unrecorded runs dimmed."""
    for i, (name, chars, style, runs) in enumerate(rows):
        if i:
            out.append("\n")
        out.append(name.ljust(LABEL_W)[:LABEL_W], st.label)
        at = len(out)
        out.append(chars, style)
        for a, b in runs:
            out.stylize(st.unrecorded, at + a, at + b)


def _note_parts(
    packing: Packing | None,
    recorded: np.ndarray | None,
    notes: str | None,
    since_ns: int,
    until_ns: int,
) -> list[str]:
    """The last line's parts: the window view's note or the share recorded, then `notes`."""
    line = []
    if packing is not None:
        line.append(window_note(packing, (until_ns - since_ns) / 1e9))
    elif recorded is not None:
        share = float(np.clip(recorded, 0, 1).mean())
        line.append(f"{UNRECORDED} not recorded (agent duty cycle: {100 * share:.0f}% recorded)")
    if notes:
        line.append(notes)
    return line
