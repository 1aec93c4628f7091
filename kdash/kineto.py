"""Import torch.profiler / Kineto Chrome traces into a kdash capture, streamed.

A Kineto trace is one JSON object: a header (`schemaVersion`, `deviceProperties`,
`baseTimeNanoseconds`, ...), then `traceEvents` (often hundreds of MB), then a short tail.
Event times are microseconds (`ts`, `dur`, floats with ns decimals) counted from
`baseTimeNanoseconds`, itself Unix wall-clock ns (checked on torch 2.13: base + ts*1000 is the
wall time the trace was taken). What becomes which table:

    cat kernel                          -> kernels  (device, stream, correlation, grid, block,
                                                     registers per thread, shared memory)
    cat cuda_runtime / cuda_driver      -> api      (name, pid, tid, correlation)
    cat gpu_memcpy / gpu_memset         -> memcpy   (kind from the name: HtoD, DtoH, ..., memset)
    cat user_annotation / gpu_user_annotation -> markers (domain = the category)
    cat cpu_op                          -> markers  (domain "cpu_op": host ranges per thread,
                                                     like NVTX; kdash.analyses.cpu_ops)
    ph s / f, cat ac2g (launch flows)   -> the correlation ids of api and kernels / memcpy

A CPU op is a host range on one thread, as an NVTX range is: the markers table holds both, told
apart by domain, so the kernel pane draws them as a lane, the export on per-thread tracks and
the report ranks them, with no table of their own (their input shapes are not kept). Python
frames, other flows (forward-backward) and the rest are counted per category in the capture's
metadata and not stored.

**Launch flows.** Kineto draws an arrow (a flow: ph "s" at the launch call, ph "f" with bp "e"
at the kernel or copy, one id each) from every CUDA call to the GPU work it started, and gives
both events the same `correlation` arg. The import binds each flow's two ends to the rows that
start where it does (same process or device, thread or stream, and nanosecond), so a row whose
`correlation` arg is missing gets its id from the flow, and the trace's metadata counts the
flows that tied a kept call to kept GPU work (`flows` per trace: what the Perfetto export's
arrows and the launch-latency analysis follow).
Kineto reports one "shared memory" figure per kernel (static + dynamic); it is stored as
`dynamic_smem`, with `static_smem` = 0, so their sum — what every pane shows — is right.

**Streaming.** `ijson` (its C backend, yajl2_c) yields one event at a time, so memory follows
the rows kept (numpy columns, appended in chunks of `CHUNK` rows, names interned), not the
file: a 1 GB trace does not need 10 GB. The header is read by a first, short pass that stops
at `traceEvents`; the events by a second pass. gzip is recognised by its magic bytes, not the
suffix.

**Bounds.** Every byte passes a `kdash.limits.JsonGuard` before the parser sees it (nesting
and string length), each table stops at `kdash.limits.MAX_ROWS` rows, and only regular files
are read (a pipe cannot be read twice): what a hostile or damaged trace asks for is refused
before it is allocated.

**Times.** Stored in ns. Without `wall_offset_ns` they stay on the trace's own (wall) clock and
the capture's metadata says so; a live session that takes a capture through SGLang's
`/start_profile` passes its `wall_offset_ns` (wall - monotonic, kdash.clock) and gets rows on
the host monotonic clock, next to its NVML and /proc rows.

**SGLang file names** `{prefix-}{profile_id}-TP-{tp}[-DP-d][-PP-p][-EP-e][-EXTEND|-DECODE]
.trace.json.gz` give each trace's ranks and stage (`parse_trace_name`; checked against
SGLang's profile_utils `_ProfilerTorch.stop`: DP/PP/EP appear only when that size is > 1, the
stage is `-{stage.name}` with `profile_by_stage`, `-prefill`/`-decode` with SGLANG_PROFILE_V2);
they are kept per trace in the metadata,
and rows of a rank are told apart by `pid` (the scheduler's process).
"""

from __future__ import annotations

import gzip
import io
import os
import re
import stat
import zlib
from array import array
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from kdash import limits, schema
from kdash.errors import UserError
from kdash.meta import CaptureMeta
from kdash.names import demangle_kernels
from kdash.schema import Batch

CHUNK = 65_536  # rows per table before a chunk is turned into numpy columns
# |ts| and dur in microseconds beyond this (31 years) are not times: base + ts * 1000 would
# leave int64 nanoseconds
MAX_TIME_US = 1e15
MAX_BASE_NS = 4 * 10**18  # baseTimeNanoseconds: Unix ns until 2096, with room for ts
MAX_SKIP_KEYS = 1_000  # distinct skipped categories counted by name; the rest as "(other)"

