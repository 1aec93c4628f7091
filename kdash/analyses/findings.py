"""The issue detector: pure functions from the `threads`, `cpu_freq` and `gpu_samples` tables
to `findings` rows (severity, kind, subject, evidence, advice).

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
  `_MAX_GAP_S` (a thread that was not listed, a suspended poller) ends one. So one unlucky
  250 ms poll never raises a finding, and the evidence says how long it lasted out of how long
  a window.
- Rates need two samples of the same thread (the first row of a thread has NaN rates), and
  fields a machine cannot give (NaN, -1) never satisfy a condition: no data, no finding.
- A finding's `t_ns` is the last sample of its longest stretch.

Kinds (the `kind` column): `off-local-cpu`, `run-queue-delay`, `migrations`, `shared-core`,
`low-cpu-freq`, `gpu-throttle`, `low-sm-clock`; one function each, all called by `find_all`.

Severity: `critical` when the thing cannot get better on its own or costs a lot (a thread whose
allowed CPUs exclude every CPU local to its GPU; hardware or thermal GPU slowdown; run-queue
delay at 10x the threshold), `warning` for a measured loss, `info` for a risk not yet seen
costing anything.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import numpy as np
import pandas as pd

from kdash import gpu_reasons, schema
from kdash.config import Thresholds
from kdash.cpulist import format_cpulist, parse_cpulist

Finding = dict[str, object]

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}

# A gap between two samples of a subject longer than this (and than 2.5 poll intervals) ends a
# stretch: below it, a late poll on a loaded machine; above it, data is missing.
_MAX_GAP_S = 2.0

# Reasons that are hardware or thermal: the GPU is being protected, not merely capped.
_HARD_REASONS = 0x8 | 0x20 | 0x40 | 0x80


# ---------------------------------------------------------------------------- entry point


def find_all(
    tables: Mapping[str, pd.DataFrame],
    topo: Mapping,
    th: Thresholds,
    now_ns: int | None = None,
) -> pd.DataFrame:
    """Every finding over the given window, most severe first (columns = schema "findings").

    `tables` maps table name -> DataFrame in the schema's columns; missing or empty tables just
    give no findings of their kind. `gpu_procs`, when given, says which pids hold which GPU
    (used when `topo` has no `gpu_of_pid`).

    `topo` is a plain dict (see `collectors.topology.build_topo`): `gpu_local_cpus`
    {gpu: cpulist}, optional `gpu_of_pid` {pid: [gpu, ...]}, `gpu_numa_node` {gpu: node},
    `core_of_cpu` {cpu: [package, core]}, `online_cpus` (cpulist), `cpu_count`. `now_ns` is the
    window's end (defaults to the newest sample).
    """
    rows: list[Finding] = []
    threads = _frame(tables, "threads")
    cpu_freq = _frame(tables, "cpu_freq")
    gpu = _frame(tables, "gpu_samples")
    topo = dict(topo or {})
    if not topo.get("gpu_of_pid"):
        derived = gpu_of_pid_from(tables.get("gpu_procs"))
        if derived:
            topo["gpu_of_pid"] = derived
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
    rows.sort(key=lambda r: (SEVERITY_ORDER.get(str(r["severity"]), 9), str(r["kind"])))
    if not rows:
        return schema.to_frame("findings", schema.empty("findings"))
    return schema.to_frame("findings", schema.make_batch("findings", rows=rows))


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


def _frame(tables: Mapping[str, pd.DataFrame], name: str) -> pd.DataFrame:
    """The table in full schema columns (old captures may lack some), or an empty frame."""
    df = tables.get(name)
    if df is None or len(df) == 0:
        return schema.to_frame(name, schema.empty(name))
    if all(c in df.columns for c in schema.columns(name)):
        return df
    return schema.to_frame(name, schema.from_frame(name, df))


# ---------------------------------------------------------------------------- helpers


def _interval(t_ns: np.ndarray) -> float:
    """The typical poll interval (ns) of a table: median step between its distinct times."""
    u = np.unique(np.asarray(t_ns, dtype=np.int64))
    return float(np.median(np.diff(u))) if len(u) > 1 else 0.0


def _runs(
    t: np.ndarray, cond: np.ndarray, interval: float | None = None
) -> tuple[float, int, float]:
    """(longest stretch in s, t_ns of its last sample, total s where cond held) for one subject.

    `t` sorted ascending. A stretch of consecutive true samples lasts from one poll interval
    (`interval` in ns: the table's, else this subject's median step) before its first sample
    to its last; a gap longer than both 2.5 intervals and `_MAX_GAP_S` breaks it.
    """
    n = len(t)
    if n == 0 or not cond.any():
        return 0.0, -1, 0.0
    t = np.asarray(t, dtype=np.int64)
    dts = np.diff(t)
    if interval is None:
        interval = float(np.median(dts)) if n > 1 else 0.0
    starts = cond.copy()
    starts[1:] &= ~cond[:-1] | (dts > max(2.5 * interval, _MAX_GAP_S * 1e9))
    run_id = np.cumsum(starts) - 1
    start_t = t[np.flatnonzero(starts)]
    idx = np.flatnonzero(cond)
    durs = t[idx] - start_t[run_id[idx]] + interval
    k = int(np.argmax(durs))
    return float(durs[k]) / 1e9, int(t[idx[k]]), len(idx) * interval / 1e9


def _window(t_ns: np.ndarray, now_ns: int | None) -> float:
    """Seconds the samples cover: first sample to `now_ns` (or the last one), plus the typical
    poll interval (the first sample stands for the interval before it too)."""
    if len(t_ns) == 0:
        return 0.0
    t_ns = np.asarray(t_ns, dtype=np.int64)
    t0, tn = int(t_ns.min()), int(t_ns.max())
    t1 = int(now_ns) if now_ns is not None else tn
    return max(0.0, (t1 - t0 + _interval(t_ns)) / 1e9)


def _span(run_s: float, window_s: float) -> str:
    return f"for {run_s:.1f} s of the {max(window_s, run_s):.1f} s window"


def _label(name: str, tid: int, pid: int) -> str:
    return f"{name or '?'} (tid {tid}, pid {pid})" if tid != pid else f"{name or '?'} (pid {pid})"


def _int_keys(d: Mapping | None) -> dict:
    """JSON round trips turn int keys into strings; the topo dict may come from a capture."""
    return {int(k): v for k, v in (d or {}).items()}


class ThreadView:
    """The `threads` table as numpy arrays sorted by (pid, tid, t_ns), with per-thread slices.

    Built once per `find_all` and shared by the thread findings: conditions are computed over
    the whole table in one vectorised step and only threads where a condition holds at all are
    visited one by one, so a 200-thread, 10 s window is judged in a few milliseconds.

    `demand` is the CPU demand in % (on-CPU % + run-queue wait as %; NaN when both rates are
    n/a, i.e. a thread's first sample), `hot` is `demand >= hot_thread_cpu_pct`.
    """

    def __init__(self, threads: pd.DataFrame, th: Thresholds) -> None:
        df = _frame({"threads": threads}, "threads")
        pid = df["pid"].to_numpy(dtype=np.int64)
        tid = df["tid"].to_numpy(dtype=np.int64)
        t = df["t_ns"].to_numpy(dtype=np.int64)
        order = np.lexsort((t, tid, pid))
        self.t = t[order]
        self.pid = pid[order]
        self.tid = tid[order]
        self.name = df["name"].to_numpy(dtype=object)[order]
        self.allowed = df["allowed_cpus"].to_numpy(dtype=object)[order]
        self.cpu = df["cpu"].to_numpy(dtype=np.int64)[order]
        self.cpu_pct = df["cpu_pct"].to_numpy(dtype=float)[order]
        self.runq = np.minimum(
            df["runq_ms_per_s"].to_numpy(dtype=float)[order], schema.RUNQ_MAX_MS_PER_S
        )
        self.invol = df["invol_switches"].to_numpy(dtype=np.int64)[order]
        self.mig = df["migrations"].to_numpy(dtype=np.int64)[order]
        both_nan = np.isnan(self.cpu_pct) & np.isnan(self.runq)
        demand = np.nan_to_num(self.cpu_pct) + np.nan_to_num(self.runq) / 10.0
        demand[both_nan] = np.nan
        self.demand = demand
        with np.errstate(invalid="ignore"):
            self.hot = np.nan_to_num(demand >= th.hot_thread_cpu_pct, nan=False).astype(bool)
        n = len(self.t)
        change = np.ones(n, dtype=bool)
        if n > 1:
            change[1:] = (self.pid[1:] != self.pid[:-1]) | (self.tid[1:] != self.tid[:-1])
        self.starts = np.flatnonzero(change)
        self.ends = np.append(self.starts[1:], n)
        self.gid = np.cumsum(change) - 1  # thread index of each row
        self.interval = _interval(self.t)  # every thread of a poll shares its t_ns

    def __len__(self) -> int:
        return len(self.t)

    def threads_where(self, cond: np.ndarray) -> Iterable[tuple[int, int, slice]]:
        """(pid, tid, rows) of each thread with at least one row where `cond` holds."""
        for g in np.unique(self.gid[cond]):
            a, b = int(self.starts[g]), int(self.ends[g])
            yield int(self.pid[a]), int(self.tid[a]), slice(a, b)

    def label(self, rows: slice) -> str:
        last = rows.stop - 1
        return _label(str(self.name[last]), int(self.tid[last]), int(self.pid[last]))


def _view(t: pd.DataFrame | ThreadView, th: Thresholds) -> ThreadView:
    return t if isinstance(t, ThreadView) else ThreadView(t, th)


# ---------------------------------------------------------------------------- threads


def off_local_cpu(
    t: pd.DataFrame | ThreadView, topo: Mapping, th: Thresholds, now_ns: int | None = None
) -> list[Finding]:
    """A hot thread running (warning/critical) or allowed (info) outside its GPU's local CPUs.

    The GPU of a thread is its process's GPU from `topo["gpu_of_pid"]`; a process absent from
    that map holds no GPU and is skipped. Without the map (or with an empty one, as when NVML
    cannot see the container's pids): the only GPU, or with several GPUs
    the union of their local CPUs ("any GPU"), so only CPUs far from every GPU are flagged.
    GPUs whose local CPUs are all online CPUs (single-node machines) give nothing to improve.
    Critical when the thread's allowed CPUs contain no local CPU at all.
    """
    v = _view(t, th)
    local_map = {}
    for g, s in _int_keys(topo.get("gpu_local_cpus")).items():
        cpus = parse_cpulist(str(s)) if s else set()
        if cpus:
            local_map[g] = cpus
    if not local_map or not v.hot.any():
        return []
    has_pid_map = bool(topo.get("gpu_of_pid"))  # an empty map (NVML saw no pids) = unknown
    gpu_of_pid = {k: [int(g) for g in gs] for k, gs in _int_keys(topo.get("gpu_of_pid")).items()}
    online = parse_cpulist(str(topo["online_cpus"])) if topo.get("online_cpus") else set()
    if not online and topo.get("cpu_count"):
        online = set(range(int(topo["cpu_count"])))
    numa = _int_keys(topo.get("gpu_numa_node"))
    window = _window(v.t, now_ns)
    out: list[Finding] = []
    for pid, tid, rows in v.threads_where(v.hot):
        if has_pid_map:
            gpus = [x for x in gpu_of_pid.get(pid, []) if x in local_map]
            if not gpus:
                continue
            gpu_words = "GPU " + ",".join(str(x) for x in gpus)
        elif len(local_map) == 1:
            gpus = list(local_map)
            gpu_words = f"GPU {gpus[0]}"
        else:
            gpus = sorted(local_map)
            gpu_words = "any GPU"
        local: set[int] = set().union(*(local_map[x] for x in gpus))
        if online and online <= local:
            continue
        hot = v.hot[rows]
        tt = v.t[rows]
        cpus = v.cpu[rows]
        outside = hot & (cpus >= 0) & ~np.isin(cpus, list(local))
        name = str(v.name[rows][-1])
        allowed_s = str(v.allowed[rows][-1])
        try:
            allowed = parse_cpulist(allowed_s)
        except ValueError:
            allowed = set()
        local_s = format_cpulist(local)
        nodes = sorted({numa.get(x, -1) for x in gpus} - {-1})
        advice = (
            f"pin it to CPUs local to {gpu_words}: `taskset -pc {local_s} {tid}` for this thread, "
            f"`taskset -apc {local_s} {pid}` for the whole process"
        )
        if nodes:
            node_s = ",".join(str(n) for n in nodes)
            advice += (
                f", or start the server under `numactl --cpunodebind={node_s} --membind={node_s}`"
            )
        run, end, _ = _runs(tt, outside, v.interval)
        if run >= th.min_duration_s:
            counts = Counter(int(c) for c in cpus[outside])
            top_cpu = counts.most_common(1)[0][0]
            never_local = bool(allowed) and not (allowed & local)
            out.append(
                {
                    "t_ns": end,
                    "severity": "critical" if never_local else "warning",
                    "kind": "off-local-cpu",
                    "subject": v.label(rows),
                    "evidence": (
                        f"{name} runs on CPU {top_cpu}, not local to {gpu_words} "
                        f"(local: {local_s}): {int(outside.sum())} of {int(hot.sum())} hot "
                        f"samples on CPUs {format_cpulist(counts)}, {_span(run, window)}; "
                        f"allowed CPUs {allowed_s or 'n/a'}"
                        + (" (none of them local)" if never_local else "")
                    ),
                    "advice": advice,
                }
            )
            continue
        hot_run, hot_end, _ = _runs(tt, hot, v.interval)
        if allowed and allowed - local and hot_run >= th.min_duration_s:
            out.append(
                {
                    "t_ns": hot_end,
                    "severity": "info",
                    "kind": "off-local-cpu",
                    "subject": v.label(rows),
                    "evidence": (
                        f"{name} is hot ({float(np.nanmedian(v.demand[rows][hot])):.0f}% CPU "
                        f"demand) and allowed on CPUs {allowed_s}, of which "
                        f"{format_cpulist(allowed - local)} are not local to {gpu_words} "
                        f"(local: {local_s}); it stayed on local CPUs {_span(hot_run, window)}"
                    ),
                    "advice": "nothing keeps it there: " + advice,
                }
            )
    return out


def runq_delay(
    t: pd.DataFrame | ThreadView, th: Thresholds, now_ns: int | None = None
) -> list[Finding]:
    """A hot thread waiting in the run queue longer than `runq_ms_per_s` ms per second.

    The evidence names the target's other hot threads seen on the same CPU at the same polls
    (the likely competitors) and the thread's involuntary switch rate (preemptions).
    Critical at 10x the threshold.
    """
    v = _view(t, th)
    with np.errstate(invalid="ignore"):
        cond_all = v.hot & np.nan_to_num(v.runq > th.runq_ms_per_s, nan=False).astype(bool)
    if not cond_all.any():
        return []
    window = _window(v.t, now_ns)
    # (t_ns, cpu) -> hot threads there, to name competitors.
    at: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for i in np.flatnonzero(v.hot & (v.cpu >= 0)):
        at.setdefault((int(v.t[i]), int(v.cpu[i])), []).append((int(v.tid[i]), str(v.name[i])))
    out: list[Finding] = []
    for _pid, tid, rows in v.threads_where(cond_all):
        cond = cond_all[rows]
        tt = v.t[rows]
        run, end, _ = _runs(tt, cond, v.interval)
        if run < th.min_duration_s:
            continue
        name = str(v.name[rows][-1])
        runq = v.runq[rows][cond]
        med, mx = float(np.median(runq)), float(np.max(runq))
        cpu_pct = float(np.nanmedian(v.cpu_pct[rows][cond]))
        cpus = v.cpu[rows][cond]
        rivals: Counter[str] = Counter()
        for ts, cpu in zip(tt[cond], cpus, strict=True):
            for otid, oname in at.get((int(ts), int(cpu)), []):
                if otid != tid:
                    rivals[f"{oname} ({otid})"] += 1
        inv_rate = _rate(tt, v.invol[rows])
        evidence = (
            f"run-queue delay {med:.1f} ms/s (median; max {mx:.1f}) on {name}, "
            f"{_span(run, window)}, while running {cpu_pct:.0f}% of the time on CPU "
            f"{format_cpulist(int(c) for c in cpus if c >= 0) or 'n/a'}"
        )
        if inv_rate is not None:
            evidence += f"; {inv_rate:.0f} involuntary switches/s"
        if rivals:
            evidence += "; shares its CPU with " + ", ".join(n for n, _ in rivals.most_common(3))
        allowed = str(v.allowed[rows][-1]) or "n/a"
        out.append(
            {
                "t_ns": end,
                "severity": "critical" if med >= 10 * th.runq_ms_per_s else "warning",
                "kind": "run-queue-delay",
                "subject": v.label(rows),
                "evidence": evidence,
                "advice": (
                    f"it is runnable but waits for a CPU: other threads compete for its allowed "
                    f"CPUs ({allowed}). Give it CPUs of its own (`taskset -pc CPUS {tid}` or a "
                    f"cpuset), move other work off them (`top -H` shows who runs there), or "
                    f"raise its priority (`renice -n -5 -p {tid}`)"
                ),
            }
        )
    return out


def _rate(tt: np.ndarray, counter: np.ndarray) -> float | None:
    """Mean rate per second of a cumulative counter over the samples where it is known."""
    ok = counter >= 0
    if ok.sum() < 2:
        return None
    t_ok, c_ok = tt[ok], counter[ok]
    dt = (t_ok[-1] - t_ok[0]) / 1e9
    return float(c_ok[-1] - c_ok[0]) / dt if dt > 0 else None


def migrations(
    t: pd.DataFrame | ThreadView, th: Thresholds, now_ns: int | None = None
) -> list[Finding]:
    """A hot thread migrating between CPUs more than `migrations_per_s` times per second.

    Needs `se.nr_migrations` (kernels with CONFIG_SCHED_DEBUG); -1 (n/a) gives nothing.
    """
    v = _view(t, th)
    n = len(v)
    if n < 2:
        return []
    # Per-row rate since the previous row of the same thread.
    rate = np.full(n, np.nan)
    same = v.gid[1:] == v.gid[:-1]
    dt = np.diff(v.t) / 1e9
    dm = np.diff(v.mig).astype(float)
    valid = same & (v.mig[1:] >= 0) & (v.mig[:-1] >= 0) & (dt > 0) & (dm >= 0)
    rate[1:][valid] = dm[valid] / dt[valid]
    cond_all = v.hot & (np.nan_to_num(rate, nan=-1.0) > th.migrations_per_s)
    if not cond_all.any():
        return []
    window = _window(v.t, now_ns)
    out: list[Finding] = []
    for _pid, tid, rows in v.threads_where(cond_all):
        cond = cond_all[rows]
        run, end, _ = _runs(v.t[rows], cond, v.interval)
        if run < th.min_duration_s:
            continue
        r = rate[rows][cond]
        name = str(v.name[rows][-1])
        cpus = format_cpulist(int(c) for c in v.cpu[rows][cond] if c >= 0)
        out.append(
            {
                "t_ns": end,
                "severity": "warning",
                "kind": "migrations",
                "subject": v.label(rows),
                "evidence": (
                    f"{float(np.median(r)):.0f} migrations/s (median; max {float(np.max(r)):.0f})"
                    f" of {name}, {_span(run, window)}, seen on CPUs {cpus or 'n/a'}; each move "
                    f"costs it its warm caches"
                ),
                "advice": (
                    f"pin it to one CPU (or one core's SMT siblings) local to its GPU: "
                    f"`taskset -pc CPU {tid}`; allowed now: {v.allowed[rows][-1] or 'n/a'}"
                ),
            }
        )
    return out


def _hot_pairs(
    t: np.ndarray, tid: np.ndarray, core: np.ndarray, cpu: np.ndarray
) -> tuple[np.ndarray, ...] | None:
    """Every pair of hot rows of one poll (same `t`) with tid_a < tid_b: their t, tid_a,
    tid_b, whether they were on the same core, and each one's CPU; None when there is none.

    With numpy rather than a pandas self-merge: this runs on the poll thread every second,
    and the merge and the per-pair lookups were most of the recorder's CPU on a busy target.
    """
    order = np.lexsort((tid, t))
    t, tid, core, cpu = t[order], tid[order], core[order], cpu[order]
    n = len(t)
    cuts = np.flatnonzero(t[1:] != t[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [n]))
    ia: list[np.ndarray] = []
    ib: list[np.ndarray] = []
    for s, e in zip(starts, ends, strict=True):
        if e - s < 2:
            continue
        a, b = np.triu_indices(int(e - s), 1)
        ia.append(a + s)
        ib.append(b + s)
    if not ia:
        return None
    i, j = np.concatenate(ia), np.concatenate(ib)
    keep = tid[i] < tid[j]
    i, j = i[keep], j[keep]
    if len(i) == 0:
        return None
    return t[i], tid[i], tid[j], core[i] == core[j], cpu[i], cpu[j]


def shared_core(
    t: pd.DataFrame | ThreadView,
    th: Thresholds,
    topo: Mapping | None = None,
    now_ns: int | None = None,
) -> list[Finding]:
    """Hot threads whose last CPU (or physical core, when `topo["core_of_cpu"]` says which
    CPUs are SMT siblings) is the same in at least `shared_core_ratio` of the polls where both
    are hot, for `min_duration_s`. Threads that share pairwise are reported as one group.
    """
    v = _view(t, th)
    sel = np.flatnonzero(v.hot & (v.cpu >= 0))
    if len(sel) < 2:
        return []
    core_of = {int(k): tuple(c) for k, c in _int_keys((topo or {}).get("core_of_cpu")).items()}
    cpu_arr = v.cpu[sel]
    if core_of:
        keys = [core_of.get(int(c), (-1, int(c))) for c in cpu_arr]
        ids = {k: i for i, k in enumerate(sorted(set(keys)))}
        core = np.array([ids[k] for k in keys], dtype=np.int64)
    else:
        core = cpu_arr
    pairs = _hot_pairs(v.t[sel], v.tid[sel], core, cpu_arr)
    if pairs is None:
        return []
    pt, pa, pb, same, cpu_a, cpu_b = pairs
    # one group per (tid_a, tid_b), in that order; rows of a group in time order
    order = np.lexsort((pt, pb, pa))
    pt, pa, pb, same = pt[order], pa[order], pb[order], same[order]
    cpu_a, cpu_b = cpu_a[order], cpu_b[order]
    new_pair = np.ones(len(pa), dtype=bool)
    new_pair[1:] = (pa[1:] != pa[:-1]) | (pb[1:] != pb[:-1])
    g_start = np.flatnonzero(new_pair)
    g_end = np.append(g_start[1:], len(pa))
    n_same_of = np.add.reduceat(same.astype(np.int64), g_start)
    size_of = g_end - g_start
    window = _window(v.t, now_ns)
    passing: dict[tuple[int, int], tuple[float, int, int, int, Counter]] = {}
    for a, b, n_same, size in zip(g_start, g_end, n_same_of, size_of, strict=True):
        if not (n_same > 0 and n_same >= th.shared_core_ratio * size):
            continue
        g_same = same[a:b]
        run, end, _ = _runs(pt[a:b], g_same, v.interval)
        if run < th.min_duration_s:
            continue
        cpus: Counter = Counter(int(c) for c in cpu_a[a:b][g_same])
        cpus.update(int(c) for c in cpu_b[a:b][g_same])
        passing[(int(pa[a]), int(pb[a]))] = (run, end, int(n_same), int(size), cpus)
    if not passing:
        return []
    # Union-find the pairs into groups: three threads on one CPU are one finding, not three.
    parent: dict[int, int] = {}

    def find(x: int) -> int:
        while parent.setdefault(x, x) != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for a, b in passing:
        parent[find(a)] = find(b)
    groups: dict[int, list[tuple[int, int]]] = {}
    for pair in passing:
        groups.setdefault(find(pair[0]), []).append(pair)
    last_row = {int(v.tid[b - 1]): b - 1 for b in v.ends}
    out: list[Finding] = []
    for pairs in groups.values():
        tids = sorted({x for p in pairs for x in p})
        run = max(passing[p][0] for p in pairs)
        end = max(passing[p][1] for p in pairs)
        n_same = sum(passing[p][2] for p in pairs)
        n_both = sum(passing[p][3] for p in pairs)
        cpus = Counter()
        for p in pairs:
            cpus.update(passing[p][4])
        labels = [_label(str(v.name[last_row[x]]), x, int(v.pid[last_row[x]])) for x in tids]
        where = (
            f"CPU {cpus.most_common(1)[0][0]}"
            if len(cpus) == 1 or not core_of
            else f"core (SMT siblings, CPUs {format_cpulist(cpus)})"
        )
        out.append(
            {
                "t_ns": end,
                "severity": "warning",
                "kind": "shared-core",
                "subject": ", ".join(labels),
                "evidence": (
                    f"{len(tids)} hot threads on the same {where} in {n_same} of {n_both} "
                    f"polls where both of a pair were hot, {_span(run, window)}; they take "
                    f"turns instead of running in parallel"
                ),
                "advice": (
                    "give each its own core local to the GPU, e.g. "
                    + ", ".join(f"`taskset -pc <cpu-{i}> {x}`" for i, x in enumerate(tids, 1))
                    + " with different CPUs that are not SMT siblings"
                ),
            }
        )
    return out


# ---------------------------------------------------------------------------- CPUs


def low_cpu_freq(
    cpu_freq: pd.DataFrame,
    th: Thresholds,
    threads: pd.DataFrame | ThreadView | None = None,
    now_ns: int | None = None,
) -> list[Finding]:
    """Busy CPUs (`busy_cpu_pct`) clocked below `low_cpu_freq_ratio` of their maximum.

    One finding for all such CPUs; `warning` when the target's hot threads ran there, else
    `info` (the host is slow, but not where the target runs). CPUs without a known maximum
    (VMs without cpufreq) cannot be judged and give nothing.
    """
    df = _frame({"cpu_freq": cpu_freq}, "cpu_freq")
    cpu = df["cpu"].to_numpy(dtype=np.int64)
    t = df["t_ns"].to_numpy(dtype=np.int64)
    order = np.lexsort((t, cpu))
    cpu, t = cpu[order], t[order]
    mhz = df["mhz"].to_numpy(dtype=float)[order]
    mx = df["max_mhz"].to_numpy(dtype=float)[order]
    busy = df["busy_pct"].to_numpy(dtype=float)[order]
    with np.errstate(invalid="ignore"):
        cond = (busy >= th.busy_cpu_pct) & (mx > 0) & (mhz < th.low_cpu_freq_ratio * mx)
    cond = np.nan_to_num(cond, nan=False).astype(bool)
    if not cond.any():
        return []
    window = _window(t, now_ns)
    interval = _interval(t)
    flagged: dict[int, tuple[float, int]] = {}
    for c in np.unique(cpu[cond]):
        a, b = np.searchsorted(cpu, [c, c + 1])
        run, end, _ = _runs(t[a:b], cond[a:b], interval)
        if run >= th.min_duration_s:
            flagged[int(c)] = (run, end)
    if not flagged:
        return []
    cpus = sorted(flagged)
    run = max(f[0] for f in flagged.values())
    end = max(f[1] for f in flagged.values())
    rows = cond & np.isin(cpu, cpus)
    med_mhz = float(np.median(mhz[rows]))
    med_max = float(np.median(mx[rows]))
    med_busy = float(np.median(busy[rows]))
    users: list[str] = []
    if threads is not None and len(threads):
        tv = _view(threads, th)
        on = np.flatnonzero(tv.hot & np.isin(tv.cpu, cpus))
        counts = Counter((int(tv.tid[i]), str(tv.name[i])) for i in on)
        users = [f"{name} ({tid})" for (tid, name), _ in counts.most_common(3)]
    evidence = (
        f"CPUs {format_cpulist(cpus)} at {med_mhz / 1000:.2f} GHz (median; max "
        f"{med_max / 1000:.2f} GHz, {med_mhz / med_max:.0%}) while {med_busy:.0f}% busy, "
        f"{_span(run, window)}"
    )
    if users:
        evidence += "; the target's hot threads there: " + ", ".join(users)
    return [
        {
            "t_ns": end,
            "severity": "warning" if users else "info",
            "kind": "low-cpu-freq",
            "subject": f"CPUs {format_cpulist(cpus)}",
            "evidence": evidence,
            "advice": (
                "set the performance governor (`cpupower frequency-set -g performance`), check "
                "the BIOS power profile and C-state limits, and power/thermal capping "
                "(`turbostat` shows the package power and throttling)"
            ),
        }
    ]


# ---------------------------------------------------------------------------- GPUs


def _gpu_groups(gpu: pd.DataFrame) -> Iterable[tuple[int, pd.DataFrame]]:
    for g, df in gpu.sort_values(["gpu", "t_ns"], kind="stable").groupby("gpu", sort=True):
        yield int(g), df


def _busy(df: pd.DataFrame, th: Thresholds) -> np.ndarray:
    u = df["util_gpu_pct"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(u >= th.gpu_busy_util_pct, nan=False).astype(bool)


def _gpu_state(df: pd.DataFrame, cond: np.ndarray) -> str:
    """SM clock vs max, power vs limit, temperature, over the flagged samples."""

    def med(col: str) -> float:
        v = df[col].to_numpy(dtype=float)[cond]
        v = v[~np.isnan(v)]
        return float(np.median(v)) if len(v) else float("nan")

    parts = []
    sm, smx = med("sm_clock_mhz"), med("sm_clock_max_mhz")
    if not np.isnan(sm):
        parts.append(f"SM clock {sm:.0f}" + (f"/{smx:.0f} MHz" if not np.isnan(smx) else " MHz"))
    p, pl = med("power_w"), med("power_limit_w")
    if not np.isnan(p):
        parts.append(f"power {p:.0f}" + (f"/{pl:.0f} W" if not np.isnan(pl) else " W"))
    temp = med("temp_c")
    if not np.isnan(temp):
        parts.append(f"{temp:.0f} °C")
    util = med("util_gpu_pct")
    if not np.isnan(util):
        parts.append(f"util {util:.0f}%")
    return ", ".join(parts)


_REASON_ADVICE = {
    0x4: "board power at its limit: `nvidia-smi -q -d POWER` shows the limit; raise it "
    "(`nvidia-smi -pl W`, admin) if the board allows, or accept it as the workload's ceiling",
    0x8: "hardware slowdown: check the power supply and cooling, `nvidia-smi -q -d PERFORMANCE` "
    "and `dmesg` for Xid errors",
    0x20: "software thermal slowdown: GPU or HBM too hot; check airflow, fans and inlet "
    "temperature (`nvidia-smi -q -d TEMPERATURE`)",
    0x40: "hardware thermal slowdown: the GPU is overheating; check cooling now",
    0x80: "external power brake asserted by the system (PSU or chassis power management)",
}


def gpu_throttle(gpu: pd.DataFrame, th: Thresholds, now_ns: int | None = None) -> list[Finding]:
    """A busy GPU (`gpu_busy_util_pct`) held back by a throttle reason in
    `gpu_reasons.THROTTLE_MASK` (power cap, thermal, hardware slowdown, power brake).

    `critical` for the hardware and thermal reasons, `warning` for the software power cap.
    """
    window = _window(gpu["t_ns"].to_numpy(dtype=np.int64), now_ns)
    out: list[Finding] = []
    for g, df in _gpu_groups(gpu):
        bits = df["throttle_reasons"].to_numpy(dtype=np.int64)
        cond = _busy(df, th) & (bits >= 0) & ((bits & gpu_reasons.THROTTLE_MASK) != 0)
        run, end, _ = _runs(df["t_ns"].to_numpy(dtype=np.int64), cond)
        if run < th.min_duration_s:
            continue
        counts: Counter[int] = Counter()
        for b in bits[cond]:
            for bit in gpu_reasons.REASONS:
                if bit & gpu_reasons.THROTTLE_MASK and b & bit:
                    counts[bit] += 1
        n = int(cond.sum())
        seen = ", ".join(
            f"{gpu_reasons.REASONS[bit][0]} {c / n:.0%}" for bit, c in counts.most_common()
        )
        any_bits = 0
        for bit in counts:
            any_bits |= bit
        out.append(
            {
                "t_ns": end,
                "severity": "critical" if any_bits & _HARD_REASONS else "warning",
                "kind": "gpu-throttle",
                "subject": f"GPU {g}",
                "evidence": (
                    f"throttled while busy {_span(run, window)}: {seen} of {n} busy samples; "
                    f"{_gpu_state(df, cond)}"
                ),
                "advice": "; ".join(_REASON_ADVICE[bit] for bit, _ in counts.most_common()),
            }
        )
    return out


def low_sm_clock(gpu: pd.DataFrame, th: Thresholds, now_ns: int | None = None) -> list[Finding]:
    """A busy GPU whose SM clock stays below `sm_clock_ratio` of its maximum.

    The evidence names the throttle reasons seen meanwhile, if any; with none, the usual causes
    are locked or application clocks set below the maximum.
    """
    window = _window(gpu["t_ns"].to_numpy(dtype=np.int64), now_ns)
    out: list[Finding] = []
    for g, df in _gpu_groups(gpu):
        sm = df["sm_clock_mhz"].to_numpy(dtype=float)
        smx = df["sm_clock_max_mhz"].to_numpy(dtype=float)
        with np.errstate(invalid="ignore"):
            low = np.nan_to_num((smx > 0) & (sm < th.sm_clock_ratio * smx), nan=False)
        cond = _busy(df, th) & low.astype(bool)
        run, end, _ = _runs(df["t_ns"].to_numpy(dtype=np.int64), cond)
        if run < th.min_duration_s:
            continue
        bits = df["throttle_reasons"].to_numpy(dtype=np.int64)[cond]
        names = sorted({n for b in bits for n in gpu_reasons.decode(int(b))} - {"idle"})
        ratio = float(np.median(sm[cond] / smx[cond]))
        why = (
            f"reasons reported meanwhile: {', '.join(names)}"
            if names
            else "no throttle reason reported"
        )
        advice = (
            "see the gpu-throttle finding for the reasons; "
            if set(names)
            & {
                gpu_reasons.REASONS[b][0]
                for b in gpu_reasons.REASONS
                if b & gpu_reasons.THROTTLE_MASK
            }
            else ""
        ) + (
            "check locked and application clocks (`nvidia-smi -q -d CLOCK`; reset with "
            "`nvidia-smi -rgc` and `nvidia-smi -rac`, admin) and the power limit"
        )
        out.append(
            {
                "t_ns": end,
                "severity": "warning",
                "kind": "low-sm-clock",
                "subject": f"GPU {g}",
                "evidence": (
                    f"SM clock at {ratio:.0%} of its maximum while busy {_span(run, window)}: "
                    f"{_gpu_state(df, cond)}; {why}"
                ),
                "advice": advice,
            }
        )
    return out
