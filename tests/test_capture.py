"""Capture files: round trip, atomic write, and clear errors for anything that is not ours."""

import json
import zipfile

import numpy as np
import pandas as pd
import pytest

import kdash
from kdash import schema
from kdash.capture import load_capture, write_capture
from kdash.errors import CaptureError


def _tables():
    k = schema.make_batch(
        "kernels",
        rows=[
            {
                "start_ns": 100,
                "end_ns": 250,
                "name": "attn_fwd",
                "device": 0,
                "stream": 7,
                "grid_x": 132,
                "grid_y": 1,
                "grid_z": 1,
                "block_x": 128,
                "block_y": 1,
                "block_z": 1,
                "registers": 96,
                "correlation_id": 5,
            },
            {"start_ns": 300, "end_ns": 330, "name": "gemm", "device": 0, "stream": 7},
        ],
    )
    g = schema.make_batch("gpu_samples", rows=[{"t_ns": 120, "gpu": 0, "power_w": 612.5}])
    return {"kernels": k, "gpu_samples": g}


def test_round_trip(tmp_path):
    meta = {
        "target": {"pid": 42, "cmdline": "python x.py", "host": "h"},
        "window": {"start_ns": 0, "end_ns": 400, "seconds": 4e-7},
    }
    path = write_capture(tmp_path / "a.kdash", meta, _tables())
    assert path.name == "a.kdash"
    tables = kdash.read_capture(path)  # the documented one-call pandas entry point
    assert set(tables) == set(schema.TABLES)
    k = tables["kernels"]
    assert isinstance(k, pd.DataFrame)
    assert list(k["name"]) == ["attn_fwd", "gemm"]
    assert int(k["registers"].iloc[0]) == 96 and int(k["registers"].iloc[1]) == -1
    assert tables["gpu_samples"]["power_w"].iloc[0] == pytest.approx(612.5)
    assert tables["threads"].empty
    cap = load_capture(path)
    assert cap.meta["target"]["pid"] == 42
    assert cap.meta["schema_version"] == schema.SCHEMA_VERSION
    assert cap.meta["tables"]["kernels"] == 2
    b = cap.batch("kernels")
    assert b["start_ns"].dtype == np.int64


def test_suffix_added_and_no_temp_left(tmp_path):
    path = write_capture(tmp_path / "b", {}, _tables())
    assert path.suffix == ".kdash"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b.kdash"]


def test_failed_write_leaves_nothing(tmp_path):
    bad = _tables()
    bad["kernels"]["name"] = object()  # not an array: the Parquet step fails mid-write
    with pytest.raises(Exception):  # noqa: B017 - any failure will do; what matters is below
        write_capture(tmp_path / "c.kdash", {}, bad)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "make, words",
    [
        (lambda p: p.write_text("hello"), "not a kdash capture"),
        (lambda p: zipfile.ZipFile(p, "w").writestr("x.txt", "x"), "no kdash.json"),
        (lambda p: zipfile.ZipFile(p, "w").writestr("kdash.json", "{]"), "not JSON"),
        (
            lambda p: zipfile.ZipFile(p, "w").writestr("kdash.json", json.dumps({"a": 1})),
            "format tag",
        ),
        (
            lambda p: zipfile.ZipFile(p, "w").writestr(
                "kdash.json", json.dumps({"format": "kdash-capture", "schema_version": 99})
            ),
            "upgrade kdash",
        ),
    ],
)
def test_foreign_files(tmp_path, make, words):
    p = tmp_path / "x.kdash"
    make(p)
    with pytest.raises(CaptureError, match=words):
        load_capture(p)


def test_truncated_capture(tmp_path):
    path = write_capture(tmp_path / "t.kdash", {}, _tables())
    data = path.read_bytes()
    cut = tmp_path / "cut.kdash"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(CaptureError):
        load_capture(cut)


def test_missing_and_folder(tmp_path):
    with pytest.raises(CaptureError, match="no such file"):
        load_capture(tmp_path / "nope.kdash")
    with pytest.raises(CaptureError, match="folder"):
        load_capture(tmp_path)
