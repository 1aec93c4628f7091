"""Reading a Kineto trace file as a stream of JSON: the header, then one event at a time.

**Streaming.** `ijson` (its C backend, yajl2_c) yields one event at a time, so memory follows
the rows kept, not the file: a 1 GB trace does not need 10 GB. The header is read by a first,
short pass that stops at `traceEvents`; the events by a second pass. gzip is recognised by its
magic bytes, not the suffix.

**Bounds.** Every byte passes a `kdash.limits.JsonGuard` before the parser sees it (nesting
and string length), and only regular files are read (a pipe cannot be read twice): what a
hostile or damaged trace asks for is refused before it is allocated. What goes wrong while
reading becomes one `UserError` line that names the file (`stream_error`).
"""

from __future__ import annotations

import gzip
import io
import os
import stat
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from kdash import limits
from kdash.errors import UserError


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


def open_trace(path: Path) -> IO[bytes]:
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


def stream_error(path: Path, e: BaseException, events: int) -> UserError:
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


READ_BUF = 1 << 16  # bytes per read: ijson builds all events of one read before it yields any

READ_ERRORS: tuple[type[BaseException], ...] = (
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
    errors = (*READ_ERRORS, ijson.JSONError)
    if check_trace_file(path).st_size == 0:
        raise UserError(f"{path} is empty, not a trace")
    with open_trace(path) as fh:
        try:
            events = ijson.parse(fh, use_float=True, buf_size=READ_BUF)
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
            raise stream_error(path, e, 0) from None
        except UserError:
            raise
        except errors as e:
            raise stream_error(path, e, 0) from None
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


def iter_events(path: str | os.PathLike) -> Iterator[dict[str, Any]]:
    """Every event of a trace, one at a time (for tools and tests that need the raw events)."""
    import ijson

    p = Path(path)
    _, where = read_header(p)
    n = 0
    with open_trace(p) as fh:
        try:
            for ev in ijson.items(fh, where, use_float=True, buf_size=READ_BUF):
                n += 1
                yield ev
        except (*READ_ERRORS, ijson.JSONError) as e:
            raise stream_error(p, e, n) from None
