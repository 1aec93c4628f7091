"""The agent's wire format: framed binary messages carrying columnar record batches.

Why columnar: the agent may see hundreds of thousands of kernel records a second, and a message
per record (JSON, pickle, a struct per row) costs microseconds of Python per row on both sides.
A batch frame instead carries each column as one raw little-endian buffer, so encoding is a
`tobytes()` per column and decoding a `numpy.frombuffer` per column (no copy).

Strings (kernel names, API names, copy kinds, NVTX names) repeat endlessly, so they travel as
`u4` ids into a dictionary that the sender grows incrementally: a NAMES frame carries only the
strings that are new since the last one, and must arrive before the first batch that uses them.
One dictionary is shared by all tables and string columns of a connection.

Frame layout (all integers little-endian)::

    header   16 bytes  magic b"KDSH", version u1, message type u1, table id u1, column count u1,
                       row count u4, payload length u4
    payload  BATCH:    per column (in `kdash.schema.TABLES` order) a descriptor
                       (dtype code u1, byte length u4), then the column buffers back to back
             NAMES:    first id u4, count u4, count end offsets u4, then the UTF-8 blob
             control:  one UTF-8 JSON object (HELLO, START, STOP, STATS, STATUS, SET); never
                       pickle

The duty cycle (agent version 2) needed no new frame layout: START carries `period_ms`,
`on_ms`, `continuous` (and `graph_kernels`), SET changes them while attached, STATUS and
STATS carry `sampling`, and each window in which CUPTI activity was on travels as an ordinary
`markers` row (domain "kdash", name "activity on"). An agent of version 1 does not know SET
(it closes the connection on it), so the client sends SET only to agents whose HELLO says 2+.

A frame that does not match (bad magic, unknown type or table, wrong column count or dtype, a
length that disagrees with the row count, an unknown string id, an oversized payload) raises
`WireError` with a message that says which field was wrong. The decoder trusts nothing it reads.
"""

from __future__ import annotations

import json
import socket
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np

from kdash import schema
from kdash.schema import Batch

MAGIC = b"KDSH"
VERSION = 1

HEADER = struct.Struct("<4sBBBBII")
COLUMN_DESC = struct.Struct("<BI")
NAMES_HEAD = struct.Struct("<II")

MAX_PAYLOAD = 256 * 1024 * 1024  # one frame; a batch of 1M kernel rows is ~90 MB
MAX_CONTROL = 1024 * 1024  # control messages are a few hundred bytes
MAX_ROWS = 10_000_000


class WireError(ValueError):
    """A frame that is not a valid kdash agent message (the text says which field is wrong)."""


class MsgType(IntEnum):
    HELLO = 1  # agent -> client: version, pid, capabilities
    START = 2  # client -> agent: {"activities": [...], "period_ms", "on_ms", "continuous"}
    STOP = 3  # client -> agent: disable all activity
    STATS = 4  # client -> agent: request ({}); agent -> client: counters
    BATCH = 5  # agent -> client: one table's columnar rows
    STATUS = 6  # agent -> client: {"state": ..., "line": ...}
    NAMES = 7  # agent -> client: new dictionary strings
    SET = 8  # client -> agent: {"continuous": bool, "period_ms": int, "on_ms": int} (agent 2+)


CONTROL_TYPES = frozenset(
    {MsgType.HELLO, MsgType.START, MsgType.STOP, MsgType.STATS, MsgType.STATUS, MsgType.SET}
)

# The tables the agent sends; ids are part of the wire format, never reuse one.
TABLE_IDS: dict[str, int] = {"kernels": 1, "api": 2, "memcpy": 3, "markers": 4, "pc_samples": 5}
TABLE_NAMES: dict[int, str] = {v: k for k, v in TABLE_IDS.items()}

