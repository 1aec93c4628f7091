"""The record model: one columnar schema per table, shared by sources, store, captures and panes.

A *batch* is a dict of equal-length numpy arrays keyed by column name. Sources emit batches,
the store keeps them in bounded rings, captures write them as Parquet, analyses read them as
DataFrames. Missing values are NaN for floats and -1 for integers ("n/a" on screen); NVML or
/proc fields that a machine cannot give never become exceptions.

Each table has one time column (`TIME_COLUMN`) on the host monotonic clock, used to trim
rings and cut capture windows.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

Batch = dict[str, np.ndarray]

STR = "str"  # stored as object arrays of Python str

# One thread waits at most the whole of a second for a CPU. Captures recorded before the
# scheduler source capped its rate hold larger values (a wait credited all at once when it
# ended); analyses clip them to this.
RUNQ_MAX_MS_PER_S = 1000.0

SCHEMA_VERSION = 1

TABLES: dict[str, list[tuple[str, str]]] = {
    # One row per GPU per NVML poll.
    "gpu_samples": [
        ("t_ns", "i8"),
        ("gpu", "i2"),
        ("sm_clock_mhz", "f4"),
        ("mem_clock_mhz", "f4"),
        ("sm_clock_max_mhz", "f4"),
        ("mem_clock_max_mhz", "f4"),
        ("temp_c", "f4"),
        ("power_w", "f4"),
        ("power_limit_w", "f4"),
        ("energy_j", "f8"),
        ("util_gpu_pct", "f4"),
        ("util_mem_pct", "f4"),
        ("mem_used_mib", "f4"),
        ("mem_total_mib", "f4"),
        ("pstate", "i2"),
        ("pcie_tx_kbs", "f4"),
        ("pcie_rx_kbs", "f4"),
        ("throttle_reasons", "i8"),  # NVML clock-event reason bits; -1 = n/a
    ],
    # One row per (pid, gpu) of the target's tree per NVML poll.
    "gpu_procs": [
        ("t_ns", "i8"),
        ("gpu", "i2"),
        ("pid", "i8"),
        ("mem_used_mib", "f4"),
        ("sm_util_pct", "f4"),
    ],
    # One row per thread of the target's tree per scheduler poll; rates are per second of wall time.
    "threads": [
        ("t_ns", "i8"),
        ("pid", "i8"),
        ("tid", "i8"),
        ("name", STR),
        ("cpu_pct", "f4"),
        ("cpu", "i4"),  # CPU last run on
        ("allowed_cpus", STR),  # cpulist, e.g. "0-31,64-95"
        ("runq_ms_per_s", "f4"),  # schedstat run-queue wait; <= RUNQ_MAX_MS_PER_S
        ("vol_switches", "i8"),  # cumulative
        ("invol_switches", "i8"),  # cumulative
        ("migrations", "i8"),  # cumulative se.nr_migrations; -1 = n/a
    ],
    # One row per CPU per scheduler poll.
    "cpu_freq": [
        ("t_ns", "i8"),
        ("cpu", "i4"),
        ("mhz", "f4"),
        ("max_mhz", "f4"),
        ("busy_pct", "f4"),
    ],
    "kernels": [
        ("start_ns", "i8"),
        ("end_ns", "i8"),
        ("name", STR),
        ("device", "i2"),
        ("stream", "i8"),
        ("pid", "i8"),
        ("grid_x", "i4"),
        ("grid_y", "i4"),
        ("grid_z", "i4"),
        ("block_x", "i4"),
        ("block_y", "i4"),
        ("block_z", "i4"),
        ("registers", "i4"),
        ("static_smem", "i4"),
        ("dynamic_smem", "i4"),
        ("correlation_id", "i8"),
        ("graph_id", "i8"),
    ],
    # One row per kernel symbol that was demangled at ingest (kdash.names): `kernels.name` holds
    # the demangled name, this the symbol as recorded. Descriptive: see STATIC_TABLES. Older
    # captures have none; loading them demangles and fills it.
    "kernel_symbols": [
        ("t_ns", "i8"),  # when the symbol was first seen
        ("name", STR),
        ("mangled", STR),
    ],
    "api": [
        ("start_ns", "i8"),
        ("end_ns", "i8"),
        ("name", STR),
        ("pid", "i8"),
        ("tid", "i8"),
        ("correlation_id", "i8"),
    ],
    "memcpy": [
        ("start_ns", "i8"),
        ("end_ns", "i8"),
        ("kind", STR),  # HtoD, DtoH, DtoD, memset, ...
        ("bytes", "i8"),
        ("device", "i2"),
        ("stream", "i8"),
        ("pid", "i8"),
        ("correlation_id", "i8"),
    ],
    # Named ranges of one thread: NVTX ranges (domain: the NVTX domain), the agent's recording
    # windows (domain "kdash") and, imported from Kineto traces, user annotations and CPU ops
    # (domain: the trace's category: "user_annotation", "cpu_op"; "gpu_user_annotation" rows
    # are on a GPU stream, tid = the stream).
    "markers": [
        ("start_ns", "i8"),
        ("end_ns", "i8"),
        ("name", STR),
        ("domain", STR),
        ("pid", "i8"),
        ("tid", "i8"),
    ],
    "pc_samples": [
        ("t_ns", "i8"),
        ("kernel", STR),
        ("cubin_crc", "i8"),
        ("pc_offset", "i8"),
        ("stall_reason", STR),
        ("count", "i8"),
    ],
    # One row per SASS instruction of a cubin whose kernels were sampled: the cubin's line table
    # (kdash.cubin), so a capture shows source lines offline without the cubin or nvdisasm.
    # t_ns is when the table was made (module load); the table is descriptive, not a time
    # series: see STATIC_TABLES.
    "source_lines": [
        ("t_ns", "i8"),
        ("kernel", STR),
        ("cubin_crc", "i8"),  # cuptiGetCubinCrc; -1 = n/a (then matched by kernel name)
        ("cubin_sha256", STR),
        ("pc_offset", "i8"),  # from the function's start, as CUPTI's pcOffset
        ("function", STR),
        ("file", STR),  # "" when the cubin has no line info
        ("line", "i4"),
        ("inlined", STR),  # inlined frames, innermost first: "standard.py:216 <- k.py:429"
        ("sass", STR),
        ("file_sha256", STR),  # the source file's hash when the table was made
    ],
    # The text of each source file a line table points at, as it was when the table was made,
    # so a capture shows the code that ran wherever it is opened (the file may be gone there,
    # or changed: torch.compile's generated modules live in /tmp). Static, like source_lines.
    "source_files": [
        ("t_ns", "i8"),
        ("file", STR),
        ("sha256", STR),
        ("text", STR),
    ],
    "findings": [
        ("t_ns", "i8"),
        ("severity", STR),  # "critical" | "warning" | "info"
        ("kind", STR),
        ("subject", STR),
        ("evidence", STR),
        ("advice", STR),
    ],
    "server": [
        ("t_ns", "i8"),
        ("metric", STR),
        ("value", "f8"),
    ],
}

# Tables that describe things rather than record events: the store never ages them out by
# time, and a capture keeps them whole (a line table made before the window still maps the
# window's samples).
STATIC_TABLES: frozenset[str] = frozenset({"source_lines", "source_files", "kernel_symbols"})

TIME_COLUMN: dict[str, str] = {
    name: ("start_ns" if cols[0][0] == "start_ns" else "t_ns") for name, cols in TABLES.items()
}


def _np_dtype(code: str) -> np.dtype:
    return np.dtype(object) if code == STR else np.dtype(code)


def _fill(code: str):
    if code == STR:
        return ""
    if code.startswith("f"):
        return np.nan
    return -1


def np_dtype(code: str) -> np.dtype:
    """The numpy dtype of a column type code ("i8", "f4", STR ...)."""
    return _np_dtype(code)


def empty_column(code: str, n: int) -> np.ndarray:
    """`n` n/a values of a column type code (what a missing column reads as)."""
    return np.full(n, _fill(code), dtype=_np_dtype(code))


def columns(table: str) -> list[str]:
    return [c for c, _ in TABLES[table]]


def empty(table: str) -> Batch:
    return {c: np.empty(0, dtype=_np_dtype(t)) for c, t in TABLES[table]}


def make_batch(table: str, rows: list[Mapping[str, object]] | None = None, **cols) -> Batch:
    """Build a schema-conforming batch from row dicts or from column sequences.

    Absent columns are filled with the n/a value of their type; unknown keys are an error,
    so a typo in a collector fails its test instead of silently dropping data.
    """
    spec = TABLES[table]
    known = {c for c, _ in spec}
    if rows is not None:
        if cols:
            raise ValueError("give rows or columns, not both")
        for r in rows:
            extra = set(r) - known
            if extra:
                raise KeyError(f"{table}: unknown columns {sorted(extra)}")
        n = len(rows)
        out: Batch = {}
        for c, t in spec:
            fill = _fill(t)
            vals = [r.get(c, fill) for r in rows]
            out[c] = _coerce(vals, t, n)
        return out
    extra = set(cols) - known
    if extra:
        raise KeyError(f"{table}: unknown columns {sorted(extra)}")
    n = None
    for v in cols.values():
        n = len(v)
        break
    n = n or 0
    out = {}
    for c, t in spec:
        if c in cols:
            if len(cols[c]) != n:
                raise ValueError(f"{table}.{c}: length {len(cols[c])} != {n}")
            out[c] = _coerce(cols[c], t, n)
        else:
            out[c] = np.full(n, _fill(t), dtype=_np_dtype(t))
    return out


def _coerce(vals, code: str, n: int) -> np.ndarray:
    dt = _np_dtype(code)
    if code == STR:
        arr = np.empty(n, dtype=object)
        arr[:] = [("" if v is None else str(v)) for v in vals]
        return arr
    if code.startswith("f"):
        return (
            np.asarray([np.nan if v is None else v for v in vals], dtype=dt)
            if isinstance(vals, list)
            else np.asarray(vals, dtype=dt)
        )
    if isinstance(vals, list):
        vals = [-1 if v is None else v for v in vals]
    return np.asarray(vals, dtype=dt)


def batch_len(batch: Batch) -> int:
    for v in batch.values():
        return len(v)
    return 0


def concat(table: str, batches: list[Batch]) -> Batch:
    if not batches:
        return empty(table)
    if len(batches) == 1:
        return batches[0]
    return {c: np.concatenate([b[c] for b in batches]) for c in columns(table)}


def to_frame(table: str, batch: Batch):
    """A pandas DataFrame with the schema's column order and dtypes (strings as object)."""
    import pandas as pd

    return pd.DataFrame({c: batch[c] for c in columns(table)})


def from_frame(table: str, df) -> Batch:
    """Back from a DataFrame (e.g. a capture's Parquet) to a batch; missing columns filled."""
    cols = {c: df[c].to_numpy() for c in columns(table) if c in df.columns}
    n = len(df)
    out: Batch = {}
    for c, t in TABLES[table]:
        if c in cols:
            v = cols[c]
            if t == STR:
                arr = np.empty(n, dtype=object)
                arr[:] = ["" if x is None else str(x) for x in v]
                out[c] = arr
            else:
                out[c] = np.asarray(v, dtype=_np_dtype(t))
        else:
            out[c] = np.full(n, _fill(t), dtype=_np_dtype(t))
    return out
