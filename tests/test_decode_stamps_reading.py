"""bench/gpu_decode_stamps.py's reading of one launch's stamps. The stamps are written by the GPU
(kernels/decode_fused.py's STAMP); here a launch's worth is made up by hand, the one stand-in,
so that each figure the script reports can be checked against what it must be."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_decode_stamps as stamps  # noqa: E402


def _launch() -> dict:
    # [start, stage-1 (or merge) end, finish, SM] in ns: SM 0 runs two stage-1 programs, SM 1
    # one and the merge program
    s1 = [[1_000, 51_000, 52_000, 0], [1_500, 50_500, 51_500, 0], [1_200, 60_000, 61_000, 1]]
    merge = [[55_000, 56_000, 64_000, 1]]
    return {"s1": torch.tensor(s1), "merge": torch.tensor(merge), "flags_left": 0}


def test_one_launch_is_read_relative_to_the_first_start() -> None:
    row = stamps.one_launch(_launch(), event_us=70.0)
    assert row["last_s1_start"] == pytest.approx(0.5)
    assert row["s1_end_p50"] == pytest.approx(50.0) and row["s1_end_max"] == pytest.approx(59.0)
    assert row["publish_max"] == pytest.approx(60.0)
    assert row["merge_end_max"] == pytest.approx(63.0)
    assert row["merge_after_last_publish"] == pytest.approx(3.0)
    assert row["span"] == pytest.approx(63.0) and row["edges"] == pytest.approx(7.0)
    # the SM with two stage-1 programs, the one with one: their median lengths
    assert row["s1_len_by_sm_load"] == {1: pytest.approx(58.8), 2: pytest.approx(49.5)}
    assert row["sms_by_load"] == {1: 1, 2: 1} and row["sms_used"] == 2
    assert row["clock_step_ns_min"] == 200


def test_launches_are_summed_up_by_their_medians() -> None:
    a = stamps.one_launch(_launch(), event_us=70.0)
    b = stamps.one_launch(_launch(), event_us=80.0)
    c = stamps.one_launch(_launch(), event_us=90.0)
    got = stamps.median_rows([a, b, c])
    assert got["event_us"] == 80.0 and got["edges"] == pytest.approx(17.0)
    assert got["s1_len_by_sm_load"][2] == pytest.approx(49.5)


def test_waves_are_parsed_with_their_bounds() -> None:
    assert stamps.parse_waves("1,2") == [1, 2] and stamps.parse_waves(" 3 ") == [3]
    assert stamps.parse_waves("0,2") is None and stamps.parse_waves("5") is None
    assert stamps.parse_waves("a") is None and stamps.parse_waves("") is None


def test_a_plan_in_two_waves_cuts_twice_the_splits_and_agrees_with_the_default(
    monkeypatch,
) -> None:
    """In the interpreter (8 SMs stand in for the GPU's): the widened plan's device-side search,
    told of twice the capacity, fills twice the splits of the default one-launch plan (a split
    it uses writes a finite log-sum-exp, one past the cut -inf), and its output matches."""
    from kdash.kernels import bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    case = bench.DecodeCase([20000], 8, 2, 64, False)
    default = case.plan(bench.DecodeConfig(), fused=True)
    ref = default.run(case.q, case.k, case.v).float().clone()
    used = int(torch.isfinite(default.lse_part).sum()) // case.hq
    plan = stamps.in_waves(case, default, 2)
    assert plan.fused and plan.num_splits == 2 * default.num_splits
    assert plan.capacity == 2 * default.capacity
    got = plan.run(case.q, case.k, case.v).float()
    assert int(torch.isfinite(plan.lse_part).sum()) // case.hq == 2 * used > 2
    assert float((got - ref).abs().max()) <= 1e-3
    assert stamps.in_waves(case, default, 1) is default
