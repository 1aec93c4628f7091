"""The scheduler source against real processes: pinned busy threads, CPUs crowded on purpose.

Every test starts its own small process tree (a Python script that forks busy children or
starts a busy thread, each pinned with `os.sched_setaffinity` and named through
/proc/self/task/<tid>/comm) and reads it with `SchedSource` through the real /proc. Thresholds
and assertions are loose on purpose: CI machines are small (2 cores) and loaded, so the tests
check presence and direction, never exact numbers.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pandas as pd
import pytest
from kdash.collectors.base import Source
from kdash.collectors.sched import SchedSource, _sched_field, _status_field
from kdash.collectors.topology import format_cpulist, online_cpus, parse_cpulist

from kdash import schema
from kdash.analyses.findings import find_all
from kdash.config import Thresholds
from kdash.target import Target

# Forks one busy child per CPU in argv[1] ("1,1,1"), each pinned to that CPU and named
# busyN; or, with mode "thread", runs one busy thread named busythr pinned to argv[1]; or,
# with mode "churn", keeps starting short-lived threads. Prints "ready <tids>" when set up.
BUSY_SCRIPT = r"""
import os, sys, threading, time
mode, spec, secs = sys.argv[1], sys.argv[2], float(sys.argv[3])
def name(n):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(n)
def spin(until):
    x = 0
    while time.monotonic() < until:
        x += 1
end = time.monotonic() + secs
if mode == "procs":
    kids = []
    for i, c in enumerate(int(c) for c in spec.split(",")):
        pid = os.fork()
        if pid == 0:
            os.sched_setaffinity(0, {c})
            name(f"busy{i}")
            spin(end)
            os._exit(0)
        os.sched_setaffinity(pid, {c})  # pinned (and moved) before we say ready
        kids.append(pid)
    print("ready", *kids, flush=True)
    for k in kids:
        os.waitpid(k, 0)
elif mode == "thread":
    tids = []
    ev = threading.Event()
    def worker():
        os.sched_setaffinity(threading.get_native_id(), {int(spec)})
        name("busythr")
        tids.append(threading.get_native_id())
        ev.set()
        spin(end)
    threading.Thread(target=worker, daemon=True).start()
    ev.wait()
    print("ready", tids[0], flush=True)
    time.sleep(max(0.0, end - time.monotonic()))
