"""bench/ncu_prefill_summary.py on real Nsight Compute exports from an H100 (tests/data/
ncu-prefill-s29: two raw pages and the head of one source page; meta.json says how they were
made)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data" / "ncu-prefill-s29"


def load():
    path = ROOT / "bench" / "ncu_prefill_summary.py"
    spec = importlib.util.spec_from_file_location("ncu_prefill_summary", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_raw_page_durations_in_microseconds_whatever_ncu_printed():
    mod = load()
    ours = mod.raw_figures(DATA / "ncu-4096-_prefill_ws_kernel-raw.csv")
    cudnn = mod.raw_figures(DATA / "ncu-16384-cudnn-raw.csv")
    # ncu printed 831.84 "us" for one and 3.17 "ms" for the other.
    assert ours["duration_us"] == 831.84
    assert 3100 < cudnn["duration_us"] < 3300
    assert ours["launch__grid_size"] == 132 and ours["launch__registers_per_thread"] == 168
    # The largest stall reason first, by name without the metric's prefix and suffix.
    stalls = list(ours["stalls_per_issue"])
    assert stalls[0] == "barrier" and ours["stalls_per_issue"]["barrier"] > 3
    # The L2 tables were collected for ours: reads dwarf writes, in requests and sectors.
    reads = ours["lts__t_sectors_srcunit_tex_op_read.sum"]
    writes = ours["lts__t_sectors_srcunit_tex_op_write.sum"]
    assert reads > 20 * writes > 0
    assert "lts__t_sectors_srcunit_tex_op_read.sum" not in cudnn  # not collected at 16k


def test_source_page_samples_by_runs_and_the_polls_of_a_tile_start():
    mod = load()
    src = mod.source_figures(DATA / "ncu-4096-_prefill_ws_kernel-source.csv")
    assert src["instructions"] == 260
    shares = src["share_by_runs"]
    assert abs(sum(shares.values()) - 1) < 0.01
    # The rows kept hold the consumer's tile start, run once a query tile by each of four
    # warps of 2048 tiles: most of their samples are two mbarrier polls (Q, first key tile).
    assert max(shares, key=shares.get) == "8192"
    polls = {p["index"]: p for p in src["polls"] if p["runs"] == 8192}
    assert len(polls) == 2 and sum(p["share"] for p in polls.values()) > 0.5


def test_main_writes_json_and_refuses_a_folder_without_exports(tmp_path, capsys):
    mod = load()
    out = tmp_path / "s.json"
    assert mod.main([str(DATA), "--out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert set(got) == {"4096-_prefill_ws_kernel", "16384-cudnn"}
    assert "source" in got["4096-_prefill_ws_kernel"] and "source" not in got["16384-cudnn"]
    capsys.readouterr()
    assert mod.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no ncu-*-raw.csv" in err