_STAGE_RE = r"(?:-(?P<stage>[A-Za-z][A-Za-z_]*))?"  # -EXTEND/-DECODE; V2: -prefill/-decode
_TRACE_NAME = re.compile(
    r"^(?:(?P<prefix>.*?)-)?(?P<id>[^-]+)(?P<ranks>(?:-(?:TP|DP|PP|EP)-\d+)+)"
    + _STAGE_RE
    + r"\.trace\.json(?:\.gz)?$"
)
_RANK = re.compile(r"-(TP|DP|PP|EP)-(\d+)")
_MERGED = re.compile(r"^merged-(?P<id>.+?)\.trace\.json(?:\.gz)?$")

_STORED = {
    "kernel",
    "cuda_runtime",
    "cuda_driver",
    "gpu_memcpy",
    "gpu_memset",
    "user_annotation",
    "gpu_user_annotation",
    "cpu_op",
}
CPU_OP_DOMAIN = "cpu_op"  # markers rows that are CPU ops
LAUNCH_FLOW = "ac2g"  # Kineto's flow category from a CUDA call to its kernel or copy
HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


@dataclass
class TraceName:
    """What an SGLang trace file name says; all None for other names."""

    prefix: str | None = None
    profile_id: str | None = None
    tp: int | None = None
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    stage: str | None = None
    merged: bool = False


def parse_trace_name(name: str) -> TraceName:
    """Ranks and stage from SGLang's trace file name (rank tokens in any order)."""
    base = os.path.basename(name)
    m = _TRACE_NAME.match(base)
    if m:
        ranks = {k.lower(): int(v) for k, v in _RANK.findall(m.group("ranks"))}
        prefix, pid = m.group("prefix") or None, m.group("id")
        # Some SGLang entry points name a profile by time.strftime("%Y%m%d-%H%M%S"): the id
        # itself holds a dash.
        if prefix and re.fullmatch(r"\d{6}", pid):
            head, _, last = prefix.rpartition("-")
            if re.fullmatch(r"\d{8}", last):
                prefix, pid = head or None, f"{last}-{pid}"
        return TraceName(prefix=prefix, profile_id=pid, stage=m.group("stage"), **ranks)
    m = _MERGED.match(base)
    if m:
        return TraceName(profile_id=m.group("id"), merged=True)
    return TraceName()


@dataclass
class TraceInfo:
    """One imported file: what it held and what was kept (goes into the capture metadata)."""

    path: str
    name: TraceName = field(default_factory=TraceName)
    base_ns: int = 0
    pid: int | None = None
    host_name: str | None = None
    events: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)
    devices: list[dict[str, Any]] = field(default_factory=list)
    start_ns: int | None = None
    end_ns: int | None = None
    cpu_ops: int = 0  # of kept["markers"]
    # launch flows: starts and ends read, ids with both, those tying a kept call to a kept
    # kernel or copy ("linked"), correlation ids set from them, and pairs whose rows carried
    # different correlation ids (left as written)
    flows: dict[str, int] = field(default_factory=dict)


# -- opening and the header ----------------------------------------------------------------
def check_trace_file(path: Path) -> os.stat_result:
    """UserError unless `path` is a regular file (a trace is read twice: header, events)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise UserError(f"no such file: {path}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UserError(f"{path} is a folder, not a trace file")
    if not stat.S_ISREG(st.st_mode):
        raise UserError(
            f"{path} is not a regular file (a pipe, e.g. <(zcat ...)?): kdash reads a trace "
            "twice; save it to a file first (.json.gz is read as it is)"
        )
    return st


def _open_binary(path: Path) -> IO[bytes]:
    """The file's JSON bytes, checked against kdash.limits as they are read: gunzipped when
    it starts with gzip's magic number."""
    check_trace_file(path)
    try:
        fh = open(path, "rb")  # noqa: SIM115 - handed to the caller, closed there
        magic = fh.read(2)
        fh.seek(0)
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    if magic == b"\x1f\x8b":
        inner: IO[bytes] = gzip.GzipFile(fileobj=fh, mode="rb")  # type: ignore[assignment]
    else:
        inner = io.BufferedReader(fh, buffer_size=1 << 20)  # type: ignore[arg-type]
    return limits.GuardedReader(inner)  # type: ignore[return-value]