# Column dtype codes; STRING_ID columns are u4 ids into the connection's dictionary.
DTYPE_CODES: dict[str, int] = {"i2": 1, "i4": 2, "i8": 3, "f4": 4, "f8": 5, "u4": 6, "u8": 7}
STRING_ID = 8
CODE_DTYPES: dict[int, np.dtype] = {c: np.dtype("<" + d) for d, c in DTYPE_CODES.items()}
CODE_DTYPES[STRING_ID] = np.dtype("<u4")


def _wire_code(type_code: str) -> int:
    return STRING_ID if type_code == schema.STR else DTYPE_CODES[type_code]


# Per table: (column name, expected wire code, numpy dtype) in schema order.
_LAYOUT: dict[str, list[tuple[str, int, np.dtype]]] = {
    t: [(c, _wire_code(tc), CODE_DTYPES[_wire_code(tc)]) for c, tc in schema.TABLES[t]]
    for t in TABLE_IDS
}


@dataclass(frozen=True)
class Header:
    msg_type: MsgType
    table_id: int
    n_cols: int
    n_rows: int
    payload_len: int


@dataclass
class Message:
    """One decoded frame. `body` is a dict for control messages, a Batch for BATCH, the new
    strings for NAMES."""

    type: MsgType
    table: str | None = None
    body: Any = None
    first_id: int = 0


def decode_header(buf: bytes | bytearray | memoryview) -> Header:
    """Parse and check the 16-byte header (not the payload)."""
    if len(buf) < HEADER.size:
        raise WireError(f"short header: {len(buf)} bytes, need {HEADER.size}")
    magic, version, mtype, table_id, n_cols, n_rows, plen = HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        raise WireError(f"bad magic {bytes(magic)!r} (not a kdash agent frame)")
    if version != VERSION:
        raise WireError(f"wire version {version}, this kdash speaks {VERSION}")
    try:
        t = MsgType(mtype)
    except ValueError:
        raise WireError(f"unknown message type {mtype}") from None
    limit = MAX_PAYLOAD if t in (MsgType.BATCH, MsgType.NAMES) else MAX_CONTROL
    if plen > limit:
        raise WireError(f"{t.name} payload of {plen} bytes exceeds the {limit}-byte limit")
    if n_rows > MAX_ROWS:
        raise WireError(f"row count {n_rows} exceeds {MAX_ROWS}")
    return Header(t, table_id, n_cols, n_rows, plen)


def check_header(
    h: Header, accept: frozenset[MsgType] | None = None, max_payload: int | None = None
) -> None:
    """WireError when a decoded header is not one of `accept` or its payload is too long."""
    if accept is not None and h.msg_type not in accept:
        raise WireError(f"{h.msg_type.name} frames are not accepted here")
    if max_payload is not None and h.payload_len > max_payload:
        raise WireError(
            f"{h.msg_type.name} payload of {h.payload_len} bytes exceeds the {max_payload}-byte "
            "limit for this peer"
        )


def _frame(mtype: MsgType, payload: bytes, table_id: int = 0, n_cols: int = 0, n_rows: int = 0):
    return HEADER.pack(MAGIC, VERSION, int(mtype), table_id, n_cols, n_rows, len(payload)) + payload


# ---- control messages ---------------------------------------------------------------------------


def encode_control(mtype: MsgType, body: Mapping[str, Any] | None = None) -> bytes:
    """A control frame: a JSON object (only plain data; nothing is executed on receipt)."""
    if mtype not in CONTROL_TYPES:
        raise WireError(f"{MsgType(mtype).name} is not a control message")
    payload = json.dumps(dict(body or {}), separators=(",", ":")).encode()
    if len(payload) > MAX_CONTROL:
        raise WireError(f"control payload of {len(payload)} bytes exceeds {MAX_CONTROL}")
    return _frame(mtype, payload)


def _decode_control(h: Header, payload: memoryview) -> Message:
    try:
        body = json.loads(bytes(payload).decode())
    except (UnicodeDecodeError, ValueError) as e:
        raise WireError(f"{h.msg_type.name}: payload is not UTF-8 JSON ({e})") from None
    if not isinstance(body, dict):
        raise WireError(f"{h.msg_type.name}: payload is {type(body).__name__}, not an object")
    return Message(h.msg_type, body=body)


