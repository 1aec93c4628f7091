"""Captures on disk: one self-describing, versioned `.kdash` file.

Layout: a zip archive (stored, not deflated: Parquet is already compressed) holding

    kdash.json               metadata: format tag, schema version, target, host, GPUs, driver,
                             clock offsets, window, sources' health, kdash version
    tables/<table>.parquet   one Parquet file per non-empty table of `kdash.schema.TABLES`

Why a zip of Parquet: one file to scp, every table readable by pandas/pyarrow, and a reader can
check the tag before trusting anything. Written into an unnamed file and linked to its name only
when whole (kdash.atomic), so a crash or a full disk never leaves a half capture under the final
name, and an existing file is never replaced.

Reading trusts nothing: `kdash.json` is checked for size, depth and the types of every key kdash
reads; every table it lists must be there with the row count it gives (a table that vanished
from a damaged zip directory is damage, not an empty table); sizes, row counts and column types
are checked from the zip directory and the Parquet footer before any table is read
(kdash.limits).

    >>> import kdash
    >>> tables = kdash.read_capture("run.kdash")      # dict of pandas DataFrames
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdash import limits, schema
from kdash.errors import CaptureError, UserError
from kdash.meta import CaptureMeta
from kdash.names import demangle_kernel_frame, symbol_rows

FORMAT_TAG = "kdash-capture"
META_NAME = "kdash.json"
SUFFIX = ".kdash"


@dataclass
class Capture:
    meta: dict  # kdash.json as read (checked against META_SPEC); `info` is its typed record
    tables: dict = field(default_factory=dict)  # table name -> pandas.DataFrame
    path: Path | None = None

    @property
    def info(self) -> CaptureMeta:
        return CaptureMeta.from_dict(self.meta)

    def batch(self, table: str) -> schema.Batch:
        df = self.tables.get(table)
        if df is None:
            return schema.empty(table)
        return schema.from_frame(table, df)


def check_new_path(path: str | os.PathLike) -> Path:
    """The path a new capture will be written to (`.kdash` added), or a one-line UserError.

    kdash never overwrites a capture: an existing file is an error, not a replacement. This is
    the early check (before a recording starts); the write itself is exclusive too.
    """
    path = Path(path)
    if path.suffix != SUFFIX:
        path = path.with_name(path.name + SUFFIX)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give a file name for the capture")
    if not path.parent.exists():
        raise UserError(f"no such folder: {path.parent}")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"cannot write in {path.parent}: permission denied")
    if path.exists() or path.is_symlink():
        raise UserError(f"{path} exists; remove it or choose another name (kdash never overwrites)")
    check_writable_folder(path.parent)
    return path


def check_writable_folder(folder: Path) -> None:
    """Make and remove a file in `folder` now, so a folder that cannot hold one (/proc, a
    read-only mount; root passes os.access everywhere) fails before a long recording, not
    after it."""
    import tempfile

    try:
        fd, name = tempfile.mkstemp(prefix=".kdash-check-", dir=folder)
    except OSError as e:
        raise UserError(f"cannot write in {folder}: {e.strerror or e}") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)


def write_capture(
    path: str | os.PathLike, meta: CaptureMeta | dict, tables: dict[str, schema.Batch]
) -> Path:
    """Write atomically and exclusively; returns the final path. `tables` maps table name ->
    batch. UserError when the path exists (even one created while writing) or the disk fails."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kdash import __version__
    from kdash.atomic import new_file

    path = Path(path)
    if path.suffix != SUFFIX:
        path = path.with_name(path.name + SUFFIX)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the folder {path.parent}: {e.strerror or e}") from None
    full_meta = meta.to_dict() if isinstance(meta, CaptureMeta) else dict(meta)
    full_meta["format"] = FORMAT_TAG
    full_meta["schema_version"] = schema.SCHEMA_VERSION
    full_meta.setdefault("kdash_version", __version__)
    full_meta["tables"] = {
        name: schema.batch_len(b) for name, b in tables.items() if name in schema.TABLES
    }
    with new_file(path) as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
        zf.writestr(META_NAME, json.dumps(full_meta, indent=1, default=_json_default))
        for name, batch in tables.items():
            if name not in schema.TABLES or schema.batch_len(batch) == 0:
                continue
            tbl = pa.Table.from_pandas(schema.to_frame(name, batch), preserve_index=False)
            buf = io.BytesIO()
            pq.write_table(tbl, buf, compression="zstd")
            zf.writestr(f"tables/{name}.parquet", buf.getvalue())
    return path