def _stream_error(path: Path, e: BaseException, events: int) -> UserError:
    where = f" after {events} events" if events else ""
    if isinstance(e, limits.LimitError):
        return limits.LimitError(f"{path}: {e}{where}; kdash does not read such traces")
    if isinstance(e, MemoryError):
        return UserError(f"{path}: out of memory reading the trace{where}")
    if isinstance(e, EOFError):
        return UserError(f"{path}: truncated gzip file{where} (copy it again)")
    if isinstance(e, gzip.BadGzipFile | zlib.error):
        return UserError(f"{path}: damaged gzip data{where} ({e})")
    if isinstance(e, UnicodeDecodeError):
        return UserError(f"{path}: not a JSON trace (bytes that are not text{where})")
    import ijson

    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    if isinstance(e, ijson.JSONError) and "integer overflow" in msg:
        return UserError(
            f"{path}: an integer too large for 64 bits{where} (kdash's JSON parser reads "
            "integers up to 2**63-1; write it as a float or a string)"
        )
    truncated = "premature EOF" in msg or not str(e)
    if isinstance(e, ijson.IncompleteJSONError) and events and truncated:
        return UserError(f"{path}: truncated JSON{where} (the trace was cut short)")
    if isinstance(e, ijson.JSONError):
        if events:
            return UserError(f"{path}: broken JSON{where} ({msg})")
        return UserError(f"{path} is not a JSON trace ({msg})")
    return UserError(f"{path}: cannot read trace{where} ({type(e).__name__}: {e})")


_BUF = 1 << 16  # bytes per read: ijson builds all events of one read before it yields any

_READ_ERRORS: tuple[type[BaseException], ...] = (
    limits.LimitError,
    EOFError,
    OSError,
    zlib.error,
    UnicodeDecodeError,
    ValueError,
    MemoryError,
)


def read_header(path: Path) -> tuple[dict[str, Any], str]:
    """Top-level fields before `traceEvents` and where the events are (`traceEvents.item` or
    `item` for a bare event array). UserError for anything that is not a trace."""
    import ijson

    header: dict[str, Any] = {}
    errors = (*_READ_ERRORS, ijson.JSONError)
    if check_trace_file(path).st_size == 0:
        raise UserError(f"{path} is empty, not a trace")
    with _open_binary(path) as fh:
        try:
            events = ijson.parse(fh, use_float=True, buf_size=_BUF)
            first = next(events, None)
            if first is None:
                raise UserError(f"{path} is empty, not a trace")
            _, ev, _ = first
            if ev == "start_array":
                return header, "item"
            if ev != "start_map":
                raise UserError(f"{path} is not a trace (JSON {ev}, not an object)")
            if _header_fields(events, header):
                return header, "traceEvents.item"
        except limits.LimitError as e:
            raise _stream_error(path, e, 0) from None
        except UserError:
            raise
        except errors as e:
            raise _stream_error(path, e, 0) from None
    raise UserError(f"{path}: JSON without traceEvents (not a Chrome/Kineto trace)")


def _header_fields(events: Iterator[tuple[str, str, Any]], header: dict[str, Any]) -> bool:
    """Fill `header` with the top-level scalars (and `deviceProperties` whole) from the parse
    events after the opening `{`; True once the `traceEvents` key is reached."""
    import ijson

    builder: Any = None
    build_key = ""
    for prefix, ev, value in events:
        if builder is not None:
            if prefix == build_key and ev in ("end_map", "end_array"):
                builder.event(ev, value)
                header[build_key] = builder.value
                builder = None
            else:
                builder.event(ev, value)
            continue
        if prefix == "" and ev == "map_key":
            if value == "traceEvents":
                return True
            continue
        if "." in prefix:
            continue
        if ev in ("start_map", "start_array") and prefix == "deviceProperties":
            builder = ijson.ObjectBuilder()
            build_key = prefix
            builder.event(ev, value)
        elif ev in ("string", "number", "boolean", "null"):
            header[prefix] = value
    return False


