"""Findings as pure functions over tables.

The thread findings are also exercised on real /proc data in test_sched.py; here they meet
hand-made tables for the edges (persistence, n/a values, JSON-shaped topology, SMT siblings).
The GPU tables are a TEST FIXTURE, not a measurement: this CI machine has no GPU, so
`h200_samples` builds rows shaped like what the NVML collector records on an H200 (SM clock
max 1980 MHz, memory 3201 MHz, 700 W limit) at 4 Hz.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kdash import gpu_reasons, schema
from kdash.analyses import findings as F
from kdash.analyses.finding import ROW_FIELDS, Finding, findings_frame, findings_of
from kdash.config import Thresholds
from kdash.topology import Topology

HZ = 4
STEP = 1_000_000_000 // HZ
T0 = 5_000_000_000_000  # an arbitrary monotonic-clock origin

DATA = Path(__file__).resolve().parent / "data"
TH = Thresholds()  # the defaults: runq 5 ms/s, hot 50%, min_duration 1 s, ...


def h200_samples(
    seconds: float,
    *,
    gpu: int = 0,
    util: float = 98.0,
    sm: float = 1980.0,
    power: float = 520.0,
    temp: float = 62.0,
    reasons: int = 0,
    start: int = T0,
) -> pd.DataFrame:
    """FIXTURE: `gpu_samples` rows shaped like an H200 under load, one per 250 ms."""
    n = int(seconds * HZ)
    return schema.to_frame(
        "gpu_samples",
        schema.make_batch(
            "gpu_samples",
            t_ns=start + np.arange(n, dtype=np.int64) * STEP,
            gpu=[gpu] * n,
            sm_clock_mhz=[sm] * n,
            mem_clock_mhz=[3201.0] * n,
            sm_clock_max_mhz=[1980.0] * n,
            mem_clock_max_mhz=[3201.0] * n,
            temp_c=[temp] * n,
            power_w=[power] * n,
            power_limit_w=[700.0] * n,
            energy_j=np.cumsum([power / HZ] * n),
            util_gpu_pct=[util] * n,
            util_mem_pct=[util * 0.6] * n,
            mem_used_mib=[120_000.0] * n,
            mem_total_mib=[143_771.0] * n,
            pstate=[0] * n,
            throttle_reasons=[reasons] * n,
        ),
    )


def thread_rows(
    seconds: float,
    *,
    tid: int,
    pid: int = 100,
    name: str = "worker",
    cpu_pct: float = 95.0,
    cpu: int | list[int] = 3,
    allowed: str = "0-7",
    runq: float = 0.0,
    migrations: list[int] | None = None,
    start: int = T0,
) -> pd.DataFrame:
    """A synthetic thread: `seconds` of 4 Hz rows, first row with n/a rates as the source
    writes it."""
    n = int(seconds * HZ)
    cpus = cpu if isinstance(cpu, list) else [cpu] * n
    pct = [np.nan] + [cpu_pct] * (n - 1)
    rq = [np.nan] + [runq] * (n - 1)
    return schema.to_frame(
        "threads",
        schema.make_batch(
            "threads",
            t_ns=start + np.arange(n, dtype=np.int64) * STEP,
            pid=[pid] * n,
            tid=[tid] * n,
            name=[name] * n,
            cpu_pct=pct,
            cpu=cpus,
            allowed_cpus=[allowed] * n,
            runq_ms_per_s=rq,
            vol_switches=np.arange(n) * 10,
            invol_switches=np.arange(n) * 3,
            migrations=migrations if migrations is not None else [0] * n,
        ),
    )


def kinds(df: pd.DataFrame) -> list[str]:
    return list(df["kind"])


# ---------------------------------------------------------------------------- GPU


def test_power_cap_while_busy_is_a_warning_with_numbers():
    gpu = h200_samples(5, sm=1620.0, power=699.0, reasons=0x4)
    out = F.find_all({"gpu_samples": gpu}, {}, TH)
    throttle = out[out["kind"] == "gpu-throttle"]
    assert len(throttle) == 1
    row = throttle.iloc[0]
    assert row["severity"] == "warning" and row["subject"] == "GPU 0"
    assert "sw-power 100%" in row["evidence"]
    assert "SM clock 1620/1980 MHz" in row["evidence"] and "power 699/700 W" in row["evidence"]
    assert "for 5.0 s of the 5.0 s window" in row["evidence"]
    assert "nvidia-smi -q -d POWER" in row["advice"]
    assert list(out.columns) == schema.columns("findings")


def test_thermal_slowdown_is_critical_and_named():
    gpu = h200_samples(3, sm=1100.0, temp=91.0, reasons=0x40 | 0x4)
    out = F.gpu_throttle(gpu, TH)
    assert [f.severity for f in out] == ["critical"]
    assert "hw-thermal" in out[0].evidence and "sw-power" in out[0].evidence
    assert "91 °C" in out[0].evidence
    assert "cooling" in out[0].advice


def test_throttle_bits_on_an_idle_gpu_or_na_say_nothing():
    idle = h200_samples(5, util=0.0, sm=345.0, power=75.0, reasons=0x1 | 0x4)
    na = h200_samples(5, reasons=-1, gpu=1)
    assert F.find_all({"gpu_samples": pd.concat([idle, na])}, {}, TH).empty


def test_a_burst_shorter_than_min_duration_is_not_a_finding():
    quiet = h200_samples(4)
    burst = h200_samples(0.5, sm=1200.0, reasons=0x4, start=T0 + 4 * 1_000_000_000)
    after = h200_samples(4, start=T0 + int(4.5 * 1_000_000_000))
    gpu = pd.concat([quiet, burst, after], ignore_index=True)
    assert F.find_all({"gpu_samples": gpu}, {}, TH).empty
    # ...and a threshold of 0.4 s turns the same data into findings.
    short = Thresholds(min_duration_s=0.4)
    assert set(kinds(F.find_all({"gpu_samples": gpu}, {}, short))) == {
        "gpu-throttle",
        "low-sm-clock",
    }


def test_low_sm_clock_without_reason_points_at_locked_clocks():
    gpu = h200_samples(3, sm=1200.0)
    out = F.find_all({"gpu_samples": gpu}, {}, TH)
    assert kinds(out) == ["low-sm-clock"]
    row = out.iloc[0]
    assert "61% of its maximum" in row["evidence"]
    assert "no throttle reason reported" in row["evidence"]
    assert "nvidia-smi -q -d CLOCK" in row["advice"]
    # At full clock nothing is said.
    assert F.low_sm_clock(h200_samples(3), TH) == []


def test_two_gpus_judged_separately():
    gpu = pd.concat(
        [h200_samples(3, gpu=0), h200_samples(3, gpu=1, sm=1300.0, reasons=0x20)],
        ignore_index=True,
    )
    out = F.find_all({"gpu_samples": gpu}, {}, TH)
    assert set(out["subject"]) == {"GPU 1"}
    assert out.iloc[0]["severity"] == "critical"  # sorted: the thermal one first
    assert "sw-thermal" in out.iloc[0]["evidence"]


def test_throttle_mask_is_what_counts():
    # sync-boost and display clocks are not throttling.
    benign = 0x10 | 0x100
    assert benign & gpu_reasons.THROTTLE_MASK == 0
    assert F.gpu_throttle(h200_samples(3, reasons=benign), TH) == []


# ---------------------------------------------------------------------------- threads


def test_runq_needs_a_hot_thread_and_persistence():
    starved = thread_rows(3, tid=101, cpu_pct=40.0, runq=300.0)  # demand 40 + 30 = 70%
    idle = thread_rows(3, tid=102, cpu_pct=1.0, runq=30.0)  # waits, but hardly wants a CPU
    out = F.find_all({"threads": pd.concat([starved, idle])}, {}, TH)
    rq = out[out["kind"] == "run-queue-delay"]
    assert list(rq["subject"]) == ["worker (tid 101, pid 100)"]
    assert rq.iloc[0]["severity"] == "critical"  # 300 ms/s >= 10 x 5 ms/s
    assert "300.0 ms/s" in rq.iloc[0]["evidence"]
    assert "12 involuntary switches/s" in rq.iloc[0]["evidence"]
    mild = thread_rows(3, tid=103, runq=8.0)
    assert [f.severity for f in F.runq_delay(mild, TH)] == ["warning"]
    brief = thread_rows(0.75, tid=104, runq=300.0)  # 2 rates: 0.5 s < 1 s
    assert F.runq_delay(brief, TH) == []


def test_first_rows_with_na_rates_never_count():
    t = thread_rows(3, tid=101, runq=100.0)
    t.loc[:, ["cpu_pct", "runq_ms_per_s"]] = np.nan
    assert F.find_all({"threads": t}, {"gpu_local_cpus": {0: "0-1"}}, TH).empty


def test_off_local_warning_when_allowed_somewhere_local():
    t = thread_rows(3, tid=7, name="launch", cpu=37, allowed="0-63")
    topo = {"gpu_local_cpus": {0: "0-31"}, "cpu_count": 64, "gpu_numa_node": {0: 0}}
    out = F.off_local_cpu(t, topo, TH)
    assert len(out) == 1
    f = out[0]
    assert f.severity == "warning"
    assert "launch runs on CPU 37, not local to GPU 0 (local: 0-31)" in f.evidence
    assert "taskset -pc 0-31 7" in f.advice
    assert "numactl --cpunodebind=0 --membind=0" in f.advice


def test_off_local_info_when_only_allowed_outside():
    t = thread_rows(3, tid=7, name="launch", cpu=5, allowed="0-63")
    out = F.off_local_cpu(t, {"gpu_local_cpus": {0: "0-31"}, "cpu_count": 64}, TH)
    assert [f.severity for f in out] == ["info"]
    assert "32-63 are not local to GPU 0" in out[0].evidence


def test_off_local_topology_from_json_and_gpu_mapping():
    t = pd.concat(
        [
            thread_rows(3, tid=7, pid=100, cpu=40, allowed="40"),
            thread_rows(3, tid=8, pid=200, cpu=40, allowed="40"),
        ]
    )
    topo = json.loads(
        json.dumps(
            {
                "gpu_local_cpus": {0: "0-31", 1: "32-63"},
                "gpu_of_pid": {100: [0], 200: [1]},
                "cpu_count": 64,
            }
        )
    )
    out = F.off_local_cpu(t, topo, TH)
    # pid 100 uses GPU 0 (CPU 40 is remote); pid 200 uses GPU 1 (CPU 40 is local).
    assert [f.subject for f in out] == ["worker (tid 7, pid 100)"]
    assert out[0].severity == "critical"
    # Without the pid map, two GPUs: only CPUs far from every GPU count -> nothing here.
    topo.pop("gpu_of_pid")
    assert F.off_local_cpu(t, topo, TH) == []


def test_off_local_silent_when_every_cpu_is_local_or_topology_unknown():
    t = thread_rows(3, tid=7, cpu=1, allowed="0-1")
    assert F.off_local_cpu(t, {"gpu_local_cpus": {0: "0-1"}, "cpu_count": 2}, TH) == []
    assert F.off_local_cpu(t, {"gpu_local_cpus": {0: ""}}, TH) == []
    assert F.off_local_cpu(t, {}, TH) == []


def test_migrations_rate_from_cumulative_counter():
    n = 12
    t = thread_rows(3, tid=9, migrations=list(np.arange(n) * 15))  # 15 per 250 ms = 60/s
    out = F.migrations(t, TH)
    assert len(out) == 1 and "60 migrations/s" in out[0].evidence
    calm = thread_rows(3, tid=9, migrations=list(np.arange(n)))  # 4/s
    assert F.migrations(calm, TH) == []
    na = thread_rows(3, tid=9, migrations=[-1] * n)
    assert F.migrations(na, TH) == []


def test_shared_core_groups_threads_and_knows_smt_siblings():
    a = thread_rows(3, tid=1, cpu=4)
    b = thread_rows(3, tid=2, cpu=4)
    c = thread_rows(3, tid=3, cpu=4)
    apart = thread_rows(3, tid=4, cpu=5)
    out = F.shared_core(pd.concat([a, b, c, apart]), TH)
    assert len(out) == 1
    assert out[0].subject.count("tid") == 3 and "tid 4," not in out[0].subject
    assert "same CPU 4" in out[0].evidence
    # CPUs 4 and 5 as SMT siblings of one core: now tid 4 shares too.
    topo = {"core_of_cpu": {"4": [0, 2], "5": [0, 2]}}
    out = F.shared_core(pd.concat([a, apart]), TH, topo)
    assert len(out) == 1 and "SMT siblings, CPUs 4-5" in out[0].evidence
    # Same CPU in only a third of the polls: below shared_core_ratio.
    mixed = thread_rows(3, tid=5, cpu=[4, 6, 6] * 4)
    assert F.shared_core(pd.concat([a, mixed]), TH) == []


# ---------------------------------------------------------------------------- CPUs


def cpu_freq_rows(seconds: float, cpus: list[int], mhz: float, busy: float) -> pd.DataFrame:
    """FIXTURE: `cpu_freq` rows of a host with cpufreq (max 3.7 GHz), which CI lacks."""
    n = int(seconds * HZ)
    t = np.repeat(T0 + np.arange(n, dtype=np.int64) * STEP, len(cpus))
    k = len(t)
    return schema.to_frame(
        "cpu_freq",
        schema.make_batch(
            "cpu_freq",
            t_ns=t,
            cpu=cpus * n,
            mhz=[mhz] * k,
            max_mhz=[3700.0] * k,
            busy_pct=[busy] * k,
        ),
    )


def test_low_cpu_frequency_under_load():
    slow = cpu_freq_rows(3, [0, 1, 2, 3], 1200.0, 95.0)
    out = F.low_cpu_freq(slow, TH)
    assert [f.severity for f in out] == ["info"]  # no target thread there
    assert "CPUs 0-3 at 1.20 GHz" in out[0].evidence and "32%" in out[0].evidence
    t = thread_rows(3, tid=11, name="sched", cpu=2)
    out = F.find_all({"cpu_freq": slow, "threads": t}, {}, TH)
    low = out[out["kind"] == "low-cpu-freq"]
    assert low.iloc[0]["severity"] == "warning" and "sched (11)" in low.iloc[0]["evidence"]
    assert "cpupower frequency-set -g performance" in low.iloc[0]["advice"]
    # Idle CPUs may clock down; unknown maxima cannot be judged.
    assert F.low_cpu_freq(cpu_freq_rows(3, [0], 1200.0, 5.0), TH) == []
    nomax = cpu_freq_rows(3, [0], 1200.0, 95.0)
    nomax["max_mhz"] = np.nan
    assert F.low_cpu_freq(nomax, TH) == []


# ---------------------------------------------------------------------------- all together


def test_find_all_empty_and_partial_inputs():
    empty = F.find_all({}, {}, TH)
    assert empty.empty and list(empty.columns) == schema.columns("findings")
    # An old capture's table without some columns still works.
    gpu = h200_samples(3, reasons=0x4).drop(columns=["pcie_tx_kbs", "pcie_rx_kbs"])
    assert kinds(F.find_all({"gpu_samples": gpu}, {}, TH)) == ["gpu-throttle"]


def test_severity_order_and_time_stamp():
    gpu = h200_samples(3, reasons=0x4)  # warning
    hot = h200_samples(3, gpu=1, reasons=0x40)  # critical
    t = thread_rows(3, tid=7, cpu=5, allowed="0-63")  # info
    out = F.find_all(
        {"gpu_samples": pd.concat([gpu, hot]), "threads": t},
        {"gpu_local_cpus": {0: "0-31"}, "cpu_count": 64},
        TH,
    )
    assert list(out["severity"]) == ["critical", "warning", "info"]
    last = T0 + (3 * HZ - 1) * STEP
    assert (out["t_ns"] == last).all()


@pytest.mark.parametrize("window_end", [None, T0 + 9_750_000_000])
def test_evidence_cites_the_window(window_end):
    gpu = h200_samples(3, reasons=0x4)
    out = F.find_all({"gpu_samples": gpu}, {}, TH, now_ns=window_end)
    expect = "3.0 s" if window_end is None else "10.0 s"
    assert f"for 3.0 s of the {expect} window" in out.iloc[0]["evidence"]


def test_empty_gpu_of_pid_map_means_unknown_not_no_gpu():
    t = thread_rows(3, tid=7, cpu=40, allowed="40")
    topo = {"gpu_local_cpus": {0: "0-31"}, "gpu_of_pid": {}, "cpu_count": 64}
    assert [f.severity for f in F.off_local_cpu(t, topo, TH)] == ["critical"]


def test_threads_meeting_in_a_single_poll_are_not_a_shared_core():
    """Regression: a pair seen together once (one merged row) once crashed shared_core."""
    a = thread_rows(3, tid=1, cpu=4)
    b = thread_rows(0.5, tid=2, cpu=4, start=T0 + 2 * STEP)  # hot in one poll only
    assert F.shared_core(pd.concat([a, b]), TH) == []
    assert "shared-core" not in kinds(F.find_all({"threads": pd.concat([a, b])}, {}, TH))


@pytest.mark.parametrize("seed", range(8))
def test_random_tables_never_break_find_all(seed: int):
    """Ragged, gappy, n/a-laden tables (threads coming and going, CPUs offline) must give a
    findings frame, never an exception: the dashboard calls this every second."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 400))
    t = T0 + np.sort(rng.integers(0, 40, n)) * STEP
    threads = schema.to_frame(
        "threads",
        schema.make_batch(
            "threads",
            t_ns=t,
            pid=rng.integers(1, 4, n),
            tid=rng.integers(1, 12, n),
            name=[f"t{i}" for i in rng.integers(0, 5, n)],
            cpu_pct=np.where(rng.random(n) < 0.2, np.nan, rng.random(n) * 120),
            cpu=rng.integers(-1, 4, n),
            allowed_cpus=rng.choice(["0-3", "1", "", "2-3"], n),
            runq_ms_per_s=np.where(rng.random(n) < 0.2, np.nan, rng.random(n) * 900),
            vol_switches=rng.integers(-1, 100, n),
            invol_switches=rng.integers(-1, 100, n),
            migrations=rng.integers(-1, 1000, n),
        ),
    )
    m = int(rng.integers(1, 200))
    gpu = h200_samples(m / HZ, reasons=0x4)
    gpu["util_gpu_pct"] = np.where(rng.random(len(gpu)) < 0.3, np.nan, rng.random(len(gpu)) * 100)
    gpu["throttle_reasons"] = rng.choice([-1, 0, 0x4, 0x40, 0x1], len(gpu))
    gpu["sm_clock_mhz"] = rng.random(len(gpu)) * 1980
    cf = cpu_freq_rows(m / HZ + 0.25, [0, 1, 2], 1200.0, 90.0)
    cf["busy_pct"] = np.where(rng.random(len(cf)) < 0.3, np.nan, rng.random(len(cf)) * 100)
    topo = {
        "gpu_local_cpus": {0: "0-1", "1": "2-3"},
        "gpu_of_pid": {1: [0], 2: [1]},
        "core_of_cpu": {0: [0, 0], 1: [0, 0], 2: [0, 1], 3: [0, 1]},
        "cpu_count": 4,
    }
    th = Thresholds(min_duration_s=0.3, hot_thread_cpu_pct=40.0)
    out = F.find_all({"threads": threads, "gpu_samples": gpu, "cpu_freq": cf}, topo, th)
    assert list(out.columns) == schema.columns("findings")
    assert set(out["severity"]) <= {"critical", "warning", "info"}
    assert (out["evidence"].str.len() > 0).all() and (out["advice"].str.len() > 0).all()


