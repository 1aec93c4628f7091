"""The one map from source fields to kdash's schema columns, per table.

Two sources fill the event tables field by field: CUPTI activity records (the agent's two
decoders) and Kineto trace events (`kdash import`). For each schema table this module says
which source field becomes which column, how its value is made, and, for every column a
source has no field for, what the column holds instead and why (the CUPTI_FILLED,
KINETO_DERIVED and OTHER_TABLES declarations; a test checks that every column of every table
is accounted for).

Why it lives in the agent's folder: the agent's modules are loaded by path into the target
process, standard library only, before the `kdash` package is importable there, so the map
is plain data that needs no import; the Kineto importer, in the core, imports it from here.

**CUPTI.** Both of the agent's decoders read RECORDS: the one that takes cupti-python's record
objects attribute by attribute (records.RecordConverter.convert) and the one that gathers the
same fields straight out of a CUPTI buffer with numpy (records.RecordConverter._columns). A
column a record kind gives no field for gets the agent's pid (column "pid") or -1 (n/a), as
`rows_to_batch` fills them, unless CONSTANTS names a value; CUPTI_FILLED says which, per kind,
and why. Markers (NVTX ranges) are not a field-by-field copy: START and END records are
paired by id (records.RecordConverter._marker), so they have their own columns below.

**Kineto.** `kdash.kineto_events` reads KINETO: (table, event categories, fields) as RECORDS
is (table, record kinds, fields), with source keys named as the trace writes them (`args.X` is
a key of the event's `args`) and a value for when the event has none of them.
"""

from __future__ import annotations

# -- CUPTI activity records ------------------------------------------------------------------
# How a column's value is made from its record field; both decoders implement each.
AS_IS = "as is"
C_STRING = "c string"  # a `const char *` in the buffer; cupti-python gives a str
API_NAME = "api name"  # a cbid, named by cupti.get_callback_name in the record kind's domain
SYNC_NAME = "sync name"  # a CUpti_ActivitySynchronizationType: "sync:<type>"
COPY_NAME = "copy name"  # a CUpti_ActivityMemcpyKind: "HtoD", "DtoH", ...
ZERO_IS_NA = "0 is n/a"  # CUPTI writes 0 for "none" (a kernel not launched from a graph): -1
ZERO_IS_PID = "0 is ours"  # CUPTI writes 0 for "this process": the agent's pid

KERNEL = (
    ("start_ns", "start", AS_IS),
    ("end_ns", "end", AS_IS),
    ("name", "name", C_STRING),
    ("device", "device_id", AS_IS),
    ("stream", "stream_id", AS_IS),
    ("grid_x", "grid_x", AS_IS),
    ("grid_y", "grid_y", AS_IS),
    ("grid_z", "grid_z", AS_IS),
    ("block_x", "block_x", AS_IS),
    ("block_y", "block_y", AS_IS),
    ("block_z", "block_z", AS_IS),
    ("registers", "registers_per_thread", AS_IS),
    ("static_smem", "static_shared_memory", AS_IS),
    ("dynamic_smem", "dynamic_shared_memory", AS_IS),
    ("correlation_id", "correlation_id", AS_IS),
    ("graph_id", "graph_id", ZERO_IS_NA),
)
API = (
    ("start_ns", "start", AS_IS),
    ("end_ns", "end", AS_IS),
    ("name", "cbid", API_NAME),
    ("pid", "process_id", ZERO_IS_PID),
    ("tid", "thread_id", AS_IS),
    ("correlation_id", "correlation_id", AS_IS),
)
SYNC = (  # an API row of our process, of no particular thread
    ("start_ns", "start", AS_IS),
    ("end_ns", "end", AS_IS),
    ("name", "type", SYNC_NAME),
    ("correlation_id", "correlation_id", AS_IS),
)
MEMCPY = (
    ("start_ns", "start", AS_IS),
    ("end_ns", "end", AS_IS),
    ("kind", "copy_kind", COPY_NAME),
    ("bytes", "bytes", AS_IS),
    ("device", "device_id", AS_IS),
    ("stream", "stream_id", AS_IS),
    ("correlation_id", "correlation_id", AS_IS),
)
MEMSET = (
    ("start_ns", "start", AS_IS),
    ("end_ns", "end", AS_IS),
    ("bytes", "bytes", AS_IS),
    ("device", "device_id", AS_IS),
    ("stream", "stream_id", AS_IS),
    ("correlation_id", "correlation_id", AS_IS),
)