# -- the columns ---------------------------------------------------------------------------
class _Table:
    """Row lists for one table, turned into numpy batches every CHUNK rows."""

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
        ts = np.asarray(c.pop("ts"), dtype=np.float64)
        durs = c.pop("dur")
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
            cols[k] = v if types[k] == schema.STR else _ints(v, pid if k == "pid" else None)
        if self.table == "kernels":
            # Kineto gives static + dynamic shared memory as one figure (see module docstring)
            cols["static_smem"] = np.where(cols["dynamic_smem"] >= 0, 0, -1)
        batch = schema.make_batch(self.table, start_ns=start, end_ns=end, **cols)
        if self.table == "kernels":
            batch, _ = demangle_kernels(batch)  # Kineto writes names demangled; some tools do not
        self.batches.append(batch)
        self.cols = {k: [] for k in ("ts", "dur", *c)}
        self.total += self.n
        self.n = 0


def _ints(values: list, fill: int | None) -> np.ndarray:
    """A list of raw JSON values -> int64; None becomes `fill` (or -1), junk becomes -1."""
    try:
        return np.asarray(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        default = -1 if fill is None else fill
        return np.asarray([default if v is None else _int(v) for v in values], dtype=np.int64)


_I64 = 2**63


def _int(v: Any, default: int = -1) -> int:
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


def _dim3(v: Any) -> tuple[int, int, int]:
    if isinstance(v, list | tuple):
        vals = [_int(x) for x in v[:3]]
        vals += [-1] * (3 - len(vals))
        return vals[0], vals[1], vals[2]
    return -1, -1, -1


class _Flows:
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
        fid, ts = _int(ev.get("id")), ev.get("ts")
        if fid < 0 or not isinstance(ts, int | float) or isinstance(ts, bool):
            return False
        if not -MAX_TIME_US < ts < MAX_TIME_US:
            return False
        if len(self.id) % CHUNK == 0:  # as often as a table checks its rows
            self.check()
        self.start.append(1 if ev.get("ph") == "s" else 0)
        self.pid.append(_int(ev.get("pid")))
        self.tid.append(_int(ev.get("tid")))
        self.ts.append(float(ts))
        self.id.append(fid)
        return True

    def check(self) -> None:
        """LimitError past two flow events (start, end) per row a table may hold."""
        if len(self.id) > 2 * limits.MAX_ROWS:
            raise limits.LimitError(f"more than {2 * limits.MAX_ROWS} flow events")

    def ends(self, start: bool, base_ns: int, wall_offset_ns: int) -> dict[str, np.ndarray]:
        """id, pid, tid and t (ns, as `_Table.flush` computes row times, so an end and its
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
    flows: _Flows,
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


def _memcpy_kind(name: str, cat: str) -> str:
    if cat == "gpu_memset" or name.startswith("Memset"):
        return "memset"
    parts = name.split()
    if len(parts) >= 2 and parts[0] == "Memcpy":
        return parts[1]
    return name


# -- reading -------------------------------------------------------------------------------
def read_traces(
    paths: Iterable[str | os.PathLike],
    *,
    wall_offset_ns: int | None = None,
    chunk: int = CHUNK,
) -> tuple[dict[str, Batch], list[TraceInfo]]:
    """All traces -> capture tables (kernels, api, memcpy, markers: annotations and CPU ops)
    and per-trace info (what was kept and skipped, the launch flows).

    `wall_offset_ns` (wall - monotonic) moves the rows onto the host monotonic clock.
    """
    tables = {
        "kernels": _Table(
            "kernels",
            [
                "ts",
                "dur",
                "name",
                "device",
                "stream",
                "pid",
                "grid_x",
                "grid_y",
                "grid_z",
                "block_x",
                "block_y",
                "block_z",
                "registers",
                "dynamic_smem",
                "correlation_id",
                "graph_id",
            ],
        ),
        "api": _Table("api", ["ts", "dur", "name", "pid", "tid", "correlation_id"]),
        "memcpy": _Table(
            "memcpy", ["ts", "dur", "kind", "bytes", "device", "stream", "pid", "correlation_id"]
        ),
        "markers": _Table("markers", ["ts", "dur", "name", "domain", "pid", "tid"]),
    }
    infos = []
    for p in paths:
        infos.append(_read_one(Path(p), tables, wall_offset_ns or 0, chunk))
    out = {}
    for name, t in tables.items():  # one table's chunks freed before the next is joined
        out[name] = schema.concat(name, t.batches)
        t.batches.clear()
    return out, infos


def _read_one(path: Path, tables: dict[str, _Table], offset: int, chunk: int) -> TraceInfo:
    import ijson

    header, where = read_header(path)
    info = _trace_info(path, header)
    first_batch = {name: len(t.batches) for name, t in tables.items()}
    reader = _EventReader(tables, info.base_ns, offset, chunk)
    errors = (*_READ_ERRORS, ijson.JSONError)
    with _open_binary(path) as fh:
        try:
            for ev in ijson.items(fh, where, use_float=True, buf_size=_BUF):
                reader.add(ev)
        except limits.LimitError as e:
            raise _stream_error(path, e, reader.n) from None
        except UserError:
            raise
        except errors as e:
            raise _stream_error(path, e, reader.n) from None
    _finish_trace(path, info, reader, tables, first_batch, offset)
    return info


def _trace_info(path: Path, header: dict[str, Any]) -> TraceInfo:
    """The file's TraceInfo from its header: base time (checked), host name, devices."""
    info = TraceInfo(path=str(path), name=parse_trace_name(path.name))
    base = header.get("baseTimeNanoseconds")
    info.base_ns = _int(base, 0) if isinstance(base, int | float) else 0
    if not -MAX_BASE_NS < info.base_ns < MAX_BASE_NS:
        raise UserError(f"{path}: baseTimeNanoseconds {base} is not a time")
    host = header.get("host_name")
    info.host_name = host if isinstance(host, str) else None
    devs = header.get("deviceProperties")
    if isinstance(devs, list):
        info.devices = [d for d in devs if isinstance(d, dict)]
    return info


class _EventReader:
    """One trace's events into the tables' row lists: one method per kind of event, and the
    state a pass carries (the host pid once seen, the flows, what was skipped, the counts)."""

    def __init__(self, tables: dict[str, _Table], base_ns: int, offset: int, chunk: int) -> None:
        self.kern, self.api, self.mem, self.mark = (
            tables[k] for k in ("kernels", "api", "memcpy", "markers")
        )
        self.base_ns = base_ns
        self.offset = offset
        self.chunk = chunk
        self.interned: dict[str, str] = {}
        self.skipped: Counter[str] = Counter()
        self.host_pid: int | None = None
        self.flows = _Flows()
        self.cpu_ops = 0
        self.n = 0
        self._by_cat = {
            "kernel": self._kernel,
            "cuda_runtime": self._api,
            "cuda_driver": self._api,
            "gpu_memcpy": self._memcpy,
            "gpu_memset": self._memcpy,
            "user_annotation": self._marker,
            "gpu_user_annotation": self._marker,
            "cpu_op": self._marker,
        }

    def _skip(self, key: str) -> None:
        if key not in self.skipped and len(self.skipped) >= MAX_SKIP_KEYS:
            key = "(other)"
        self.skipped[key] += 1

    def _cols(self, t: _Table) -> dict[str, list]:
        """The table's row lists, flushed first when a chunk is full."""
        if t.n >= self.chunk:
            t.flush(self.base_ns, self.offset, self.host_pid)
        return t.cols

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
        if cat in _STORED:
            ts = ev.get("ts")
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
        handler = self._by_cat.get(cat)
        if handler is None:
            self._other(ev, cat)
        else:
            handler(ev, cat, name, args)

    def _flow(self, ev: dict[str, Any], ph: str) -> None:
        cat = ev.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        if cat != LAUNCH_FLOW or ph == "t" or not self.flows.add(ev):
            self._skip(f"{cat or '(none)'} flow")

    def _kernel(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        kc = self._cols(self.kern)
        g = args.get("grid")
        b = args.get("block")
        gx, gy, gz = g if type(g) is list and len(g) == 3 else _dim3(g)
        bx, by, bz = b if type(b) is list and len(b) == 3 else _dim3(b)
        kc["ts"].append(ev["ts"])
        kc["dur"].append(ev.get("dur", 0.0))
        kc["name"].append(name)
        kc["device"].append(args.get("device", ev.get("pid")))
        kc["stream"].append(args.get("stream", ev.get("tid")))
        kc["pid"].append(None)
        kc["grid_x"].append(gx)
        kc["grid_y"].append(gy)
        kc["grid_z"].append(gz)
        kc["block_x"].append(bx)
        kc["block_y"].append(by)
        kc["block_z"].append(bz)
        kc["registers"].append(args.get("registers per thread", -1))
        kc["dynamic_smem"].append(args.get("shared memory", -1))
        kc["correlation_id"].append(args.get("correlation", -1))
        kc["graph_id"].append(args.get("graph id", args.get("graph_id", -1)))
        self.kern.n += 1

    def _api(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        ac = self._cols(self.api)
        pid = ev.get("pid")
        if self.host_pid is None and _int(pid) >= 0:
            self.host_pid = _int(pid)
        ac["ts"].append(ev["ts"])
        ac["dur"].append(ev.get("dur", 0.0))
        ac["name"].append(name)
        ac["pid"].append(pid)
        ac["tid"].append(ev.get("tid", -1))
        ac["correlation_id"].append(args.get("correlation", -1))
        self.api.n += 1

    def _memcpy(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        mc = self._cols(self.mem)
        mc["ts"].append(ev["ts"])
        mc["dur"].append(ev.get("dur", 0.0))
        kind = _memcpy_kind(name, cat)
        mc["kind"].append(self.interned.setdefault(kind, kind))
        mc["bytes"].append(args.get("bytes", -1))
        mc["device"].append(args.get("device", ev.get("pid")))
        mc["stream"].append(args.get("stream", ev.get("tid")))
        mc["pid"].append(None)
        mc["correlation_id"].append(args.get("correlation", -1))
        self.mem.n += 1

    def _marker(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        rc = self._cols(self.mark)
        # raw pid and tid, made integers per chunk (CPU ops are most events)
        if cat == "cpu_op":
            self.cpu_ops += 1
            pid = ev.get("pid")
        elif cat == "gpu_user_annotation":
            pid = None
        else:
            pid = ev.get("pid")
        if self.host_pid is None and pid is not None and _int(pid) >= 0:
            self.host_pid = _int(pid)
        rc["ts"].append(ev["ts"])
        rc["dur"].append(ev.get("dur", 0.0))
        rc["name"].append(name)
        rc["domain"].append(cat)
        rc["pid"].append(pid)
        rc["tid"].append(ev.get("tid"))
        self.mark.n += 1

    def _other(self, ev: dict[str, Any], cat: str) -> None:
        if self.host_pid is None and cat in HOST_CATS:
            p = _int(ev.get("pid"))
            self.host_pid = p if p >= 0 else None
        self._skip(cat or "(none)")


def _finish_trace(
    path: Path,
    info: TraceInfo,
    reader: _EventReader,
    tables: dict[str, _Table],
    first_batch: dict[str, int],
    offset: int,
) -> None:
    """The last rows flushed, the flows checked and linked, and what the file held into `info`."""
    n, host_pid = reader.n, reader.host_pid
    for t in tables.values():
        try:
            t.flush(info.base_ns, offset, host_pid)
        except limits.LimitError as e:
            raise _stream_error(path, e, n) from None
    try:
        reader.flows.check()
    except limits.LimitError as e:
        raise _stream_error(path, e, n) from None
    for t in tables.values():
        for b in t.batches[first_batch[t.table] :]:
            if "pid" in b and host_pid is not None:
                b["pid"][b["pid"] < 0] = host_pid  # device rows belong to the trace's process
            tcol = b["start_ns"]
            if len(tcol):
                lo, hi = int(tcol.min()), int(b["end_ns"].max())
                info.start_ns = lo if info.start_ns is None else min(info.start_ns, lo)
                info.end_ns = hi if info.end_ns is None else max(info.end_ns, hi)
        info.kept[t.table] = sum(len(b["start_ns"]) for b in t.batches[first_batch[t.table] :])
    mine = {name: t.batches[first_batch[name] :] for name, t in tables.items()}
    gpu = {"kernels": mine["kernels"], "memcpy": mine["memcpy"]}
    info.flows = link_flows(reader.flows, mine["api"], gpu, info.base_ns, offset)
    info.cpu_ops = reader.cpu_ops
    info.pid = host_pid
    info.events = n
    info.skipped = dict(reader.skipped)
    if n == 0:
        raise UserError(f"{path}: a trace with no events (was the profiler running?)")


# -- capture -------------------------------------------------------------------------------
def _gpus_from(infos: Sequence[TraceInfo]) -> list[dict[str, Any]]:
    seen: dict[int, dict[str, Any]] = {}
    for info in infos:
        for d in info.devices:
            idx = _int(d.get("id"), len(seen))
            if idx in seen:
                continue
            mem = d.get("totalGlobalMem")
            seen[idx] = {
                "index": idx,
                "name": d.get("name"),
                "mem_total_mib": round(mem / 2**20) if isinstance(mem, int | float) else None,
                "compute_capability": f"{d.get('computeMajor')}.{d.get('computeMinor')}"
                if "computeMajor" in d
                else None,
                "sm_count": d.get("numSms"),
            }
    return [seen[k] for k in sorted(seen)]


def trace_meta(infos: Sequence[TraceInfo], wall_offset_ns: int | None) -> CaptureMeta:
    """Capture metadata for imported traces, in the same keys a recorded capture has."""
    import platform
    import socket

    from kdash.meta import MONOTONIC, WALL, ClockInfo, Window
    from kdash.meta import build_meta as new_meta

    starts = [i.start_ns for i in infos if i.start_ns is not None]
    ends = [i.end_ns for i in infos if i.end_ns is not None]
    start = min(starts) if starts else 0
    end = max(ends) if ends else 0
    host = next((i.host_name for i in infos if i.host_name), None)
    pid = next((i.pid for i in infos if i.pid is not None), None)
    traces = []
    for i in infos:
        d = asdict(i)
        d.pop("devices")
        d["name"] = {k: v for k, v in d["name"].items() if v is not None and v is not False}
        traces.append(d)
    return new_meta(
        title=f"imported {len(infos)} Kineto trace{'s' if len(infos) != 1 else ''}",
        origin="kineto-import",
        target={"pid": pid, "cmdline": "", "host": host or ""},
        host={
            "hostname": host or "",
            "imported_on": socket.gethostname(),
            "machine": platform.machine(),
        },
        gpus=_gpus_from(infos),
        clock=ClockInfo(
            domain=MONOTONIC if wall_offset_ns is not None else WALL,
            wall_offset_ns=wall_offset_ns if wall_offset_ns is not None else 0,
            derived_from="Kineto baseTimeNanoseconds + ts",
        ),
        # Kineto's timestamps are microseconds: keep them in the window's length
        window=Window.of(start, end, digits=6),
        sources={"kineto": "ok"},
        traces=traces,
    )


def build_meta(infos: Sequence[TraceInfo], wall_offset_ns: int | None) -> dict[str, Any]:
    """`trace_meta` as the JSON object a capture holds."""
    return trace_meta(infos, wall_offset_ns).to_dict()


@dataclass
class ImportResult:
    path: Path
    rows: dict[str, int]
    traces: list[TraceInfo]
    seconds: float


def import_traces(
    paths: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    wall_offset_ns: int | None = None,
    extra_meta: dict[str, Any] | None = None,
) -> ImportResult:
    """Read the traces and write one capture at `output` (atomically; `.kdash` added)."""
    from kdash.capture import write_capture

    if not paths:
        raise UserError("no trace files given")
    tables, infos = read_traces(paths, wall_offset_ns=wall_offset_ns)
    meta = trace_meta(infos, wall_offset_ns).merged(extra_meta)
    written = write_capture(output, meta, tables)
    return ImportResult(
        path=written,
        rows={k: schema.batch_len(v) for k, v in tables.items()},
        traces=infos,
        seconds=meta.window.seconds,
    )


_TRACE_SUFFIXES = (".trace.json.gz", ".trace.json", ".json.gz", ".json", ".gz")


def default_output(traces: Sequence[Path]) -> Path:
    """Next to the first trace: `{prefix-}{id}.kdash` for SGLang rank files of one profile,
    else the first file's name without its trace suffix."""
    first = traces[0]
    names = [parse_trace_name(t.name) for t in traces]
    if names[0].profile_id and all(n.profile_id == names[0].profile_id for n in names):
        stem = (
            f"{names[0].prefix}-{names[0].profile_id}" if names[0].prefix else names[0].profile_id
        )
        if len(traces) == 1:
            stem = first.name
            for suf in _TRACE_SUFFIXES:
                if stem.endswith(suf):
                    stem = stem[: -len(suf)]
                    break
        return first.with_name(stem + ".kdash")
    stem = first.name
    for suf in _TRACE_SUFFIXES:
        if stem.endswith(suf):
            stem = stem[: -len(suf)]
            break
    return first.with_name(stem + ".kdash")


def _check_output(path: Path) -> Path:
    from kdash.capture import check_new_path

    return check_new_path(path)


def expand_trace_args(paths: Sequence[Path]) -> list[Path]:
    """Files as given; a folder stands for the traces in it (SGLang's rank files when it holds
    any, else every *.json / *.json.gz). UserError for a missing path or an empty folder."""
    out: list[Path] = []
    for p in paths:
        if not p.exists():
            raise UserError(f"no such file: {p}")
        if p.is_dir():
            found = find_rank_traces(p) or sorted(
                f for f in p.iterdir() if f.is_file() and f.name.endswith((".json", ".json.gz"))
            )
            if not found:
                raise UserError(f"no trace files (*.json, *.json.gz) in {p}")
            out.extend(found)
        else:
            check_trace_file(p)
            out.append(p)
    if not out:
        raise UserError("give at least one trace file")
    return out


def cmd_import(args: Any) -> int:
    """`kdash import TRACE... [--output PATH]`: one capture from the traces (a folder stands
    for the traces in it); prints one line, and a note when no kernel was in them."""
    traces = expand_trace_args([Path(t) for t in args.traces])
    out = _check_output(Path(args.output) if args.output else default_output(traces))
    res = import_traces(traces, out)
    r = res.rows
    ops = sum(i.cpu_ops for i in res.traces)
    linked = sum(i.flows.get("linked", 0) for i in res.traces)
    print(
        f"wrote {res.path}: {r['kernels']} kernels, {r['api']} API calls ({linked} tied to "
        f"their kernel or copy by a launch flow), {r['memcpy']} copies, {ops} CPU ops, "
        f"{r['markers'] - ops} annotations from {len(traces)} trace"
        f"{'s' if len(traces) != 1 else ''} ({res.seconds:.3f} s)"
    )
    if r["kernels"] == 0:
        print(
            "note: no GPU kernels in the trace(s): recorded without CUDA activity, or another "
            "CUPTI client (kdash's agent, Nsight) held CUPTI while it ran"
        )
    return 0


def settled_traces(
    folder: Path, prefix: str, sizes: dict[Path, tuple[int, float]], stable_s: float
) -> tuple[list[Path], int]:
    """(files of `prefix`, how many kept their size for `stable_s`): torch writes in place.
    `sizes` carries each file's last size and since when, from one call to the next."""
    import time

    now = time.monotonic()
    files = find_rank_traces(folder, prefix)
    settled = 0
    for f in files:
        try:
            size = f.stat().st_size
        except OSError:
            continue
        old = sizes.get(f)
        if old is None or old[0] != size:
            sizes[f] = (size, now)
        elif size > 0 and now - old[1] >= stable_s:
            settled += 1
    return files, settled


def find_rank_traces(folder: str | os.PathLike, prefix: str | None = None) -> list[Path]:
    """SGLang rank trace files in `folder` (of one `profile_prefix` when given), sorted by
    profile id, stage and ranks. Merged files are left out: the rank files hold the same events.
    """
    out = []
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return []
    for p in entries:
        n = parse_trace_name(p.name)
        if n.profile_id is None or n.merged:
            continue
        if prefix is not None and n.prefix != prefix:
            continue
        out.append((n.profile_id, n.stage or "", n.dp or 0, n.pp or 0, n.tp or 0, n.ep or 0, p))
    return [t[-1] for t in sorted(out, key=lambda t: t[:-1])]


def wait_for_traces(
    folder: str | os.PathLike,
    prefix: str,
    count: int,
    timeout_s: float = 60.0,
    stable_s: float = 1.0,
    poll_s: float = 0.2,
) -> list[Path]:
    """Wait until `count` rank files of `prefix` exist and their sizes have not changed for
    `stable_s` (torch writes the .gz in place, so a file can be seen half written).

    Returns the files; UserError on timeout, saying how many came. `folder` may be a path seen
    through /proc/PID/root for a server in a container.
    """
    import time

    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, tuple[int, float]] = {}
    files: list[Path] = []
    while True:
        now = time.monotonic()
        files, settled = settled_traces(folder, prefix, sizes, stable_s)
        if len(files) >= count and settled >= len(files):
            return files
        if now >= deadline:
            raise UserError(
                f"{len(files)} of {count} trace files with prefix {prefix!r} in {folder} after "
                f"{timeout_s:g} s (no requests, so no steps? or the server cannot write there)"
            )
        time.sleep(poll_s)


def iter_events(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every event of a trace, one at a time (for tools and tests that need the raw events)."""
    import ijson

    p = Path(path)
    _, where = read_header(p)
    n = 0
    with _open_binary(p) as fh:
        try:
            for ev in ijson.items(fh, where, use_float=True, buf_size=_BUF):
                n += 1
                yield ev
        except (*_READ_ERRORS, ijson.JSONError) as e:
            raise _stream_error(p, e, n) from None
