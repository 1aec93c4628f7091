"""Kernel findings: why the GPU sat idle, and how long launched kernels waited to start.

Pure functions over the `kernels`, `api`, `memcpy`, `markers` and `threads` tables, giving
`Finding`s (`kdash.analyses.finding`) like `kdash.analyses.findings`, with their numbers in
`data` too.
The kernel pane shows them under its lanes; `kdash report` lists them with the CPU findings.

How much of the recorded time the GPU was busy and idle is `kdash.analyses.gpu_time`'s
accounting (kernels and copies are busy; idle splits into gaps under `MIN_GAP_US`, the `short`
class: launch-bound, and longer gaps). A long gap is only worth a line if it says what to
change, so each is explained by what came before the kernel (or copy) that ended it, from the
CUPTI records alone:

- `sync`: that kernel's launch call came after the launching thread returned from a
  synchronize (or a blocking copy): the host emptied the GPU's queue on purpose, then spent the
  rest of the gap getting the next launch out (the "sync after every step" pathology);
- `host`: the launch came late with no synchronize before it, after a silence (no CUDA call
  on that thread) shorter than `QUIET_US`: the launching thread was busy on the CPU between
  launches (Python, scheduling) or descheduled, and the GPU ran dry;
- `quiet`: the same with a longer silence: the host had no work for the GPU (a server between
  requests) or ran a long CPU phase; a detail for a server, a finding for a training loop;
- `gpu`: the launch call had returned before the GPU went idle, yet the kernel started late:
  it waited on the GPU side (a copy, an event on another stream);
- `unknown`: the launch call was not recorded (API activity off, or outside a sampling window),
  or the gap ran to the end of a recording window, so what ended it was not recorded.

The idle share is taken over recorded time only: with a duty-cycled agent, the time between
its sampling windows is not idle, it is unseen.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd

from kdash.analyses.finding import Finding
from kdash.analyses.kernels import launch_latency, short_name
from kdash.schema import RUNQ_MAX_MS_PER_S

if TYPE_CHECKING:  # gpu_time builds on this module's gap causes: imported where used
    from kdash.analyses.gpu_time import Accounting, GpuTime

MIN_GAP_US = 100.0
# Below this share of recorded time idle, the gaps are a detail, not a finding.
IDLE_INFO_SHARE = 0.05
IDLE_WARN_SHARE = 0.20
# Launch-to-start latency on a GPU that had nothing else to run; above this at p99, a finding.
LATENCY_WARN_US = 50.0
# An OS thread id is at most 2^22 (pid_max's ceiling); CUPTI's API records carry
# pthread_self() cut to 32 bits instead, which is larger unless the agent translated it.
MAX_OS_TID = 1 << 22

# A launching thread silent for this long before its launch was not trying to feed the GPU.
QUIET_US = 10_000.0

CAUSES = ("sync", "host", "quiet", "gpu", "unknown")
ACTIONABLE = ("sync", "host")
# Idle time in gaps shorter than MIN_GAP_US: a class of its own beside the long-gap causes.
SHORT = "short"
_SYNC = re.compile(r"Synchroniz|^cudaMemcpy(_v\d+)?$|^cuMemcpy(DtoH|HtoD|DtoD)?(_v\d+)?$")

ADVICE = {
    "short": "the GPU finishes each kernel before the host has submitted the next (launch-"
    "bound): replay the step from a CUDA graph, fuse small kernels (torch.compile), or give "
    "each kernel more work (a larger batch)",
    "sync": "the host empties the GPU's queue before it queues more: drop the synchronize (or "
    "the .item()/.cpu()/.tolist() that hides one) from the step loop, or queue the next step "
    "before waiting on this one",
    "host": "the launching thread is too slow between launches: replay the step from a CUDA "
    "graph, move Python work (scheduling, tokenising) off that thread, and check its row in the "
    "CPU pane for run-queue delay or a core shared with a busy thread",
    "quiet": "the host queued nothing for long stretches: if requests were waiting, look at the "
    "scheduler thread in the CPU pane; a server between requests is idle by design",
    "gpu": "kernels were queued but waited on the GPU side: look at copies and event waits "
    "between streams before them",
    "unknown": "record API calls too (the agent's default) to see what the host did before",
}


def api_short(name: str) -> str:
    """`cudaLaunchKernel_v7000` -> `cudaLaunchKernel`: the version suffix says nothing here."""
    return re.sub(r"_v\d+$", "", str(name))


def is_sync_call(name: str) -> bool:
    """Calls that block the host until the GPU has caught up."""
    return bool(_SYNC.search(api_short(name)))


def thread_label(tid: int, names: Mapping[int, str] | None = None) -> str:
    """A thread as the user can find it: its OS tid and name, or the raw id CUPTI gave."""
    tid = int(tid)
    if tid < 0:
        return "an unknown thread"
    if tid >= MAX_OS_TID:
        return f"thread 0x{tid:x} (pthread id; no OS tid recorded)"
    name = (names or {}).get(tid)
    return f"thread {tid} ({name})" if name else f"thread {tid}"


def thread_names(threads: pd.DataFrame | None) -> dict[int, str]:
    """tid -> the last name the scheduler collector saw for it."""
    if threads is None or threads.empty:
        return {}
    last = threads.sort_values("t_ns").drop_duplicates("tid", keep="last")
    return {int(t): str(n) for t, n in zip(last["tid"], last["name"], strict=True)}


def gap_causes(gaps: pd.DataFrame, kernels: pd.DataFrame, api: pd.DataFrame) -> pd.DataFrame:
    """Each gap (from `idle_gaps`) with its cause, the launching thread, the call before the
    launch on that thread, and when the launch call started (µs after the gap began).

    Added columns: next_name, cause, tid, prev_call, prev_end_us (the previous call's end,
    µs after the gap began; negative: before), launch_us, silence_us (the launching thread's
    longest stretch without a CUDA call between the gap's start and the launch).
    """
    out = gaps.copy()
    n = len(out)
    out["next_name"] = ""
    out["cause"] = "unknown"
    out["tid"] = -1
    out["prev_call"] = ""
    out["prev_end_us"] = np.nan
    out["launch_us"] = np.nan
    out["silence_us"] = np.nan
    if n == 0 or kernels.empty:
        return out
    # The kernel that ended each gap: the first to start at the gap's end on its device.
    k = kernels[["device", "start_ns", "name", "correlation_id"]].sort_values(
        ["device", "start_ns"], kind="stable"
    )
    nxt = pd.merge(
        out[["device", "end_ns"]].reset_index(),
        k.drop_duplicates(["device", "start_ns"]),
        left_on=["device", "end_ns"],
        right_on=["device", "start_ns"],
        how="left",
    ).set_index("index")
    out["next_name"] = nxt["name"].fillna("").astype(str)
    if api.empty:
        return out
    calls = api[api["tid"] != -1]  # SYNCHRONIZATION records have no thread: their API call has
    launch = calls.drop_duplicates("correlation_id", keep="first").set_index("correlation_id")
    corr = nxt["correlation_id"]
    found = corr.notna() & corr.isin(launch.index)
    if not found.any():
        return out
    rows = launch.loc[corr[found].astype(np.int64)]
    idx = corr[found].index
    l_start = rows["start_ns"].to_numpy(np.int64)
    l_end = rows["end_ns"].to_numpy(np.int64)
    tids = rows["tid"].to_numpy(np.int64)
    a = out.loc[idx, "start_ns"].to_numpy(np.int64)
    out.loc[idx, "tid"] = tids
    out.loc[idx, "launch_us"] = (l_start - a) / 1e3
    causes = np.full(len(idx), "host", dtype=object)
    prev_call = np.full(len(idx), "", dtype=object)
    prev_end = np.full(len(idx), np.nan)
    silence = np.full(len(idx), np.nan)
    causes[l_end <= a] = "gpu"  # queued before the GPU ran dry, yet started late
    late = l_end > a
    sorted_calls = calls.sort_values("end_ns", kind="stable")
    for tid, g in sorted_calls.groupby("tid"):
        sel = np.nonzero(late & (tids == tid))[0]
        if not sel.size:
            continue
        starts = g["start_ns"].to_numpy(np.int64)
        ends = g["end_ns"].to_numpy(np.int64)
        names = g["name"].to_numpy(object)
        codes, uniq = pd.factorize(names)
        sync = np.array([is_sync_call(n) for n in uniq], dtype=bool)[codes]
        short = np.array([api_short(n) for n in uniq], dtype=object)[codes]
        # The silence before each call (since the thread's previous call ended).
        quiet_before = np.zeros_like(starts)
        quiet_before[1:] = starts[1:] - ends[:-1]
        ga, gl = a[sel], l_start[sel]
        prev = np.searchsorted(ends, gl, side="right") - 1  # the call before the launch
        first = np.searchsorted(ends, ga, side="left")  # the first call ending in the gap
        has_prev = prev >= 0
        prev_call[sel[has_prev]] = short[prev[has_prev]]
        prev_end[sel[has_prev]] = (ends[prev[has_prev]] - ga[has_prev]) / 1e3
        inside = first <= prev  # at least one call ended inside the gap before the launch
        fi = np.minimum(first, len(ends) - 1)
        waiting = inside & (starts[fi] <= ga) & sync[fi]  # draining the GPU when it went idle
        causes[sel[waiting]] = "sync"
        prev_call[sel[waiting]] = short[fi[waiting]]
        prev_end[sel[waiting]] = (ends[fi[waiting]] - ga[waiting]) / 1e3
        # The longest stretch without a CUDA call between the gap's start and the launch:
        # calls inside the gap (a late copy, a late sync) break it up.
        sil = (gl - ga).astype(float)
        for j in np.nonzero(inside & ~waiting)[0]:
            lo, hi = int(first[j]), int(prev[j])
            parts = [starts[lo] - ga[j], gl[j] - ends[hi]]
            if hi > lo:
                parts.append(int(quiet_before[lo + 1 : hi + 1].max()))
            sil[j] = max(parts)
        rest = ~waiting
        silence[sel[rest]] = sil[rest] / 1e3
        causes[sel[rest & (sil / 1e3 >= QUIET_US)]] = "quiet"
    out.loc[idx, "cause"] = causes
    out.loc[idx, "prev_call"] = prev_call
    out.loc[idx, "prev_end_us"] = prev_end
    out.loc[idx, "silence_us"] = silence
    return out


def explain_gap(g, names: Mapping[int, str] | None = None) -> str:
    """One gap in words: what came before the kernel that ended it."""
    nxt = short_name(g.next_name, 40) if g.next_name else "the next kernel"
    who = thread_label(g.tid, names)
    if g.cause == "sync":
        return (
            f"{who} returned from {g.prev_call} {g.prev_end_us / 1e3:.2f} ms into it and "
            f"launched {nxt} {(g.launch_us - g.prev_end_us) / 1e3:.2f} ms later"
        )
    if g.cause == "host":
        before = (
            f" (its call before: {g.prev_call}, {-g.prev_end_us / 1e3:.2f} ms before the gap)"
            if g.prev_call and g.prev_end_us < 0
            else f" (its call before: {g.prev_call})"
            if g.prev_call
            else ""
        )
        return f"{who} launched {nxt} {g.launch_us / 1e3:.2f} ms into it{before}"
    if g.cause == "quiet":
        return (
            f"{who} made no CUDA call for {g.silence_us / 1e3:.2f} ms, then launched {nxt} "
            f"{g.launch_us / 1e3:.2f} ms into it"
        )
    if g.cause == "gpu":
        return f"{nxt} was launched by {who} before the GPU went idle, yet started late"
    return f"the launch of {nxt} was not recorded"


@dataclass(frozen=True)
class IdleSummary:
    """One device's recorded time (`kdash.analyses.gpu_time`) and the finding made of it: which
    class of idle time it is about (`top`: `SHORT` gaps or a long-gap cause) and who fed it."""

    device: int
    time: GpuTime
    gaps: int  # long gaps (>= MIN_GAP_US)
    share: float  # idle / recorded
    by_cause: dict[str, float]  # long-gap cause -> share of the long-gap idle time, largest first
    top: str  # the class the finding is about: the largest actionable one when it matters
    actionable_share: float  # idle time of ACTIONABLE causes and short gaps / recorded
    example: Any  # the longest gap of `top` (a row of `gap_causes`); None for short gaps
    example_at_s: float  # its start, seconds after the device's first record
    feeder: int  # the thread behind most `top` gaps (-1: none)
    feeder_call: str  # its most common call before them
    t_ns: int  # when the finding is stamped: the example gap's end, else the last record

    @property
    def recorded_ns(self) -> int:
        return self.time.recorded_ns

    @property
    def severity(self) -> str | None:
        if self.share < IDLE_INFO_SHARE:
            return None
        return "warning" if self.actionable_share >= IDLE_WARN_SHARE else "info"


def explained_gaps(
    kernels: pd.DataFrame,
    api: pd.DataFrame,
    markers: pd.DataFrame | None = None,
    min_gap_us: float = MIN_GAP_US,
    memcpy: pd.DataFrame | None = None,
) -> pd.DataFrame:
    """Every idle gap of at least `min_gap_us` inside recorded time (copies count as busy), with
    its cause (`gap_causes`' columns)."""
    from kdash.analyses.gpu_time import account

    return account(kernels, memcpy, markers, api, min_gap_us).gaps


def _launcher(kernels: pd.DataFrame, api: pd.DataFrame, device: int) -> int:
    """The thread that launched most of the device's kernels (-1: no launch call recorded)."""
    if api.empty or kernels.empty:
        return -1
    corr = kernels.loc[kernels["device"] == device, "correlation_id"].unique()
    tids = api.loc[(api["tid"] != -1) & api["correlation_id"].isin(corr), "tid"]
    return int(tids.mode().iloc[0]) if len(tids) else -1


def idle_summaries(
    kernels: pd.DataFrame,
    api: pd.DataFrame,
    markers: pd.DataFrame | None = None,
    min_gap_us: float = MIN_GAP_US,
    accounting: Accounting | None = None,
    memcpy: pd.DataFrame | None = None,
) -> list[IdleSummary]:
    """Per device: the recorded time's accounting, and which idle class matters and why
    (`accounting`: `gpu_time.account` of the same tables, when the caller has it already)."""
    from kdash.analyses.gpu_time import account

    if kernels.empty:
        return []
    acc = accounting or account(kernels, memcpy, markers, api, min_gap_us)
    out = []
    for t in acc.gpus:
        g = acc.gaps[acc.gaps["device"] == t.gpu]
        idle = t.idle_ns
        classes = t.classes_ns()
        # The finding is about what the user can change: the host's part (short gaps: the
        # launch rate; sync and host gaps) when it matters, even where quiet stretches (no
        # work queued) hold more of the idle time.
        act = {c: v for c, v in classes.items() if c in (SHORT, *ACTIONABLE)}
        act_share = t.share(sum(act.values()))
        if act and act_share >= IDLE_INFO_SHARE:
            top = next(iter(act))
        elif classes:
            top = next(iter(classes))
        else:
            top = SHORT
        example, at_s, t_ns = None, 0.0, t.last_ns
        feeder, call = -1, ""
        if top != SHORT and len(g):
            focus = g[g["cause"] == top]
            example = focus.loc[focus["gap_us"].idxmax()]
            at_s = (int(example["start_ns"]) - t.first_ns) / 1e9
            t_ns = int(example["end_ns"])
            if top in ACTIONABLE:
                feeder = int(focus["tid"].mode().iloc[0])
                calls = focus.loc[focus["tid"] == feeder, "prev_call"]
                calls = calls[calls != ""]
                call = str(calls.mode().iloc[0]) if not calls.empty else ""
        elif top == SHORT:
            feeder = _launcher(kernels, api, t.gpu)
        long_idle = t.long_gap_idle_ns
        out.append(
            IdleSummary(
                device=t.gpu,
                time=t,
                gaps=t.long_gaps,
                share=t.share(idle),
                by_cause={c: v / long_idle for c, v in t.idle_by_cause_ns.items()}
                if long_idle
                else {},
                top=top,
                actionable_share=act_share,
                example=example,
                example_at_s=at_s,
                feeder=feeder,
                feeder_call=call,
                t_ns=t_ns,
            )
        )
    return out


# The launching thread's own state, from the scheduler collector's rows: when it waited this
# long for a CPU, or ran nearly all the time, the host gaps have a host-side reason to name.
FEEDER_RUNQ_MS = 50.0
FEEDER_BUSY_PCT = 90.0

FEEDER_ADVICE = {
    "short": "the GPU finishes each kernel before the host has submitted the next (launch-"
    "bound): replay the step from a CUDA graph, fuse small kernels (torch.compile), or give "
    "each kernel more work (a larger batch)",
    "runq": "the thread that feeds this GPU waits for a CPU: give it a core of its own "
    "(taskset/cpuset, or move the busy threads that share its CPUs away), then look again",
    "busy": "the thread that feeds this GPU is busy all the time: it cannot launch faster, so "
    "launch less (replay steps from a CUDA graph, fuse small kernels) or move its other work "
    "to another thread",
}


@dataclass(frozen=True)
class FeederState:
    """The launching thread as the scheduler collector saw it over the window."""

    cpu_pct: float  # mean on-CPU %
    runq_ms_per_s: float  # mean run-queue wait
    allowed: str  # its last allowed-CPU list

    @property
    def problem(self) -> str | None:
        if self.runq_ms_per_s >= FEEDER_RUNQ_MS:
            return "runq"
        if self.cpu_pct >= FEEDER_BUSY_PCT:
            return "busy"
        return None

    def text(self) -> str:
        return (
            f"over the window it ran {self.cpu_pct:.0f}% of the time and waited "
            f"{self.runq_ms_per_s:.1f} ms/s for a CPU (allowed CPUs {self.allowed or 'n/a'})"
        )


def feeder_state(threads: pd.DataFrame | None, tid: int) -> FeederState | None:
    """The thread's mean CPU % and run-queue wait over the rows given, or None when the
    scheduler collector has no rows for it (or the id is a pthread id, not an OS tid)."""
    if threads is None or threads.empty or tid < 0 or tid >= MAX_OS_TID:
        return None
    rows = threads[threads["tid"] == tid]
    cpu = rows["cpu_pct"].astype(float).dropna()
    if cpu.empty:
        return None
    runq = rows["runq_ms_per_s"].astype(float).dropna().clip(upper=RUNQ_MAX_MS_PER_S)
    return FeederState(
        cpu_pct=float(cpu.mean()),
        runq_ms_per_s=float(runq.mean()) if len(runq) else 0.0,
        allowed=str(rows["allowed_cpus"].iloc[-1]),
    )


def causes_text(by_cause: Mapping[str, float]) -> str:
    """ "host 62%, quiet 38%, sync <1%": shares of the idle time, largest first."""
    return ", ".join(f"{c} {'<1' if v < 0.005 else f'{100 * v:.0f}'}%" for c, v in by_cause.items())


def gap_brief(g, names: Mapping[int, str] | None = None) -> str:
    """A gap's cause in a few words, for the pane's one line (the report has `explain_gap`)."""
    who = thread_label(g.tid, names).split(" (pthread")[0]
    if g.cause == "sync":
        return f"{who} was in {g.prev_call}"
    if g.cause == "host":
        after = f" after {g.prev_call}" if g.prev_call else ""
        return f"{who} launched {g.launch_us / 1e3:.1f} ms late{after}"
    if g.cause == "quiet":
        return f"{who} made no CUDA call for {g.silence_us / 1e3:.1f} ms"
    if g.cause == "gpu":
        return "queued, waited on the GPU side"
    return "its launch was not recorded"


def idle_findings(
    kernels: pd.DataFrame,
    api: pd.DataFrame,
    markers: pd.DataFrame | None = None,
    threads: pd.DataFrame | None = None,
    min_gap_us: float = MIN_GAP_US,
    memcpy: pd.DataFrame | None = None,
    accounting: Accounting | None = None,
) -> list[Finding]:
    """One finding per device whose GPU sat idle for a noticeable share of the recorded time:
    the accounting of busy and idle time, split by class, with the main class spelt out (the
    longest gap of a long-gap cause, or the count and median of the short gaps).

    Each finding carries its numbers in `data` (the report's `--json`), besides the prose."""
    from kdash.analyses.gpu_time import time_text

    names = thread_names(threads)
    out: list[Finding] = []
    for d in idle_summaries(kernels, api, markers, min_gap_us, accounting, memcpy):
        if d.severity is None:
            continue
        lead = ""
        advice = ADVICE[d.top]
        state = None
        if d.feeder >= 0:
            what = (
                "launched most of its kernels"
                if d.top == SHORT
                else f"fed most of the {d.top} gaps"
            )
            lead = f" {thread_label(d.feeder, names)} {what}"
            lead += f", mostly after {d.feeder_call}" if d.feeder_call else ""
            state = feeder_state(threads, d.feeder)
            if state is not None:
                lead += f"; {state.text()}"
                if d.top in ("host", SHORT) and state.problem:
                    advice = FEEDER_ADVICE[state.problem]
            lead += "."
        t = d.time
        evidence = (
            f"over the {t.recorded_ns / 1e9:.1f} s recorded, {time_text(t, memcpy is not None)}."
        )
        data: dict[str, Any] = {
            "gpu": d.device,
            "about": d.top,
            "idle_share": d.share,
            "actionable_share": d.actionable_share,
            "gpu_time": t.to_json(),
            "feeder_tid": d.feeder if d.feeder >= 0 else None,
            "feeder_call": d.feeder_call or None,
        }
        if d.top == SHORT:
            evidence += (
                f" The short gaps are the GPU finishing each kernel before the next is "
                f"submitted (median {t.short_gap_median_us:.1f} µs).{lead}"
            )
        else:
            evidence += (
                f"{lead} Longest {d.top} gap {d.example['gap_us'] / 1e3:.2f} ms at "
                f"+{d.example_at_s:.1f} s: {explain_gap(d.example, names)}"
            )
            data["longest_gap_us"] = float(d.example["gap_us"])
            data["longest_gap_at_s"] = d.example_at_s
        if state is not None:
            data["feeder_cpu_pct"] = state.cpu_pct
            data["feeder_runq_ms_per_s"] = state.runq_ms_per_s
        out.append(
            Finding(
                t_ns=d.t_ns,
                severity=d.severity,
                kind="gpu-idle-gaps",
                subject=f"GPU {d.device}",
                evidence=evidence,
                advice=advice,
                data=data,
            )
        )
    return out


def latency_findings(
    kernels: pd.DataFrame,
    api: pd.DataFrame,
    memcpy: pd.DataFrame | None = None,
    threads: pd.DataFrame | None = None,
    warn_us: float = LATENCY_WARN_US,
) -> list[Finding]:
    """Launch-to-start latency that is not queueing: a kernel whose launch call returned while
    the GPU had nothing else to run, and still started late.

    Time spent behind earlier kernels is the queue doing its job (the host is ahead), so each
    kernel's wait is counted from the later of its launch call's end and the end of the kernel
    before it on its device.
    """
    lat = launch_latency(kernels, api[api["tid"] != -1] if not api.empty else api)
    if lat.empty:
        return []
    k = kernels[["device", "start_ns", "end_ns", "correlation_id"]].sort_values(
        ["device", "start_ns"], kind="stable"
    )
    prev_end = k.groupby("device")["end_ns"].transform(lambda e: e.cummax().shift(1))
    k = k.assign(prev_end=prev_end.fillna(np.iinfo(np.int64).min).astype(np.int64))
    m = lat.merge(
        k[["correlation_id", "start_ns", "device", "prev_end"]], on=["correlation_id", "start_ns"]
    )
    ready = np.maximum(m["api_end_ns"].to_numpy(np.int64), m["prev_end"].to_numpy(np.int64))
    m["idle_wait_us"] = (m["start_ns"].to_numpy(np.int64) - ready) / 1e3
    m = m[m["idle_wait_us"] >= 0]
    if m.empty:
        return []
    names = thread_names(threads)
    out: list[Finding] = []
    for dev, g in m.groupby("device"):
        p50, p99 = np.percentile(g["idle_wait_us"].to_numpy(float), [50, 99])
        if p99 < warn_us:
            continue
        worst = g.loc[g["idle_wait_us"].idxmax()]
        before = ""
        if memcpy is not None and not memcpy.empty:
            cp = memcpy[
                (memcpy["device"] == dev)
                & (memcpy["end_ns"] > int(worst["api_end_ns"]))
                & (memcpy["start_ns"] < int(worst["start_ns"]))
            ]
            if not cp.empty:
                c = cp.iloc[-1]
                before = f"; a {c['kind']} copy of {int(c['bytes'])} B ran before it"
        out.append(
            Finding(
                t_ns=int(worst["start_ns"]),
                severity="warning",
                kind="launch-latency",
                subject=f"GPU {int(dev)}",
                evidence=(
                    f"kernels launched onto an idle GPU waited p50 {p50:.1f} µs, p99 {p99:.1f} "
                    f"µs to start ({len(g)} launches); worst {worst['idle_wait_us']:.1f} µs: "
                    f"{short_name(str(worst['name']), 40)} from "
                    f"{thread_label(int(worst['tid']), names)}{before}"
                ),
                advice="a wait after the launch returned is the driver or a dependency, not "
                "the host: look for copies, event waits or another process on this GPU",
                data={
                    "gpu": int(dev),
                    "p50_us": float(p50),
                    "p99_us": float(p99),
                    "launches": len(g),
                    "worst_us": float(worst["idle_wait_us"]),
                    "worst_kernel": str(worst["name"]),
                    "worst_tid": int(worst["tid"]),
                },
            )
        )
    return out


def kernel_findings(tables: Mapping[str, pd.DataFrame]) -> list[Finding]:
    """Every kernel finding over the given tables (missing tables: no finding of that kind)."""
    kernels = tables.get("kernels")
    if kernels is None or kernels.empty:
        return []
    api = tables.get("api")
    if api is None:
        api = pd.DataFrame(columns=["start_ns", "end_ns", "name", "pid", "tid", "correlation_id"])
    memcpy = tables.get("memcpy")
    return idle_findings(
        kernels, api, tables.get("markers"), tables.get("threads"), memcpy=memcpy
    ) + latency_findings(kernels, api, memcpy, tables.get("threads"))