# (table, the cupti.ActivityKind members decoded together, their fields), in the order each
# table's rows are put together from one buffer. Kinds of one entry share a record layout.
RECORDS = (
    ("kernels", ("CONCURRENT_KERNEL", "KERNEL"), KERNEL),
    ("api", ("RUNTIME",), API),
    ("api", ("DRIVER",), API),
    ("api", ("SYNCHRONIZATION",), SYNC),
    ("memcpy", ("MEMCPY",), MEMCPY),
    ("memcpy", ("MEMSET",), MEMSET),
)
# Values for columns a record kind has no field for, other than the pid / n/a defaults.
CONSTANTS = {"MEMSET": {"kind": "memset"}}

# Marker rows as `_marker` makes them, from the fields of MARKER_FIELDS.
MARKER_COLUMNS = ("start_ns", "end_ns", "name", "domain", "tid")
MARKER_FIELDS = ("flags_", "timestamp", "id", "name", "domain", "object_id")

# Tuple layouts of the attribute decoder's rows, per table: the columns of the table's first
# RECORDS entry (the others give a subset of them).
ROW_COLUMNS: dict[str, tuple[str, ...]] = {}
for _table, _kinds, _fields in RECORDS:
    ROW_COLUMNS.setdefault(_table, tuple(c for c, _a, _h in _fields))
ROW_COLUMNS["markers"] = MARKER_COLUMNS
del _table, _kinds, _fields

# cupti.ActivityKind member -> cupti-python dtype of that record (CUPTI 13 record versions)
RECORD_DTYPES = {
    "CONCURRENT_KERNEL": "activity_kernel10_dtype",
    "KERNEL": "activity_kernel10_dtype",
    "RUNTIME": "activity_api_dtype",
    "DRIVER": "activity_api_dtype",
    "MEMCPY": "activity_memcpy6_dtype",
    "MEMSET": "activity_memset4_dtype",
    "SYNCHRONIZATION": "activity_synchronization2_dtype",
    "MARKER": "activity_marker2_dtype",
}

# CUpti_ActivityMemcpyKind member name -> the name kdash shows
COPY_KIND_NAMES = {
    "HTOD": "HtoD",
    "DTOH": "DtoH",
    "HTOA": "HtoA",
    "ATOH": "AtoH",
    "ATOA": "AtoA",
    "ATOD": "AtoD",
    "DTOA": "DtoA",
    "DTOD": "DtoD",
    "HTOH": "HtoH",
    "PTOP": "PtoP",
}


def fields_of(kind_name: str) -> tuple[str, tuple[tuple[str, str, str], ...]] | None:
    """(table, fields) of a cupti.ActivityKind member name, or None when kdash keeps none."""
    for table, kinds, fields in RECORDS:
        if kind_name in kinds:
            return table, fields
    return None


# -- Kineto trace events ----------------------------------------------------------------------
# Entries are (column, source keys, how, absent). The keys are tried in order and the first one
# the event has gives the value; `absent` is the value when it has none. Integers are made per
# chunk of rows (kdash.kineto_columns): a None there is n/a (-1, or the trace's pid in a pid
# column) and so is what is not an integer. How a value is made (kdash.kineto_events):
US_START = "us from base"  # microseconds since the trace's baseTimeNanoseconds: start_ns
US_DURATION = "us long"  # microseconds from the start: end_ns = start + dur
TEXT = "text"  # the event's name, "" when it is not a string
CATEGORY = "category"  # the event's category, lower-cased
COPY_KIND = "copy kind"  # from a copy's name: "Memcpy HtoD (...)" -> "HtoD"; a memset: "memset"
DIM3_X = "dim3 x"  # one element of a [x, y, z] list (grid, block); -1 when it is not one
DIM3_Y = "dim3 y"
DIM3_Z = "dim3 z"
TRACE_PID = "trace pid"  # no key: the pid of the trace's process, once the trace names it

