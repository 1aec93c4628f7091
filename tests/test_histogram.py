"""Cumulative-histogram math in the core (`kdash.histogram`): Prometheus' quantile, the
observations between two scrapes, and the server table's bucket rows summed over a window."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import pytest

from kdash import histogram as h

ROOT = Path(__file__).resolve().parent.parent


def test_bucket_quantile_is_prometheus_interpolation():
    b = {0.1: 0.0, 0.2: 10.0, 0.4: 10.0, math.inf: 10.0}
    assert h.bucket_quantile(0.5, b) == pytest.approx(0.15)
    assert h.bucket_quantile(0.99, b) == pytest.approx(0.199)
    # everything above the last finite bound -> that bound
    assert h.bucket_quantile(0.5, {1.0: 0.0, math.inf: 4.0}) == 1.0
    assert math.isnan(h.bucket_quantile(0.5, {1.0: 0.0, math.inf: 0.0}))
    assert math.isnan(h.bucket_quantile(0.5, {1.0: 3.0}))  # no +Inf bucket: not a histogram
    assert math.isnan(h.bucket_quantile(0.5, {}))


def test_bucket_delta_starts_afresh_after_a_restart():
    old = {1.0: 2.0, math.inf: 3.0}
    assert h.bucket_delta({1.0: 5.0, math.inf: 7.0}, old) == {1.0: 3.0, math.inf: 4.0}
    # counters that went down (restart): the new counts stand alone
    assert h.bucket_delta({1.0: 1.0, math.inf: 1.0}, {1.0: 5.0, math.inf: 5.0}) == {
        1.0: 1.0,
        math.inf: 1.0,
    }
    assert h.bucket_delta({1.0: 1.0}, {}) == {1.0: 1.0}


def test_window_buckets_sum_the_rows_of_one_histogram():
    rows = {
        f"ttft{h.BUCKET_TAG}{h.le_text(0.1)}": 1.0,
        f"ttft{h.BUCKET_TAG}{h.le_text(math.inf)}": 2.0,
        "itl_le:0.1": 9.0,  # another histogram
        "num_running_reqs": 4.0,
    }
    metrics = [*rows, "ttft_le:0.1", "ttft_le:+Inf"]
    values = [*rows.values(), 3.0, 3.0]
    assert h.le_text(math.inf) == "+Inf" and h.le_text(0.1) == "0.1"
    assert h.window_buckets(metrics, values, "ttft") == {0.1: 4.0, math.inf: 5.0}
    assert h.window_buckets(metrics, values, "e2e") == {}


def test_the_collector_and_the_server_pane_use_the_core_math():
    """The server pane reads its quantiles from the core, not from a collector module."""
    from kdash.collectors import sglang_http

    assert sglang_http.bucket_quantile is h.bucket_quantile
    assert sglang_http.window_buckets is h.window_buckets
    tree = ast.parse((ROOT / "tui" / "panes" / "server.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert "kdash.histogram" in imported
    assert not {m for m in imported if m.startswith("kdash.collectors")}
