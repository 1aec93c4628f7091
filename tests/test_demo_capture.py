"""The bundled demo capture: `kdash demo --headless --duration 20` on an H200 under the agent.

Real kernels from the project's own attention workload, so the kernel analyses, the report and
the Perfetto export are checked on real CUPTI records here, without a GPU.
"""

import bisect
import gzip
import json
import subprocess
import sys

import numpy as np
import pytest

from kdash.analyses.gpu_time import account
from kdash.analyses.kernel_findings import CAUSES
from kdash.analyses.kernels import idle_gaps, launch_latency, top_kernels
from kdash.capture import load_capture
from kdash.commands import bundled_demo
from kdash.export import IDLE_TID


@pytest.fixture(scope="module")
def demo():
    return load_capture(bundled_demo())


def test_bundled_and_titled(demo):
    assert "H200" in demo.meta["title"]
    # the agent at its default duty cycle (lowered by its cost budget), PC sampling off
    assert demo.meta["sources"]["agent"].startswith("ok: sampling 3% (100 ms/")
    assert demo.meta["sources"]["pc sampling"] == "off"
    assert demo.meta["window"]["seconds"] > 15


def test_top_kernels_are_ours(demo):
    tk = top_kernels(demo.tables["kernels"])
    names = list(tk["name"])
    assert {"_decode_stage1", "_decode_stage2", "_extend_kernel"} <= set(names)
    assert tk["pct"].sum() == pytest.approx(100.0)
    assert (tk["p99_us"] >= tk["p50_us"]).all()
    d1 = tk[tk["name"] == "_decode_stage1"].iloc[0]
    assert d1["registers"] > 0 and d1["calls"] > 100


def test_top_kernels_match_a_plain_per_name_computation(demo):
    """The vectorised table against the obvious loop over names (np.percentile per name, the
    launch shape of each name's last launch), on the real records."""
    k = demo.tables["kernels"]
    tk = top_kernels(k).set_index("name")
    dur = (k["end_ns"] - k["start_ns"]).clip(lower=0).astype(float)
    names = k["name"].unique()
    for name in names[:: max(1, len(names) // 40)]:  # ~40 names, rare and common
        sel = (k["name"] == name).to_numpy()
        d = dur[sel].to_numpy()
        row, last = tk.loc[name], k[sel].iloc[-1]
        assert row["calls"] == len(d)
        assert row["total_ms"] == pytest.approx(d.sum() / 1e6)
        assert row["mean_us"] == pytest.approx(d.mean() / 1e3)
        assert row["p50_us"] == pytest.approx(np.percentile(d, 50) / 1e3)
        assert row["p99_us"] == pytest.approx(np.percentile(d, 99) / 1e3)
        assert row["grid"] == f"{last['grid_x']},{last['grid_y']},{last['grid_z']}"
        assert row["registers"] == last["registers"]
    assert list(tk["total_ms"]) == sorted(tk["total_ms"], reverse=True)


def test_latency_and_gaps(demo):
    k, a = demo.tables["kernels"], demo.tables["api"]
    lat = launch_latency(k, a)
    assert len(lat) > 0.5 * len(k)  # most kernels match their launch call
    assert lat["latency_us"].median() > 0
    gaps = idle_gaps(k)
    assert len(gaps) > 0 and (gaps["gap_us"] >= 100).all()


def test_report_and_export(tmp_path):
    path = bundled_demo()
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", path, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["top_kernels"] and doc["tables"]["kernels"] > 10_000
    out = tmp_path / "demo.json.gz"
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "export", path, "--perfetto", out],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    ev = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    assert len(kernels) == doc["tables"]["kernels"]
    assert any(e["ph"] == "C" and e["name"].startswith("SM clock") for e in ev)
    lanes = {(e["pid"], e["tid"]) for e in kernels}
    assert lanes  # one lane per GPU/stream
    # Slices on one lane must not overlap partially (Perfetto needs nesting).
    by_lane = {}
    for e in kernels:
        by_lane.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_lane.values():
        spans.sort()
        for (_s0, e0), (s1, e1) in zip(spans, spans[1:], strict=False):
            assert s1 >= e0 - 1e-3 or e1 <= e0 + 1e-3
    # the GPU's idle gaps (the report's accounting: copies are busy), on their own track,
    # named by cause, never overlapping a kernel of the same GPU
    t = load_capture(path).tables
    idle = [e for e in ev if e.get("cat") == "gpu_idle"]
    assert len(idle) == len(account(t["kernels"], t["memcpy"], t["markers"], t["api"]).gaps)
    doc_trace = json.loads(gzip.decompress(out.read_bytes()))
    assert doc_trace["otherData"]["gpu_time"] == doc["gpu_time"]
    assert {e["name"] for e in idle} <= {f"idle: {c}" for c in CAUSES}
    assert {e["tid"] for e in idle} == {IDLE_TID}
    busy = sorted((e["ts"], e["ts"] + e["dur"]) for e in kernels)
    starts = [b[0] for b in busy]
    for e in idle[:: max(1, len(idle) // 200)]:
        i = bisect.bisect_left(starts, e["ts"] + e["dur"] - 1e-3)
        assert all(b_end <= e["ts"] + 1e-3 or b_start >= e["ts"] + e["dur"] - 1e-3
                   for b_start, b_end in busy[max(0, i - 50) : i + 1])  # fmt: skip
    host = [e for e in idle if e["name"] == "idle: host"]
    assert host and all("launching_tid" in e["args"] for e in host)


def test_demo_headless_without_gpu_is_refused():
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "demo", "--headless"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if r.returncode == 0:
        pytest.skip("this machine has a GPU")
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kdash: ")
