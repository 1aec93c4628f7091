"""Kineto traces read into the capture's tables and metadata, and written as one capture.

**Times.** Stored in ns. Without `wall_offset_ns` they stay on the trace's own (wall) clock and
the capture's metadata says so; a live session that takes a capture through SGLang's
`/start_profile` passes its `wall_offset_ns` (wall - monotonic, kdash.clock) and gets rows on
the host monotonic clock, next to its NVML and /proc rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kdash import limits, schema
from kdash.errors import UserError
from kdash.kineto_columns import CHUNK, RowTable, json_int
from kdash.kineto_events import KINETO_TABLES, EventReader, table_columns
from kdash.kineto_files import TraceName, parse_trace_name
from kdash.kineto_flows import link_flows
from kdash.kineto_stream import READ_BUF, READ_ERRORS, open_trace, read_header, stream_error
from kdash.meta import CaptureMeta
from kdash.schema import Batch

MAX_BASE_NS = 4 * 10**18  # baseTimeNanoseconds: Unix ns until 2096, with room for ts


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
    tables = {table: RowTable(table, table_columns(table)) for table in KINETO_TABLES}
    infos = []
    for p in paths:
        infos.append(_read_one(Path(p), tables, wall_offset_ns or 0, chunk))
    out = {}
    for name, t in tables.items():  # one table's chunks freed before the next is joined
        out[name] = schema.concat(name, t.batches)
        t.batches.clear()
    return out, infos


def _read_one(path: Path, tables: dict[str, RowTable], offset: int, chunk: int) -> TraceInfo:
    import ijson

    header, where = read_header(path)
    info = _trace_info(path, header)
    first_batch = {name: len(t.batches) for name, t in tables.items()}
    reader = EventReader(tables, info.base_ns, offset, chunk)
    errors = (*READ_ERRORS, ijson.JSONError)
    with open_trace(path) as fh:
        try:
            for ev in ijson.items(fh, where, use_float=True, buf_size=READ_BUF):
                reader.add(ev)
        except limits.LimitError as e:
            raise stream_error(path, e, reader.n) from None
        except UserError:
            raise
        except errors as e:
            raise stream_error(path, e, reader.n) from None
    _finish_trace(path, info, reader, tables, first_batch, offset)
    return info


def _trace_info(path: Path, header: dict[str, Any]) -> TraceInfo:
    """The file's TraceInfo from its header: base time (checked), host name, devices."""
    info = TraceInfo(path=str(path), name=parse_trace_name(path.name))
    base = header.get("baseTimeNanoseconds")
    info.base_ns = json_int(base, 0) if isinstance(base, int | float) else 0
    if not -MAX_BASE_NS < info.base_ns < MAX_BASE_NS:
        raise UserError(f"{path}: baseTimeNanoseconds {base} is not a time")
    host = header.get("host_name")
    info.host_name = host if isinstance(host, str) else None
    devs = header.get("deviceProperties")
    if isinstance(devs, list):
        info.devices = [d for d in devs if isinstance(d, dict)]
    return info


def _finish_trace(
    path: Path,
    info: TraceInfo,
    reader: EventReader,
    tables: dict[str, RowTable],
    first_batch: dict[str, int],
    offset: int,
) -> None:
    """The last rows flushed, the flows checked and linked, and what the file held into `info`."""
    n, host_pid = reader.n, reader.host_pid
    for t in tables.values():
        try:
            t.flush(info.base_ns, offset, host_pid)
        except limits.LimitError as e:
            raise stream_error(path, e, n) from None
    try:
        reader.flows.check()
    except limits.LimitError as e:
        raise stream_error(path, e, n) from None
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
            idx = json_int(d.get("id"), len(seen))
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
