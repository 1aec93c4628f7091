"""The issue detector: pure functions from the `threads`, `cpu_freq` and `gpu_samples` tables
to `Finding`s (severity, kind, subject, evidence, advice), and `find_all`, which gives them as
the `findings` table the recorder keeps and captures store.

Each finding answers "what is wrong, with which thread or device, how do we know, what to do".
The caller hands over the window it wants judged (the dashboard: the last 10 s, recomputed
every second; `kdash report`: the whole capture) and the thresholds of `kdash.config.Thresholds`.

Rules shared by all findings:

- A *hot* thread is one that wants a CPU: its on-CPU % plus its run-queue wait as a % of wall
  time (`cpu_pct + runq_ms_per_s / 10`) is at least `hot_thread_cpu_pct`. Counting the wait
  matters: three busy threads crammed onto one CPU each get 33% of it, and a plain CPU %
  threshold would call the starved threads cold.
- Persistence: a condition is judged per sample; a finding needs a stretch of consecutive
  samples where it holds that lasts at least `min_duration_s` (from one interval before its
  first sample to its last sample). A late poll does not break a stretch: the rates of the
  sample after it cover the whole gap. Only a gap longer than both 2.5 poll intervals and
  `finding_rules.MAX_GAP_S` (a thread that was not listed, a suspended poller) ends one. So
  one unlucky 250 ms poll never raises a finding, and the evidence says how long it lasted
  out of how long a window.
- Rates need two samples of the same thread (the first row of a thread has NaN rates), and
  fields a machine cannot give (NaN, -1) never satisfy a condition: no data, no finding.
- A finding's `t_ns` is the last sample of its longest stretch.

Kinds (the `kind` column): `off-local-cpu`, `run-queue-delay`, `migrations`, `shared-core`,
`low-cpu-freq`, `gpu-throttle`, `low-sm-clock`; one function each, all called by `find_all`.

Severity: `critical` when the thing cannot get better on its own or costs a lot (a thread whose
allowed CPUs exclude every CPU local to its GPU; hardware or thermal GPU slowdown; run-queue
delay at 10x the threshold), `warning` for a measured loss, `info` for a risk not yet seen
costing anything.

The code: `finding` (the `Finding` record, severity order, the table's shape),
`finding_rules` (persistence), `thread_view` (the `threads` table as arrays), `thread_findings`
and `clock_findings` (the kinds); this module holds the entry point and re-exports the public
names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import pandas as pd

from kdash.analyses.clock_findings import gpu_throttle, low_cpu_freq, low_sm_clock
from kdash.analyses.finding import SEVERITY_ORDER, Finding, findings_frame
from kdash.analyses.finding_rules import table_frame
from kdash.analyses.thread_findings import migrations, off_local_cpu, runq_delay, shared_core
from kdash.analyses.thread_view import ThreadView
from kdash.config import Thresholds
from kdash.topology import Topology

__all__ = [
    "SEVERITY_ORDER",
    "Finding",
    "ThreadView",
    "find_all",
    "gpu_of_pid_from",
    "gpu_throttle",
    "low_cpu_freq",
    "low_sm_clock",
    "migrations",
    "off_local_cpu",
    "runq_delay",
    "shared_core",
]


# ---------------------------------------------------------------------------- entry point


def find_all(
    tables: Mapping[str, pd.DataFrame],
    topo: Topology | Mapping | None,
    th: Thresholds,
    now_ns: int | None = None,
) -> pd.DataFrame:
    """Every finding over the given window, most severe first (columns = schema "findings").

    `tables` maps table name -> DataFrame in the schema's columns; missing or empty tables just
    give no findings of their kind. `gpu_procs`, when given, says which pids hold which GPU
    (used when `topo` has no `gpu_of_pid`).

    `topo` is the machine (`kdash.topology.Topology`, as `collectors.topology.build_topo` reads
    it), or its JSON object as a capture stores it. `now_ns` is the window's end (defaults to
    the newest sample).
    """
    rows: list[Finding] = []
    threads = table_frame(tables, "threads")
    cpu_freq = table_frame(tables, "cpu_freq")
    gpu = table_frame(tables, "gpu_samples")
    topo = Topology.from_dict(topo)
    if not topo.gpu_of_pid:
        derived = gpu_of_pid_from(tables.get("gpu_procs"))
        if derived:
            topo = replace(topo, gpu_of_pid=derived)
    tv = ThreadView(threads, th) if len(threads) else None
    if tv is not None:
        rows += off_local_cpu(tv, topo, th, now_ns)
        rows += runq_delay(tv, th, now_ns)
        rows += migrations(tv, th, now_ns)
        rows += shared_core(tv, th, topo, now_ns)
    if len(cpu_freq):
        rows += low_cpu_freq(cpu_freq, th, tv, now_ns)
    if len(gpu):
        rows += gpu_throttle(gpu, th, now_ns)
        rows += low_sm_clock(gpu, th, now_ns)
    rows.sort(key=lambda f: (f.rank, f.kind))
    return findings_frame(rows)


def gpu_of_pid_from(gpu_procs: pd.DataFrame | None) -> dict[int, list[int]]:
    """{pid: [gpu, ...]} from the NVML collector's `gpu_procs` table (the processes holding a
    GPU context), for when the caller's topo has no `gpu_of_pid`."""
    if gpu_procs is None or len(gpu_procs) == 0:
        return {}
    if "pid" not in gpu_procs.columns or "gpu" not in gpu_procs.columns:
        return {}
    pairs = gpu_procs[["pid", "gpu"]].drop_duplicates()
    out: dict[int, list[int]] = {}
    for pid, gpu in zip(pairs["pid"].to_numpy(), pairs["gpu"].to_numpy(), strict=True):
        if int(pid) > 0 and int(gpu) >= 0:
            out.setdefault(int(pid), []).append(int(gpu))
    return {p: sorted(set(g)) for p, g in out.items()}