def _json_default(o: object) -> object:
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_meta(path: str | os.PathLike) -> dict:
    p = Path(path)
    with _open_zip(p) as zf:
        return _meta(zf, p)


def load_capture(path: str | os.PathLike) -> Capture:
    """Load every table into pandas. Raises CaptureError (one line) for anything not ours."""
    p = Path(path)
    with _open_zip(p) as zf:
        meta = _meta(zf, p)
        listed = meta.get("tables")
        tables = {}
        for name in schema.TABLES:
            member = f"tables/{name}.parquet"
            expected = listed.get(name) if isinstance(listed, dict) else None
            try:
                info = zf.getinfo(member)
            except KeyError:
                if expected:
                    raise CaptureError(
                        f"{p}: damaged capture ({member} is missing; {META_NAME} lists "
                        f"{expected} rows)"
                    ) from None
                tables[name] = schema.to_frame(name, schema.empty(name))
                continue
            raw = _read_member(zf, info, p, limits.MAX_MEMBER_BYTES)
            tables[name] = _read_table(name, raw, expected, p, member)
    # Captures written before kdash demangled at ingest hold CUPTI's symbols
    done = demangle_kernel_frame(tables["kernels"])
    known = set(tables["kernel_symbols"]["mangled"])
    new = {m: d for m, d in done.items() if m not in known}
    if new:
        import pandas as pd

        t0 = int(tables["kernels"]["start_ns"].min())
        rows = schema.to_frame("kernel_symbols", symbol_rows(new, t0))
        tables["kernel_symbols"] = pd.concat([tables["kernel_symbols"], rows], ignore_index=True)
    return Capture(meta=meta, tables=tables, path=p)


# -- reading, checked ----------------------------------------------------------------------
_ZIP_ERRORS: tuple[type[BaseException], ...] = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    OSError,
    EOFError,
    zlib.error,
    struct.error,
    ValueError,
    OverflowError,
    NotImplementedError,
    RuntimeError,  # zipfile: an encrypted member
)
_METHODS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflated"}


def _open_zip(p: Path) -> zipfile.ZipFile:
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise CaptureError(f"no such file: {p}") from None
    except OSError as e:
        raise CaptureError(f"cannot read {p}: {e.strerror or e}") from None
    if stat.S_ISDIR(st.st_mode):
        raise CaptureError(f"{p} is a folder, not a capture file")
    if not stat.S_ISREG(st.st_mode):
        # a pipe would block (or be read once): the zip directory is at the end of the file
        raise CaptureError(
            f"{p} is not a regular file (a pipe or a device?); kdash reads captures from files"
        )
    try:
        zf = zipfile.ZipFile(p)
    except OSError as e:
        raise CaptureError(f"cannot read {p}: {e.strerror or e}") from None
    except _ZIP_ERRORS:
        raise CaptureError(
            f"{p} is not a kdash capture (not a .kdash archive, or truncated)"
        ) from None
    return zf


