"""One Kineto event into the row lists of its table, as the one field map says
(`kdash.collectors.agent.fields.KINETO`: which categories become which table, which of an
event's keys fill which column, and how).

A CPU op is a host range on one thread, as an NVTX range is: it goes into the markers table
with domain `CPU_OP_DOMAIN`. Python frames, other flows and the rest are counted per category
(`EventReader.skipped`) and not stored.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from kdash.collectors.agent import fields
from kdash.kineto_columns import MAX_TIME_US, RowTable, dim3, json_int
from kdash.kineto_flows import LAUNCH_FLOW, LaunchFlows

MAX_SKIP_KEYS = 1_000  # distinct skipped categories counted by name; the rest as "(other)"

CPU_OP_DOMAIN = "cpu_op"  # markers rows that are CPU ops
# the categories of host events: their pid is the trace's process (a GPU event's is a device)
HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


def memcpy_kind(name: str, cat: str) -> str:
    if cat == "gpu_memset" or name.startswith("Memset"):
        return "memset"
    parts = name.split()
    if len(parts) >= 2 and parts[0] == "Memcpy":
        return parts[1]
    return name


_EVENT, _ARGS = 0, 1  # where a source key is looked up: the event, or its `args`
_ARGS_PREFIX = "args."  # how the map names a key of `args`
_DIMS = {fields.DIM3_X: 0, fields.DIM3_Y: 1, fields.DIM3_Z: 2}


def _where(key: str) -> tuple[int, str]:
    if key.startswith(_ARGS_PREFIX):
        return _ARGS, key[len(_ARGS_PREFIX) :]
    return _EVENT, key


class EventPlan:
    """How the events of one entry of `fields.KINETO` become rows of its table: the map's
    columns grouped by how each is made, so the reading loop runs no per-column branch.

    `start`: (column, key) and `end`: (column, key, absent) of the times; `one`: (column,
    where, key, absent) for a value read from one key; `two`: (column, where, key, where, key,
    absent) for a key with a fallback; `dims`: (where, key, columns x/y/z) of a [x, y, z] list;
    `made`: (column, how) for a value made from the event's name or category, or the trace's
    pid (None: filled when the chunk is turned into numpy columns)."""

    __slots__ = ("columns", "dims", "end", "made", "one", "start", "table", "two")

    def __init__(self, table: str, entries: tuple) -> None:
        self.table = table
        self.columns = tuple(col for col, _k, _h, _a in entries)
        one: list[tuple] = []
        two: list[tuple] = []
        dims: dict[tuple[int, str], list[str]] = {}
        made: list[tuple[str, str]] = []
        start = end = None
        for col, keys, how, absent in entries:
            if how == fields.US_START:
                start = (col, keys[0])
            elif how == fields.US_DURATION:
                end = (col, keys[0], absent)
            elif how == fields.AS_IS and len(keys) == 1:
                one.append((col, *_where(keys[0]), absent))
            elif how == fields.AS_IS and len(keys) == 2:
                two.append((col, *_where(keys[0]), *_where(keys[1]), absent))
            elif how in _DIMS and len(keys) == 1:
                dims.setdefault(_where(keys[0]), ["", "", ""])[_DIMS[how]] = col
            elif how in (fields.TEXT, fields.CATEGORY, fields.COPY_KIND, fields.TRACE_PID):
                made.append((col, how))
            else:
                raise ValueError(f"{table}.{col}: no reader for {how!r} from {keys}")
        if start is None or end is None:
            raise ValueError(f"{table}: the map gives no start and end time")
        if any("" in cols for cols in dims.values()):
            raise ValueError(f"{table}: a [x, y, z] list must fill three columns")
        self.start, self.end = start, end
        self.one, self.two, self.made = tuple(one), tuple(two), tuple(made)
        self.dims = tuple((w, k, tuple(cols)) for (w, k), cols in dims.items())


def _plans() -> dict[str, EventPlan]:
    """Category -> its plan, checked against what the reader and RowTable rely on: the times
    in start_ns / end_ns read from one key for every category (add() checks it before any
    plan runs), and the entries of one table filling the same columns (one list per column)."""
    plans = {cat: EventPlan(table, ents) for table, cats, ents in fields.KINETO for cat in cats}
    for cat, plan in plans.items():
        if plan.start[0] != "start_ns" or plan.end[0] != "end_ns":
            raise ValueError(f"{cat}: the times go in start_ns and end_ns")
        if {p.columns for p in plans.values() if p.table == plan.table} != {plan.columns}:
            raise ValueError(f"the Kineto entries of {plan.table} fill different columns")
    if len({plan.start[1] for plan in plans.values()}) != 1:
        raise ValueError("every Kineto category's start must be read from one key")
    return plans


PLANS = _plans()
KINETO_TABLES = tuple(dict.fromkeys(plan.table for plan in PLANS.values()))
TIME_KEY = next(iter(PLANS.values())).start[1]  # "ts"


def table_columns(table: str) -> tuple[str, ...]:
    """The columns the map fills in `table`, in the map's order (its row lists)."""
    return next(p.columns for p in PLANS.values() if p.table == table)