def test_a_late_poll_does_not_break_a_stretch_but_missing_data_does():
    th = Thresholds(min_duration_s=3.0)
    first = h200_samples(2, reasons=0x4)
    late = h200_samples(2, reasons=0x4, start=T0 + 3_000_000_000)  # one poll 1.25 s late
    out = F.gpu_throttle(pd.concat([first, late], ignore_index=True), th)
    assert len(out) == 1 and "for 5.0 s" in out[0].evidence
    lost = h200_samples(2, reasons=0x4, start=T0 + 7_000_000_000)  # 5 s without samples
    assert F.gpu_throttle(pd.concat([first, lost], ignore_index=True), th) == []


def test_gpu_of_pid_comes_from_gpu_procs_when_topo_lacks_it():
    t = pd.concat(
        [
            thread_rows(3, tid=7, pid=100, cpu=40, allowed="40"),
            thread_rows(3, tid=8, pid=200, cpu=40, allowed="40"),
        ]
    )
    procs = schema.to_frame(
        "gpu_procs",
        schema.make_batch("gpu_procs", t_ns=[T0, T0], gpu=[0, 1], pid=[100, 200]),
    )
    topo = {"gpu_local_cpus": {0: "0-31", 1: "32-63"}, "cpu_count": 64}
    assert F.gpu_of_pid_from(procs) == {100: [0], 200: [1]}
    out = F.find_all({"threads": t, "gpu_procs": procs}, topo, TH)
    off = out[out["kind"] == "off-local-cpu"]
    assert list(off["subject"]) == ["worker (tid 7, pid 100)"]
    # Without it, two GPUs and no map: CPU 40 is local to one of them, nothing to say.
    assert "off-local-cpu" not in kinds(F.find_all({"threads": t}, topo, TH))


