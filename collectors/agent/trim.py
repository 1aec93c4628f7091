"""GPU records cut by the end of a recording window: what their timestamps can be trusted for.

Seen on the H200 (CUDA 13.0's CUPTI, tests/data/h200-demo-duty-untrimmed.kdash, the demo's
graph-replayed decode at the default duty cycle): when kernel activity is switched off while a
CUDA graph's kernels are still queued or running, CUPTI stamps their end at about the moment of
the switch (a 2-µs kernel then lasts 1.4 ms), and kernels that start after it are still
recorded, with their end stamped when activity is next switched on (1.3 s later). Kept as they
are, 188 of 112k records made an `rsqrt` of 1.5 µs at p99 average 225 µs and "run" longer than
all the recorded time together.

So, per record: inside a window that a switch-off ended, an end past the window's end is cut
back to it (the kernel ran at least until then; what came after was not recorded); a record
that starts in the off time after such a window is dropped. Kernels of one stream run one after
another, so near a switch-off (the last EDGE_NS of the window) a kernel's end is also cut back
to the start of the next kernel on its stream (`lanes`): in the same demo, 137 records that
ended at the switch-off overlapped their successors by 161 ms in all. Windows that ended without a
switch-off (continuous recording cuts one row per period) never cut. Records before the oldest
window known are kept (nothing is known about them).

Standard library only at module level (the agent's rule); numpy arrives with the rows.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

Window = tuple[int, int, bool]  # start_ns, end_ns (monotonic), ended by a switch-off
EDGE_NS = 50_000_000  # how close to a switch-off an end may be falsified (26.7 ms seen)


def trim_to_windows(
    start: Any,
    end: Any,
    windows: list[Window],
    open_since: int | None,
    lanes: tuple[Any, Any] | None = None,
) -> tuple[Any, Any, int, int]:
    """(keep mask, end times with cut records clipped, records clipped, records dropped).

    `start`/`end`: numpy int64 arrays on the windows' clock; `windows`: the closed windows
    known, any order; `open_since`: the start of the window now recording, or None; `lanes`:
    the rows' (device, stream) arrays, for kernels (one stream runs one kernel at a time).
    """
    import numpy as np

    n = len(start)
    keep = np.ones(n, dtype=bool)
    if n == 0 or not windows:
        return keep, end, 0, 0
    ws = sorted(windows)
    starts = np.array([w[0] for w in ws], dtype=np.int64)
    ends = np.array([w[1] for w in ws], dtype=np.int64)
    cut = np.array([w[2] for w in ws], dtype=bool)
    # the next window's start after each window (or when recording opened again)
    nxt = np.append(starts[1:], open_since if open_since is not None else np.iinfo(np.int64).max)
    i = np.searchsorted(starts, start, side="right") - 1
    known = i >= 0
    j = np.where(known, i, 0)
    inside = known & (start <= ends[j])
    clip = inside & cut[j] & (end > ends[j])
    off = known & ~inside & cut[j] & (start < nxt[j])
    new_end = np.where(clip, ends[j], end)
    keep &= ~off
    if lanes is not None:
        near = inside & cut[j] & (new_end >= ends[j] - EDGE_NS)
        capped = _cap_at_next_on_stream(start, new_end, lanes[0], lanes[1], near & keep)
        clip |= capped != new_end
        new_end = capped
    return keep, new_end, int(clip.sum()), int(off.sum())


def _cap_at_next_on_stream(start: Any, end: Any, device: Any, stream: Any, mask: Any) -> Any:
    """`end`, with each masked row's end cut back to the next row's start on its (device,
    stream), where it ran past it."""
    import numpy as np

    out = np.array(end, dtype=np.int64, copy=True)
    if not mask.any():
        return out
    o = np.lexsort((start, stream, device))
    s, e, d, st, m = start[o], out[o], device[o], stream[o], mask[o]
    nxt = np.full(len(s), np.iinfo(np.int64).max, dtype=np.int64)
    same = (d[1:] == d[:-1]) & (st[1:] == st[:-1])
    nxt[:-1] = np.where(same, s[1:], nxt[:-1])
    cut = m & (e > nxt)
    e = np.where(cut, np.maximum(nxt, s), e)
    out[o] = e
    return out
