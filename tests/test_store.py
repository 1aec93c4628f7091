"""The store's bounds: by time and by rows, with overflow counted rather than silent."""

import numpy as np

from kdash import schema
from kdash.store import Store


def _threads(ts):
    n = len(ts)
    return schema.make_batch(
        "threads", t_ns=np.asarray(ts, dtype=np.int64), pid=[1] * n, tid=list(range(n))
    )


def test_time_bound_drops_old_chunks():
    s = Store(retention_s=1.0)
    s.append("threads", _threads([0, 100]))
    s.append("threads", _threads([2_000_000_000]))
    got = s.get("threads")
    assert list(got["t_ns"]) == [2_000_000_000]
    assert s.stats()["threads"]["overflowed"] == 0


def test_row_bound_counts_overflow():
    s = Store(retention_s=1e6, max_rows=5)
    s.append("threads", _threads(range(4)))
    s.append("threads", _threads(range(4, 8)))
    got = s.get("threads")
    assert list(got["t_ns"]) == [3, 4, 5, 6, 7]
    assert s.stats()["threads"]["overflowed"] == 3
    assert s.stats()["threads"]["total"] == 8
    assert s.overflowed() == 3


def test_window_query_and_frame():
    s = Store()
    s.append("threads", _threads([10, 20, 30, 40]))
    assert list(s.get("threads", 15, 35)["t_ns"]) == [20, 30]
    df = s.frame("threads", since_ns=30)
    assert list(df.columns) == schema.columns("threads")
    assert len(df) == 2


def test_make_batch_rejects_unknown_columns():
    import pytest

    with pytest.raises(KeyError):
        schema.make_batch("threads", rows=[{"t_ns": 1, "no_such_column": 3}])
    b = schema.make_batch("gpu_samples", rows=[{"t_ns": 1, "gpu": 0}])
    assert np.isnan(b["power_w"][0]) and b["throttle_reasons"][0] == -1
