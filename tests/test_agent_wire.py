"""The agent wire format: round trips, the incremental string dictionary, and bad frames.

The record batches here are generated (a fixture, not real CUPTI output): random numbers in
every schema column and kernel names drawn from a small repeating set, as in a decode loop.
"""

from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
from kdash.collectors.agent import wire

from kdash import schema


def generated_batch(table: str, n: int, seed: int = 0, names: list[str] | None = None):
    """A fixture batch: every column of `table` filled with seeded random values."""
    rng = np.random.default_rng(seed)
    names = names or [f"kernel_{i}<float, 128>" for i in range(7)] + ["ampere_sgemm_128x64_nn"]
    cols = {}
    for col, code in schema.TABLES[table]:
        if code == schema.STR:
            cols[col] = rng.choice(np.array(names, dtype=object), n)
        elif code.startswith("f"):
            cols[col] = rng.random(n).astype(code)
        else:
            info = np.iinfo(np.dtype(code))
            cols[col] = rng.integers(info.min, info.max, n, dtype=np.dtype(code), endpoint=True)
    return schema.make_batch(table, **cols)


def assert_batches_equal(table: str, a, b) -> None:
    assert set(a) == set(b) == set(schema.columns(table))
    for col in schema.columns(table):
        assert len(a[col]) == len(b[col]), col
        assert (
            list(a[col]) == list(b[col])
            if a[col].dtype == object
            else np.array_equal(a[col], b[col])
        ), col


@pytest.mark.parametrize("table", list(wire.TABLE_IDS))
def test_round_trip_every_table(table):
    enc = wire.StringEncoder()
    dec = wire.Decoder()
    batch = generated_batch(table, 1000, seed=3)
    frames = wire.split_frames(wire.encode_batch(table, batch, enc))
    msgs = [dec.decode(f) for f in frames]
    # strings first (this batch introduced them), then the rows
    assert [m.type for m in msgs] == [wire.MsgType.NAMES, wire.MsgType.BATCH]
    assert msgs[1].table == table
    assert_batches_equal(table, batch, msgs[1].body)
    out = msgs[1].body
    for col, code in schema.TABLES[table]:
        if code != schema.STR:
            assert out[col].dtype == np.dtype(code), col


def test_dictionary_is_incremental():
    enc = wire.StringEncoder()
    dec = wire.Decoder()
    b1 = generated_batch("kernels", 500, seed=1, names=["a", "b"])
    b2 = generated_batch("kernels", 500, seed=2, names=["a", "b"])
    b3 = generated_batch("kernels", 500, seed=3, names=["b", "c", "ü_unicode"])
    f1 = wire.split_frames(wire.encode_batch("kernels", b1, enc))
    f2 = wire.split_frames(wire.encode_batch("kernels", b2, enc))
    f3 = wire.split_frames(wire.encode_batch("kernels", b3, enc))
    assert len(f1) == 2 and len(f2) == 1 and len(f3) == 2  # repeats send no NAMES frame
    names3 = dec.decode(f1[0]).body + []
    assert sorted(names3) == ["a", "b"]
    for f in f1[1:] + f2:
        dec.decode(f)
    new = dec.decode(f3[0])
    assert new.type == wire.MsgType.NAMES and new.first_id == 2
    assert sorted(new.body) == ["c", "ü_unicode"]
    assert_batches_equal("kernels", b3, dec.decode(f3[1]).body)


def test_prepared_string_ids_fast_path():
    enc = wire.StringEncoder()
    ids = np.array([enc.intern("x"), enc.intern("y"), enc.intern("x")], dtype=np.uint32)
    batch = generated_batch("api", 3)
    batch["name"] = ids
    dec = wire.Decoder()
    msgs = [dec.decode(f) for f in wire.split_frames(wire.encode_batch("api", batch, enc))]
    assert list(msgs[-1].body["name"]) == ["x", "y", "x"]
    bad = dict(batch, name=np.array([0, 1, 7], dtype=np.uint32))
    with pytest.raises(wire.WireError, match="outside the dictionary"):
        wire.encode_batch("api", bad, enc)


def test_empty_batch_and_control_round_trip():
    enc = wire.StringEncoder()
    dec = wire.Decoder()
    (f,) = wire.split_frames(wire.encode_batch("markers", schema.empty("markers"), enc))
    m = dec.decode(f)
    assert m.type == wire.MsgType.BATCH and schema.batch_len(m.body) == 0
    body = {"state": "unavailable", "line": "unavailable: no cupti", "n": [1, 2]}
    m = dec.decode(wire.encode_control(wire.MsgType.STATUS, body))
    assert m.type == wire.MsgType.STATUS and m.body == body


