"""CUPTI activity records -> per-table column batches, by the one field map in fields.py.

Two decoders read the same map: `convert` takes cupti-python's record objects attribute by
attribute (the fallback), `_columns` gathers every field of a buffer with numpy (buffers.py).
Standard library at module level; numpy is imported when records first arrive.
"""

from __future__ import annotations

import threading
import time
from operator import attrgetter

from .buffers import BufferReader, LayoutMismatch, c_strings
from .constants import MARKER_END, MARKER_START, MAX_OPEN_MARKERS
from .fields import (
    API_NAME,
    AS_IS,
    C_STRING,
    CONSTANTS,
    COPY_KIND_NAMES,
    COPY_NAME,
    RECORD_DTYPES,
    RECORDS,
    ROW_COLUMNS,
    SYNC_NAME,
    ZERO_IS_NA,
    ZERO_IS_PID,
)
from .loader import schema_module

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from typing import Any

    Batch = dict[str, Any]  # column name -> numpy array (see kdash.schema)


def batch_rows(batch: Batch) -> int:
    for v in batch.values():
        return len(v)
    return 0


def default_of(column: str, pid: int) -> Any:
    """What a column that a record kind has no field for holds: our pid, or -1 (n/a)."""
    return pid if column == "pid" else -1


class _ObjectPlan:
    """How the attribute decoder makes one table row of a record kind (from fields.RECORDS):
    one attrgetter for its fields, where each goes in the row, the row's other columns, and
    the fields whose value needs making (`fixes`: row position, function)."""

    __slots__ = ("direct", "fixes", "get", "positions", "table", "template")

    def __init__(self, table: str, fields: tuple, constants: dict, pid: int, fixer) -> None:
        cols = ROW_COLUMNS[table]
        self.table = table
        self.get = attrgetter(*(attr for _c, attr, _h in fields))
        self.positions = tuple(cols.index(c) for c, _a, _h in fields)
        self.direct = self.positions == tuple(range(len(cols)))  # the fields are the row
        self.template = [constants.get(c, default_of(c, pid)) for c in cols]
        self.fixes = tuple(
            (cols.index(c), fixer(how)) for c, _a, how in fields if how not in (AS_IS, C_STRING)
        )


