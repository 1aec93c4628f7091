"""Time-binned text sparklines and bands that share one time axis.

Why not Textual's `Sparkline` widget: it spreads whatever samples it gets over its width, so
two sparklines with different sample rates (or a gap where a source stalled) would not line up
with each other, with the throttle band, or with the kernel lanes. Here every series is binned
into the same `width` bins over the same [since, until] window first, so column i means the
same time span in every row of every pane; an empty bin stays blank (no invented data).
"""

from __future__ import annotations

import numpy as np

BLOCKS = "▁▂▃▄▅▆▇█"
SHADES = " ░▒▓█"


def bin_index(t_ns: np.ndarray, since_ns: int, until_ns: int, width: int) -> np.ndarray:
    """Bin number (0..width-1) of each time stamp; -1 outside the window."""
    span = max(1, until_ns - since_ns)
    idx = ((t_ns.astype(np.int64) - since_ns) * width // span).astype(np.int64)
    idx[(t_ns < since_ns) | (t_ns > until_ns)] = -1
    idx[idx == width] = width - 1
    return idx


def hold_bins(t_ns: np.ndarray, since_ns: int, until_ns: int, width: int) -> int:
    """How many empty bins after a sample still show that sample: up to two sample periods.

    When bins are narrower than the poll period (a 12 s window over 70 columns at 4 Hz),
    most bins hold no sample; holding the last value across them draws a continuous line, as
    a step chart would. A gap longer than two periods (a stalled source) stays blank.
    """
    if len(t_ns) < 2 or width <= 0:
        return 0
    period = float(np.median(np.diff(np.sort(t_ns.astype(np.int64)))))
    bin_ns = max(1.0, (until_ns - since_ns) / width)
    return int(np.ceil(2 * period / bin_ns))


def _hold(out: np.ndarray, have: np.ndarray, hold: int) -> None:
    """Forward-fill `out` in place into at most `hold` empty bins after each filled one."""
    last, since_last = -1, 0
    for i in range(len(out)):
        if have[i]:
            last, since_last = i, 0
        elif last >= 0:
            since_last += 1
            if since_last <= hold:
                out[i] = out[last]


def bin_mean(
    t_ns: np.ndarray, values: np.ndarray, since_ns: int, until_ns: int, width: int
) -> np.ndarray:
    """Mean of the finite values in each bin, held across short gaps (see `hold_bins`);
    NaN where there is no sample."""
    out = np.full(width, np.nan)
    if width <= 0 or len(t_ns) == 0:
        return out
    v = values.astype(np.float64)
    idx = bin_index(t_ns, since_ns, until_ns, width)
    ok = (idx >= 0) & np.isfinite(v) & (v >= 0)
    if not ok.any():
        return out
    sums = np.bincount(idx[ok], weights=v[ok], minlength=width)
    counts = np.bincount(idx[ok], minlength=width)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    _hold(out, counts > 0, hold_bins(t_ns, since_ns, until_ns, width))
    return out


def bin_or(t_ns: np.ndarray, bits: np.ndarray, since_ns: int, until_ns: int, width: int):
    """Bitwise OR of the (non-negative) bit masks in each bin; -1 where a bin has no sample."""
    out = np.full(width, -1, dtype=np.int64)
    if width <= 0 or len(t_ns) == 0:
        return out
    idx = bin_index(t_ns, since_ns, until_ns, width)
    b = bits.astype(np.int64)
    for i, v in zip(idx, b, strict=True):
        if i < 0 or v < 0:
            continue
        out[i] = v if out[i] < 0 else (out[i] | v)
    _hold(out, out >= 0, hold_bins(t_ns, since_ns, until_ns, width))
    return out


def spark(values: np.ndarray, lo: float, hi: float) -> str:
    """One block character per bin, scaled to [lo, hi]; a space for an empty bin."""
    if hi <= lo:
        hi = lo + 1.0
    chars = []
    top = len(BLOCKS) - 1
    for v in values:
        if not np.isfinite(v):
            chars.append(" ")
            continue
        f = min(1.0, max(0.0, (float(v) - lo) / (hi - lo)))
        chars.append(BLOCKS[round(f * top)])
    return "".join(chars)


def shade(fractions: np.ndarray) -> str:
    """Busy fraction per bin (0..1) as a shade character; a space for 0 or no data."""
    top = len(SHADES) - 1
    out = []
    for f in fractions:
        if not np.isfinite(f) or f <= 0:
            out.append(" ")
        else:
            out.append(SHADES[max(1, min(top, int(np.ceil(f * top))))])
    return "".join(out)


def busy_fraction(
    starts: np.ndarray, ends: np.ndarray, since_ns: int, until_ns: int, width: int
) -> np.ndarray:
    """Share of each bin covered by [start, end) intervals (overlaps counted once per bin up
    to 1.0). Vectorised over intervals via a difference array, so 100k kernels stay cheap."""
    out = np.zeros(width)
    if width <= 0 or len(starts) == 0:
        return out
    span = max(1, until_ns - since_ns)
    s = np.clip(starts.astype(np.float64), since_ns, until_ns)
    e = np.clip(ends.astype(np.float64), since_ns, until_ns)
    keep = e > s
    if not keep.any():
        return out
    # Position in bin units; accumulate covered length per bin with a prefix-sum trick.
    ps = (s[keep] - since_ns) * width / span
    pe = (e[keep] - since_ns) * width / span
    grid = np.arange(width + 1, dtype=np.float64)
    # covered(x) = sum over intervals of clamp(x - ps, 0, pe - ps): evaluate at bin edges.
    order_s = np.sort(ps)
    order_e = np.sort(pe)
    cs = np.concatenate([[0.0], np.cumsum(order_s)])
    ce = np.concatenate([[0.0], np.cumsum(order_e)])
    ns = np.searchsorted(order_s, grid, side="right")
    ne = np.searchsorted(order_e, grid, side="right")
    covered_s = grid * ns - cs[ns]
    covered_e = grid * ne - ce[ne]
    covered = covered_s - covered_e
    return np.clip(np.diff(covered), 0.0, 1.0)


def fmt(v: float, spec: str = ".0f", unit: str = "") -> str:
    """A number for the screen; NaN, None and negative sentinels read "n/a"."""
    if v is None:
        return "n/a"
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "n/a"
    if not np.isfinite(f) or f < 0:
        return "n/a"
    return f"{f:{spec}}{unit}"