# ---- the string dictionary ----------------------------------------------------------------------


OVERFLOW_NAME = "<kdash: name table full>"


class StringEncoder:
    """Sender side of the dictionary: string -> id, and the strings not yet sent.

    `max_strings` / `max_bytes` bound the dictionary, which lives as long as the connection:
    a target that names every NVTX range differently would otherwise grow it (and the
    agent's memory) for the whole session. Past a bound every new string maps to one
    OVERFLOW_NAME entry (each such use counted in `overflowed`); strings longer than
    `max_chars` are cut. The defaults (None) keep everything.
    """

    def __init__(
        self,
        max_strings: int | None = None,
        max_bytes: int | None = None,
        max_chars: int | None = None,
    ) -> None:
        self._ids: dict[str, int] = {}
        self._strings: list[str] = []
        self._sent = 0
        self._max_strings = max_strings
        self._max_bytes = max_bytes
        self._max_chars = max_chars
        self._bytes = 0
        self._overflow_id: int | None = None
        self.overflowed = 0

    def __len__(self) -> int:
        return len(self._strings)

    def intern(self, s: str) -> int:
        i = self._ids.get(s)
        if i is not None:
            return i
        if self._max_chars is not None and len(s) > self._max_chars:
            s = s[: self._max_chars]  # the long original is not kept as a key: no growth
            i = self._ids.get(s)
            if i is not None:
                return i
        if self._full(len(s)):
            self.overflowed += 1
            return self._overflow()
        return self._add(s)

    def _full(self, chars: int) -> bool:
        # one slot and its bytes stay free for OVERFLOW_NAME
        if self._max_strings is not None and len(self._strings) + 2 > self._max_strings:
            return True
        return self._max_bytes is not None and self._bytes + 4 * (chars + 32) > self._max_bytes

    def _add(self, s: str) -> int:
        i = len(self._strings)
        self._ids[s] = i
        self._strings.append(s)
        self._bytes += 4 * len(s)  # upper bound of its UTF-8 length
        return i

    def _overflow(self) -> int:
        if self._overflow_id is None:
            self._overflow_id = self._ids.get(OVERFLOW_NAME)
            if self._overflow_id is None:
                self._overflow_id = self._add(OVERFLOW_NAME)
        return self._overflow_id

    def ids(self, values: Iterable[str]) -> np.ndarray:
        get = self._ids.get
        intern = self.intern
        return np.fromiter(
            ((i if (i := get(v)) is not None else intern(v)) for v in values), dtype="<u4"
        )

    def pending_names(self) -> bytes | None:
        """A NAMES frame with every string interned since the last call, or None."""
        if self._sent == len(self._strings):
            return None
        first = self._sent
        new = self._strings[first:]
        self._sent = len(self._strings)
        return encode_names(first, new)


def encode_names(first_id: int, names: Sequence[str]) -> bytes:
    blobs = [s.encode("utf-8", "surrogatepass") for s in names]
    ends = np.cumsum([len(b) for b in blobs], dtype="<u8") if blobs else np.zeros(0, "<u8")
    if ends.size and ends[-1] > 0xFFFFFFFF:
        raise WireError("NAMES blob over 4 GiB")
    payload = NAMES_HEAD.pack(first_id, len(names)) + ends.astype("<u4").tobytes() + b"".join(blobs)
    return _frame(MsgType.NAMES, payload)


