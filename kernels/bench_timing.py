"""Timing helpers of the kernel benchmark (kernels/bench.py): GPU time by ``do_bench``, by
CUDA-graph replay and after a read-only L2 flush, and the host time of a call."""

from __future__ import annotations

import time

import torch


def log(msg: str) -> None:
    print(msg, flush=True)


def bench_ms(fn, *, rep: int = 100) -> float:
    """Median ms of ``fn`` by ``triton.testing.do_bench`` (which flushes L2 before every call)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median"))


ROUNDS = 6  # twice the contenders of a prefill row: balanced orders (turn_orders)


def turn_orders(names: list[str], rounds: int) -> list[list[str]]:
    """The order of the contenders in each of ``rounds`` rounds, from a Williams design: over
    ``len(names)`` rounds (twice that for an odd count, each order then followed by its reverse)
    every contender goes first equally often and follows every other equally often, so none is
    always timed right after the one that draws the most power (a compute-bound prefill at
    600-700 W leaves the next contender a hotter card than a slower one does)."""
    n = len(names)
    base = [0] + [n - i // 2 if i % 2 == 0 else (i + 1) // 2 for i in range(1, n)]
    rows = [[names[(b + k) % n] for b in base] for k in range(n)]
    if n % 2:
        rows = [row for pair in zip(rows, [r[::-1] for r in rows], strict=True) for row in pair]
    return [rows[r % len(rows)] for r in range(rounds)] if n else [[] for _ in range(rounds)]


def bench_ms_rounds(
    fns: dict, *, rounds: int = ROUNDS, rep: int = 40
) -> dict[str, list[float] | str]:
    """``bench_ms`` of each of ``fns`` (name -> callable) in turn, ``rounds`` times over in the
    orders of :func:`turn_orders`: the ms of each round per name (in round order), or the first
    line of the error that stopped a name (it is not timed again). Taking turns puts every
    contender under the same clocks and temperatures: one timed after the other for a whole run
    each, a compute-bound pair at 600-700 W can meet different clock states (bench/NOTES-kernels.md,
    session 25)."""
    got: dict[str, list[float] | str] = {name: [] for name in fns}
    for order in turn_orders(list(fns), rounds):
        for name in order:
            times = got[name]
            if isinstance(times, str):
                continue
            try:
                times.append(bench_ms(fns[name], rep=rep))
            except Exception as e:  # noqa: BLE001 - the caller records the failing contender
                got[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return got


_FLUSH: dict[str, torch.Tensor] = {}


def bench_readflush_ms(fn, *, iters: int = 100) -> float:
    """Median ms of ``fn`` after an L2 flush that only reads (a sum over 256 MiB).

    ``do_bench`` flushes L2 by zeroing 256 MiB, which leaves L2 full of dirty lines whose write-back
    then competes with the timed kernel (~24 MB written back during a 268 MB decode call on an
    H100, by Nsight Compute: bench/NOTES-kernels.md, session 33). A read
    flush evicts the timed kernel's data just as well and leaves clean lines. Reported next to the
    ``do_bench`` figure, not instead of it.
    """
    if "buf" not in _FLUSH:
        _FLUSH["buf"] = torch.randn(64 * 1024 * 1024, device="cuda")
    buf = _FLUSH["buf"]
    for _ in range(5):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        buf.sum()  # reads 256 MiB; the scalar result is dropped
        starts[i].record()
        fn()
        ends[i].record()
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in zip(starts, ends, strict=True))
    return float(times[len(times) // 2])


def bench_host_us(fn, *, iters: int = 200) -> float:
    """Median host-side us of one call of ``fn``: the Python wrapper plus its kernel launches.

    The GPU is drained before every call, so no launch waits on a full queue and the figure is the
    host's own cost. ``do_bench`` hides it only while it is shorter than the L2-flush kernel queued
    in front of each call; a longer host time leaks into the timed region (bench/NOTES-kernels.md).
    """
    for _ in range(5):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    times.sort()
    return times[len(times) // 2] * 1e6


def bench_host_nosync_us(fn, *, calls: int = 100, reps: int = 7) -> float:
    """Host us per call of ``fn`` over ``calls`` calls in a row with no synchronisation between
    them (median of ``reps`` such runs; the GPU is drained between runs, untimed): the
    ``run_mean_us`` of :func:`bench_host_calls`.

    This is what a serving loop pays per decode call on its CPU. ``calls`` is small enough that
    the launch queue (about a thousand kernels) never fills, so no call waits on the GPU.
    """
    return bench_host_calls(fn, calls=calls, reps=reps)["run_mean_us"]


def bench_graph_ms(fn, *, rep: int = 100) -> float:
    """Median ms of ``fn`` replayed from a CUDA graph (no launch gaps; no L2 flush)."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median"))


def host_call_times(fn, calls: int) -> list[float]:
    """Host us of each of ``calls`` calls of ``fn`` in a row with no synchronisation between
    them, the GPU drained before the first and after the last (untimed)."""
    torch.cuda.synchronize()
    run = []
    for _ in range(calls):
        t0 = time.perf_counter_ns()
        fn()
        run.append((time.perf_counter_ns() - t0) / 1e3)
    torch.cuda.synchronize()
    return run


def bench_host_calls(fn, *, calls: int = 100, reps: int = 7) -> dict[str, float]:
    """Host us of each call of ``fn`` over ``reps`` runs of ``calls`` calls in a row with no
    synchronisation between them (the GPU drained between runs, untimed).

    ``run_mean_us`` is the median of the runs' means (what a serving loop pays a call, slow
    calls included; :func:`bench_host_nosync_us`); ``per_call_us`` the median call, with
    the 90th percentile, the slowest call and the calls over 50 us beside it, so what moves a
    run's mean is seen: on the GPU machine's virtual CPUs a fresh process's calls run at 40-80
    us each for its first second or so, and single calls take up to ~400 us
    (bench/NOTES-kernels.md, session 23).
    """
    for _ in range(5):
        fn()
    every: list[float] = []
    means = []
    for _ in range(reps):
        run = host_call_times(fn, calls)
        means.append(sum(run) / calls)
        every += run
    every.sort()
    means.sort()
    return {
        "per_call_us": every[len(every) // 2],
        "run_mean_us": means[len(means) // 2],
        "p90_us": every[int(0.9 * len(every))],
        "max_us": every[-1],
        "calls_over_50us": sum(t > 50 for t in every),
    }