class EventReader:
    """One trace's events into the tables' row lists: each stored category by its `EventPlan`,
    and the state a pass carries (the host pid once seen, the flows, what was skipped, the
    counts)."""

    def __init__(self, tables: dict[str, RowTable], base_ns: int, offset: int, chunk: int) -> None:
        self.base_ns = base_ns
        self.offset = offset
        self.chunk = chunk
        self.interned: dict[str, str] = {}
        self.skipped: Counter[str] = Counter()
        self.host_pid: int | None = None
        self.flows = LaunchFlows()
        self.cpu_ops = 0
        self.n = 0
        make: dict[str, Callable[[str, str], Any]] = {
            fields.TEXT: lambda name, cat: name,
            fields.CATEGORY: lambda name, cat: cat,
            fields.COPY_KIND: self._copy_kind,
            fields.TRACE_PID: lambda name, cat: None,
        }
        # per stored category: its table and its plan with each column name replaced by the
        # `append` of that column's row list (RowTable keeps its lists), `made` columns with
        # the function that makes each
        self._cats: dict[str, tuple] = {}
        for cat, plan in PLANS.items():
            t = tables[plan.table]
            add = {col: t.cols[col].append for col in plan.columns}
            self._cats[cat] = (
                t,
                (add[plan.start[0]], plan.start[1]),
                (add[plan.end[0]], *plan.end[1:]),
                tuple((add[col], *rest) for col, *rest in plan.one),
                tuple((add[col], *rest) for col, *rest in plan.two),
                tuple((w, k, tuple(add[col] for col in cols)) for w, k, cols in plan.dims),
                tuple((add[col], make[how]) for col, how in plan.made),
            )

    def _skip(self, key: str) -> None:
        if key not in self.skipped and len(self.skipped) >= MAX_SKIP_KEYS:
            key = "(other)"
        self.skipped[key] += 1

    def _copy_kind(self, name: str, cat: str) -> str:
        kind = memcpy_kind(name, cat)
        return self.interned.setdefault(kind, kind)

    def add(self, ev: Any) -> None:
        self.n += 1
        if not isinstance(ev, dict):
            return
        ph = ev.get("ph")
        if ph != "X":
            if ph in ("s", "t", "f"):  # a flow's start, step, end
                self._flow(ev, ph)
            return
        cat = ev.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        stored = self._cats.get(cat)
        if stored is not None:
            ts = ev.get(TIME_KEY)
            if not isinstance(ts, int | float) or isinstance(ts, bool):
                self.skipped[f"{cat} without ts"] += 1
                return
            if not -MAX_TIME_US < ts < MAX_TIME_US:  # NaN fails too
                self.skipped[f"{cat} with a ts that is not a time"] += 1
                return
        name = ev.get("name")
        name = self.interned.setdefault(name, name) if isinstance(name, str) else ""
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        if stored is None:
            self._other(ev, cat)
        else:
            self._row(stored, ev, cat, name, args)

    def _flow(self, ev: dict[str, Any], ph: str) -> None:
        cat = ev.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        if cat != LAUNCH_FLOW or ph == "t" or not self.flows.add(ev):
            self._skip(f"{cat or '(none)'} flow")

    def _row(self, stored: tuple, ev: dict[str, Any], cat: str, name: str, args: dict) -> None:
        """One event's row, appended raw (made integers per chunk, in RowTable.flush)."""
        t, start, end, one, two, dims, made = stored
        if t.n >= self.chunk:
            t.flush(self.base_ns, self.offset, self.host_pid)
        if self.host_pid is None and cat in HOST_CATS:
            pid = json_int(ev.get("pid"))
            if pid >= 0:
                self.host_pid = pid
        if cat == CPU_OP_DOMAIN:
            self.cpu_ops += 1
        src = (ev, args)
        add, key = start
        add(ev[key])
        add, key, absent = end
        add(ev.get(key, absent))
        for add, where, key, absent in one:
            add(src[where].get(key, absent))
        for add, where, key, where2, key2, absent in two:
            add(src[where].get(key, src[where2].get(key2, absent)))
        for where, key, (ax, ay, az) in dims:
            v = src[where].get(key)
            x, y, z = v if type(v) is list and len(v) == 3 else dim3(v)
            ax(x)
            ay(y)
            az(z)
        for add, make in made:
            add(make(name, cat))
        t.n += 1

    def _other(self, ev: dict[str, Any], cat: str) -> None:
        if self.host_pid is None and cat in HOST_CATS:
            p = json_int(ev.get("pid"))
            self.host_pid = p if p >= 0 else None
        self._skip(cat or "(none)")