def _decode_names(h: Header, payload: memoryview) -> Message:
    if len(payload) < NAMES_HEAD.size:
        raise WireError("NAMES: payload shorter than its 8-byte head")
    first, count = NAMES_HEAD.unpack_from(payload, 0)
    off = NAMES_HEAD.size
    if off + 4 * count > len(payload):
        raise WireError(f"NAMES: {count} offsets do not fit in {len(payload)} bytes")
    ends = np.frombuffer(payload, dtype="<u4", count=count, offset=off).astype(np.int64)
    blob = bytes(payload[off + 4 * count :])
    if count and (ends[-1] != len(blob) or np.any(np.diff(ends) < 0) or ends[0] < 0):
        raise WireError("NAMES: string offsets do not match the blob")
    if not count and blob:
        raise WireError("NAMES: trailing bytes after zero strings")
    starts = np.concatenate(([0], ends[:-1])) if count else ends
    try:
        names = [
            blob[a:b].decode("utf-8", "surrogatepass") for a, b in zip(starts, ends, strict=True)
        ]
    except UnicodeDecodeError as e:
        raise WireError(f"NAMES: string is not UTF-8 ({e})") from None
    return Message(MsgType.NAMES, body=names, first_id=first)


class StringTable:
    """Receiver side of the dictionary: id -> string, as an object array for vector lookups."""

    def __init__(self) -> None:
        self._names: list[str] = []
        self._arr = np.empty(0, dtype=object)

    def __len__(self) -> int:
        return len(self._names)

    def add(self, first_id: int, names: Sequence[str]) -> None:
        if first_id != len(self._names):
            raise WireError(
                f"NAMES starts at id {first_id} but the dictionary has {len(self._names)} strings"
            )
        self._names.extend(names)
        arr = np.empty(len(self._names), dtype=object)
        arr[:] = self._names
        self._arr = arr

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        if ids.size and int(ids.max()) >= len(self._names):
            raise WireError(
                f"string id {int(ids.max())} not in the dictionary ({len(self._names)} strings)"
            )
        return self._arr[ids]


# ---- batches ------------------------------------------------------------------------------------


def encode_batch(table: str, batch: Mapping[str, np.ndarray], strings: StringEncoder) -> bytes:
    """Frames for one table's rows: a NAMES frame first when new strings appeared, then BATCH.

    String columns may hold Python strings (looked up and interned here) or integer ids that
    came from the same `strings.intern` (the agent's fast path: it interns while converting).
    Numeric columns are cast to the schema dtype; a missing column is an error, not a default,
    so a converter bug shows up in the test rather than as a column of -1 on screen.
    """
    if table not in TABLE_IDS:
        raise WireError(f"table {table!r} is not sent by the agent")
    layout = _LAYOUT[table]
    n = None
    descs: list[bytes] = []
    bufs: list[bytes] = []
    for col, code, dt in layout:
        if col not in batch:
            raise WireError(f"{table}: column {col!r} missing")
        v = batch[col]
        if n is None:
            n = len(v)
        elif len(v) != n:
            raise WireError(f"{table}.{col}: {len(v)} rows, other columns have {n}")
        if code == STRING_ID:
            arr = np.asarray(v)
            if arr.dtype.kind in "iu":
                if arr.size and (int(arr.max()) >= len(strings) or int(arr.min()) < 0):
                    raise WireError(f"{table}.{col}: string id outside the dictionary")
                arr = arr.astype(dt, copy=False)
            else:
                arr = strings.ids(arr)
        else:
            arr = np.ascontiguousarray(v, dtype=dt)
        b = arr.tobytes()
        descs.append(COLUMN_DESC.pack(code, len(b)))
        bufs.append(b)
    n = n or 0
    out = strings.pending_names() or b""
    payload = b"".join(descs) + b"".join(bufs)
    if len(payload) > MAX_PAYLOAD:
        raise WireError(f"{table}: batch of {n} rows is {len(payload)} bytes; split it")
    return out + _frame(MsgType.BATCH, payload, TABLE_IDS[table], len(layout), n)