def _read_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, p: Path, limit: int) -> bytes:
    """A member's bytes, after checking its method and inflated size in the zip directory;
    its CRC is checked by zipfile as it is read."""
    name = info.filename
    if info.compress_type not in _METHODS:
        raise CaptureError(
            f"{p}: damaged capture ({name}: unsupported zip compression method "
            f"{info.compress_type}; kdash writes stored members)"
        )
    if info.flag_bits & 0x1:
        raise CaptureError(f"{p}: damaged capture ({name} is encrypted)")
    if info.file_size > limit:
        raise limits.LimitError(
            f"{p}: {name} inflates to {info.file_size / 2**20:.0f} MiB, over kdash's limit "
            f"of {limit / 2**20:.0f} MiB (damaged, or not written by kdash)"
        )
    try:
        with zf.open(info) as fh:
            raw = fh.read(limit + 1)
    except _ZIP_ERRORS as e:
        raise CaptureError(f"{p}: damaged capture ({name}: {e})") from None
    if len(raw) != info.file_size:
        raise CaptureError(
            f"{p}: damaged capture ({name}: {len(raw)} bytes, the zip directory says "
            f"{info.file_size})"
        )
    return raw


def _arrow_kind_ok(code: str, typ: Any) -> bool:
    import pyarrow as pa

    if pa.types.is_null(typ):
        return True
    if pa.types.is_dictionary(typ):
        typ = typ.value_type
    if code == schema.STR:
        return pa.types.is_string(typ) or pa.types.is_large_string(typ)
    if code.startswith("f"):
        return pa.types.is_floating(typ) or pa.types.is_integer(typ)
    return pa.types.is_integer(typ)


def _read_table(name: str, raw: bytes, expected: int | None, p: Path, member: str):
    """One table's Parquet bytes -> DataFrame in the schema's columns, checked from the footer
    first (row count, uncompressed size, column types); read on this thread only, so a damaged
    file never leaves pyarrow's reader threads running when kdash exits."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    def damaged(why: object) -> CaptureError:
        return CaptureError(f"{p}: damaged capture ({member}: {why})")

    try:
        pf = pq.ParquetFile(pa.BufferReader(raw), pre_buffer=False)
        md = pf.metadata
        rows = md.num_rows
        inflated = sum(md.row_group(i).total_byte_size for i in range(md.num_row_groups))
        arrow_schema = pf.schema_arrow
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt input
        raise damaged(e) from None
    _check_footer(rows, inflated, expected, p, member, damaged)
    spec = dict(schema.TABLES[name])
    present = {f.name: f.type for f in arrow_schema}
    for col, code in spec.items():
        if col in present and not _arrow_kind_ok(code, present[col]):
            raise damaged(f"column {col} is {present[col]}, not {_KIND_NAMES[code[0]]}")
    wanted = [c for c in spec if c in present]
    df = _read_columns(pf, wanted, spec, rows, damaged)
    for col, code in spec.items():  # a column kdash did not write yet: its n/a value
        if col not in df.columns:
            df[col] = schema.empty_column(code, len(df))
    return df[list(spec)]


def _check_footer(
    rows: int,
    inflated: int,
    expected: int | None,
    p: Path,
    member: str,
    damaged: Callable[[object], CaptureError],
) -> None:
    """The footer's row count and inflated size against kdash's limits and the metadata."""
    if rows < 0 or rows > limits.MAX_ROWS:
        raise limits.LimitError(
            f"{p}: {member} claims {rows} rows, over kdash's limit of {limits.MAX_ROWS} "
            "(damaged, or not written by kdash)"
        )
    if expected is not None and rows != expected:
        raise damaged(f"{rows} rows, {META_NAME} lists {expected}")
    if inflated > limits.MAX_PARQUET_BYTES:
        raise limits.LimitError(
            f"{p}: {member} inflates to {inflated / 2**30:.1f} GiB, over kdash's limit of "
            f"{limits.MAX_PARQUET_BYTES / 2**30:.0f} GiB"
        )


def _read_columns(
    pf: Any,
    wanted: list[str],
    spec: dict[str, str],
    rows: int,
    damaged: Callable[[object], CaptureError],
) -> Any:
    """The wanted columns as a DataFrame, nulls filled with each column's n/a value."""
    import pyarrow as pa
    import pyarrow.compute as pc

    try:
        tbl = pf.read(columns=wanted, use_threads=False)
        if tbl.num_rows != rows:
            raise damaged(f"{tbl.num_rows} rows read, the footer says {rows}")
        for col in wanted:
            arr = tbl.column(col)
            if arr.null_count or pa.types.is_null(arr.type):
                fill = _fill_scalar(spec[col])
                filled = pc.fill_null(arr.cast(_arrow_type(spec[col])), fill)
                tbl = tbl.set_column(tbl.schema.get_field_index(col), col, filled)
        return tbl.to_pandas(use_threads=False)
    except CaptureError:
        raise
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - pyarrow raises several types for corrupt input
        raise damaged(e) from None


