"""`kdash report --json`: the document validates against kdash/data/report.schema.json for every
shipped capture and trace, carries `report_schema_version`, GPU time per GPU and the findings'
numbers as fields, and `--top N` cuts its lists."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kdash import kineto, schema
from kdash.capture import Capture, load_capture
from kdash.report import REPORT_SCHEMA_VERSION, schema_path, summarize

sys.path.insert(0, str(Path(__file__).parent))
from jsonschema_subset import errors

ROOT = Path(__file__).resolve().parents[1]
CAPTURES = sorted((ROOT / "tests" / "data").glob("*.kdash")) + [
    ROOT / "kdash" / "data" / "demo-h200.kdash"
]
TRACES = sorted((ROOT / "tests" / "data").glob("*.trace.json.gz"))


@pytest.fixture(scope="module")
def report_schema() -> dict:
    return json.loads(schema_path().read_text())


def _doc(cap: Capture, **kw) -> dict:
    """The summary as `--json` writes it (json.dumps with default=str), read back."""
    return json.loads(json.dumps(summarize(cap, **kw), default=str))


def _trace_capture(path: Path) -> Capture:
    tables, infos = kineto.read_traces([path])
    frames = {n: schema.to_frame(n, tables.get(n, schema.empty(n))) for n in schema.TABLES}
    return Capture(meta=kineto.build_meta(infos, None), tables=frames)


@pytest.mark.parametrize("path", CAPTURES + TRACES, ids=lambda p: p.name)
def test_every_shipped_capture_validates(path, report_schema):
    cap = _trace_capture(path) if path.name.endswith(".json.gz") else load_capture(path)
    doc = _doc(cap)
    assert errors(doc, report_schema) == []
    assert doc["report_schema_version"] == REPORT_SCHEMA_VERSION
    for g in doc["gpu_time"]:
        assert g["idle_s"] == pytest.approx(g["recorded_s"] - g["busy_s"], abs=1e-9)
        parts = g["short_gap_idle_s"] + sum(g["idle_by_cause_s"].values())
        assert parts == pytest.approx(g["idle_s"], abs=1e-8)
    for f in doc["findings"]:
        if f["kind"] == "gpu-idle-gaps":
            assert f["data"]["gpu_time"] in doc["gpu_time"]


def test_the_schema_checker_catches_a_broken_document(report_schema):
    doc = _doc(load_capture(CAPTURES[-1]))
    doc["gpu_time"][0]["busy_share"] = 1.5
    del doc["gpu_time"][0]["short_gaps"]
    doc["findings"][0]["data"]["about"] = "nonsense"
    doc["report_schema_version"] = 0
    found = "\n".join(errors(doc, report_schema))
    assert "gpu_time[0].busy_share: 1.5 > 1" in found
    assert "gpu_time[0]: missing 'short_gaps'" in found
    assert "findings[0].data.about" in found
    assert "report_schema_version: 0 != 1" in found


def test_findings_carry_their_numbers():
    doc = _doc(load_capture(CAPTURES[-1]))
    (idle,) = [f for f in doc["findings"] if f["kind"] == "gpu-idle-gaps"]
    d = idle["data"]
    assert d["about"] == "host" and d["longest_gap_us"] > 1000
    assert d["gpu_time"]["short_gaps"] > 10_000 and d["feeder_tid"] > 0
    assert f"{d['longest_gap_us'] / 1e3:.2f} ms" in idle["evidence"]
    stored = [f for f in doc["findings"] if f["kind"] not in ("gpu-idle-gaps", "launch-latency")]
    assert all(f["data"] == {} and isinstance(f["t_ns"], int) for f in stored)


def test_top_cuts_the_lists():
    path = CAPTURES[-1]
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", str(path), "--json", "--top", "3"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert len(doc["top_kernels"]) == 3 and len(doc["threads_top"]) == 3
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", str(path), "--top", "0"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr == "kdash: --top must be at least 1, not 0\n"


def test_schema_is_package_data():
    text = (ROOT / "pyproject.toml").read_text()
    assert '"data/*.json"' in text and schema_path().parent.name == "data"


CPU_TRACE = ROOT / "tests" / "data" / "cpu-mlp.trace.json.gz"


def test_cpu_only_trace_reports_its_cpu_ops(tmp_path):
    """The REAL CPU-only torch.profiler trace: no kernel, yet the report ranks every CPU op
    (counted here from the trace's JSON) and names the threads that ran them."""
    import gzip

    raw = json.loads(gzip.decompress(CPU_TRACE.read_bytes()))["traceEvents"]
    ops = [e for e in raw if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    doc = _doc(_trace_capture(CPU_TRACE), top=10_000)
    assert doc["top_kernels"] == [] and doc["gpu_time"] == []
    top = doc["top_cpu_ops"]
    assert sum(r["calls"] for r in top) == len(ops)
    assert {r["name"] for r in top} == {e["name"] for e in ops}
    assert [r["self_ms"] for r in top] == sorted((r["self_ms"] for r in top), reverse=True)
    assert sum(r["self_pct"] for r in top) == pytest.approx(100, abs=0.01)
    assert all(r["self_ms"] <= r["total_ms"] + 1e-9 for r in top)
    threads = doc["cpu_op_threads"]
    assert {r["tid"] for r in threads} == {e["tid"] for e in ops} and len(threads) >= 2
    assert sum(r["ops"] for r in threads) == len(ops)
    # --top cuts the list; the text report shows it
    assert len(_doc(_trace_capture(CPU_TRACE), top=3)["top_cpu_ops"]) == 3
    cap = tmp_path / "cpu.kdash"
    kineto.import_traces([CPU_TRACE], cap)
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", str(cap)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "Top CPU ops" in r.stdout and top[0]["name"] in r.stdout
    assert f"thread {threads[0]['tid']} (pid {threads[0]['pid']}): {threads[0]['ops']} CPU ops" in (
        r.stdout
    )
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", str(cap)],
        capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"},
    )  # fmt: skip
    table = r.stdout[r.stdout.index("Top CPU ops") :].splitlines()
    assert r.returncode == 0 and all(len(line) <= 80 for line in table)
    assert any(line.startswith(f"│ {top[0]['name']} ") for line in table)


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_captures_without_cpu_ops_report_empty_lists(path):
    doc = _doc(load_capture(path))
    assert doc["top_cpu_ops"] == [] and doc["cpu_op_threads"] == []


def test_top_kernels_say_which_have_source_and_hot_lines_start_with_one_that_has(tmp_path):
    """The shipped H200 samples (Triton kernels with line tables, cuBLAS and ATen without):
    `has_source` marks the kernels the data maps to lines; `hot_lines[0]` is one of them even
    where a kernel without source has more samples."""
    import gzip
    import json as _json
    from pathlib import Path

    import pandas as pd

    from kdash import cubin
    from kdash.report import _readable_kernels, _top_kernel_rows

    data = Path(__file__).parent / "data"
    with gzip.open(data / "h200-pcsamples.json.gz", "rt") as f:
        samples = pd.DataFrame(_json.load(f))
    lt = cubin.line_table((data / "h200-cubins" / "_decode_stage2.cubin").read_bytes())
    if not lt.has_lines:
        pytest.skip(lt.why or "no line info")
    sl = pd.DataFrame(cubin.to_rows(lt, t_ns=0))
    readable = _readable_kernels(sl)
    assert "_decode_stage2" in readable and not any(k.startswith("nvjet") for k in readable)
    tk = pd.DataFrame({"name": ["nvjet_sm90_tst_x", "_decode_stage2"], "calls": [1, 1]})
    rows = _top_kernel_rows(tk, {}, readable)
    assert [r["has_source"] for r in rows] == [False, True]
    per = samples.groupby("kernel")["count"].sum().sort_values(ascending=False)
    assert per.index[0] != "_decode_stage2"  # hotter kernels without a table exist
    hot = cubin.hot_lines_by_kernel(samples, sl)
    assert hot[0]["kernel"] == "_decode_stage2" and hot[0]["file"]


def test_watch_cost_is_what_the_capture_kept(report_schema):
    """A capture written with the agent's estimate (`agent_cost` in its metadata, as
    Session.build_meta writes it) reports it as `watch_cost` and prints it in the text
    report; an older capture (none of the shipped ones has it) reports null."""
    import dataclasses
    import io

    from rich.console import Console

    from kdash.report import render

    old = load_capture(ROOT / "kdash" / "data" / "demo-h200.kdash")
    assert _doc(old)["watch_cost"] is None
    agents = {"4242": {"windows_sent": 7, "switch_us_per_window": 812.5}}
    meta = {**old.meta, "agent_cost": {"estimate": 0.034, "agents": agents}}
    doc = _doc(dataclasses.replace(old, meta=meta))
    assert errors(doc, report_schema) == []
    assert doc["watch_cost"] == {"estimate": 0.034, "agents": agents}
    out = io.StringIO()
    render(doc, Console(file=out, width=120, color_system=None))
    assert "kdash cost ≈ 3% while recording" in out.getvalue()
    junk = {**old.meta, "agent_cost": {"estimate": "high", "agents": []}}
    assert _doc(dataclasses.replace(old, meta=junk))["watch_cost"] == {
        "estimate": None,
        "agents": {},
    }