# -- the record and its table --------------------------------------------------------------
def test_every_rule_gives_records_that_the_table_gives_back():
    """find_all's table holds each rule's Finding, field for field, and reads back into it."""
    gpu = pd.concat([h200_samples(3, reasons=0x4), h200_samples(3, gpu=1, reasons=0x40)])
    t = thread_rows(3, tid=7, pid=100, cpu=40, allowed="0-63")
    topo = {"gpu_local_cpus": {0: "0-31"}, "cpu_count": 64}
    direct = F.gpu_throttle(gpu, TH) + F.off_local_cpu(t, topo, TH)
    assert direct and all(isinstance(f, Finding) for f in direct)
    table = F.find_all({"threads": t, "gpu_samples": gpu}, topo, TH)
    assert list(table.columns) == list(ROW_FIELDS) == schema.columns("findings")
    back = findings_of(table)
    assert sorted(back, key=lambda f: (f.rank, f.kind, f.subject)) == sorted(
        direct, key=lambda f: (f.rank, f.kind, f.subject)
    )
    assert [f.severity for f in back] == ["critical", "warning", "warning"]  # most severe first
    # a store batch of the same table reads into the same records
    assert findings_of(schema.from_frame("findings", table)) == back


def test_a_topology_record_and_its_json_object_give_the_same_findings():
    t = thread_rows(3, tid=7, pid=100, cpu=40, allowed="40")
    stored = {"gpu_local_cpus": {"0": "0-31"}, "gpu_of_pid": {"100": [0]}, "cpu_count": 64}
    record = Topology(gpu_local_cpus={0: "0-31"}, gpu_of_pid={100: [0]}, cpu_count=64)
    a = F.find_all({"threads": t}, stored, TH)
    b = F.find_all({"threads": t}, record, TH)
    assert not a.empty and a.equals(b)