class RecordConverter:
    """Turns CUPTI activity records into per-table columns: cupti-python's record objects
    (`convert`, `batches`) or a raw buffer (`batches_raw`).

    `convert` runs inside CUPTI's buffer-completed callback, so it only copies the fields the
    schema wants into tuples; numpy arrays, the clock offset and string ids are made later on
    the agent's own thread. Kernel, copy, API and marker names come out as Python strings.
    NVTX ranges arrive as separate START and END marker records, which are paired here by id
    (the open ones are bounded, the overflow counted).
    """

    def __init__(self, cupti_mod: Any, pid: int) -> None:
        ak = cupti_mod.ActivityKind
        self.cupti = cupti_mod
        self.pid = pid
        self.k_driver = int(ak.DRIVER)
        self.k_kernel = {int(ak.CONCURRENT_KERNEL), int(ak.KERNEL)}
        self.k_marker = int(ak.MARKER)
        self._plans: dict[int, _ObjectPlan] = {}
        for table, kinds, fields in RECORDS:
            for kname in kinds:
                kind = getattr(ak, kname, None)
                if kind is not None:
                    self._plans[int(kind)] = _ObjectPlan(
                        table, fields, CONSTANTS.get(kname, {}), pid, self._fixer(int(kind))
                    )
        self._api_names: dict[tuple[int, int], str] = {}
        self._copy_names: dict[int, str] = {}
        self._sync_names: dict[int, str] = {}
        self._open_markers: dict[int, tuple[int, str, str, int]] = {}
        self._types: dict[str, dict[str, str]] = {}
        self.markers_overflowed = 0
        self.other_records = 0
        self.fast_note = ""
        self._verified = False
        self.bad_time_records = 0  # kernel records dropped for impossible times (see batches_raw)
        self._kind_ints = {
            n: int(getattr(ak, n)) for n in RECORD_DTYPES if getattr(ak, n, None) is not None
        }
        try:
            self.reader: BufferReader | None = BufferReader(cupti_mod, self._kind_ints)
        except LayoutMismatch as e:
            self.reader = None
            self.fast_note = f"reading records attribute by attribute (slower): {e}"

    def _api_name(self, kind: int, cbid: int) -> str:
        key = (kind, cbid)
        name = self._api_names.get(key)
        if name is None:
            dom = self.cupti.CallbackDomain
            domain = dom.DRIVER_API if kind == self.k_driver else dom.RUNTIME_API
            try:
                name = str(self.cupti.get_callback_name(domain, cbid))
            except Exception as e:  # noqa: BLE001 - an unnamed API still gets a row
                name = f"cbid {cbid} ({type(e).__name__})"
            self._api_names[key] = name
        return name

    def _copy_name(self, copy_kind: int) -> str:
        name = self._copy_names.get(copy_kind)
        if name is None:
            try:
                raw = self.cupti.ActivityMemcpyKind(copy_kind).name
            except (ValueError, AttributeError):
                raw = f"kind{copy_kind}"
            name = COPY_KIND_NAMES.get(raw, raw)
            self._copy_names[copy_kind] = name
        return name

    def _sync_name(self, t: int) -> str:
        name = self._sync_names.get(t)
        if name is None:
            try:
                name = "sync:" + self.cupti.ActivitySynchronizationType(t).name.lower()
            except (ValueError, AttributeError):
                name = f"sync:{t}"
            self._sync_names[t] = name
        return name

    def _name(self, how: str, kind: int, value: Any) -> Any:
        """One field's value in the attribute decoder, made as fields.py says."""
        if how == API_NAME:
            return self._api_name(kind, value)
        if how == COPY_NAME:
            return self._copy_name(value)
        if how == SYNC_NAME:
            return self._sync_name(value)
        if how == ZERO_IS_NA:
            return value or -1
        if how == ZERO_IS_PID:
            return value or self.pid
        return value  # AS_IS, and C_STRING (cupti-python has made it a str)

    def _fixer(self, kind: int):
        """For one record kind: how -> the function that makes a field's value (attribute
        decoder; cupti-python has already made C strings Python strings)."""

        pid, api_name = self.pid, self._api_name

        def fixer(how: str):
            if how == API_NAME:
                return lambda v: api_name(kind, v)
            if how == ZERO_IS_NA:
                return lambda v: v or -1
            if how == ZERO_IS_PID:
                return lambda v: v or pid
            return lambda v: self._name(how, kind, v)

        return fixer

    def convert(self, activities: list[Any]) -> dict[str, list[tuple]]:
        """Rows per table as tuples in the order of `ROW_COLUMNS` (timestamps still CUPTI's)."""
        out: dict[str, list[tuple]] = {t: [] for t in ROW_COLUMNS}
        plans = self._plans
        for a in activities:
            k = a.kind
            plan = plans.get(k)
            if plan is None:
                if k == self.k_marker:
                    self._marker(a, out["markers"])
                else:
                    self.other_records += 1
                continue
            vals = plan.get(a)
            if plan.direct:
                row = list(vals)
            else:
                row = list(plan.template)
                for pos, v in zip(plan.positions, vals, strict=True):
                    row[pos] = v
            for pos, fn in plan.fixes:
                row[pos] = fn(row[pos])
            out[plan.table].append(tuple(row))
        return out

    def batches(self, activities: list[Any]) -> dict[str, dict[str, Any]]:
        """Per-table column batches (CUPTI timestamps) of one buffer: fast path, else slow."""
        if not activities:
            return {}
        if self.reader is not None:
            try:
                out = self._fast(activities)
                if not self._verified and "kernels" in out:
                    self._verify(activities, out["kernels"])
                return out
            except LayoutMismatch as e:
                self.reader = None
                self.fast_note = f"reading records attribute by attribute (slower): {e}"
        rows = self.convert(activities)
        return {t: rows_to_batch(t, r, 0, self.pid) for t, r in rows.items() if r}

    def _verify(self, activities: list[Any], kernels: dict[str, Any]) -> None:
        """Compare the first gathered kernel rows with cupti-python's own attributes, once."""
        objs = [a for a in activities[:64] if int(a.kind) in self.k_kernel][:3]
        for i, a in enumerate(objs):
            want = (int(a.start), int(a.end), int(a.correlation_id), str(a.name), int(a.grid_x))
            got = (
                int(kernels["start_ns"][i]),
                int(kernels["end_ns"][i]),
                int(kernels["correlation_id"][i]),
                str(kernels["name"][i]),
                int(kernels["grid_x"][i]),
            )
            if want != got:
                raise LayoutMismatch(f"buffer read {got} but cupti-python says {want}")
        if objs:
            self._verified = True

    def _fast(self, activities: list[Any]) -> dict[str, dict[str, Any]]:
        r = self.reader
        assert r is not None
        views, kinds, offs, _span = r.walk(activities)
        return self._columns(views, kinds, offs, activities)

    def batches_raw(self, addr: int, valid: int) -> dict[str, dict[str, Any]]:
        """Per-table batches from a raw CUPTI buffer (our own buffer callback, see RawBuffers).

        Kernel rows with impossible times (end before start, or more than an hour from CUPTI's
        clock now) are dropped and counted in `bad_time_records`: CUPTI writes a few of them
        for kernels replayed from CUDA graphs (198 of 17,640 in a decode step on the H200), so
        they say nothing about the layout. A first buffer where most rows are impossible does:
        that raises LayoutMismatch. (Falling back to cupti-python's record objects on the
        strength of a few such rows once cost a graph-replayed decode loop 98% of its speed.)
        """
        r = self.reader
        if r is None:
            raise LayoutMismatch(self.fast_note or "no record layouts")
        views, kinds, offs, _span = r.walk_span(addr, valid)
        out = self._columns(views, kinds, offs, None)
        k = out.get("kernels")
        if k is not None:
            now = int(self.cupti.get_timestamp())
            hour = 3600 * 10**9
            sane = (k["end_ns"] >= k["start_ns"]) & (abs(k["start_ns"] - now) < hour)
            n_bad = int(sane.size - sane.sum())
            if not self._verified:
                if n_bad * 2 > sane.size:
                    raise LayoutMismatch(
                        f"{n_bad} of {sane.size} kernel records have impossible times"
                    )
                self._verified = True
            if n_bad:
                self.bad_time_records += n_bad
                out["kernels"] = {c: v[sane] for c, v in k.items()}
        return out

    def _column_types(self, table: str) -> dict[str, str]:
        types = self._types.get(table)
        if types is None:
            types = self._types[table] = dict(schema_module().TABLES[table])
        return types

    def _gather(
        self, views: dict, o: Any, dt: Any, kind: int, field: tuple[str, str, str], dtype: str
    ) -> Any:
        """One column of the records at offsets `o`, made from its field as fields.py says."""
        r = self.reader
        assert r is not None
        np = r.np
        _col, attr, how = field
        v = r.field(views, o, dt, attr)
        if how == C_STRING:
            return c_strings(v)
        if how in (API_NAME, SYNC_NAME, COPY_NAME):
            uniq, inv = np.unique(v, return_inverse=True)
            names = [self._name(how, kind, int(u)) for u in uniq]
            return np.array(names, dtype=object)[inv]
        if how in (ZERO_IS_NA, ZERO_IS_PID):
            v = v.astype(np.int64)
            v[v == 0] = -1 if how == ZERO_IS_NA else self.pid
        return v.astype(dtype)

    def _group(self, views: dict, kinds: Any, offs: Any, counts: Any, entry: tuple) -> dict | None:
        """The columns of one fields.RECORDS entry's records in a buffer, or None if none."""
        r = self.reader
        assert r is not None
        np = r.np
        table, knames, fields = entry
        present = [self._kind_ints[n] for n in knames if n in self._kind_ints]
        present = [k for k in present if 0 <= k < 256 and counts[k]]
        if not present:
            return None
        mask = kinds == present[0]
        for k in present[1:]:
            mask |= kinds == k
        o = offs[mask]
        dt = r.dtypes[self._kind_ints[knames[0]]]
        types = self._column_types(table)
        cols = {f[0]: self._gather(views, o, dt, present[0], f, types[f[0]]) for f in fields}
        const = CONSTANTS.get(knames[0], {})
        for c, code in types.items():
            if c not in cols:
                v = const.get(c, default_of(c, self.pid))
                cols[c] = np.full(o.size, v, dtype=object if isinstance(v, str) else code)
        return cols

    def _columns(
        self, views: dict, kinds: Any, offs: Any, activities: list[Any] | None
    ) -> dict[str, dict[str, Any]]:
        r = self.reader
        assert r is not None
        np = r.np
        counts = np.bincount(kinds[(kinds >= 0) & (kinds < 256)], minlength=256)
        parts: dict[str, list[dict]] = {}
        for entry in RECORDS:
            cols = self._group(views, kinds, offs, counts, entry)
            if cols is not None:
                parts.setdefault(entry[0], []).append(cols)
        out: dict[str, dict[str, Any]] = {}
        for table, ps in parts.items():
            out[table] = (
                ps[0] if len(ps) == 1 else {c: np.concatenate([p[c] for p in ps]) for c in ps[0]}
            )
        if "MARKER" in self._kind_ints:
            idx = np.flatnonzero(kinds == self._kind_ints["MARKER"])
            if idx.size:  # rare; START/END paired by id, one record at a time
                rows: list[tuple] = []
                if activities is not None:
                    for i in idx.tolist():
                        self._marker(activities[i], rows)
                else:
                    for rec in self._marker_records(views, offs[idx]):
                        self._marker(rec, rows)
                if rows:
                    out["markers"] = rows_to_batch("markers", rows, 0, self.pid)
        return out

    def _marker_records(self, views: dict, offs: Any) -> list[Any]:
        """Marker records read from a raw buffer, shaped like cupti-python's objects."""
        from types import SimpleNamespace

        r = self.reader
        assert r is not None
        dt = r.dtypes[self._kind_ints["MARKER"]]
        flags = r.field(views, offs, dt, "flags_").tolist()
        ts = r.field(views, offs, dt, "timestamp").tolist()
        ids = r.field(views, offs, dt, "id").tolist()
        names = c_strings(r.field(views, offs, dt, "name")).tolist()
        if "domain" in (dt.names or ()):
            domains = c_strings(r.field(views, offs, dt, "domain")).tolist()
        else:
            domains = [""] * len(names)
        tids = [-1] * len(ids)
        try:  # object_id is a union; .pt.thread_id sits 4 bytes in
            odt, ooff = dt.fields["object_id"][:2]
            toff = ooff + odt.fields["pt"][0].fields["thread_id"][1]
            tids = views[4][(offs + toff) // 4].tolist()
        except (KeyError, TypeError, AttributeError):
            pass  # this layout has no thread id: rows keep -1 (n/a)
        return [
            SimpleNamespace(flags_=f, timestamp=t, id=i, name=n, domain=d, object_id=_Tid(tid))
            for f, t, i, n, d, tid in zip(flags, ts, ids, names, domains, tids, strict=True)
        ]

    def _marker(self, a: Any, out: list[tuple]) -> None:
        flags = a.flags_
        ts = a.timestamp
        if flags & MARKER_END:
            opened = self._open_markers.pop(a.id, None)
            if opened is not None:
                start, name, domain, tid = opened
                out.append((start, ts, name, domain, tid))
            return
        try:
            tid = a.object_id.pt.thread_id
        except AttributeError:
            tid = -1
        name = a.name or ""
        domain = a.domain or ""
        if flags & MARKER_START:
            if len(self._open_markers) >= MAX_OPEN_MARKERS:
                self.markers_overflowed += 1
                return
            self._open_markers[a.id] = (ts, name, domain, tid)
        else:  # instantaneous
            out.append((ts, ts, name, domain, tid))


class ThreadIds:
    """CUPTI names the thread of an API or NVTX record by `pthread_self()` cut to 32 bits; the
    dashboard knows threads by OS tid (the scheduler collector's, the CPU pane's). Python knows
    both for its own threads (`threading.enumerate()`: `ident` and `native_id`), which are the
    ones that launch kernels in a Python server. Ids of threads Python never saw (a C++ worker)
    are left as they are: above 2^22, no OS tid can be mistaken for one.
    """

    MASK = 0xFFFFFFFF
    REFRESH_S = 1.0  # an unknown id looks the threads up again at most this often

    def __init__(self) -> None:
        self._map: dict[int, int] = {}
        self._looked = -1e9

    def _refresh(self) -> None:
        self._looked = time.monotonic()
        for t in threading.enumerate():
            if t.ident is not None and getattr(t, "native_id", None) is not None:
                self._map[t.ident & self.MASK] = int(t.native_id)

    def translate(self, tids: Any) -> Any:
        """The array with every known pthread id replaced by its OS tid (-1 stays -1)."""
        import numpy as np

        if not len(tids):
            return tids
        uniq, inv = np.unique(tids, return_inverse=True)
        if any(int(u) >= 0 and int(u) not in self._map for u in uniq) and (
            time.monotonic() - self._looked >= self.REFRESH_S
        ):
            self._refresh()
        mapped = np.array([self._map.get(int(u), int(u)) for u in uniq], dtype=np.int64)
        return mapped[inv]


def rows_to_batch(table: str, rows: list[tuple], offset_ns: int, pid: int) -> dict[str, Any]:
    """Column arrays for the wire from converter tuples; CUPTI time + offset = monotonic ns."""
    import numpy as np

    schema = schema_module()

    cols = ROW_COLUMNS[table]
    n = len(rows)
    transposed = list(zip(*rows, strict=True)) if n else [() for _ in cols]
    out: dict[str, Any] = {}
    types = dict(schema.TABLES[table])
    for c, vals in zip(cols, transposed, strict=True):
        code = types[c]
        if code == schema.STR:
            arr = np.empty(n, dtype=object)
            arr[:] = vals
            out[c] = arr
        elif c in ("start_ns", "end_ns"):
            out[c] = np.fromiter(vals, dtype=np.int64, count=n) + offset_ns
        else:
            out[c] = np.fromiter(vals, dtype=np.int64, count=n).astype(code)
    for c, code in schema.TABLES[table]:
        if c not in out:
            out[c] = np.full(n, pid if c == "pid" else -1, dtype=code)
    return out


class _Tid:
    """`object_id.pt.thread_id` for marker records read from a raw buffer."""

    __slots__ = ("pt",)

    def __init__(self, tid: int) -> None:
        from types import SimpleNamespace

        self.pt = SimpleNamespace(thread_id=tid)
