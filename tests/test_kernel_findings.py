"""Kernel findings: GPU idle time by cause, launch latency that is not queueing.

Three kinds of data: the bundled demo capture (real CUPTI records from the H200: the demo with
graph-replayed decode at the agent's default duty cycle, 112k kernels in 16 windows) for what the
analysis says about a real workload; the demo as an older agent recorded it
(tests/data/h200-demo-old-agent.kdash: eager decode recorded continuously, every kernel with its
own launch call, CUPTI's pthread ids) for what only that capture has; and small MADE-UP tables
(built below, each said to be one) for each cause, where a real recording of every case on
demand is not possible here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from kdash.tui.panes.kernels import analysis_notes

from kdash import schema
from kdash.analyses.kernel_findings import (
    ACTIONABLE,
    QUIET_US,
    gap_causes,
    idle_findings,
    idle_summaries,
    is_sync_call,
    kernel_findings,
    latency_findings,
    thread_label,
)
from kdash.analyses.kernels import idle_gaps
from kdash.capture import load_capture

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "kdash" / "data" / "demo-h200.kdash"
OLD = ROOT / "tests" / "data" / "h200-demo-old-agent.kdash"


@pytest.fixture(scope="module")
def demo():
    return load_capture(DEMO)


@pytest.fixture(scope="module")
def old():
    return load_capture(OLD)


# -- the real capture ---------------------------------------------------------------------------
def test_every_eager_gap_gets_a_cause_from_its_own_launch_call(old):
    """The old-agent demo launched every kernel eagerly (the bundled one replays decode from
    CUDA graphs: a graph's kernels share one launch call, so their gaps have no cause)."""
    k, api = old.tables["kernels"], old.tables["api"]
    g = gap_causes(idle_gaps(k), k, api)
    assert len(g) > 1000
    # It recorded runtime+driver API calls: every gap's kernel has its launch call.
    assert (g["cause"] != "unknown").all()
    launch = api[api["tid"] != -1].drop_duplicates("correlation_id").set_index("correlation_id")
    nxt = k.set_index(["device", "start_ns"])
    for r in g.sample(50, random_state=1).itertuples():
        kern = nxt.loc[(r.device, r.end_ns)]
        kern = kern.iloc[0] if isinstance(kern, pd.DataFrame) else kern
        call = launch.loc[int(kern["correlation_id"])]
        assert r.next_name == kern["name"]
        assert r.launch_us == pytest.approx((call["start_ns"] - r.start_ns) / 1e3)
        if r.cause == "gpu":
            assert call["end_ns"] <= r.start_ns
        else:
            assert call["end_ns"] > r.start_ns
    # host vs quiet is the launching thread's longest silence inside the gap
    host, quiet = g[g["cause"] == "host"], g[g["cause"] == "quiet"]
    assert len(host) and len(quiet)
    assert (host["silence_us"] < QUIET_US).all() and (quiet["silence_us"] >= QUIET_US).all()
    assert (g["silence_us"].dropna() <= g.loc[g["silence_us"].notna(), "launch_us"] + 1e-6).all()


def test_demo_is_host_bound_and_says_by_whom(demo):
    """Over its recording windows the demo's GPU waits on the one Python thread that launches
    (prefill and the eager part of each step; decode's graph replays leave gaps of no known
    cause): the finding names that thread by its OS tid, the one the CPU pane lists."""
    t = demo.tables
    (d,) = idle_summaries(t["kernels"], t["api"], t["markers"], memcpy=t["memcpy"])
    assert d.time.duty_cycled and d.top == "host" and d.share > 0.5
    assert d.by_cause["unknown"] > 0.3  # the graph replays' gaps
    assert list(d.by_cause) == sorted(d.by_cause, key=d.by_cause.get, reverse=True)
    pid = int(demo.meta["target"]["pid"])
    assert d.feeder == pid and d.feeder in set(t["threads"]["tid"])  # the main thread
    (f,) = idle_findings(t["kernels"], t["api"], t["markers"], t["threads"], memcpy=t["memcpy"])
    assert f.severity == "warning" and f.kind == "gpu-idle-gaps"
    assert f"thread {pid} (python3) fed most of the host gaps" in f.evidence
    assert "pthread id" not in f.evidence
    assert f"Longest host gap {d.example['gap_us'] / 1e3:.2f} ms" in f.evidence
    # that thread is on a CPU all the time: the advice is to launch less, not faster
    assert f.advice.startswith("the thread that feeds this GPU is busy all the time")


def test_old_agent_demo_names_its_feeder_by_pthread_id(old):
    """The old-agent demo, eager from one Python thread: the GPU waits on that thread, and the
    finding says so (its thread is a pthread id: the capture predates the agent's tid
    translation)."""
    (d,) = idle_summaries(old.tables["kernels"], old.tables["api"])
    assert d.top == "host" and d.share > 0.5
    assert sum(d.by_cause.values()) == pytest.approx(1.0)
    assert list(d.by_cause) == sorted(d.by_cause, key=d.by_cause.get, reverse=True)
    assert d.feeder >= 1 << 22  # a pthread id, not an OS tid
    (f,) = idle_findings(old.tables["kernels"], old.tables["api"])
    assert f.severity == "warning" and f.kind == "gpu-idle-gaps"
    assert f"thread 0x{d.feeder:x} (pthread id" in f.evidence
    assert f"Longest host gap {d.example['gap_us'] / 1e3:.2f} ms" in f.evidence
    assert f.advice.startswith("the launching thread is too slow")


def test_demo_notes_line_and_report(demo, tmp_path):
    t = demo.tables
    notes = analysis_notes(t["kernels"], t["api"], t["markers"], t["threads"], memcpy=t["memcpy"])
    # the accounting leads: busy (kernels, copies), then idle by class
    assert notes.startswith("GPU0 busy 19% (kernels 17%, copies 1%) · idle 81%: 7% in 113k gaps")
    assert "<100 µs, 74% longer (unknown 54%, host 34%, quiet 10%, sync 2%)" in notes
    assert "worst host gap" in notes
    assert "launch→start p50" in notes
    from kdash.report import summarize

    s = summarize(demo)
    kinds = [f["kind"] for f in s["findings"]]
    assert "gpu-idle-gaps" in kinds
    json.dumps(s, default=str)  # --json stays serialisable


def test_kernel_findings_over_no_kernels_is_empty():
    empty = schema.to_frame("kernels", schema.empty("kernels"))
    assert kernel_findings({"kernels": empty}) == []
    assert kernel_findings({}) == []


# -- made-up tables, one per cause ---------------------------------------------------------------
US = 1_000


def _kernels(rows):
    """MADE-UP kernels: (start_us, end_us, correlation_id) on device 0."""
    return schema.to_frame(
        "kernels",
        schema.make_batch(
            "kernels",
            start_ns=np.array([r[0] * US for r in rows], dtype=np.int64),
            end_ns=np.array([r[1] * US for r in rows], dtype=np.int64),
            name=[f"k{r[2]}" for r in rows],
            device=np.zeros(len(rows), dtype=np.int16),
            stream=np.full(len(rows), 7),
            pid=np.full(len(rows), 100),
            correlation_id=np.array([r[2] for r in rows], dtype=np.int64),
        ),
    )


def _api(rows):
    """MADE-UP API calls: (start_us, end_us, name, tid, correlation_id)."""
    return schema.to_frame(
        "api",
        schema.make_batch(
            "api",
            start_ns=np.array([r[0] * US for r in rows], dtype=np.int64),
            end_ns=np.array([r[1] * US for r in rows], dtype=np.int64),
            name=[r[2] for r in rows],
            pid=np.full(len(rows), 100),
            tid=np.array([r[3] for r in rows], dtype=np.int64),
            correlation_id=np.array([r[4] for r in rows], dtype=np.int64),
        ),
    )


def _one_gap(api_rows, k2=(1000, 1010, 2)):
    k = _kernels([(0, 100, 1), k2])
    g = gap_causes(idle_gaps(k), k, _api(api_rows))
    assert len(g) == 1
    return g.iloc[0]


def test_cause_sync_host_quiet_gpu_unknown():
    first = (0, 5, "cudaLaunchKernel_v7000", 42, 1)
    # sync: the thread was inside cudaStreamSynchronize when the GPU ran dry
    g = _one_gap([first, (10, 150, "cudaStreamSynchronize_v3020", 42, 9), (990, 995,
                  "cudaLaunchKernel_v7000", 42, 2)])  # fmt: skip
    assert (g.cause, g.prev_call, g.tid) == ("sync", "cudaStreamSynchronize", 42)
    assert g.prev_end_us == pytest.approx(50.0)
    # host: no sync, the launch came 890 µs late, and the thread was silent < QUIET_US
    g = _one_gap([first, (990, 995, "cudaLaunchKernel_v7000", 42, 2)])
    assert g.cause == "host" and g.silence_us == pytest.approx(890.0)
    assert g.prev_call == "cudaLaunchKernel"
    # quiet: the same, with a 30 ms silence
    g = _one_gap([first, (30_100, 30_105, "cudaLaunchKernel_v7000", 42, 2)], (30_200, 30_210, 2))
    assert g.cause == "quiet" and g.silence_us == pytest.approx(30_000.0)
    # a sync that began after the GPU went idle does not explain the gap: the quiet before
    # it does (the thread was not waiting on the GPU)
    late_sync = (20_000, 20_010, "cudaStreamSynchronize_v3020", 42, 9)
    launch = (20_015, 20_020, "cudaLaunchKernel_v7000", 42, 2)
    g = _one_gap([first, late_sync, launch], (20_100, 20_110, 2))
    assert g.cause == "quiet" and g.silence_us == pytest.approx(19_900.0)
    # gpu: launched before the GPU ran dry, started late anyway
    g = _one_gap([first, (50, 60, "cudaLaunchKernel_v7000", 42, 2)])
    assert g.cause == "gpu"
    # unknown: its launch call was not recorded
    g = _one_gap([first])
    assert g.cause == "unknown" and g.next_name == "k2"


def test_sync_calls_and_thread_labels():
    for name in ("cudaStreamSynchronize_v3020", "cudaDeviceSynchronize", "cuCtxSynchronize",
                 "cudaEventSynchronize_v3020", "cudaMemcpy_v3020", "cuMemcpyDtoH_v2"):  # fmt: skip
        assert is_sync_call(name), name
    for name in ("cudaMemcpyAsync_v3020", "cudaLaunchKernel_v7000", "cuLaunchKernelEx"):
        assert not is_sync_call(name), name
    assert thread_label(754, {754: "scheduler"}) == "thread 754 (scheduler)"
    assert thread_label(754) == "thread 754"
    assert "pthread id" in thread_label(3804758336)
    assert thread_label(-1) == "an unknown thread"


def test_idle_share_counts_recorded_time_only():
    """MADE-UP: a duty-cycled agent recorded 0-1 ms and 10-11 ms; the 9 ms between its windows
    is unseen, not idle."""
    k = _kernels([(0, 200, 1), (700, 1000, 2), (10_000, 10_300, 3), (10_800, 11_000, 4)])
    api = _api([(0, 5, "cudaLaunchKernel", 42, 1), (650, 655, "cudaLaunchKernel", 42, 2),
                (9990, 9995, "cudaLaunchKernel", 42, 3), (10_750, 10_755, "cudaLaunchKernel",
                42, 4)])  # fmt: skip
    windows = schema.to_frame(
        "markers",
        schema.make_batch(
            "markers",
            start_ns=np.array([0, 10_000 * US]),
            end_ns=np.array([1000 * US, 11_000 * US]),
            name=["activity on", "activity on"],
            domain=["kdash", "kdash"],
            pid=np.full(2, 100),
            tid=np.full(2, -1),
        ),
    )
    (d,) = idle_summaries(k, api, windows)
    assert d.recorded_ns == 2000 * US
    assert d.share == pytest.approx((500 + 500) / 2000)  # two 500 µs gaps, both host
    assert d.top == "host" and d.top in ACTIONABLE and d.severity == "warning"
    (plain,) = idle_summaries(k, api)  # without windows the unseen 9 ms would count
    assert plain.share > 0.9


def test_launch_latency_counts_only_waits_on_an_idle_gpu():
    """MADE-UP: k2 was launched while k1 ran (queued: not a finding); k3 was launched onto an
    idle GPU and started 80 µs after its launch returned; a copy ran in between."""
    k = _kernels([(0, 100, 1), (100, 150, 2), (400, 410, 3)])
    api = _api([(0, 5, "cudaLaunchKernel", 42, 1), (10, 15, "cudaLaunchKernel", 42, 2),
                (300, 320, "cudaLaunchKernel", 42, 3)])  # fmt: skip
    copies = schema.to_frame(
        "memcpy",
        schema.make_batch(
            "memcpy",
            start_ns=np.array([330 * US]),
            end_ns=np.array([390 * US]),
            kind=["HtoD"],
            bytes=np.array([1 << 20]),
            device=np.zeros(1, dtype=np.int16),
            stream=np.full(1, 8),
            pid=np.full(1, 100),
            correlation_id=np.array([77]),
        ),
    )
    (f,) = latency_findings(k, api, copies, warn_us=50)
    ev = f.evidence
    assert "worst 80.0 µs: k3 from thread 42" in ev and "HtoD copy of 1048576 B" in ev
    assert latency_findings(k, api, copies, warn_us=100) == []  # p99 80 < 100: no finding


def test_report_prints_kernel_findings_as_blocks_at_80_and_a_table_when_wide(demo):
    import io

    from rich.console import Console

    from kdash.report import render, summarize

    s = summarize(demo)
    narrow, wide = io.StringIO(), io.StringIO()
    render(s, Console(file=narrow, width=80, color_system=None))
    render(s, Console(file=wide, width=160, color_system=None))
    text = narrow.getvalue()
    assert "WARNING gpu-idle-gaps · GPU 0" in text
    assert "→ the thread that feeds this GPU is busy all the time" in text
    # the kernel name column keeps its width at 80: the top kernel's name is whole
    assert "_decode_stage1" in text
    assert "gpu-idle-gaps" in wide.getvalue() and "WARNING gpu-idle-gaps" not in wide.getvalue()


def _threads(tid: int, cpu_pct: float, runq: float):
    """MADE-UP scheduler rows for one thread over the gaps' second."""
    n = 4
    return schema.to_frame(
        "threads",
        schema.make_batch(
            "threads",
            t_ns=np.arange(n, dtype=np.int64) * 250 * US * 1000,
            pid=np.full(n, 100),
            tid=np.full(n, tid),
            name=["launcher"] * n,
            cpu_pct=np.full(n, cpu_pct, dtype=np.float32),
            cpu=np.zeros(n, dtype=np.int32),
            allowed_cpus=["0-3"] * n,
            runq_ms_per_s=np.full(n, runq, dtype=np.float32),
        ),
    )


@pytest.mark.parametrize(
    ("cpu_pct", "runq", "advice"),
    [(40.0, 300.0, "waits for a CPU"), (97.0, 1.0, "busy all the time"), (40.0, 1.0, "too slow")],
)
def test_host_gaps_name_the_feeding_threads_own_state(cpu_pct, runq, advice):
    """MADE-UP: one thread (OS tid 4242) launches every kernel and comes late each time; its
    scheduler rows decide which advice the finding gives."""
    ks = [(i * 1000, i * 1000 + 200, i + 1) for i in range(10)]
    calls = [(i * 1000 - 20 if i else 0, i * 1000 - 15 if i else 5, "cudaLaunchKernel", 4242,
              i + 1) for i in range(10)]  # fmt: skip
    k, api = _kernels(ks), _api(calls)
    (f,) = idle_findings(k, api, threads=_threads(4242, cpu_pct, runq))
    ev = f.evidence
    assert "thread 4242 (launcher) fed most of the host gaps" in ev
    assert f"ran {cpu_pct:.0f}% of the time and waited {runq:.1f} ms/s for a CPU" in ev
    assert "allowed CPUs 0-3" in ev and advice in f.advice
    # without scheduler rows for it (or with a pthread id) the finding says what it knows
    (bare,) = idle_findings(k, api)
    assert "ran " not in bare.evidence and "too slow" in bare.advice


def test_notes_line_says_when_the_feeder_waits_for_a_cpu():
    ks = [(i * 1000, i * 1000 + 200, i + 1) for i in range(10)]
    calls = [(i * 1000 - 20 if i else 0, i * 1000 - 15 if i else 5, "cudaLaunchKernel", 4242,
              i + 1) for i in range(10)]  # fmt: skip
    k, api = _kernels(ks), _api(calls)
    line = analysis_notes(k, api, None, _threads(4242, 40.0, 300.0))
    assert "worst host gap" in line and "its feeder waits 300 ms/s for a CPU" in line
    assert "feeder" not in analysis_notes(k, api, None, _threads(4242, 40.0, 1.0))
