"""Kineto's launch flows, bound to the rows they join.

Kineto draws an arrow (a flow: ph "s" at the launch call, ph "f" with bp "e" at the kernel or
copy, one id each) from every CUDA call to the GPU work it started, and gives both events the
same `correlation` arg. The import binds each flow's two ends to the rows that start where it
does (same process or device, thread or stream, and nanosecond), so a row whose `correlation`
arg is missing gets its id from the flow, and the trace's metadata counts the flows that tied a
kept call to kept GPU work (`flows` per trace: what the Perfetto export's arrows and the
launch-latency analysis follow).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kdash import limits
from kdash.kineto_columns import CHUNK, MAX_TIME_US, json_int
from kdash.schema import Batch

LAUNCH_FLOW = "ac2g"  # Kineto's flow category from a CUDA call to its kernel or copy


class LaunchFlows:
    """The launch flows' ends of one trace, as compact columns (8 bytes a field, not a dict
    per event): a trace has one per CUDA call that started GPU work."""

    def __init__(self) -> None:
        self.start = array("b")  # 1: ph "s", 0: ph "f"
        self.pid = array("q")
        self.tid = array("q")
        self.ts = array("d")
        self.id = array("q")

    def add(self, ev: dict[str, Any]) -> bool:
        """Keep a flow end; False when it is not one kdash can bind (no id, no time)."""
        fid, ts = json_int(ev.get("id")), ev.get("ts")
        if fid < 0 or not isinstance(ts, int | float) or isinstance(ts, bool):
            return False
        if not -MAX_TIME_US < ts < MAX_TIME_US:
            return False
        if len(self.id) % CHUNK == 0:  # as often as a table checks its rows
            self.check()
        self.start.append(1 if ev.get("ph") == "s" else 0)
        self.pid.append(json_int(ev.get("pid")))
        self.tid.append(json_int(ev.get("tid")))
        self.ts.append(float(ts))
        self.id.append(fid)
        return True

    def check(self) -> None:
        """LimitError past two flow events (start, end) per row a table may hold."""
        if len(self.id) > 2 * limits.MAX_ROWS:
            raise limits.LimitError(f"more than {2 * limits.MAX_ROWS} flow events")

    def ends(self, start: bool, base_ns: int, wall_offset_ns: int) -> dict[str, np.ndarray]:
        """id, pid, tid and t (ns, as `RowTable.flush` computes row times, so an end and its
        row agree to the nanosecond) of the starts or of the ends, the first per id."""
        sel = np.frombuffer(self.start, dtype=np.int8) == (1 if start else 0)
        ids = np.frombuffer(self.id, dtype=np.int64)[sel]
        _, first = np.unique(ids, return_index=True)
        first.sort()
        ts = np.frombuffer(self.ts, dtype=np.float64)[sel][first]
        return {
            "id": ids[first],
            "pid": np.frombuffer(self.pid, dtype=np.int64)[sel][first],
            "tid": np.frombuffer(self.tid, dtype=np.int64)[sel][first],
            "t": np.rint(ts * 1000.0).astype(np.int64) + (base_ns - wall_offset_ns),
        }


def _cat_rows(batches: list[Batch], cols: Sequence[str]) -> dict[str, np.ndarray]:
    return {c: np.concatenate([b[c] for b in batches]).astype(np.int64) for c in cols}


def _set_rows(batches: list[Batch], col: str, rows: np.ndarray, values: np.ndarray) -> None:
    """Write `values` at the rows (numbered across `batches`, in order) of column `col`."""
    lo = 0
    for b in batches:
        n = len(b[col])
        sel = (rows >= lo) & (rows < lo + n)
        if sel.any():
            b[col][rows[sel] - lo] = values[sel]
        lo += n


def _find(keys: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Per row of `keys` (n x 3 ints), the index of the first equal row of `rows`, or -1."""
    if not len(keys) or not len(rows):
        return np.full(len(keys), -1, dtype=np.int64)
    _, codes = np.unique(np.concatenate([rows, keys]), axis=0, return_inverse=True)
    codes = codes.reshape(-1)
    n = len(rows)
    uniq, lowest = np.unique(codes[:n], return_index=True)
    first = np.full(int(codes.max()) + 1, -1, dtype=np.int64)
    first[uniq] = lowest
    return first[codes[n:]]


