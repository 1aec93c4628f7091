"""Import torch.profiler / Kineto Chrome traces into a kdash capture, streamed.

A Kineto trace is one JSON object: a header (`schemaVersion`, `deviceProperties`,
`baseTimeNanoseconds`, ...), then `traceEvents` (often hundreds of MB), then a short tail.
Event times are microseconds (`ts`, `dur`, floats with ns decimals) counted from
`baseTimeNanoseconds`, itself Unix wall-clock ns (checked on torch 2.13: base + ts*1000 is the
wall time the trace was taken). What becomes which table, and which of an event's keys fill
which column, is the one field map's (`kdash.collectors.agent.fields.KINETO`, beside the CUPTI
map the agent decodes by): kernels, CUDA runtime and driver calls (api), copies and memsets
(memcpy), user annotations and CPU ops (markers). The launch flows (`ph` s / f, `cat` ac2g)
give api rows and kernel / memcpy rows their correlation ids.

A CPU op is a host range on one thread, as an NVTX range is: the markers table holds both, told
apart by domain, so the kernel pane draws them as a lane, the export on per-thread tracks and
the report ranks them, with no table of their own (their input shapes are not kept). Python
frames, other flows (forward-backward) and the rest are counted per category in the capture's
metadata and not stored.

The import is split by concern: `kdash.kineto_stream` reads the file as streamed JSON (header,
then events, within `kdash.limits`), `kdash.kineto_events` maps each event onto its table's
columns by that map, `kdash.kineto_columns` turns the row lists into numpy batches,
`kdash.kineto_flows` binds the launch flows, `kdash.kineto_read` builds the tables and the
capture's metadata, and `kdash.kineto_files` knows SGLang's trace file names. This module is
`kdash import` and the names the rest of kdash imports.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kdash.errors import UserError
from kdash.kineto_columns import CHUNK, MAX_TIME_US
from kdash.kineto_events import CPU_OP_DOMAIN, HOST_CATS, MAX_SKIP_KEYS
from kdash.kineto_files import (
    TraceName,
    find_rank_traces,
    parse_trace_name,
    settled_traces,
    wait_for_traces,
)
from kdash.kineto_flows import LAUNCH_FLOW, link_flows
from kdash.kineto_read import (
    MAX_BASE_NS,
    ImportResult,
    TraceInfo,
    build_meta,
    import_traces,
    read_traces,
    trace_meta,
)
from kdash.kineto_stream import check_trace_file, iter_events, read_header

__all__ = [
    "CHUNK",
    "CPU_OP_DOMAIN",
    "HOST_CATS",
    "LAUNCH_FLOW",
    "MAX_BASE_NS",
    "MAX_SKIP_KEYS",
    "MAX_TIME_US",
    "ImportResult",
    "TraceInfo",
    "TraceName",
    "build_meta",
    "check_trace_file",
    "cmd_import",
    "default_output",
    "expand_trace_args",
    "find_rank_traces",
    "import_traces",
    "iter_events",
    "link_flows",
    "parse_trace_name",
    "read_header",
    "read_traces",
    "settled_traces",
    "trace_meta",
    "wait_for_traces",
]


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