def test_a_finding_row_and_report_object_keep_their_shapes():
    f = Finding(
        t_ns=np.int64(7).item(),
        severity="warning",
        kind="launch-latency",
        subject="GPU 0",
        evidence="e",
        advice="a",
        data={"p99_us": 80.0},
    )
    assert f.to_row() == {"t_ns": 7, "severity": "warning", "kind": "launch-latency",
                          "subject": "GPU 0", "evidence": "e", "advice": "a"}  # fmt: skip
    assert list(f.to_dict()) == [*ROW_FIELDS, "data"] and f.to_dict()["data"] == {"p99_us": 80.0}
    # the table keeps no `data`: a stored finding reads back without it
    assert Finding.from_row({**f.to_row(), "t_ns": np.int64(7)}) == Finding(**f.to_row())
    assert Finding(7, "odd", "k", "s", "e", "a").rank > f.rank  # unknown severities sort last
    assert findings_of(None) == [] and findings_frame([]).empty


@pytest.mark.parametrize("name", ["local-cpu.kdash", "h200-contended.kdash", "h200-matmul.kdash"])
def test_a_captures_findings_read_into_records_and_back(name):
    from kdash.capture import load_capture

    table = load_capture(DATA / name).tables["findings"]
    records = findings_of(table)
    assert records and all(f.data == {} for f in records)
    assert [f.to_row() for f in records] == [
        {k: (int(v) if k == "t_ns" else v) for k, v in r.items()} for r in table.to_dict("records")
    ]