def _good_kernel_frame() -> tuple[bytes, wire.Decoder]:
    enc = wire.StringEncoder()
    dec = wire.Decoder()
    names, batch = wire.split_frames(
        wire.encode_batch("kernels", generated_batch("kernels", 10), enc)
    )
    dec.decode(names)
    return bytes(batch), dec


def _patch(frame: bytes, offset: int, fmt: str, value) -> bytes:
    import struct

    b = bytearray(frame)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda f: b"XXXX" + f[4:], "bad magic"),
        (lambda f: _patch(f, 4, "<B", 9), "wire version 9"),
        (lambda f: _patch(f, 5, "<B", 99), "unknown message type 99"),
        (lambda f: _patch(f, 6, "<B", 42), "unknown table id 42"),
        (lambda f: _patch(f, 7, "<B", 3), "3 columns, schema has"),
        (lambda f: _patch(f, 8, "<I", 11), "bytes for 11 rows"),
        (lambda f: f[:-5], "header says"),
        (lambda f: _patch(f, 16, "<B", 5), "dtype code 5, expected 3"),
        (lambda f: f[:12] + (2**31).to_bytes(4, "little") + f[16:], "exceeds"),
        (lambda f: f[:10], "short header"),
    ],
)
def test_bad_frames_raise_clear_errors(mutate, message):
    frame, dec = _good_kernel_frame()
    dec.decode(frame)  # the unmutated frame is fine
    with pytest.raises(wire.WireError, match=message):
        dec.decode(mutate(frame))


def test_unknown_string_id_and_names_gap():
    enc = wire.StringEncoder()
    batch = generated_batch("kernels", 5)
    names, frame = wire.split_frames(wire.encode_batch("kernels", batch, enc))
    with pytest.raises(wire.WireError, match="not in the dictionary"):
        wire.Decoder().decode(frame)  # the NAMES frame was never seen
    dec = wire.Decoder()
    with pytest.raises(wire.WireError, match="starts at id 3"):
        dec.decode(wire.encode_names(3, ["late"]))


def test_bad_control_payloads():
    dec = wire.Decoder()
    frame = wire.encode_control(wire.MsgType.STOP, {})
    not_json = frame[:12] + (3).to_bytes(4, "little") + b"\xff\xfe{"
    with pytest.raises(wire.WireError, match="not UTF-8 JSON"):
        dec.decode(not_json)
    a_list = frame[:12] + (2).to_bytes(4, "little") + b"[]"
    with pytest.raises(wire.WireError, match="not an object"):
        dec.decode(a_list)
    with pytest.raises(wire.WireError, match="not a control message"):
        wire.encode_control(wire.MsgType.BATCH, {})


def test_encode_rejects_missing_or_ragged_columns():
    enc = wire.StringEncoder()
    batch = generated_batch("kernels", 4)
    del batch["graph_id"]
    with pytest.raises(wire.WireError, match="graph_id"):
        wire.encode_batch("kernels", batch, enc)
    batch = generated_batch("kernels", 4)
    batch["stream"] = batch["stream"][:2]
    with pytest.raises(wire.WireError, match="2 rows"):
        wire.encode_batch("kernels", batch, enc)
    with pytest.raises(wire.WireError, match="not sent by the agent"):
        wire.encode_batch("gpu_samples", {}, enc)


def test_recv_message_over_a_real_socket_pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    enc = wire.StringEncoder()
    batches = [generated_batch("kernels", 20_000, seed=s) for s in range(5)]

    def send():
        for bt in batches:
            a.sendall(wire.encode_batch("kernels", bt, enc))
        a.sendall(wire.encode_control(wire.MsgType.STATUS, {"state": "ok"}))
        a.close()

    t = threading.Thread(target=send)
    t.start()
    dec = wire.Decoder()
    got = []
    while (m := wire.recv_message(b, dec)) is not None:
        got.append(m)
    t.join()
    rows = [m for m in got if m.type == wire.MsgType.BATCH]
    assert len(rows) == 5
    for bt, m in zip(batches, rows, strict=True):
        assert_batches_equal("kernels", bt, m.body)
    assert got[-1].body == {"state": "ok"}
    b.close()


def test_recv_message_reports_a_cut_connection():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    frame = wire.encode_control(wire.MsgType.STATUS, {"state": "ok", "line": "x" * 100})
    a.sendall(frame[:30])
    a.close()
    with pytest.raises(wire.WireError, match="closed inside"):
        wire.recv_message(b, wire.Decoder())
    b.close()


def test_set_is_a_control_message_and_round_trips():
    frame = wire.encode_control(
        wire.MsgType.SET, {"continuous": True, "period_ms": 1000, "on_ms": 100}
    )
    msg = wire.Decoder().decode(frame)
    assert msg.type == wire.MsgType.SET
    assert msg.body == {"continuous": True, "period_ms": 1000, "on_ms": 100}
    assert wire.MsgType.SET in wire.CONTROL_TYPES and int(wire.MsgType.SET) == 8