KINETO_KERNEL = (
    ("start_ns", ("ts",), US_START, None),
    ("end_ns", ("dur",), US_DURATION, 0.0),
    ("name", ("name",), TEXT, None),
    # a GPU event's own pid and tid are its device and stream, for traces without the args
    ("device", ("args.device", "pid"), AS_IS, None),
    ("stream", ("args.stream", "tid"), AS_IS, None),
    ("pid", (), TRACE_PID, None),
    ("grid_x", ("args.grid",), DIM3_X, None),
    ("grid_y", ("args.grid",), DIM3_Y, None),
    ("grid_z", ("args.grid",), DIM3_Z, None),
    ("block_x", ("args.block",), DIM3_X, None),
    ("block_y", ("args.block",), DIM3_Y, None),
    ("block_z", ("args.block",), DIM3_Z, None),
    ("registers", ("args.registers per thread",), AS_IS, -1),
    ("dynamic_smem", ("args.shared memory",), AS_IS, -1),  # static + dynamic: KINETO_DERIVED
    ("correlation_id", ("args.correlation",), AS_IS, -1),
    ("graph_id", ("args.graph id", "args.graph_id"), AS_IS, -1),
)
KINETO_API = (
    ("start_ns", ("ts",), US_START, None),
    ("end_ns", ("dur",), US_DURATION, 0.0),
    ("name", ("name",), TEXT, None),
    ("pid", ("pid",), AS_IS, None),
    ("tid", ("tid",), AS_IS, -1),
    ("correlation_id", ("args.correlation",), AS_IS, -1),
)
KINETO_COPY = (
    ("start_ns", ("ts",), US_START, None),
    ("end_ns", ("dur",), US_DURATION, 0.0),
    ("kind", ("name",), COPY_KIND, None),
    ("bytes", ("args.bytes",), AS_IS, -1),
    ("device", ("args.device", "pid"), AS_IS, None),
    ("stream", ("args.stream", "tid"), AS_IS, None),
    ("pid", (), TRACE_PID, None),
    ("correlation_id", ("args.correlation",), AS_IS, -1),
)
KINETO_HOST_RANGE = (  # a range on a host thread, as an NVTX range is
    ("start_ns", ("ts",), US_START, None),
    ("end_ns", ("dur",), US_DURATION, 0.0),
    ("name", ("name",), TEXT, None),
    ("domain", ("cat",), CATEGORY, None),
    ("pid", ("pid",), AS_IS, None),
    ("tid", ("tid",), AS_IS, None),
)
KINETO_GPU_RANGE = (  # an annotation drawn on a GPU stream: its pid is the device's
    ("start_ns", ("ts",), US_START, None),
    ("end_ns", ("dur",), US_DURATION, 0.0),
    ("name", ("name",), TEXT, None),
    ("domain", ("cat",), CATEGORY, None),
    ("pid", (), TRACE_PID, None),
    ("tid", ("tid",), AS_IS, None),  # the stream
)

# (table, the Kineto categories read together, their fields). Events of any other category
# are counted per category and not stored.
KINETO = (
    ("kernels", ("kernel",), KINETO_KERNEL),
    ("api", ("cuda_runtime", "cuda_driver"), KINETO_API),
    ("memcpy", ("gpu_memcpy", "gpu_memset"), KINETO_COPY),
    ("markers", ("user_annotation", "cpu_op"), KINETO_HOST_RANGE),
    ("markers", ("gpu_user_annotation",), KINETO_GPU_RANGE),
)

# -- what each column holds where a source has no field for it --------------------------------
# CUPTI: per record kind, the columns left to `rows_to_batch`'s defaults (or CONSTANTS).
_OURS = "the agent's own pid: CUPTI records only the process the agent runs in"
CUPTI_FILLED: dict[str, dict[str, str]] = {
    "CONCURRENT_KERNEL": {"pid": _OURS},
    "KERNEL": {"pid": _OURS},
    "RUNTIME": {},
    "DRIVER": {},
    "SYNCHRONIZATION": {
        "pid": _OURS,
        "tid": "-1: a synchronization record names no thread",
    },
    "MEMCPY": {"pid": _OURS},
    "MEMSET": {"pid": _OURS, "kind": "CONSTANTS: every memset row is of kind 'memset'"},
    "MARKER": {"pid": _OURS},
}
# Kineto: per table, the columns made from other columns rather than from a field.
KINETO_DERIVED: dict[str, dict[str, str]] = {
    "kernels": {
        "static_smem": "Kineto gives static + dynamic shared memory as one figure, kept in "
        "dynamic_smem so their sum is right: 0, or -1 where that figure is n/a",
    },
}
# Tables neither CUPTI activity records nor Kineto events fill: who does.
OTHER_TABLES: dict[str, str] = {
    "gpu_samples": "NVML, polled by collectors.nvml",
    "gpu_procs": "NVML's per-process figures, collectors.nvml",
    "threads": "/proc, polled by collectors.sched",
    "cpu_freq": "/proc and /sys, polled by collectors.sched",
    "kernel_symbols": "kernel names demangled at ingest (kdash.names)",
    "pc_samples": "CUPTI's PC sampling API, not activity records (agent.pcsampling)",
    "source_lines": "the line tables of sampled cubins (agent.lines, kdash.cubin)",
    "source_files": "the source files those line tables point at (agent.lines)",
    "findings": "kdash's analyses",
    "server": "SGLang's metrics endpoint (collectors.sglang_http)",
}
