"""`kdash export --perfetto`: a capture as a Chrome trace (JSON, optionally gzipped).

Tracks: one process per GPU with a thread per stream for kernels and copies and one for its
idle gaps named by cause (`idle: host`, `idle: sync`, ...: kdash.analyses.gpu_time; the same
accounting's busy and idle time per GPU is in `otherData.gpu_time`),
one process per watched pid with its API calls and NVTX ranges per thread, and counter
tracks for the GPU's
clocks, temperature, power and utilisation, and the busiest threads' CPU %. Timestamps are
microseconds from the capture window's start, so the trace opens at zero.

Slices on one track must nest in Perfetto: calls on one thread do; kernels on one stream
usually do, and those that overlap their predecessor (programmatic dependent launch, seen on the
H200) go to an overflow lane; NVTX ranges get their own track per thread.
"""

from __future__ import annotations

import gzip
import heapq
import json
from pathlib import Path

import numpy as np

from kdash.capture import Capture
from kdash.errors import UserError

GPU_PID_BASE = 1_000_000  # synthetic pids for GPU tracks, away from real ones
# Kernels on one stream can overlap on Hopper (programmatic dependent launch: cuBLAS starts the
# next kernel's prologue before the previous one ends). Perfetto needs slices on one track to
# nest, so a kernel that starts inside its predecessor goes to an overflow lane of that stream.
OVERLAP_TID_STEP = 1 << 32


def _lanes(starts, ends) -> list[int]:
    """Lane per slice (sorted by start) so that slices on one lane never overlap: the lowest
    lane whose last slice has ended, in O(n log n) (a capture whose kernels all overlap, real
    or damaged, needs as many lanes as kernels; a scan of the lanes per kernel was quadratic).
    """
    busy: list[tuple[int, int]] = []  # (end, lane) of lanes whose last slice may still run
    free: list[int] = []  # lanes whose last slice ended before the current start
    out = []
    count = 0
    for s, e in zip(starts.tolist(), ends.tolist(), strict=True):
        # starts ascend, so a lane that is free now stays free for every later slice
        while busy and busy[0][0] <= s:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            lane = heapq.heappop(free)
        else:
            lane = count
            count += 1
        heapq.heappush(busy, (e, lane))
        out.append(lane)
    return out


COUNTERS = [
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("mem_clock_mhz", "memory clock (MHz)"),
    ("temp_c", "temperature (C)"),
    ("power_w", "power (W)"),
    ("util_gpu_pct", "utilisation (%)"),
]


def trace_events(cap: Capture, top_threads: int = 8) -> list[dict]:
    t = cap.tables
    t0 = (cap.meta.get("window") or {}).get("start_ns")
    if t0 is None:
        starts = [df[c].min() for df, c in _time_cols(t) if len(df)]
        t0 = int(min(starts)) if starts else 0
    ev: list[dict] = []

    def us(ns) -> float:
        return (int(ns) - t0) / 1e3

    gpus = sorted(
        set(t["gpu_samples"]["gpu"].astype(int).tolist())
        | set(t["kernels"]["device"].astype(int).tolist())
    )
    names = {g.get("index"): g.get("name", "") for g in cap.meta.get("gpus") or []}
    for g in gpus:
        ev.append(_meta("process_name", GPU_PID_BASE + g, 0, f"GPU {g} {names.get(g, '')}".strip()))
        ev.append(_meta("process_sort_index", GPU_PID_BASE + g, 0, None, sort_index=g))

    k = t["kernels"].sort_values(["device", "stream", "start_ns"], kind="stable")
    lane_names: dict[tuple[int, int], str] = {}
    for (dev, stream), g in k.groupby(["device", "stream"], sort=True):
        lanes = _lanes(g["start_ns"].to_numpy(), g["end_ns"].to_numpy())
        for row, lane in zip(g.itertuples(index=False), lanes, strict=True):
            tid = int(stream) + OVERLAP_TID_STEP * int(lane)
            lane_names[(int(dev), tid)] = (
                f"stream {int(stream)}" if lane == 0 else f"stream {int(stream)} (overlap {lane})"
            )
            ev.append(
                {
                    "ph": "X",
                    "cat": "kernel",
                    "name": row.name,
                    "pid": GPU_PID_BASE + int(dev),
                    "tid": tid,
                    "ts": us(row.start_ns),
                    "dur": max(0.0, (row.end_ns - row.start_ns) / 1e3),
                    "args": {
                        "grid": [int(row.grid_x), int(row.grid_y), int(row.grid_z)],
                        "block": [int(row.block_x), int(row.block_y), int(row.block_z)],
                        "registers": int(row.registers),
                        "shared_memory": int(row.static_smem) + int(row.dynamic_smem),
                        "correlation": int(row.correlation_id),
                        "graph_id": int(row.graph_id),
                    },
                }
            )
    for (dev, tid), name in lane_names.items():
        ev.append(_meta("thread_name", GPU_PID_BASE + dev, tid, name))

    ev += _idle_gap_events(t, us)

    m = t["memcpy"]
    for row in m.itertuples(index=False):
        ev.append(
            {
                "ph": "X",
                "cat": "memcpy",
                "name": f"{row.kind} {int(row.bytes)} B",
                "pid": GPU_PID_BASE + int(row.device),
                "tid": int(row.stream),
                "ts": us(row.start_ns),
                "dur": max(0.0, (row.end_ns - row.start_ns) / 1e3),
                "args": {"bytes": int(row.bytes), "correlation": int(row.correlation_id)},
            }
        )

    for row in t["api"].itertuples(index=False):
        ev.append(
            {
                "ph": "X",
                "cat": "cuda_api",
                "name": row.name,
                "pid": int(row.pid),
                "tid": int(row.tid),
                "ts": us(row.start_ns),
                "dur": max(0.0, (row.end_ns - row.start_ns) / 1e3),
                "args": {"correlation": int(row.correlation_id)},
            }
        )
    nvtx_tid_offset = 1 << 40
    for row in t["markers"].itertuples(index=False):
        ev.append(
            {
                "ph": "X",
                "cat": "nvtx",
                "name": row.name,
                "pid": int(row.pid),
                "tid": nvtx_tid_offset + int(row.tid),
                "ts": us(row.start_ns),
                "dur": max(0.0, (row.end_ns - row.start_ns) / 1e3),
            }
        )

    gs = t["gpu_samples"]
    for col, label in COUNTERS:
        if col not in gs:
            continue
        for row in gs[["t_ns", "gpu", col]].itertuples(index=False):
            v = float(row[2])
            if np.isnan(v):
                continue
            ev.append(
                {
                    "ph": "C",
                    "name": label,
                    "pid": GPU_PID_BASE + int(row[1]),
                    "ts": us(row[0]),
                    "args": {"value": v},
                }
            )

    th = t["threads"]
    if len(th):
        hot = th.groupby(["pid", "tid"])["cpu_pct"].mean().sort_values(ascending=False)
        names_by_tid = th.groupby("tid")["name"].last().to_dict()
        for pid, tid in list(hot.index[:top_threads]):
            sub = th[(th["pid"] == pid) & (th["tid"] == tid)]
            label = f"CPU % {names_by_tid.get(tid, '')} ({tid})"
            for row in sub[["t_ns", "cpu_pct"]].itertuples(index=False):
                if np.isnan(row[1]):
                    continue
                ev.append(
                    {
                        "ph": "C",
                        "name": label,
                        "pid": int(pid),
                        "ts": us(row[0]),
                        "args": {"value": float(row[1])},
                    }
                )
        for pid in sorted(set(th["pid"].astype(int).tolist())):
            ev.append(_meta("process_name", pid, 0, f"pid {pid}"))
    return ev