_KIND_NAMES = {"s": "strings", "f": "numbers", "i": "integers"}


def _arrow_type(code: str) -> Any:
    import pyarrow as pa

    if code == schema.STR:
        return pa.string()
    return pa.from_numpy_dtype(schema.np_dtype(code))


def _fill_scalar(code: str) -> object:
    if code == schema.STR:
        return ""
    if code.startswith("f"):
        return float("nan")
    return -1


# -- kdash.json ----------------------------------------------------------------------------
def _meta(zf: zipfile.ZipFile, p: Path) -> dict:
    try:
        info = zf.getinfo(META_NAME)
    except KeyError:
        raise CaptureError(f"{p} is not a kdash capture (no {META_NAME} inside)") from None
    raw = _read_member(zf, info, p, limits.MAX_META_BYTES)
    try:
        limits.JsonGuard().feed(raw)
    except limits.LimitError as e:
        raise CaptureError(f"{p}: damaged capture ({META_NAME}: {e})") from None
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError):
        raise CaptureError(f"{p}: damaged capture (metadata is not JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        raise CaptureError(f"{p} is not a kdash capture (format tag missing)")
    ver = meta.get("schema_version")
    if not isinstance(ver, int) or isinstance(ver, bool):
        raise CaptureError(
            f"{p}: damaged capture (schema_version is {_json_type(ver)}, not an integer)"
        )
    if ver > schema.SCHEMA_VERSION:
        raise CaptureError(
            f"{p} has capture schema {ver}; this kdash reads up to {schema.SCHEMA_VERSION}: "
            "upgrade kdash"
        )
    problem = _check(meta, META_SPEC, "")
    if problem:
        raise CaptureError(f"{p}: damaged capture ({META_NAME}: {problem})")
    return meta


def validate_meta(meta: object) -> str:
    """What is wrong with a capture's metadata, "" when nothing: the keys kdash reads must have
    the types it reads them as (a capture's file is not to be trusted)."""
    return _check(meta, META_SPEC, "")


def _json_type(v: object) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "a list"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


class _Obj:
    """An object whose listed keys, when present, have the given specs; others are free."""

    def __init__(self, fields: dict[str, Any], required: tuple[str, ...] = ()) -> None:
        self.fields = fields
        self.required = required


class _List:
    def __init__(self, item: Any) -> None:
        self.item = item


class _Map:
    """An object with any keys, each value of one spec."""

    def __init__(self, value: Any) -> None:
        self.value = value


_NUM = (int, float)
_SCALAR = (str, int, float, bool, type(None))
_N = type(None)

META_SPEC = _Obj(
    {
        "format": (str,),
        "kdash_version": (str, _N),
        "created_wall_ns": (int, _N),
        "title": (str, _N),
        "origin": (str, _N),
        "target": (_N, _Obj({"pid": (int, _N), "cmdline": (str, _N), "host": (str, _N)})),
        "host": (_N, _Obj({"hostname": (str, _N)})),
        "gpus": (
            _N,
            _List(_Obj({"index": (int,), "name": (str, _N), "local_cpus": (str, _N)})),
        ),
        "driver": (str, _N),
        "clock": (_N, _Obj({"wall_offset_ns": (int, _N), "domain": (str, _N)})),
        "window": (
            _N,
            _Obj(
                {
                    "start_ns": (int, _N),
                    "end_ns": (int, _N),
                    "seconds": (*_NUM, _N),
                    "trigger_ns": (int, _N),
                }
            ),
        ),
        "sources": (_N, _Map(_SCALAR)),
        "sources_health": (
            _N,
            _Map(
                _Obj(
                    {
                        "state": (str,),
                        "code": (str,),
                        "reason": (str,),
                        "fields": (_N, _Map(_SCALAR)),
                    },
                    ("state",),
                )
            ),
        ),
        "overflowed_rows": (int, _N),
        "interval_s": (*_NUM, _N),
        "topology": (_N, _Obj({"gpu_local_cpus": (_N, _Map((str, _N)))})),
        "tables": (_N, _Map((int,))),
        "traces": (_N, _List((dict,))),
        "cost_estimate": (_N, _Map((*_NUM, _N))),
        "sglang": (
            _N,
            _Obj(
                {
                    "url": (str, _N),
                    "server": (_N, _Obj({})),
                    "server_error": (str, _N),
                    "schedulers": (
                        _N,
                        _List(
                            _Obj(
                                {
                                    "pid": (int, str, _N),
                                    "gpu": (int, _N),
                                    "ranks": (str, _N),
                                    "gpu_source": (str, _N),
                                }
                            )
                        ),
                    ),
                    "roles": (
                        _N,
                        _List(_Obj({"pid": (int, str), "role": (str,)}, ("pid", "role"))),
                    ),
                }
            ),
        ),
    }
)


def _check(value: object, spec: Any, where: str) -> str:
    """ "" when `value` fits `spec`, else what does not (naming the key)."""
    if isinstance(spec, tuple):
        return _check_alts(value, spec, where)
    if isinstance(spec, _Obj):
        return _check_obj(value, spec, where)
    if isinstance(spec, _List):
        return _check_list(value, spec, where)
    if isinstance(spec, _Map):
        return _check_map(value, spec, where)
    raise TypeError(f"bad spec {spec!r}")


def _check_alts(value: object, spec: tuple, where: str) -> str:
    here = where or "the metadata"
    for alt in spec:
        if isinstance(alt, _Obj | _List | _Map):
            if isinstance(value, dict if not isinstance(alt, _List) else list):
                return _check(value, alt, where)
        elif isinstance(value, alt) and not (isinstance(value, bool) and alt in (int, float)):
            if isinstance(value, int) and not -(2**63) <= value < 2**63:
                return f"{here} is an integer beyond 64 bits"
            return ""
    return f"{here} is {_json_type(value)}, not {_spec_name(spec)}"


def _check_obj(value: object, spec: _Obj, where: str) -> str:
    if not isinstance(value, dict):
        return f"{where or 'the metadata'} is {_json_type(value)}, not an object"
    for key in spec.required:
        if key not in value:
            return f"{where}.{key} is missing" if where else f"{key} is missing"
    for key, sub in spec.fields.items():
        if key in value:
            problem = _check(value[key], sub, f"{where}.{key}" if where else key)
            if problem:
                return problem
    return ""


def _check_list(value: object, spec: _List, where: str) -> str:
    here = where or "the metadata"
    if not isinstance(value, list):
        return f"{here} is {_json_type(value)}, not a list"
    for i, item in enumerate(value):
        problem = _check(item, spec.item, f"{here}[{i}]")
        if problem:
            return problem
    return ""


def _check_map(value: object, spec: _Map, where: str) -> str:
    if not isinstance(value, dict):
        return f"{where or 'the metadata'} is {_json_type(value)}, not an object"
    for key, item in value.items():
        problem = _check(item, spec.value, f"{where}.{key}" if where else key)
        if problem:
            return problem
    return ""


def _spec_name(spec: tuple) -> str:
    names = []
    for alt in spec:
        if alt is _N:
            names.append("null")
        elif isinstance(alt, _Obj | _Map) or alt is dict:
            names.append("an object")
        elif isinstance(alt, _List) or alt is list:
            names.append("a list")
        else:
            names.append(
                {str: "a string", int: "an integer", float: "a number", bool: "a boolean"}[alt]
            )
    return " or ".join(dict.fromkeys(names))
