"""Raw JSON values from Kineto events into numpy columns of the capture's tables.

The reading loop appends values as they come (it is the hot path), one list per column the
field map fills (`kdash.collectors.agent.fields.KINETO`); `RowTable.flush` turns each chunk of
`CHUNK` rows into one numpy batch, times into ns, makes the columns the map derives
(`fields.KINETO_DERIVED`), and stops a table at `kdash.limits.MAX_ROWS` rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kdash import limits, schema
from kdash.names import demangle_kernels
from kdash.schema import Batch

CHUNK = 65_536  # rows per table before a chunk is turned into numpy columns
# |ts| and dur in microseconds beyond this (31 years) are not times: base + ts * 1000 would
# leave int64 nanoseconds
MAX_TIME_US = 1e15


class RowTable:
    """Row lists for one table, turned into numpy batches every CHUNK rows. The lists are
    emptied in place, never replaced, so a reader may hold their `append` methods."""

    def __init__(self, table: str, cols: Sequence[str]) -> None:
        self.table = table
        self.cols = {c: [] for c in cols}
        self.batches: list[Batch] = []
        self.n = 0
        self.total = 0  # rows in self.batches

    def flush(self, base_ns: int, wall_offset_ns: int, pid: int | None) -> None:
        """Turn the row lists into one numpy batch. Values were appended raw (the reading loop
        is the hot path); they are made integers here, column by column, with a per-value
        fallback only for a column that holds something odd (a string pid, a missing field)."""
        if self.n == 0:
            return
        c = self.cols
        # the time columns' lists hold Kineto's µs: start from the base, length
        ts = np.asarray(c["start_ns"], dtype=np.float64)
        durs = c["end_ns"]
        try:
            dur = np.asarray(durs, dtype=np.float64)
        except (TypeError, ValueError):  # a string dur somewhere: 0 for what is not a number
            dur = np.asarray(
                [d if isinstance(d, int | float) else 0.0 for d in durs], dtype=np.float64
            )
        if self.total + self.n > limits.MAX_ROWS:
            raise limits.LimitError(
                f"more than {limits.MAX_ROWS} {self.table} rows (kdash's limit for one table)"
            )
        np.nan_to_num(dur, copy=False, nan=0.0, posinf=0.0, neginf=0.0)
        np.clip(dur, 0.0, MAX_TIME_US, out=dur)
        start = np.rint(ts * 1000.0).astype(np.int64) + (base_ns - wall_offset_ns)
        end = start + np.rint(dur * 1000.0).astype(np.int64)
        types = dict(schema.TABLES[self.table])
        cols: dict[str, Any] = {}
        for k, v in c.items():
            if k in ("start_ns", "end_ns"):
                continue
            cols[k] = v if types[k] == schema.STR else int_column(v, pid if k == "pid" else None)
        if self.table == "kernels":
            # Kineto's one shared-memory figure is static + dynamic, kept in dynamic_smem
            cols["static_smem"] = np.where(cols["dynamic_smem"] >= 0, 0, -1)
        batch = schema.make_batch(self.table, start_ns=start, end_ns=end, **cols)
        if self.table == "kernels":
            batch, _ = demangle_kernels(batch)  # Kineto writes names demangled; some tools do not
        self.batches.append(batch)
        for v in c.values():  # the batch holds copies
            v.clear()
        self.total += self.n
        self.n = 0


def int_column(values: list, fill: int | None) -> np.ndarray:
    """A list of raw JSON values -> int64; None becomes `fill` (or -1), junk becomes -1."""
    try:
        return np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        default = -1 if fill is None else fill
        return np.asarray([default if v is None else json_int(v) for v in values], dtype=np.int64)


_I64 = 2**63


def json_int(v: Any, default: int = -1) -> int:
    """An int64 from a JSON value; `default` for what is not one (out of range included)."""
    if isinstance(v, bool):
        return default
    if isinstance(v, float):
        v = int(v) if -_I64 < v < _I64 else default  # NaN and inf fail the comparison
    elif isinstance(v, str) and 0 < len(v) < 21 and v.lstrip("-").isdigit():
        v = int(v)
    if isinstance(v, int):
        return v if -_I64 <= v < _I64 else default
    return default


def dim3(v: Any) -> tuple[int, int, int]:
    if isinstance(v, list | tuple):
        vals = [json_int(x) for x in v[:3]]
        vals += [-1] * (3 - len(vals))
        return vals[0], vals[1], vals[2]
    return -1, -1, -1
