"""Bounds on what kdash reads, checked before anything is allocated for it.

A small file can ask for a lot: an 80 KB JSON document nested 40,000 deep costs a streaming
parser gigabytes (every event carries its whole prefix path), a 3 MB capture can claim 200 M
rows, a zip member can inflate a thousandfold, and a 300 MB string costs the JSON parser minutes.
Real inputs stay far below these bounds, so crossing one is reported as bad input (exit 2).
"""

from __future__ import annotations

from typing import IO

import numpy as np

from kdash.errors import UserError

MAX_DEPTH = 256  # JSON nesting: Kineto events nest ~6 deep, kdash.json ~5
MAX_STRING_BYTES = 16 << 20  # one JSON string (kernel names are at most a few KB)
MAX_ROWS = 20_000_000  # rows of one table (the headless recorder keeps at most this many)
MAX_MEMBER_BYTES = 1 << 30  # one zip member, inflated
MAX_META_BYTES = 16 << 20  # kdash.json
MAX_PARQUET_BYTES = 4 << 30  # one table's Parquet data, uncompressed (its footer says)


class LimitError(UserError):
    """Input beyond one of the bounds above."""


_QUOTE, _BACKSLASH = 34, 92
_SLICE = 1 << 16
_OPENERS = (91, 123)  # [ {
_CLOSERS = (93, 125)  # ] }


class JsonGuard:
    """Follows JSON bytes chunk by chunk, vectorised, and raises LimitError on nesting deeper
    than `max_depth` or a string longer than `max_string` bytes, before a parser sees them.

    It tracks only what the bounds need (inside a string or not, escapes, depth), so it stays
    cheap (~1 ms per MB); bytes that are not JSON are left for the parser to report.
    """

    def __init__(self, max_depth: int = MAX_DEPTH, max_string: int = MAX_STRING_BYTES) -> None:
        self.max_depth = max_depth
        self.max_string = max_string
        self.depth = 0
        self.in_string = False
        self.string_len = 0  # bytes of the open string so far
        self.backslashes = 0  # backslashes ending the previous chunk (inside a string)
        self.in_string_at_start = False  # of the chunk being fed

    def feed(self, data: bytes) -> None:
        # in slices, so the int64 work arrays stay small (a MB read would need ~25 MB of them)
        view = memoryview(data)
        for i in range(0, len(view), _SLICE):
            self._feed(view[i : i + _SLICE])

    def _feed(self, data: memoryview) -> None:
        n = len(data)
        if n == 0:
            return
        b = np.frombuffer(data, dtype=np.uint8)
        quotes = np.flatnonzero(b == _QUOTE)
        bs = b == _BACKSLASH
        if quotes.size and (self.backslashes or bs.any()):
            quotes = self._unescaped(quotes, bs)
        if bs.any():
            idx = np.arange(n)
            last_plain = int(np.maximum.accumulate(np.where(bs, -1, idx))[-1])
            run = n - 1 - last_plain
            self.backslashes = run + (self.backslashes if last_plain < 0 else 0)
        else:
            self.backslashes = 0
        self._strings(quotes, n)
        brackets = np.flatnonzero(
            (b == _OPENERS[0]) | (b == _OPENERS[1]) | (b == _CLOSERS[0]) | (b == _CLOSERS[1])
        )
        if brackets.size:
            before = np.searchsorted(quotes, brackets)
            outside = ((before + int(self.in_string_at_start)) & 1) == 0
            kept = brackets[outside]
            if kept.size:
                vals = b[kept]
                steps = np.where((vals == _OPENERS[0]) | (vals == _OPENERS[1]), 1, -1)
                levels = self.depth + np.cumsum(steps)
                if int(levels.max()) > self.max_depth:
                    raise LimitError(f"JSON nested deeper than {self.max_depth} levels")
                self.depth = max(0, int(levels[-1]))
        self.in_string = bool((int(self.in_string_at_start) + quotes.size) & 1)

    def _unescaped(self, quotes: np.ndarray, bs: np.ndarray) -> np.ndarray:
        """Quotes not escaped: preceded by an even run of backslashes (counting the previous
        chunk's tail)."""
        idx = np.arange(bs.size)
        last_plain = np.maximum.accumulate(np.where(bs, -1, idx))
        prev = quotes - 1
        run = np.zeros(quotes.size, dtype=np.int64)
        has_prev = prev >= 0
        lp = np.where(has_prev, last_plain[np.maximum(prev, 0)], -1)
        run[has_prev] = prev[has_prev] - lp[has_prev]
        # a run reaching the chunk's start continues the previous chunk's trailing backslashes
        run[lp < 0] += self.backslashes
        return quotes[(run & 1) == 0]

    def _strings(self, quotes: np.ndarray, n: int) -> None:
        """Check string lengths; `quotes` are this chunk's unescaped quote offsets."""
        self.in_string_at_start = self.in_string
        if quotes.size == 0:
            if self.in_string:
                self.string_len += n
                self._check(self.string_len)
            return
        lengths = []
        q = quotes
        if self.in_string:
            lengths.append(self.string_len + int(q[0]))
            q = q[1:]
        # q now starts with an opening quote: pairs (open, close)
        pairs = q.size // 2
        if pairs:
            opens, closes = q[0 : 2 * pairs : 2], q[1 : 2 * pairs : 2]
            lengths.append(int((closes - opens - 1).max()))
        if q.size & 1:  # a string still open at the chunk's end
            self.string_len = n - 1 - int(q[-1])
            lengths.append(self.string_len)
        else:
            self.string_len = 0
        if lengths:
            self._check(max(lengths))

    def _check(self, length: int) -> None:
        if length > self.max_string:
            raise LimitError(f"a JSON string longer than {self.max_string >> 20} MiB")


class GuardedReader:
    """A binary file whose bytes pass through a JsonGuard as they are read."""

    def __init__(self, fh: IO[bytes], guard: JsonGuard | None = None) -> None:
        self._fh = fh
        self.guard = guard or JsonGuard()

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self.guard.feed(data)
        return data

    def close(self) -> None:
        self._fh.close()

    def __enter__(self) -> GuardedReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
