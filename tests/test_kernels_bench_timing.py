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
    assert bench_timing.ROUNDS == 6  # the prefill rows' default: twice three contenders
    # round 1 in the given order; round 2 reversed, where flash fails; round 3 rotated, flash
    # not timed again
    assert calls == ["ours", "flash", "cudnn", "cudnn", "flash", "ours", "cudnn", "ours"]
    assert got["ours"] == [1.0, 6.0, 8.0]
    assert got["sdpa_cudnn"] == [3.0, 4.0, 7.0]
    assert got["sdpa_flash"] == "RuntimeError: no kernel for this shape"


@pytest.mark.parametrize("rounds", [1, 2, 5])
def test_each_round_times_every_contender_once(monkeypatch, rounds: int) -> None:
    seen: list[str] = []
    monkeypatch.setattr(bench_timing, "bench_ms", lambda fn, rep=100: seen.append(fn) or 1.0)
    got = bench_timing.bench_ms_rounds({"a": "a", "b": "b"}, rounds=rounds)
    assert [sorted(seen[i : i + 2]) for i in range(0, len(seen), 2)] == [["a", "b"]] * rounds
    assert seen == [x for order in bench_timing.turn_orders(["a", "b"], rounds) for x in order]
    assert got == {"a": [1.0] * rounds, "b": [1.0] * rounds}


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
def test_balanced_orders_put_each_contender_first_and_after_each_other_equally(n: int) -> None:
    names = [f"c{i}" for i in range(n)]
    cycle = n if n % 2 == 0 else 2 * n  # a Williams design's length
    orders = bench_timing.turn_orders(names, cycle)
    assert all(sorted(o) == names for o in orders)
    firsts = [o[0] for o in orders]
    assert {firsts.count(c) for c in names} == {cycle // n}
    follows = [(o[i], o[i + 1]) for o in orders for i in range(n - 1)]
    pairs = [(a, b) for a in names for b in names if a != b]
    # within rounds each ordered pair is as common as any other
    assert {follows.count(p) for p in pairs} == {len(follows) // len(pairs)}


def test_a_prefill_row_keeps_each_round_in_the_order_it_ran(monkeypatch) -> None:
    """The bench's prefill row on the CPU at a toy size: the contenders' callables are never
    run (``bench_ms`` is the recorder, and SDPA's FLASH and cuDNN backends, which need CUDA, are
    stood in for by named callables); what is checked is that ``round_orders`` says which
    contender ran when, so ``rounds_us`` can be read by predecessor."""
    import torch
    from kdash.kernels import bench

    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "PREFILL_TOKENS", 32)
    monkeypatch.setattr(bench.PrefillCase, "sdpa", lambda self, backend: f"sdpa {backend.name}")
    calls: list = []

    def fake_bench_ms(fn, *, rep: int = 100) -> float:
        calls.append(fn)
        return float(len(calls))  # ms: the call's position, 1-based

    monkeypatch.setattr(bench_timing, "bench_ms", fake_bench_ms)
    cfg = bench.chosen_config(64, False, torch.device("cpu"))
    row = bench.prefill_row("toy", 2, 2, 64, False, 16, {"d64-full": cfg})
    names = {"sdpa FLASH_ATTENTION": "sdpa_flash", "sdpa CUDNN_ATTENTION": "sdpa_cudnn"}
    ran = [names.get(fn, "ours") if isinstance(fn, str) else "ours" for fn in calls]
    assert len(row["round_orders"]) == bench_timing.ROUNDS == 6
    assert ran == [name for order in row["round_orders"] for name in order]
    for r, order in enumerate(row["round_orders"]):
        for pos, name in enumerate(order):
            assert row["rounds_us"][name][r] == (3 * r + pos + 1) * 1e3
    firsts = [order[0] for order in row["round_orders"]]
    assert sorted(firsts) == sorted(["ours", "sdpa_flash", "sdpa_cudnn"] * 2)
