"""Analyses on real captures recorded headless on an H200 (bench/device_host.sh, tests/data).

h200-matmul.kdash: a bf16 8192^3 matmul loop — board at its 700 W limit, SM clock held well
below 1980 MHz by the software power cap. h200-contended.kdash: a small matmul loop whose
launch thread shares CPU 3 with a busy neighbour (both pinned with taskset).
"""

from pathlib import Path

import pytest

from kdash.analyses.findings import find_all
from kdash.capture import load_capture
from kdash.config import Thresholds
from kdash.report import summarize

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def matmul():
    return load_capture(DATA / "h200-matmul.kdash")


@pytest.fixture(scope="module")
def contended():
    return load_capture(DATA / "h200-contended.kdash")


def _topo(cap):
    return {
        "gpu_local_cpus": {g["index"]: g["local_cpus"] for g in cap.meta["gpus"]},
        "cpu_count": cap.meta["host"]["cpus"],
    }


def test_metadata_is_self_describing(matmul):
    m = matmul.meta
    assert m["gpus"][0]["name"] == "NVIDIA H200"
    assert m["driver"].startswith("580")
    assert m["window"]["seconds"] > 10
    assert "matmul_load.py" in m["target"]["cmdline"]


def test_power_cap_found_again_from_tables(matmul):
    f = find_all(matmul.tables, _topo(matmul), Thresholds())
    kinds = set(f["kind"])
    assert "gpu-throttle" in kinds
    row = f[f["kind"] == "gpu-throttle"].iloc[0]
    assert "sw-power" in row["evidence"]


def test_report_numbers(matmul):
    s = summarize(matmul)
    g = s["gpu_summary"][0]
    assert g["util_gpu_pct_mean"] > 90
    assert g["power_w_max"] > 0.9 * g["power_limit_w"]
    assert g["sm_clock_mhz_mean"] < g["sm_clock_max_mhz"]
    assert "sw-power" in g["throttle_reasons_seen"]
    assert s["threads_top"][0]["cpu_pct_mean"] > 80  # the launch thread spins in cudaSync


def test_contended_run_queue_found(contended):
    f = find_all(contended.tables, _topo(contended), Thresholds())
    rq = f[f["kind"] == "run-queue-delay"]
    assert len(rq) == 1
    assert str(contended.meta["target"]["pid"]) in rq.iloc[0]["subject"]
    # With a generous threshold the same data is not flagged: the threshold is what decides.
    f2 = find_all(contended.tables, _topo(contended), Thresholds(runq_ms_per_s=900.0))
    assert "run-queue-delay" not in set(f2["kind"])
