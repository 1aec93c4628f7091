"""The one clock: nanoseconds on the host's monotonic clock.

Every record kdash stores is stamped on `time.monotonic_ns()`. Captures also keep the offset
to the wall clock, measured once, so a replay on another machine can print real dates and a
Perfetto export can line up with other traces.
"""

from __future__ import annotations

import time


def now_ns() -> int:
    return time.monotonic_ns()


def wall_offset_ns() -> int:
    """`time.time_ns() - time.monotonic_ns()`, sampled tightly (min over a few tries).

    Taking the pair with the smallest gap bounds the error by the gap itself.
    """
    best_gap = None
    best = 0
    for _ in range(5):
        a = time.monotonic_ns()
        w = time.time_ns()
        b = time.monotonic_ns()
        gap = b - a
        if best_gap is None or gap < best_gap:
            best_gap = gap
            best = w - (a + b) // 2
    return best