else:
    print("ready", flush=True)
    while time.monotonic() < end:
        ts = [threading.Thread(target=time.sleep, args=(0.002,)) for _ in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
"""


@contextmanager
def busy_tree(mode: str, spec: str, secs: float) -> Iterator[tuple[subprocess.Popen, list[int]]]:
    """Start the busy script; yield (process, tids or child pids it printed). Always reaped."""
    p = subprocess.Popen(
        [sys.executable, "-c", BUSY_SCRIPT, mode, spec, str(secs)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = p.stdout.readline().split() if p.stdout else []
        assert line and line[0] == "ready", f"busy script failed: {line}"
        yield p, [int(x) for x in line[1:]]
    finally:
        p.kill()
        p.wait(timeout=10)
        if p.stdout:
            p.stdout.close()


def pinned_cpu() -> int:
    """A CPU this process may use; the highest, so that CPU 0's housekeeping stays apart."""
    return max(os.sched_getaffinity(0))


def poll_for(src: SchedSource, seconds: float, every: float = 0.2) -> dict[str, pd.DataFrame]:
    """Poll a started source for `seconds`; the concatenated tables as DataFrames."""
    got: dict[str, list] = {"threads": [], "cpu_freq": []}
    end = time.monotonic() + seconds
    while True:
        out = src.poll(time.monotonic_ns())
        for k in got:
            got[k].append(out[k])
        if time.monotonic() >= end:
            break
        time.sleep(every)
    return {k: schema.to_frame(k, schema.concat(k, v)) for k, v in got.items()}


def demand(df: pd.DataFrame) -> pd.Series:
    """CPU demand in %: on-CPU % plus run-queue wait as % (what a spinner keeps near 100)."""
    return df["cpu_pct"] + df["runq_ms_per_s"] / 10.0


def test_is_a_source_and_batches_match_schema():
    src = SchedSource(Target.from_pid(os.getpid()))
    assert isinstance(src, Source)
    src.start()
    try:
        out = src.poll(time.monotonic_ns())
    finally:
        src.stop()
    assert set(out) == {"threads", "cpu_freq"}
    for table, batch in out.items():
        assert list(batch) == schema.columns(table)
        assert len({len(v) for v in batch.values()}) == 1
    assert os.getpid() in set(out["threads"]["tid"])
    # First poll: no previous reading, so rates are n/a rather than invented.
    assert np.isnan(out["threads"]["cpu_pct"]).all()


def test_pinned_busy_thread_reports_its_cpu_and_allowed_list():
    cpu = pinned_cpu()
    with busy_tree("thread", str(cpu), 6) as (p, tids):
        src = SchedSource(Target.from_pid(p.pid))
        src.start()
        try:
            df = poll_for(src, 1.2)["threads"]
        finally:
            src.stop()
    busy = df[df["tid"] == tids[0]]
    assert len(busy) >= 4
    assert set(busy["name"]) == {"busythr"}
    assert (busy["pid"] == p.pid).all()
    assert set(busy["cpu"]) == {cpu}
    assert set(busy["allowed_cpus"]) == {str(cpu)}
    # The main thread sleeps and keeps the default affinity.
    main = df[df["tid"] == p.pid]
    assert parse_cpulist(main["allowed_cpus"].iloc[-1]) == os.sched_getaffinity(0)
    rates = busy["cpu_pct"].dropna()
    assert len(rates) >= 3
    # A spinner wants the CPU all the time: it runs or waits in the run queue. On a loaded CI
    # box its CPU % alone can be small, but run + wait stays near 100%.
    assert demand(busy).median() > 60.0
    assert rates.median() > main["cpu_pct"].dropna().median()
    assert (busy["vol_switches"] >= 0).all() and (busy["invol_switches"] >= 0).all()
    assert busy["vol_switches"].is_monotonic_increasing


def test_crowded_cpu_gives_runqueue_delay_and_findings():
    cpu = pinned_cpu()
    with busy_tree("procs", f"{cpu},{cpu},{cpu}", 6) as (p, kids):
        src = SchedSource(Target.from_pid(p.pid))
        src.start()
        try:
            tables = poll_for(src, 2.4)
        finally:
            src.stop()
    df = tables["threads"]
    busy = df[df["tid"].isin(kids)].dropna(subset=["runq_ms_per_s"])
    assert set(busy["tid"]) == set(kids)
    assert set(busy["cpu"]) == {cpu}
    # Three spinners on one CPU: each waits about 2/3 of the time (~667 ms/s).
    assert busy.groupby("tid")["runq_ms_per_s"].median().min() > 100.0
    assert busy["cpu_pct"].median() < 80.0  # they take turns
    th = Thresholds(runq_ms_per_s=20.0, hot_thread_cpu_pct=30.0, min_duration_s=0.8)
    found = find_all(tables, {"cpu_count": os.cpu_count()}, th)
    runq = found[found["kind"] == "run-queue-delay"]
    assert {f"busy{i} (pid {k})" for i, k in enumerate(kids)} <= set(runq["subject"])
    assert runq["evidence"].str.contains("ms/s").all()
    assert runq["evidence"].str.contains("shares its CPU with busy").all()
    shared = found[found["kind"] == "shared-core"]
    assert len(shared) == 1
    assert all(f"pid {k}" in shared["subject"].iloc[0] for k in kids)
    assert f"CPU {cpu}" in shared["evidence"].iloc[0]
    # The same data judged with a threshold above what was measured raises nothing.
    calm = Thresholds(runq_ms_per_s=5000.0, hot_thread_cpu_pct=30.0, min_duration_s=0.8)
    assert "run-queue-delay" not in set(find_all(tables, {}, calm)["kind"])


def test_off_local_cpu_finding_from_real_threads():
    cpu = pinned_cpu()
    online = online_cpus()
    if online == {cpu}:
        pytest.skip("one CPU: no CPU can be 'not local'")
    local = format_cpulist(online - {cpu})
    with busy_tree("thread", str(cpu), 6) as (p, tids):
        src = SchedSource(Target.from_pid(p.pid))
        src.start()
        try:
            tables = poll_for(src, 1.6)
        finally:
            src.stop()
    th = Thresholds(hot_thread_cpu_pct=30.0, min_duration_s=0.8)
    topo = {"gpu_local_cpus": {0: local}, "gpu_of_pid": {p.pid: [0]}, "cpu_count": len(online)}
    found = find_all(tables, topo, th)
    off = found[found["kind"] == "off-local-cpu"]
    assert list(off["subject"]) == [f"busythr (tid {tids[0]}, pid {p.pid})"]
    row = off.iloc[0]
    # Allowed on that one CPU only, none of them local: it can never get better by itself.
    assert row["severity"] == "critical"
    assert f"runs on CPU {cpu}, not local to GPU 0 (local: {local})" in row["evidence"]
    assert f"taskset -pc {local} {tids[0]}" in row["advice"]
    # The same threads with the pinned CPU counted as local: nothing to say.
    topo_ok = {**topo, "gpu_local_cpus": {0: format_cpulist(online)}}
    assert "off-local-cpu" not in set(find_all(tables, topo_ok, th)["kind"])
    # A process that holds no GPU is not judged.
    topo_other = {**topo, "gpu_of_pid": {p.pid + 999_999: [0]}}
    assert "off-local-cpu" not in set(find_all(tables, topo_other, th)["kind"])


def test_forced_migrations_are_counted_and_flagged():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to migrate between")
    with busy_tree("procs", str(cpus[0]), 6) as (p, kids):
        src = SchedSource(Target.from_pid(p.pid))
        src.start()
        try:
            chunks = []
            # Bounce it between two CPUs every ~25 ms (each a real migration) and poll every
            # 7th bounce: an odd stride, so successive polls see both affinities.
            for i in range(64):
                os.sched_setaffinity(kids[0], {cpus[i % 2]})
                if i % 7 == 0:
                    chunks.append(src.poll(time.monotonic_ns()))
                time.sleep(0.025)
        finally:
            src.stop()
    tables = {
        k: schema.to_frame(k, schema.concat(k, [c[k] for c in chunks]))
        for k in ("threads", "cpu_freq")
    }
    t = tables["threads"]
    kid = t[t["tid"] == kids[0]]
    if (kid["migrations"] < 0).all():
        assert "migrations n/a" in str(src.health)
        pytest.skip("kernel without /proc/<tid>/sched: migrations not available")
    assert kid["migrations"].iloc[-1] - kid["migrations"].iloc[0] >= 10
    assert len(set(kid["allowed_cpus"])) == 2
    th = Thresholds(migrations_per_s=5.0, hot_thread_cpu_pct=30.0, min_duration_s=0.6)
    found = find_all(tables, {}, th)
    mig = found[found["kind"] == "migrations"]
    assert list(mig["subject"]) == [f"busy0 (pid {kids[0]})"]
    assert "migrations/s" in mig["evidence"].iloc[0]


def test_cpu_rows_busy_and_frequency_or_a_reason():
    cpu = pinned_cpu()
    with busy_tree("procs", str(cpu), 6) as (p, _):
        src = SchedSource(Target.from_pid(p.pid))
        src.start()
        try:
            freq = poll_for(src, 0.8)["cpu_freq"]
        finally:
            src.stop()
    online = online_cpus()
    assert set(freq["cpu"]) == online
    busy = freq.dropna(subset=["busy_pct"])
    assert busy["busy_pct"].between(0.0, 100.0).all()
    assert busy[busy["cpu"] == cpu]["busy_pct"].median() > 50.0
    has_cpufreq = os.path.exists(f"/sys/devices/system/cpu/cpu{cpu}/cpufreq/scaling_cur_freq")
    if has_cpufreq:
        assert (freq["mhz"] > 0).all() and (freq["max_mhz"] > 0).all()
        assert "cpufreq" not in str(src.health)
    else:
        assert src.health.state == "degraded" and "no cpufreq" in src.health.reason
        # The /proc/cpuinfo fallback gives a clock when the platform has one at all.
        assert freq["mhz"].isna().all() or (freq["mhz"].dropna() > 0).all()


def test_threads_coming_and_going_and_target_exit():
    with busy_tree("churn", "0", 2.0) as (p, _):
        src = SchedSource(Target.from_pid(p.pid), fd_budget=4)
        src.start()
        tids: set[int] = set()
        for _ in range(12):
            out = src.poll(time.monotonic_ns())
            tids |= set(int(t) for t in out["threads"]["tid"])
            time.sleep(0.05)
        assert len(tids) > 1  # short-lived threads were seen, none of them raised
        assert src.health.state in ("ok", "degraded")
        assert "permission" not in str(src.health)
        p.kill()
        p.wait(timeout=10)
        time.sleep(0.05)
        src.tree_interval_s = 0.0  # re-read the tree now
        out = src.poll(time.monotonic_ns())
        src.stop()
    assert len(out["threads"]["tid"]) == 0
    assert src.health.state == "unavailable" and str(p.pid) in src.health.reason


def test_kept_descriptors_and_plain_reads_agree():
    cpu = pinned_cpu()
    with busy_tree("thread", str(cpu), 6) as (p, tids):
        kept = SchedSource(Target.from_pid(p.pid))
        plain = SchedSource(Target.from_pid(p.pid), fd_budget=0)
        kept.start()
        plain.start()
        try:
            for _ in range(3):
                a = kept.poll(time.monotonic_ns())["threads"]
                b = plain.poll(time.monotonic_ns())["threads"]
                time.sleep(0.15)
        finally:
            kept.stop()
            plain.stop()
    assert kept._fds_open == 0 and plain._fds_open == 0  # stop() closed them all
    for batch in (a, b):
        i = list(batch["tid"]).index(tids[0])
        assert batch["cpu"][i] == cpu
        assert batch["cpu_pct"][i] + batch["runq_ms_per_s"][i] / 10 > 60.0


def test_parsers_on_real_proc_files():
    tid = os.getpid()
    with open(f"/proc/self/task/{tid}/status", "rb") as f:
        status = f.read()
    vol = _status_field(status, b"voluntary_ctxt_switches:")
    assert vol >= 0
    assert _status_field(status, b"no_such_field:") == -1
    path = f"/proc/self/task/{tid}/sched"
    if os.path.exists(path):
        with open(path, "rb") as f:
            sched = f.read()
        assert _sched_field(sched, b"se.nr_migrations") >= 0
        assert _sched_field(sched, b"nr_voluntary_switches") >= vol
    assert _sched_field(b"nothing here\n", b"se.nr_migrations") == -1


RENAME_SCRIPT = r"""
import sys, threading, time
ev = threading.Event()
t = threading.Thread(target=ev.wait, daemon=True)
t.start()
# start() returns before the thread is blocked in ev.wait; on a loaded machine its last few
# microseconds could land after the test's first poll. Ready once it sleeps and its run time
# holds still across 50 ms (a runnable thread waiting for a CPU shows R, not S).
task = f"/proc/self/task/{t.native_id}"
def run_ns():
    return open(f"{task}/schedstat").read().split()[0]
def sleeping():
    return open(f"{task}/stat").read().rsplit(")", 1)[1].split()[0] == "S"
while True:
    before = run_ns()
    time.sleep(0.05)
    if sleeping() and run_ns() == before:
        break
print("ready", t.native_id, flush=True)
sys.stdin.readline()
with open(f"/proc/self/task/{t.native_id}/comm", "w") as f:
    f.write("renamed")
print("done", flush=True)
sys.stdin.readline()
"""


def test_sleeping_thread_is_cheap_but_not_stale():
    """A thread that never runs is read through schedstat alone; a rename from another thread
    of its process still shows within `full_every` polls."""
    p = subprocess.Popen(
        [sys.executable, "-c", RENAME_SCRIPT],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert p.stdout and p.stdin
        line = p.stdout.readline().split()
        assert line[0] == "ready"
        tid = int(line[1])
        src = SchedSource(Target.from_pid(p.pid), full_every=3)
        src.start()

        def name_of() -> tuple[str, float]:
            b = src.poll(time.monotonic_ns())["threads"]
            i = list(b["tid"]).index(tid)
            return str(b["name"][i]), float(b["cpu_pct"][i])

        first = [name_of() for _ in range(3)]
        assert len({n for n, _ in first}) == 1 and first[0][0] != "renamed"
        assert all(pct == 0.0 for _, pct in first[1:])  # asleep the whole time
        p.stdin.write("go\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "done"
        names = [name_of()[0] for _ in range(3)]
        src.stop()
    finally:
        p.kill()
        p.wait(timeout=10)
    assert names[-1] == "renamed"


# -- run-queue rates that cannot exceed a second per second ----------------------------------------
class _FakeTarget:
    """The process tree of a made-up /proc (below): one process, whatever psutil says."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def pids(self) -> list[int]:
        return [self.pid]


def _fake_thread(proc, pid: int, tid: int, exec_ns: int, wait_ns: int, slices: int) -> None:
    """MADE-UP /proc/<pid>/task/<tid> files in the kernel's formats (stat fields 14-15 hold
    utime/stime in ticks; schedstat is on-CPU ns, run-queue wait ns, timeslices)."""
    d = proc / str(pid) / "task" / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    fields = ["R"] + ["0"] * 50
    fields[11] = fields[12] = "5"  # fields 14 and 15: it has run
    (d / "stat").write_text(f"{tid} (launcher) " + " ".join(fields) + "\n")
    (d / "schedstat").write_text(f"{exec_ns} {wait_ns} {slices}\n")
    (d / "sched").write_text(
        "nr_voluntary_switches : 1\nnr_involuntary_switches : 2\nse.nr_migrations : 0\n"
    )


def test_a_wait_credited_when_it_ends_never_reads_over_1000_ms_per_s(tmp_path):
    """The newcomer's 1890 and 6053.9 ms/s: the kernel adds a wait to schedstat's run_delay
    when the thread gets a CPU, so a thread kept runnable for 1.5 s shows the whole wait in
    the one poll where it finally ran. MADE-UP /proc files replay that: between two polls
    ~20 ms apart the wait counter jumps by 1.5 s while the thread ran 1 ms. The rate is the
    part of the interval it did not run, not 75,000 ms/s. (The tid is this process's own, so
    the affinity system call has a real thread to ask.)"""
    from kdash.collectors.sched import runq_rate

    pid = tid = os.getpid()
    _fake_thread(tmp_path, pid, tid, 1_000_000, 0, 5)
    src = SchedSource(_FakeTarget(pid), proc=str(tmp_path), sysfs=str(tmp_path / "sys"))
    src.start()
    first = src.poll(time.monotonic_ns())["threads"]
    assert np.isnan(first["runq_ms_per_s"][0])  # a thread's first row has no rate
    time.sleep(0.02)
    _fake_thread(tmp_path, pid, tid, 2_000_000, 1_500_000_000, 6)
    b = src.poll(time.monotonic_ns())["threads"]
    src.stop()
    runq, cpu = float(b["runq_ms_per_s"][0]), float(b["cpu_pct"][0])
    assert 0 < runq <= 1000.0
    assert runq + 10 * cpu == pytest.approx(1000.0, rel=1e-3)  # waited all it did not run
    assert runq_rate(1_500_000_000, 0, 250_000_000) == 1000.0
    assert runq_rate(50_000_000, 10_000_000, 250_000_000) == pytest.approx(200.0)
    assert runq_rate(-5, 0, 250_000_000) == 0.0 and np.isnan(runq_rate(1, 0, 0))


def test_findings_and_report_clip_rates_of_older_captures():
    """MADE-UP rows as a capture recorded before the cap holds them (the newcomer's 1890 and
    6053.9): the finding's numbers and the report's mean stay within 1000 ms/s."""
    from kdash.analyses.kernel_findings import feeder_state
    from kdash.report import thread_summary

    n = 40
    runq = np.where(np.arange(n) % 2 == 0, 1890.0, 6053.9).astype(np.float32)
    rows = schema.to_frame(
        "threads",
        schema.make_batch(
            "threads",
            t_ns=np.arange(n, dtype=np.int64) * 250_000_000,
            pid=np.full(n, 100),
            tid=np.full(n, 4242),
            name=["launcher"] * n,
            cpu_pct=np.full(n, 30.0, dtype=np.float32),
            cpu=np.zeros(n, dtype=np.int32),
            allowed_cpus=["0"] * n,
            runq_ms_per_s=runq,
        ),
    )
    f = find_all({"threads": rows}, {}, Thresholds())
    (ev,) = f.loc[f["kind"] == "run-queue-delay", "evidence"]
    assert "run-queue delay 1000.0 ms/s (median; max 1000.0)" in ev
    assert feeder_state(rows, 4242).runq_ms_per_s == 1000.0
    assert thread_summary(rows)[0]["runq_ms_per_s_mean"] == 1000.0
