"""Cumulative histograms (upper bound -> count, as Prometheus keeps them): quantiles, the
observations between two reads, and the `server` table's bucket rows summed over a window.

Pure math on plain mappings. The SGLang metrics collector stores each scrape's bucket deltas as
`<short>_le:<bound>` rows and the server pane sums them back over the shown window; both come
here, so the pane needs no collector.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

BUCKET_TAG = "_le:"  # `ttft_le:0.1` rows: bucket counts between two scrapes


def le_text(le: float) -> str:
    """A bucket bound as the `_le:` rows name it."""
    return "+Inf" if math.isinf(le) else f"{le:g}"


def window_buckets(metrics: Iterable[str], values: Iterable[float], short: str) -> dict:
    """Sum the `<short>_le:<bound>` rows of a span into one cumulative histogram
    (bound -> count) that `bucket_quantile` reads; empty when no request finished."""
    tag = short + BUCKET_TAG
    out: dict[float, float] = {}
    for m, v in zip(metrics, values, strict=True):
        if m.startswith(tag):
            text = m[len(tag) :]
            le = math.inf if text == "+Inf" else float(text)
            out[le] = out.get(le, 0.0) + float(v)
    return out


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus' `histogram_quantile` on cumulative bucket counts (upper bound -> count).

    Linear interpolation inside the bucket that holds the rank; the +Inf bucket answers with
    the largest finite bound. NaN when there are no observations.
    """
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return math.nan
    total = buckets[math.inf]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == math.inf:
                return prev_bound if len(bounds) > 1 else math.nan
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return bounds[-2] if len(bounds) > 1 else math.nan


def bucket_delta(new: Mapping[float, float], old: Mapping[float, float]) -> dict[float, float]:
    """Observations between two scrapes; a counter that went down (restart) starts afresh."""
    if not old or any(new.get(b, 0.0) < c for b, c in old.items()):
        return dict(new)
    return {b: c - old.get(b, 0.0) for b, c in new.items()}