def _decode_batch(h: Header, payload: memoryview, strings: StringTable) -> Message:
    table = TABLE_NAMES.get(h.table_id)
    if table is None:
        raise WireError(f"BATCH for unknown table id {h.table_id}")
    layout = _LAYOUT[table]
    if h.n_cols != len(layout):
        raise WireError(f"{table}: {h.n_cols} columns, schema has {len(layout)}")
    off = COLUMN_DESC.size * h.n_cols
    if off > len(payload):
        raise WireError(f"{table}: column descriptors do not fit in {len(payload)} bytes")
    out: Batch = {}
    for i, (col, want, dt) in enumerate(layout):
        code, nbytes = COLUMN_DESC.unpack_from(payload, i * COLUMN_DESC.size)
        if code != want:
            raise WireError(f"{table}.{col}: dtype code {code}, expected {want}")
        if nbytes != h.n_rows * dt.itemsize:
            raise WireError(
                f"{table}.{col}: {nbytes} bytes for {h.n_rows} rows of {dt.itemsize} bytes"
            )
        if off + nbytes > len(payload):
            raise WireError(f"{table}.{col}: column runs past the end of the frame")
        arr = np.frombuffer(payload, dtype=dt, count=h.n_rows, offset=off)
        off += nbytes
        out[col] = strings.lookup(arr) if code == STRING_ID else arr
    if off != len(payload):
        raise WireError(f"{table}: {len(payload) - off} trailing bytes after the columns")
    return Message(MsgType.BATCH, table=table, body=out)


# ---- whole frames -------------------------------------------------------------------------------


@dataclass
class Decoder:
    """Receiver state for one connection: the string dictionary. `decode` takes one frame."""

    strings: StringTable = field(default_factory=StringTable)

    def decode(self, frame: bytes | bytearray | memoryview) -> Message:
        mv = memoryview(frame)
        h = decode_header(mv)
        payload = mv[HEADER.size :]
        if len(payload) != h.payload_len:
            raise WireError(f"payload is {len(payload)} bytes, header says {h.payload_len}")
        return self.decode_payload(h, payload)

    def decode_payload(self, h: Header, payload: memoryview) -> Message:
        if h.msg_type == MsgType.BATCH:
            return _decode_batch(h, payload, self.strings)
        if h.msg_type == MsgType.NAMES:
            msg = _decode_names(h, payload)
            self.strings.add(msg.first_id, msg.body)
            return msg
        return _decode_control(h, payload)


def split_frames(data: bytes | bytearray | memoryview) -> list[memoryview]:
    """Cut a byte string holding whole frames into frames (for tests and file replays)."""
    mv = memoryview(data)
    out = []
    pos = 0
    while pos < len(mv):
        h = decode_header(mv[pos : pos + HEADER.size])
        end = pos + HEADER.size + h.payload_len
        if end > len(mv):
            raise WireError(f"truncated frame: need {end - pos} bytes, have {len(mv) - pos}")
        out.append(mv[pos:end])
        pos = end
    return out


# ---- sockets ------------------------------------------------------------------------------------


def _recv_exact(sock: socket.socket, buf: bytearray | memoryview, what: str) -> bool:
    """Fill `buf`; False on a clean EOF before the first byte, WireError on EOF mid-way."""
    mv = memoryview(buf)
    got = 0
    while got < len(mv):
        n = sock.recv_into(mv[got:])
        if n == 0:
            if got == 0:
                return False
            raise WireError(f"connection closed inside a {what} ({got}/{len(mv)} bytes)")
        got += n
    return True


def recv_message(
    sock: socket.socket,
    decoder: Decoder,
    accept: frozenset[MsgType] | None = None,
    max_payload: int | None = None,
) -> Message | None:
    """Read and decode one frame from a blocking socket; None when the peer closed cleanly.

    The payload gets its own buffer, so the numpy columns of a BATCH are views of it (no copy)
    and stay valid after the next read. `accept` and `max_payload` are checked on the header,
    before the payload is read: the agent takes only small control frames from its clients,
    and must not allocate (or keep, for NAMES) whatever a peer claims to send.
    """
    head = bytearray(HEADER.size)
    if not _recv_exact(sock, head, "header"):
        return None
    h = decode_header(head)
    check_header(h, accept, max_payload)
    payload = bytearray(h.payload_len)
    if h.payload_len and not _recv_exact(sock, payload, f"{h.msg_type.name} payload"):
        raise WireError(f"connection closed before the {h.msg_type.name} payload")
    return decoder.decode_payload(h, memoryview(payload))