IDLE_TID = -2  # the GPU process's track of idle gaps, named by cause


def _idle_gap_events(t, us) -> list[dict]:
    """The GPU's idle gaps (>= 100 us, inside recorded time; copies are busy) as slices named by
    their cause (kdash.analyses.gpu_time, the accounting the pane and the report use), on one
    track per GPU under its kernels: in the trace the user sees where the GPU waited and on
    what, next to the host thread's calls."""
    from kdash.analyses.gpu_time import account

    k = t["kernels"]
    if k.empty:
        return []
    gaps = account(k, t.get("memcpy"), t.get("markers"), t.get("api")).gaps
    if gaps.empty:
        return []
    ev = []
    for dev in sorted(set(gaps["device"].astype(int).tolist())):
        ev.append(_meta("thread_name", GPU_PID_BASE + dev, IDLE_TID, "idle gaps (cause)"))
    for g in gaps.itertuples(index=False):
        args = {"cause": g.cause, "next_kernel": g.next_name}
        if g.tid >= 0:
            args["launching_tid"] = int(g.tid)
        if g.prev_call:
            args["call_before_launch"] = g.prev_call
        if g.launch_us == g.launch_us:  # not NaN
            args["launch_after_us"] = round(float(g.launch_us), 1)
        ev.append(
            {
                "ph": "X",
                "cat": "gpu_idle",
                "name": f"idle: {g.cause}",
                "pid": GPU_PID_BASE + int(g.device),
                "tid": IDLE_TID,
                "ts": us(g.start_ns),
                "dur": max(0.0, (g.end_ns - g.start_ns) / 1e3),
                "args": args,
            }
        )
    return ev


def _gpu_time(cap: Capture) -> list[dict]:
    """Busy and idle time per GPU, as `kdash report --json` gives it."""
    from kdash.analyses.gpu_time import gpu_time

    t = cap.tables
    return [
        g.to_json() for g in gpu_time(t["kernels"], t.get("memcpy"), t.get("markers"), t.get("api"))
    ]


def _time_cols(tables):
    from kdash import schema

    for name, df in tables.items():
        yield df, schema.TIME_COLUMN[name]


def _meta(kind: str, pid: int, tid: int, name: str | None, sort_index: int | None = None) -> dict:
    args = {"name": name} if name is not None else {"sort_index": sort_index}
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


def write_perfetto(cap: Capture, out: Path) -> tuple[Path, int]:
    """Write atomically; `.gz` suffix means gzip. Returns (path, event count)."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out} is a folder; give a file name ending .json or .json.gz")
    if not out.parent.exists():
        raise UserError(f"no such folder: {out.parent}")
    events = trace_events(cap)
    doc = {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "kdash_version": cap.meta.get("kdash_version"),
            "target": cap.meta.get("target"),
            "window": cap.meta.get("window"),
            "gpu_time": _gpu_time(cap),
        },
    }
    from kdash.atomic import new_file

    data = json.dumps(doc, separators=(",", ":")).encode()
    with new_file(out, exclusive=False) as raw:  # a trace, not a capture: replaced, atomically
        if out.name.endswith(".gz"):
            with gzip.GzipFile(fileobj=raw, mode="wb") as gz:
                gz.write(data)
        else:
            raw.write(data)
    return out, len(events)
