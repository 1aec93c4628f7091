"""bench/gpu_decode_dram.py's reading of Nsight Compute's CSV, on a real one: session 33's run
on an H100 (bench/results/decode-dram-h100-s33-hint.{csv,json}), 18 profiled launches of the
one-launch decode kernel. The labels the script wrote on the GPU machine are the JSON's rows
less what the join added, so joining them again must give the same figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
sys.path.insert(0, str(ROOT / "bench"))
import gpu_decode_dram as dram  # noqa: E402

ADDED = ("kernel_names", "dram_read_MB", "dram_write_MB", "read_over_needed", "us_under_ncu")


def _recorded() -> tuple[list[dict], list[dict]]:
    joined = json.loads((RESULTS / "decode-dram-h100-s33-hint.json").read_text())
    labels = [{k: v for k, v in r.items() if k not in ADDED} for r in joined]
    return joined, labels


def test_the_recorded_csv_joins_to_the_recorded_figures() -> None:
    joined, labels = _recorded()
    rows = dram.read_ncu_csv(RESULTS / "decode-dram-h100-s33-hint.csv")
    assert len(rows) == 18 and all(r["kernel"] == "_decode_fused" for r in rows)
    # base units (--print-units base): bytes, not MB, with thousands separators stripped
    assert all(r["dram__bytes_read.sum"] > 1e8 for r in rows)
    again = dram.join(labels, rows)
    for got, want in zip(again, joined, strict=True):
        for k in ("dram_read_MB", "dram_write_MB", "us_under_ncu"):
            assert got[k] == pytest.approx(want[k])


def test_a_zeroing_flush_leaves_writes_a_reading_flush_does_not() -> None:
    """What the run showed: every call reads its bytes once, and only after do_bench's zeroing
    flush does a call write back more than a few MB."""
    joined, _ = _recorded()
    for r in joined:
        assert r["read_over_needed"] == pytest.approx(1.0, abs=0.005)
        if r["flush"] == "zero":
            assert r["dram_write_MB"] > 5
        else:
            assert r["dram_write_MB"] < 3


def test_a_run_that_does_not_match_its_labels_is_refused(tmp_path: Path) -> None:
    _, labels = _recorded()
    rows = dram.read_ncu_csv(RESULTS / "decode-dram-h100-s33-hint.csv")
    with pytest.raises(SystemExit, match="18 kernels labelled, 17 rows"):
        dram.join(labels, rows[:-1])
    not_csv = tmp_path / "log.txt"
    not_csv.write_text("==PROF== Disconnected from process 1\n")
    with pytest.raises(SystemExit, match="no ncu CSV header"):
        dram.read_ncu_csv(not_csv)


def test_shapes_are_checked() -> None:
    assert dram.parse_shape("1x65536:64/8:fp8") == (1, 65536, 64, 8, True)
    for bad in ("1x65536:64/8", "1x65536:60/8:bf16", "0x10:8/8:bf16", "1x10:8/8:fp16"):
        with pytest.raises(SystemExit, match="bad shape"):
            dram.parse_shape(bad)
