"""The store: one bounded ring per table, fed by sources, read by panes and the capture writer.

Bounds are by time (the seconds the UI shows plus the pre-trigger seconds) and by rows (so a
kernel storm cannot grow memory without limit). Rows pushed out by the row bound before they
aged out are counted in `overflowed` and shown, never dropped silently.

Writers append whole batches; readers get a consistent concatenated view. Reads compact the
chunk list in place, so a pane that redraws at 2 Hz pays one concatenation per new batch, not
one per chunk ever received. The compacted chunk is kept sorted by the table's time column
(batches from several agents interleave), so a window read is two binary searches and views
of the columns: with 100,000 kernels a boolean mask over every column took ~10 ms of each
redraw, the whole budget of the kernel timeline.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import numpy as np

from kdash import schema
from kdash.names import demangle_kernels, symbol_rows
from kdash.schema import Batch


@dataclass
class _Ring:
    chunks: list[Batch] = field(default_factory=list)
    rows: int = 0
    overflowed: int = 0
    total: int = 0  # rows ever appended
    sorted: bool = True  # chunks == [one chunk sorted by the time column]


def _read_only(view: np.ndarray) -> np.ndarray:
    """A window is a view into the ring: a reader that wrote into it would change the store."""
    view.flags.writeable = False
    return view


class Store:
    def __init__(self, retention_s: float = 120.0, max_rows: int | dict[str, int] = 2_000_000):
        self.retention_ns = int(retention_s * 1e9)
        self._max_rows = max_rows
        self._rings: dict[str, _Ring] = {t: _Ring() for t in schema.TABLES}
        self._lock = threading.Lock()
        self.latest_ns = 0  # newest time stamp seen in any table
        self._symbols: set[str] = set()  # kernel symbols with a kernel_symbols row

    def max_rows(self, table: str) -> int:
        if isinstance(self._max_rows, dict):
            return self._max_rows.get(table, 2_000_000)
        return self._max_rows

    def append(self, table: str, batch: Batch) -> None:
        n = schema.batch_len(batch)
        if n == 0:
            return
        if table == "kernels":
            batch, done = demangle_kernels(batch)
            new = {m: d for m, d in done.items() if m not in self._symbols}
            if new:
                self._symbols.update(new)
                self.append("kernel_symbols", symbol_rows(new, int(batch["start_ns"].min())))
        tcol = schema.TIME_COLUMN[table]
        newest = int(batch[tcol].max())
        with self._lock:
            ring = self._rings[table]
            ring.chunks.append(batch)
            ring.sorted = False
            ring.rows += n
            ring.total += n
            if newest > self.latest_ns:
                self.latest_ns = newest
            self._trim(table, ring)

    def extend(self, batches: dict[str, Batch]) -> None:
        for table, batch in batches.items():
            self.append(table, batch)

    def _trim(self, table: str, ring: _Ring) -> None:
        tcol = schema.TIME_COLUMN[table]
        cutoff = self.latest_ns - self.retention_ns
        # Age out whole chunks whose newest row is older than the cutoff (not descriptive
        # tables such as line tables: they stay valid; the row bound still applies).
        while (
            table not in schema.STATIC_TABLES
            and ring.chunks
            and ring.chunks[0][tcol].size
            and ring.chunks[0][tcol].max() < cutoff
        ):
            ring.rows -= len(ring.chunks[0][tcol])
            ring.chunks.pop(0)
        if (
            table not in schema.STATIC_TABLES
            and ring.sorted
            and len(ring.chunks) == 1
            and ring.chunks[0][tcol].size
            and ring.chunks[0][tcol][0] < cutoff
        ):  # one sorted chunk: its old rows are a prefix
            first = ring.chunks[0]
            k = int(np.searchsorted(first[tcol], cutoff, side="left"))
            ring.chunks[0] = {c: v[k:] for c, v in first.items()}
            ring.rows -= k
        limit = self.max_rows(table)
        while ring.rows > limit and ring.chunks:
            first = ring.chunks[0]
            n0 = len(first[tcol])
            excess = ring.rows - limit
            if excess >= n0:
                ring.chunks.pop(0)
                ring.rows -= n0
                ring.overflowed += n0
            else:
                ring.chunks[0] = {c: v[excess:] for c, v in first.items()}
                ring.rows -= excess
                ring.overflowed += excess

    def get(self, table: str, since_ns: int | None = None, until_ns: int | None = None) -> Batch:
        """Rows whose time column lies in [since_ns, until_ns]; the whole ring when both None."""
        tcol = schema.TIME_COLUMN[table]
        with self._lock:
            ring = self._rings[table]
            if not ring.sorted and ring.chunks:
                data = schema.concat(table, ring.chunks) if len(ring.chunks) > 1 else ring.chunks[0]
                t = data[tcol]
                if len(t) > 1 and not bool(np.all(t[1:] >= t[:-1])):
                    order = np.argsort(t, kind="stable")
                    data = {c: v[order] for c, v in data.items()}
                ring.chunks = [data]
                ring.sorted = True
                self._trim(table, ring)  # now the rows past the retention are a prefix
            data = ring.chunks[0] if ring.chunks else schema.empty(table)
        if since_ns is None and until_ns is None:
            return data
        t = data[tcol]
        lo = 0 if since_ns is None else int(np.searchsorted(t, since_ns, side="left"))
        hi = len(t) if until_ns is None else int(np.searchsorted(t, until_ns, side="right"))
        return {c: _read_only(v[lo:hi]) for c, v in data.items()}

    def frame(self, table: str, since_ns: int | None = None, until_ns: int | None = None):
        return schema.to_frame(table, self.get(table, since_ns, until_ns))

    def stats(self) -> dict[str, dict[str, int]]:
        with self._lock:
            return {
                t: {"rows": r.rows, "overflowed": r.overflowed, "total": r.total}
                for t, r in self._rings.items()
            }

    def overflowed(self) -> int:
        with self._lock:
            return sum(r.overflowed for r in self._rings.values())
