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


def test_window_reads_match_a_mask_over_interleaved_batches():
    """Batches from several agents arrive out of time order: a window read returns exactly
    the rows a boolean mask would (sorted by time), as read-only views."""
    import numpy as np
    import pytest

    from kdash import schema
    from kdash.store import Store

    rng = np.random.default_rng(3)
    st = Store(retention_s=1e6)
    all_t = []
    for _ in range(30):
        t = np.sort(rng.integers(0, 10**9, 500))
        all_t.append(t)
        st.append("kernels", schema.make_batch("kernels", start_ns=t, end_ns=t + 5))
    every = np.sort(np.concatenate(all_t))
    for lo, hi in ((None, None), (10**8, 5 * 10**8), (None, 3 * 10**8), (9 * 10**8, None)):
        got = st.get("kernels", lo, hi)["start_ns"]
        m = np.ones(len(every), bool)
        if lo is not None:
            m &= every >= lo
        if hi is not None:
            m &= every <= hi
        assert np.array_equal(got, every[m])
    win = st.get("kernels", 0, 10**9)
    with pytest.raises(ValueError):
        win["start_ns"][0] = 1  # a view into the store must not be written
    # a late batch after a read: sorted again at the next read
    st.append("kernels", schema.make_batch("kernels", start_ns=np.array([5]), end_ns=np.array([6])))
    assert st.get("kernels", 0, 10)["start_ns"].tolist() == sorted(
        [5, *every[every <= 10].tolist()]
    )


def test_time_bound_trims_the_old_prefix_of_a_compacted_ring():
    import numpy as np

    from kdash import schema
    from kdash.store import Store

    st = Store(retention_s=1.0)
    t = np.arange(0, 2 * 10**9, 10**6)
    st.append("kernels", schema.make_batch("kernels", start_ns=t, end_ns=t + 1))
    st.get("kernels")  # compacted and sorted
    st.append(
        "kernels",
        schema.make_batch(
            "kernels", start_ns=np.array([3 * 10**9]), end_ns=np.array([3 * 10**9 + 1])
        ),
    )
    st.get("kernels")
    kept = st.get("kernels")["start_ns"]
    assert kept.min() >= 2 * 10**9 - 10**9 - 10**6  # nothing older than the retention
