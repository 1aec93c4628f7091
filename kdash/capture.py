"""Captures on disk: one self-describing, versioned `.kdash` file.

Layout: a zip archive (stored, not deflated: Parquet is already compressed) holding

    kdash.json               metadata: format tag, schema version, target, host, GPUs, driver,
                             clock offsets, window, sources' health, kdash version
    tables/<table>.parquet   one Parquet file per non-empty table of `kdash.schema.TABLES`

Why a zip of Parquet: one file to scp, every table readable by pandas/pyarrow, and a reader can
check the tag before trusting anything. Written under a temporary name in the target folder and
renamed into place, so a crash or a full disk never leaves a half capture under the final name.

    >>> import kdash
    >>> tables = kdash.read_capture("run.kdash")      # dict of pandas DataFrames
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

from kdash import schema
from kdash.errors import CaptureError

FORMAT_TAG = "kdash-capture"
META_NAME = "kdash.json"
SUFFIX = ".kdash"


@dataclass
class Capture:
    meta: dict
    tables: dict = field(default_factory=dict)  # table name -> pandas.DataFrame
    path: Path | None = None

    def batch(self, table: str) -> schema.Batch:
        df = self.tables.get(table)
        if df is None:
            return schema.empty(table)
        return schema.from_frame(table, df)


def check_new_path(path: str | os.PathLike) -> Path:
    """The path a new capture will be written to (`.kdash` added), or a one-line UserError.

    kdash never overwrites a capture: an existing file is an error, not a replacement.
    """
    from kdash.errors import UserError

    path = Path(path)
    if path.suffix != SUFFIX:
        path = path.with_name(path.name + SUFFIX)
    if path.is_dir():
        raise UserError(f"{path} is a folder; give a file name for the capture")
    if not path.parent.exists():
        raise UserError(f"no such folder: {path.parent}")
    if not os.access(path.parent, os.W_OK):
        raise UserError(f"cannot write in {path.parent}: permission denied")
    if path.exists():
        raise UserError(f"{path} exists; remove it or choose another name (kdash never overwrites)")
    return path


def write_capture(path: str | os.PathLike, meta: dict, tables: dict[str, schema.Batch]) -> Path:
    """Write atomically; returns the final path. `tables` maps table name -> batch."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kdash import __version__

    path = Path(path)
    if path.suffix != SUFFIX:
        path = path.with_name(path.name + SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    full_meta = dict(meta)
    full_meta["format"] = FORMAT_TAG
    full_meta["schema_version"] = schema.SCHEMA_VERSION
    full_meta.setdefault("kdash_version", __version__)
    full_meta["tables"] = {
        name: schema.batch_len(b) for name, b in tables.items() if name in schema.TABLES
    }
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh, zipfile.ZipFile(fh, "w", zipfile.ZIP_STORED) as zf:
            zf.writestr(META_NAME, json.dumps(full_meta, indent=1, default=_json_default))
            for name, batch in tables.items():
                if name not in schema.TABLES or schema.batch_len(batch) == 0:
                    continue
                tbl = pa.Table.from_pandas(schema.to_frame(name, batch), preserve_index=False)
                buf = io.BytesIO()
                pq.write_table(tbl, buf, compression="zstd")
                zf.writestr(f"tables/{name}.parquet", buf.getvalue())
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def _json_default(o):
    import numpy as np

    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def read_meta(path: str | os.PathLike) -> dict:
    with _open_zip(Path(path)) as zf:
        return _meta(zf, Path(path))


def load_capture(path: str | os.PathLike) -> Capture:
    """Load every table into pandas. Raises CaptureError (one line) for anything not ours."""
    import pyarrow.parquet as pq

    p = Path(path)
    with _open_zip(p) as zf:
        meta = _meta(zf, p)
        tables = {}
        for name in schema.TABLES:
            member = f"tables/{name}.parquet"
            try:
                raw = zf.read(member)
            except KeyError:
                tables[name] = schema.to_frame(name, schema.empty(name))
                continue
            except (zipfile.BadZipFile, OSError, EOFError) as e:
                raise CaptureError(f"{p}: damaged capture ({member}: {e})") from None
            try:
                tables[name] = pq.read_table(io.BytesIO(raw)).to_pandas()
            except Exception as e:  # pyarrow raises several types for corrupt input
                raise CaptureError(f"{p}: damaged capture ({member}: {e})") from None
    return Capture(meta=meta, tables=tables, path=p)


def _open_zip(p: Path) -> zipfile.ZipFile:
    if not p.exists():
        raise CaptureError(f"no such file: {p}")
    if p.is_dir():
        raise CaptureError(f"{p} is a folder, not a capture file")
    try:
        zf = zipfile.ZipFile(p)
    except zipfile.BadZipFile:
        raise CaptureError(
            f"{p} is not a kdash capture (not a .kdash archive, or truncated)"
        ) from None
    except OSError as e:
        raise CaptureError(f"cannot read {p}: {e.strerror or e}") from None
    return zf


def _meta(zf: zipfile.ZipFile, p: Path) -> dict:
    try:
        raw = zf.read(META_NAME)
    except KeyError:
        raise CaptureError(f"{p} is not a kdash capture (no {META_NAME} inside)") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CaptureError(f"{p}: damaged capture ({e})") from None
    try:
        meta = json.loads(raw)
    except ValueError:
        raise CaptureError(f"{p}: damaged capture (metadata is not JSON)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_TAG:
        raise CaptureError(f"{p} is not a kdash capture (format tag missing)")
    ver = meta.get("schema_version")
    if not isinstance(ver, int) or ver > schema.SCHEMA_VERSION:
        raise CaptureError(
            f"{p} has capture schema {ver}; this kdash reads up to {schema.SCHEMA_VERSION}: "
            "upgrade kdash"
        )
    return meta
