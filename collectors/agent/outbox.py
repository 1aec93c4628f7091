"""What waits for the client: row batches from CUPTI's callbacks and from PC-sampling ranges,
and the windows during which activity was on. Bounded (MAX_PENDING_ROWS: rows beyond it are
counted as dropped), filled from any thread, sent by the session's thread.

Standard library at module level; numpy and wire.py are imported when there is something to send.
"""

from __future__ import annotations

import threading

from .constants import MAX_PENDING_ROWS, PC_WINDOW_NAME, WINDOW_DOMAIN, WINDOW_NAME
from .fields import ROW_COLUMNS
from .loader import wire_module
from .records import ThreadIds, batch_rows

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Batch = dict[str, Any]  # column name -> numpy array (see kdash.schema)

FRAME_ROWS = 200_000  # rows per BATCH frame
RECENT_WINDOWS = 8  # closed windows kept for trimming rows that complete late
TRIMMED = ("kernels", "memcpy")  # GPU intervals whose end a switch-off can falsify


class Outbox:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._lock = threading.Lock()
        self._chunks: list[dict[str, Batch]] = []
        self._rows = 0
        self._windows: list[tuple[int, int]] = []  # on-windows not yet sent (monotonic ns)
        # the last closed windows, with whether a switch-off ended each: rows are trimmed to
        # them at send (trim.py); a few, since a buffer may complete a little late
        self._recent: list[tuple[int, int, bool]] = []
        self.open_since: int | None = None  # start of the window now recording (monotonic ns)
        self.trimmed_rows = 0  # GPU records whose end a window's switch-off cut back
        self.dropped_off_rows = 0  # GPU records that began while activity was off
        self._pc_windows: list[tuple[int, int]] = []
        self._thread_ids = ThreadIds()  # CUPTI's pthread ids -> OS tids, for api/markers rows
        self.dropped_rows = 0
        self.discarded_rows = 0
        self.sent_rows: dict[str, int] = {}
        self.on_ns = 0  # total time CUPTI activity was on, over all sessions
        self.windows_sent = 0

    def sink(self, rows: dict[str, Batch]) -> None:
        """The controller's sink: one buffer's batches (CUPTI's clock)."""
        n = sum(batch_rows(b) for b in rows.values())
        with self._lock:
            if self._rows + n > MAX_PENDING_ROWS:
                self.dropped_rows += n
                return
            self._chunks.append(rows)
            self._rows += n

    def add_pc_range(self, cols: Batch, start_ns: int, end_ns: int) -> None:
        """One PC-sampling range's rows (already on the monotonic clock) and its window."""
        n = batch_rows(cols)
        with self._lock:
            if n:
                self._chunks.append({"pc_samples": cols})
                self._rows += n
            self._pc_windows.append((start_ns, end_ns))

    def add_window(self, start_ns: int, end_ns: int, switched_off: bool = True) -> None:
        """Queue one on-window [start_ns, end_ns] (monotonic) for the client as a markers row;
        `switched_off`: activity went off at its end (not a continuous period's row)."""
        if end_ns <= start_ns:
            return
        with self._lock:
            self._windows.append((start_ns, end_ns))
            self._recent = [
                *self._recent[-(RECENT_WINDOWS - 1) :],
                (start_ns, end_ns, switched_off),
            ]
        self.on_ns += end_ns - start_ns

    def take(self) -> list[dict[str, Batch]]:
        with self._lock:
            out, self._chunks, self._rows = self._chunks, [], 0
        return out

    def discard(self) -> None:
        """The client has gone: rows on their way to it are counted for the next one."""
        self.discarded_rows += sum(batch_rows(b) for ch in self.take() for b in ch.values())
        with self._lock:
            self._windows = []

    def send(
        self,
        send: Callable[[bytes], None],
        strings: Any,
        offset_ns: int,
        open_since: int | None = None,
    ) -> None:
        """Send everything queued: windows first, then rows (CUPTI time + `offset_ns`), GPU
        rows trimmed to their windows (`open_since`: the start of the window recording now)."""
        wire = wire_module()
        self.open_since = open_since

        chunks = self.take()
        with self._lock:
            windows, self._windows = self._windows, []
            pc_windows, self._pc_windows = self._pc_windows, []
        if windows:
            self._send_windows(send, strings, windows)
        if pc_windows:
            self._send_windows(send, strings, pc_windows, PC_WINDOW_NAME)
        if not chunks:
            return
        import numpy as np

        for table in ROW_COLUMNS:
            parts = [ch[table] for ch in chunks if table in ch]
            if not parts:
                continue
            cols = {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
            cols["start_ns"] = cols["start_ns"] + offset_ns
            cols["end_ns"] = cols["end_ns"] + offset_ns
            if table in TRIMMED:
                cols = self._trim(cols)
            if "tid" in cols:
                cols["tid"] = self._thread_ids.translate(cols["tid"])
            self._send_table(send, strings, wire, table, cols, len(cols["start_ns"]))
        pcs = [ch["pc_samples"] for ch in chunks if "pc_samples" in ch]
        if pcs:  # already on the monotonic clock (t_ns taken at the range's end)
            cols = {c: np.concatenate([p[c] for p in pcs]) for c in pcs[0]}
            self._send_table(send, strings, wire, "pc_samples", cols, len(cols["t_ns"]))

    def _trim(self, cols: Batch) -> Batch:
        """Cut back ends past the end of their window; drop rows that began while off."""
        from .trim import trim_to_windows

        with self._lock:
            recent, open_since = list(self._recent), self.open_since
        lanes = (cols["device"], cols["stream"]) if "stream" in cols and "device" in cols else None
        keep, end, clipped, dropped = trim_to_windows(
            cols["start_ns"], cols["end_ns"], recent, open_since, lanes
        )
        self.trimmed_rows += clipped
        self.dropped_off_rows += dropped
        cols["end_ns"] = end
        if dropped:
            cols = {c: v[keep] for c, v in cols.items()}
        return cols

    def _send_table(
        self, send: Callable[[bytes], None], strings: Any, wire: Any, table: str, cols: dict, n: int
    ) -> None:
        for i in range(0, n, FRAME_ROWS):
            part = {c: v[i : i + FRAME_ROWS] for c, v in cols.items()}
            send(wire.encode_batch(table, part, strings))
        self.sent_rows[table] = self.sent_rows.get(table, 0) + n

    def _send_windows(
        self,
        send: Callable[[bytes], None],
        strings: Any,
        windows: list[tuple[int, int]],
        name: str = WINDOW_NAME,
    ) -> None:
        """On-windows as markers rows (domain "kdash", name "activity on", tid -1): the
        timeline marks the gaps between them as "not recorded", not as "GPU idle"."""
        import numpy as np

        wire = wire_module()
        n = len(windows)
        batch = {
            "start_ns": np.array([w[0] for w in windows], dtype=np.int64),
            "end_ns": np.array([w[1] for w in windows], dtype=np.int64),
            "name": np.full(n, name, dtype=object),
            "domain": np.full(n, WINDOW_DOMAIN, dtype=object),
            "pid": np.full(n, self.pid, dtype=np.int64),
            "tid": np.full(n, -1, dtype=np.int64),
        }
        send(wire.encode_batch("markers", batch, strings))
        if name == WINDOW_NAME:
            self.windows_sent += n
        self.sent_rows["markers"] = self.sent_rows.get("markers", 0) + n
