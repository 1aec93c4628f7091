"""The bench's turn-taking timer (kernels/bench_timing.bench_ms_rounds).

``bench_ms`` (Triton's do_bench, which needs a CUDA GPU) is stood in for by a recorder that
returns a made-up time per call and raises for one contender: what is under test is the order
of the turns and what a failing contender leaves, not a timing."""

from __future__ import annotations

import pytest
from kdash.kernels import bench_timing


def test_contenders_take_turns_and_a_failure_stops_only_its_own(monkeypatch) -> None:
    calls: list[str] = []
    fns = {"ours": "ours", "sdpa_flash": "flash", "sdpa_cudnn": "cudnn"}

    def fake_bench_ms(fn, *, rep: int = 100) -> float:
        calls.append(fn)
        assert rep == 40
        if fn == "flash" and calls.count("flash") == 2:
            raise RuntimeError("no kernel for this shape\nsecond line")
        return float(len(calls))

    monkeypatch.setattr(bench_timing, "bench_ms", fake_bench_ms)
    got = bench_timing.bench_ms_rounds(fns, rounds=3)
    # round 1: all three; round 2: flash fails; round 3: flash is not timed again
    assert calls == ["ours", "flash", "cudnn", "ours", "flash", "cudnn", "ours", "cudnn"]
    assert got["ours"] == [1.0, 4.0, 7.0]
    assert got["sdpa_cudnn"] == [3.0, 6.0, 8.0]
    assert got["sdpa_flash"] == "RuntimeError: no kernel for this shape"


@pytest.mark.parametrize("rounds", [1, 2])
def test_each_round_times_every_contender_once(monkeypatch, rounds: int) -> None:
    seen: list[str] = []
    monkeypatch.setattr(bench_timing, "bench_ms", lambda fn, rep=100: seen.append(fn) or 1.0)
    got = bench_timing.bench_ms_rounds({"a": "a", "b": "b"}, rounds=rounds)
    assert seen == ["a", "b"] * rounds
    assert got == {"a": [1.0] * rounds, "b": [1.0] * rounds}
