"""Kernel-name display and the launch-latency join, on names recorded on the H200."""

from kdash.analyses.kernels import short_name
from kdash.names import demangle

REDUCE = (  # recorded on the H200 (kdash/data/demo-h200.kdash)
    "_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_7MeanOpsIffffEEjfLi4ELi4EEEEEvT1_"
)


def test_mangled_names_are_demangled_and_cut():
    assert short_name(demangle(REDUCE)) == "reduce_kernel<MeanOps>"


def test_plain_names_kept_and_long_names_elided():
    assert short_name("_decode_stage1") == "_decode_stage1"
    long = "nvjet_sm90_tst_64x16_64x16_2x1_v_bz_splitK_NNT_with_a_very_long_suffix"
    s = short_name(long, 30)
    assert len(s) == 30 and "…" in s and s.startswith("nvjet")


def test_idle_gaps_only_inside_recorded_windows():
    """With duty-cycled activity, time between windows is not idle: only in-window gaps count."""
    import pandas as pd

    from kdash import schema
    from kdash.analyses.kernels import idle_gaps, recorded_windows

    us = 1000
    k = schema.to_frame(
        "kernels",
        schema.make_batch(
            "kernels",
            start_ns=[0, 50 * us, 900 * us],
            end_ns=[10 * us, 60 * us, 910 * us],
            name=["a", "b", "c"],
            device=[0, 0, 0],
        ),
    )
    # hand-made rows in the agent's window format (a fixture)
    m = schema.to_frame(
        "markers",
        schema.make_batch(
            "markers",
            start_ns=[0, 880 * us],
            end_ns=[100 * us, 980 * us],
            name=["activity on", "activity on"],
            domain=["kdash", "kdash"],
        ),
    )
    w = recorded_windows(m)
    assert len(w) == 2
    plain = idle_gaps(k, min_gap_us=20)
    assert list(plain["gap_us"]) == [40.0, 840.0]
    clipped = idle_gaps(k, min_gap_us=20, windows=w)
    # 10-50 us lies in window 1; of 60-900 us only 60-100 and 880-900 were recorded
    assert list(clipped["gap_us"]) == [40.0, 40.0, 20.0]
    assert recorded_windows(pd.DataFrame()) is None
