"""The one map from CUPTI activity records to kdash's schema columns.

Both of the agent's decoders read it: the one that takes cupti-python's record objects
attribute by attribute (records.RecordConverter.convert) and the one that gathers the same
fields straight out of a CUPTI buffer with numpy (records.RecordConverter._columns). A column
the map gives no field for gets the agent's pid (column "pid") or -1 (n/a), as
`rows_to_batch` fills them, unless CONSTANTS names a value.

Markers (NVTX ranges) are not a field-by-field copy: START and END records are paired by id
(records.RecordConverter._marker), so they have their own columns below.
"""

from __future__ import annotations

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
