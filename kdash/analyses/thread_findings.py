"""The thread findings: `off-local-cpu`, `run-queue-delay`, `migrations`, `shared-core`.

Each judges the target's hot threads (see `kdash.analyses.findings` for what *hot* means) from
one `ThreadView`, built once by `find_all` and passed to all four.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

import numpy as np
import pandas as pd

from kdash.analyses.finding import Finding
from kdash.analyses.finding_rules import (
    covered_s,
    span_words,
    stretches,
    subject_label,
)
from kdash.analyses.thread_view import ThreadView, as_view
from kdash.config import Thresholds
from kdash.cpulist import format_cpulist, parse_cpulist
from kdash.topology import Topology


def off_local_cpu(
    t: pd.DataFrame | ThreadView,
    topo: Topology | Mapping,
    th: Thresholds,
    now_ns: int | None = None,
) -> list[Finding]:
    """A hot thread running (warning/critical) or allowed (info) outside its GPU's local CPUs.

    The GPU of a thread is its process's GPU from `topo.gpu_of_pid`; a process absent from
    that map holds no GPU and is skipped. Without the map (or with an empty one, as when NVML
    cannot see the container's pids): the only GPU, or with several GPUs
    the union of their local CPUs ("any GPU"), so only CPUs far from every GPU are flagged.
    GPUs whose local CPUs are all online CPUs (single-node machines) give nothing to improve.
    Critical when the thread's allowed CPUs contain no local CPU at all.
    """
    v = as_view(t, th)
    topo = Topology.from_dict(topo)
    local_map = {}
    for g, s in (topo.gpu_local_cpus or {}).items():
        cpus = parse_cpulist(s) if s else set()
        if cpus:
            local_map[g] = cpus
    if not local_map or not v.hot.any():
        return []
    gpu_of_pid = topo.gpu_of_pid or {}
    has_pid_map = bool(gpu_of_pid)  # an empty map (NVML saw no pids) = unknown
    online = parse_cpulist(topo.online_cpus) if topo.online_cpus else set()
    if not online and topo.cpu_count:
        online = set(range(topo.cpu_count))
    numa = topo.gpu_numa_node or {}
    window = covered_s(v.t, now_ns)
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
        run, end, _ = stretches(tt, outside, v.interval)
        if run >= th.min_duration_s:
            counts = Counter(int(c) for c in cpus[outside])
            top_cpu = counts.most_common(1)[0][0]
            never_local = bool(allowed) and not (allowed & local)
            out.append(
                Finding(
                    t_ns=end,
                    severity="critical" if never_local else "warning",
                    kind="off-local-cpu",
                    subject=v.label(rows),
                    evidence=(
                        f"{name} runs on CPU {top_cpu}, not local to {gpu_words} "
                        f"(local: {local_s}): {int(outside.sum())} of {int(hot.sum())} hot "
                        f"samples on CPUs {format_cpulist(counts)}, {span_words(run, window)}; "
                        f"allowed CPUs {allowed_s or 'n/a'}"
                        + (" (none of them local)" if never_local else "")
                    ),
                    advice=advice,
                )
            )
            continue
        hot_run, hot_end, _ = stretches(tt, hot, v.interval)
        if allowed and allowed - local and hot_run >= th.min_duration_s:
            out.append(
                Finding(
                    t_ns=hot_end,
                    severity="info",
                    kind="off-local-cpu",
                    subject=v.label(rows),
                    evidence=(
                        f"{name} is hot ({float(np.nanmedian(v.demand[rows][hot])):.0f}% CPU "
                        f"demand) and allowed on CPUs {allowed_s}, of which "
                        f"{format_cpulist(allowed - local)} are not local to {gpu_words} "
                        f"(local: {local_s}); it stayed on local CPUs {span_words(hot_run, window)}"
                    ),
                    advice="nothing keeps it there: " + advice,
                )
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
    v = as_view(t, th)
    with np.errstate(invalid="ignore"):
        cond_all = v.hot & np.nan_to_num(v.runq > th.runq_ms_per_s, nan=False).astype(bool)
    if not cond_all.any():
        return []
    window = covered_s(v.t, now_ns)
    # (t_ns, cpu) -> hot threads there, to name competitors.
    at: dict[tuple[int, int], list[tuple[int, str]]] = {}
    for i in np.flatnonzero(v.hot & (v.cpu >= 0)):
        at.setdefault((int(v.t[i]), int(v.cpu[i])), []).append((int(v.tid[i]), str(v.name[i])))
    out: list[Finding] = []
    for _pid, tid, rows in v.threads_where(cond_all):
        cond = cond_all[rows]
        tt = v.t[rows]
        run, end, _ = stretches(tt, cond, v.interval)
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
            f"{span_words(run, window)}, while running {cpu_pct:.0f}% of the time on CPU "
            f"{format_cpulist(int(c) for c in cpus if c >= 0) or 'n/a'}"
        )
        if inv_rate is not None:
            evidence += f"; {inv_rate:.0f} involuntary switches/s"
        if rivals:
            evidence += "; shares its CPU with " + ", ".join(n for n, _ in rivals.most_common(3))
        allowed = str(v.allowed[rows][-1]) or "n/a"
        out.append(
            Finding(
                t_ns=end,
                severity="critical" if med >= 10 * th.runq_ms_per_s else "warning",
                kind="run-queue-delay",
                subject=v.label(rows),
                evidence=evidence,
                advice=(
                    f"it is runnable but waits for a CPU: other threads compete for its allowed "
                    f"CPUs ({allowed}). Give it CPUs of its own (`taskset -pc CPUS {tid}` or a "
                    f"cpuset), move other work off them (`top -H` shows who runs there), or "
                    f"raise its priority (`renice -n -5 -p {tid}`)"
                ),
            )
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
    v = as_view(t, th)
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
    window = covered_s(v.t, now_ns)
    out: list[Finding] = []
    for _pid, tid, rows in v.threads_where(cond_all):
        cond = cond_all[rows]
        run, end, _ = stretches(v.t[rows], cond, v.interval)
        if run < th.min_duration_s:
            continue
        r = rate[rows][cond]
        name = str(v.name[rows][-1])
        cpus = format_cpulist(int(c) for c in v.cpu[rows][cond] if c >= 0)
        out.append(
            Finding(
                t_ns=end,
                severity="warning",
                kind="migrations",
                subject=v.label(rows),
                evidence=(
                    f"{float(np.median(r)):.0f} migrations/s (median; max {float(np.max(r)):.0f})"
                    f" of {name}, {span_words(run, window)}, seen on CPUs {cpus or 'n/a'}; "
                    f"each move costs it its warm caches"
                ),
                advice=(
                    f"pin it to one CPU (or one core's SMT siblings) local to its GPU: "
                    f"`taskset -pc CPU {tid}`; allowed now: {v.allowed[rows][-1] or 'n/a'}"
                ),
            )
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
    topo: Topology | Mapping | None = None,
    now_ns: int | None = None,
) -> list[Finding]:
    """Hot threads whose last CPU (or physical core, when `topo.core_of_cpu` says which
    CPUs are SMT siblings) is the same in at least `shared_core_ratio` of the polls where both
    are hot, for `min_duration_s`. Threads that share pairwise are reported as one group.
    """
    v = as_view(t, th)
    sel = np.flatnonzero(v.hot & (v.cpu >= 0))
    if len(sel) < 2:
        return []
    core_of = Topology.from_dict(topo).core_of_cpu or {}
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
    window = covered_s(v.t, now_ns)
    passing: dict[tuple[int, int], tuple[float, int, int, int, Counter]] = {}
    for a, b, n_same, size in zip(g_start, g_end, n_same_of, size_of, strict=True):
        if not (n_same > 0 and n_same >= th.shared_core_ratio * size):
            continue
        g_same = same[a:b]
        run, end, _ = stretches(pt[a:b], g_same, v.interval)
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
        labels = [subject_label(str(v.name[last_row[x]]), x, int(v.pid[last_row[x]])) for x in tids]
        where = (
            f"CPU {cpus.most_common(1)[0][0]}"
            if len(cpus) == 1 or not core_of
            else f"core (SMT siblings, CPUs {format_cpulist(cpus)})"
        )
        out.append(
            Finding(
                t_ns=end,
                severity="warning",
                kind="shared-core",
                subject=", ".join(labels),
                evidence=(
                    f"{len(tids)} hot threads on the same {where} in {n_same} of {n_both} "
                    f"polls where both of a pair were hot, {span_words(run, window)}; they take "
                    f"turns instead of running in parallel"
                ),
                advice=(
                    "give each its own core local to the GPU, e.g. "
                    + ", ".join(f"`taskset -pc <cpu-{i}> {x}`" for i, x in enumerate(tids, 1))
                    + " with different CPUs that are not SMT siblings"
                ),
            )
        )
    return out