def link_flows(
    flows: LaunchFlows,
    api: list[Batch],
    gpu: dict[str, list[Batch]],
    base_ns: int,
    wall_offset_ns: int,
) -> dict[str, int]:
    """Bind each launch flow to the API call it starts on and the kernel or copy it ends on
    (same pid and tid, or device and stream, and start ns), fill missing correlation ids from
    it, and count. `api` and `gpu` ("kernels", "memcpy") are this trace's batches, changed in
    place."""
    n_start = int(np.count_nonzero(np.frombuffer(flows.start, dtype=np.int8)))
    out = {"starts": n_start, "ends": len(flows.id) - n_start, "pairs": 0}
    out.update(linked=0, filled=0, disagree=0)
    if not n_start or n_start == len(flows.id):
        return out
    s = flows.ends(True, base_ns, wall_offset_ns)
    f = flows.ends(False, base_ns, wall_offset_ns)
    # flow ids with both ends: the i-th start and the fi-th end
    order = np.argsort(f["id"], kind="stable")
    at = np.searchsorted(f["id"], s["id"], sorter=order).clip(0, max(len(order) - 1, 0))
    fi = order[at]
    both = f["id"][fi] == s["id"]
    out["pairs"] = int(both.sum())
    si, fi = np.flatnonzero(both), fi[both]
    if not len(si) or not api:
        return out
    a = _cat_rows(api, ("pid", "tid", "start_ns", "correlation_id"))
    call = _find(
        np.column_stack([s["pid"][si], s["tid"][si], s["t"][si]]),
        np.column_stack([a["pid"], a["tid"], a["start_ns"]]),
    )
    # GPU rows of every table in one numbering: table index, row in table
    keys, table_of, row_of, corr_of = [], [], [], []
    for ti, batches in enumerate(gpu.values()):
        if not batches:
            continue
        g = _cat_rows(batches, ("device", "stream", "start_ns", "correlation_id"))
        keys.append(np.column_stack([g["device"], g["stream"], g["start_ns"]]))
        table_of.append(np.full(len(g["start_ns"]), ti))
        row_of.append(np.arange(len(g["start_ns"])))
        corr_of.append(g["correlation_id"])
    if not keys:
        return out
    work = _find(np.column_stack([f["pid"][fi], f["tid"][fi], f["t"][fi]]), np.concatenate(keys))
    ok = (call >= 0) & (work >= 0)
    out["linked"] = int(ok.sum())
    if not ok.any():
        return out
    call, work, fid = call[ok], work[ok], s["id"][si][ok]
    api_c = a["correlation_id"][call]
    gpu_c = np.concatenate(corr_of)[work]
    out["disagree"] = int(((api_c >= 0) & (gpu_c >= 0) & (api_c != gpu_c)).sum())
    # The id both ends get: the call's, else the GPU row's, else the flow's own (Kineto's flow
    # ids are its correlation ids).
    corr = np.where(api_c >= 0, api_c, np.where(gpu_c >= 0, gpu_c, fid))
    fix_api, fix_gpu = api_c < 0, gpu_c < 0
    if fix_api.any():
        _set_rows(api, "correlation_id", call[fix_api], corr[fix_api])
    tables, rows = np.concatenate(table_of)[work], np.concatenate(row_of)[work]
    for ti, batches in enumerate(gpu.values()):
        sel = fix_gpu & (tables == ti)
        if sel.any():
            _set_rows(batches, "correlation_id", rows[sel], corr[sel])
    out["filled"] = int(fix_api.sum() + fix_gpu.sum())
    return out
