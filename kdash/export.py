"""`kdash export --perfetto`: a capture as a Chrome trace (JSON, optionally gzipped).

What Perfetto's JSON importer needs to show the trace as kdash means it (read from its
json_trace_parser and the import tests in tests/test_export.py):

- **Thread ids in [1, 2**32).** Perfetto folds a tid below 0 or at/above 2**32 into the
  process's main thread without a word, so every track here has an id in range: GPU processes
  number their tracks from 1, and host processes keep a thread's real tid for its CUDA calls
  and take ids from `SYNTH_TID_BASE` (above any Linux tid) for tracks of their own.
- **Every track named** by a thread_name metadata event, and every process by process_name.
- **Slices on one track nest** (Perfetto drops or errors on partial overlap): kernels on one
  stream that overlap (programmatic dependent launch, seen on the H200) and copies go to lanes
  of their own; a thread's calls and its NVTX ranges to lanes that nest (`_nesting_lanes`).
- **Flows** from each launch call to its kernels and copies (the correlation id): ph "s" at
  the call, ph "f" with bp "e" at the kernel or copy, one id per arrow.
- **Counters** (ph "C") per GPU (clocks, temperature, power, utilisation) and for the busiest
  threads' CPU %.

Tracks: one process per GPU with a track per stream (and its overlap lanes), one for copies
per stream, and one for the GPU's idle gaps named by cause (kdash.analyses.gpu_time; the same
accounting's busy and idle time per GPU is in `otherData.gpu_time`); one process per watched
pid with its CUDA calls per thread, and its NVTX ranges and CPU ops (torch.profiler's, markers
rows of domain "cpu_op": category "cpu_op", "CPU ops · thread N") on tracks of their own per
thread and domain. Kernel slices
carry the label the tables show (kdash.names) and the full name in their args. Timestamps are
microseconds from the capture window's start, so the trace opens at zero.

**Streaming.** Events are written as they are made, through a buffered (and gzip) stream; what
is held is columnar (numpy arrays of the tables and their lanes), never a list of events, so
memory stays flat in the number of events (tests/test_export.py measures it).
"""

from __future__ import annotations

import gzip
import heapq
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np
import pandas as pd

from kdash.capture import Capture
from kdash.errors import UserError
from kdash.names import short_names, symbols_of

GPU_PID_BASE = 1_000_000  # synthetic pids for GPU processes, away from real ones
UNKNOWN_PID = GPU_PID_BASE - 1  # rows whose process is not known
SYNTH_TID_BASE = 1 << 31  # host tracks of kdash's own: above Linux's pid_max (2**22)
MAX_TID = 1 << 32  # Perfetto folds ids at or above this into the main thread
IDLE_TID = 1  # each GPU process's track of idle gaps, named by cause

COUNTERS = [
    ("sm_clock_mhz", "SM clock (MHz)"),
    ("mem_clock_mhz", "memory clock (MHz)"),
    ("temp_c", "temperature (C)"),
    ("power_w", "power (W)"),
    ("util_gpu_pct", "utilisation (%)"),
]


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


MAX_NEST_LANES = 16  # beyond, `_nesting_lanes` falls back to `_lanes` for the rest


def _nesting_lanes(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Lane per slice (sorted by start, longer first on ties) such that slices on one lane
    nest or are disjoint: a call and the calls inside it stay on one track. A slice that would
    overlap an open one partially goes to the next lane."""
    stacks: list[list[int]] = []
    out = np.empty(len(starts), dtype=np.int64)
    for i, (s, e) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        for lane, st in enumerate(stacks):
            while st and st[-1] <= s:
                st.pop()
            if not st or e <= st[-1]:
                st.append(e)
                out[i] = lane
                break
        else:
            if len(stacks) < MAX_NEST_LANES:
                stacks.append([e])
                out[i] = len(stacks) - 1
            else:  # pathological overlap: disjoint lanes past the nesting ones
                rest = _lanes(starts[i:], ends[i:])
                out[i:] = np.asarray(rest) + MAX_NEST_LANES
                break
    return out


class _Out:
    """Chrome JSON written as it is made: one event at a time into a buffered stream."""

    def __init__(self, fh: IO[str]) -> None:
        self.fh = fh
        self.n = 0
        fh.write('{"traceEvents":[\n')

    def ev(self, e: dict[str, Any]) -> None:
        if self.n:
            self.fh.write(",\n")
        self.fh.write(json.dumps(e, separators=(",", ":")))
        self.n += 1

    def close(self, other: dict[str, Any]) -> None:
        self.fh.write('\n],"displayTimeUnit":"ms","otherData":')
        self.fh.write(json.dumps(other, separators=(",", ":"), default=_plain))
        self.fh.write("}\n")


def _plain(o: object) -> object:
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(type(o).__name__)


class _Tracks:
    """Track ids per process, each announced with its name the first time it is used."""

    def __init__(self, out: _Out) -> None:
        self.out = out
        self.ids: dict[tuple[int, object], int] = {}
        self.next_gpu: dict[int, int] = {}
        self.next_host: dict[int, int] = {}
        self.procs: set[int] = set()

    def process(self, pid: int, name: str, sort_index: int | None = None) -> None:
        if pid in self.procs:
            return
        self.procs.add(pid)
        self.out.ev(
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}}
        )
        if sort_index is not None:
            self.out.ev(
                {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
                 "args": {"sort_index": sort_index}}
            )  # fmt: skip

    def tid(self, pid: int, key: object, name: str, real: int | None = None, sort: int = 0) -> int:
        """The track id of `key` in `pid`: `real` when it is a usable thread id, else the
        process's next synthetic one."""
        k = (pid, key)
        t = self.ids.get(k)
        if t is not None:
            return t
        if real is not None and 0 < real < SYNTH_TID_BASE:
            t = real
        elif pid >= GPU_PID_BASE:
            t = self.next_gpu.get(pid, IDLE_TID + 1)
            self.next_gpu[pid] = t + 1
        else:
            t = self.next_host.get(pid, SYNTH_TID_BASE)
            self.next_host[pid] = t + 1
        self.ids[k] = t
        self.out.ev(
            {"ph": "M", "name": "thread_name", "pid": pid, "tid": t, "args": {"name": name}}
        )
        if sort:
            self.out.ev(
                {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": t,
                 "args": {"sort_index": sort}}
            )  # fmt: skip
        return t


def _host_pid(pid: int) -> int:
    return pid if 0 < pid < GPU_PID_BASE else UNKNOWN_PID


def write_events(cap: Capture, out: _Out, top_threads: int = 8) -> None:
    """Every event of the capture's trace, written to `out` as it is made."""
    t = cap.tables
    t0 = (cap.meta.get("window") or {}).get("start_ns")
    if t0 is None:
        starts = [df[c].min() for df, c in _time_cols(t) if len(df)]
        t0 = int(min(starts)) if starts else 0
    t0 = int(t0)

    def us(ns: int) -> float:
        return (ns - t0) / 1e3

    tracks = _Tracks(out)
    th = t["threads"]
    thread_names = th.groupby("tid")["name"].last().to_dict() if len(th) else {}
    gpu_names = {g.get("index"): g.get("name", "") for g in cap.meta.get("gpus") or []}
    gpus = sorted(
        set(t["gpu_samples"]["gpu"].astype(int).tolist())
        | set(t["kernels"]["device"].astype(int).tolist())
        | set(t["memcpy"]["device"].astype(int).tolist())
    )
    for g in gpus:
        tracks.process(GPU_PID_BASE + g, f"GPU {g} {gpu_names.get(g, '')}".strip(), sort_index=g)

    # Host calls first: the flows need each launch's track and time.
    api = t["api"]
    api = api.assign(xend=np.maximum(api["end_ns"].to_numpy(), api["start_ns"].to_numpy()))
    api = api.assign(xneg=api["start_ns"] - api["xend"])  # longer first among equal starts
    api = api.sort_values(["pid", "tid", "start_ns", "xneg"], kind="stable")
    launch: dict[str, np.ndarray] = {"corr": np.empty(0, np.int64)}
    corr_l, pid_l, tid_l, ts_l = [], [], [], []
    for (pid, tid), g in api.groupby(["pid", "tid"], sort=True):
        hp = _host_pid(int(pid))
        tracks.process(hp, f"pid {hp}" if hp != UNKNOWN_PID else "unknown process")
        tname = thread_names.get(tid, "")
        lanes = _nesting_lanes(g["start_ns"].to_numpy(), g["xend"].to_numpy())
        lane_tids = {}
        for lane in sorted(set(lanes.tolist())):
            label = f"{tname} ({int(tid)})" if tname else f"thread {int(tid)}"
            if int(tid) < 0:
                label = "CUDA calls of unknown threads"
            if lane:
                label += f" (overlap {lane})"
            real = int(tid) if lane == 0 else None
            lane_tids[lane] = tracks.tid(hp, ("api", int(tid), lane), label, real=real)
        tids = np.array([lane_tids[x] for x in lanes.tolist()], dtype=np.int64)
        for row, track in zip(g.itertuples(index=False), tids.tolist(), strict=True):
            out.ev(
                {"ph": "X", "cat": "cuda_api", "name": row.name, "pid": hp, "tid": track,
                 "ts": us(row.start_ns), "dur": (row.xend - row.start_ns) / 1e3,
                 "args": {"correlation": int(row.correlation_id)}}
            )  # fmt: skip
        corr_l.append(g["correlation_id"].to_numpy(np.int64))
        pid_l.append(np.full(len(g), hp, dtype=np.int64))
        tid_l.append(tids)
        ts_l.append(g["start_ns"].to_numpy(np.int64))
    if corr_l:
        corr = np.concatenate(corr_l)
        keep = corr >= 0
        order = np.argsort(corr[keep], kind="stable")
        launch = {
            "corr": corr[keep][order],
            "pid": np.concatenate(pid_l)[keep][order],
            "tid": np.concatenate(tid_l)[keep][order],
            "ts": np.concatenate(ts_l)[keep][order],
        }

    flows = _Arrows(out, launch)
    _write_kernels(t, out, tracks, us, flows, symbols_of(t["kernel_symbols"]))
    _write_copies(t["memcpy"], out, tracks, us, flows)
    _write_idle_gaps(t, out, tracks, us)
    _write_markers(t["markers"], out, tracks, us, thread_names)
    _write_counters(t, out, tracks, us, top_threads, thread_names)


class _Arrows:
    """Flow arrows from launch calls (`launch`: their correlation ids, sorted, with each call's
    track and time) to GPU work, numbered across kernels and copies."""

    def __init__(self, out: _Out, launch: dict[str, np.ndarray]) -> None:
        self.out = out
        self.launch = launch
        self.n = 0

    def calls(self, corr: np.ndarray) -> np.ndarray:
        """Per GPU row, the index of its launch call in `launch` (the first, should a
        correlation id repeat), or -1."""
        lc = self.launch["corr"]
        lo = np.searchsorted(lc, corr, side="left")
        hi = np.searchsorted(lc, corr, side="right")
        return np.where((hi > lo) & (corr >= 0), lo, -1)

    def arrow(self, call: int, pid: int, track: int, ts: float, us) -> None:
        if call < 0:
            return
        self.n += 1
        self.out.ev(
            {"ph": "s", "cat": "launch", "name": "launch", "id": self.n,
             "pid": int(self.launch["pid"][call]), "tid": int(self.launch["tid"][call]),
             "ts": us(int(self.launch["ts"][call]))}
        )  # fmt: skip
        self.out.ev(
            {"ph": "f", "bp": "e", "cat": "launch", "name": "launch", "id": self.n,
             "pid": pid, "tid": track, "ts": ts}
        )  # fmt: skip


def _stream_rows(df, flows: _Arrows):
    """Per (device, stream) in order: (pid, stream, row, end, overlap lane, launch call) of
    each row, ends clamped to starts, overlapping rows on lanes of their own."""
    df = df.sort_values(["device", "stream", "start_ns"], kind="stable")
    for (dev, stream), g in df.groupby(["device", "stream"], sort=True):
        pid = GPU_PID_BASE + int(dev)
        ends = np.maximum(g["end_ns"].to_numpy(), g["start_ns"].to_numpy())
        lanes = _lanes(g["start_ns"].to_numpy(), ends)
        calls = flows.calls(g["correlation_id"].to_numpy(np.int64))
        for row, end, lane, call in zip(
            g.itertuples(index=False), ends.tolist(), lanes, calls.tolist(), strict=True
        ):
            yield pid, stream, row, end, lane, call


def _write_kernels(t, out: _Out, tracks: _Tracks, us, flows: _Arrows, symbols: dict) -> None:
    k = t["kernels"]
    if k.empty:
        return
    labels = short_names(k["name"].astype(str), 48)
    for pid, stream, row, end, lane, call in _stream_rows(k, flows):
        name = f"stream {int(stream)}" + (f" (overlap {lane})" if lane else "")
        track = tracks.tid(pid, ("kernel", int(stream), lane), name, sort=2 + lane)
        ts = us(row.start_ns)
        args = {
            "name": row.name,
            "grid": [int(row.grid_x), int(row.grid_y), int(row.grid_z)],
            "block": [int(row.block_x), int(row.block_y), int(row.block_z)],
            "registers": int(row.registers),
            "shared_memory": int(row.static_smem) + int(row.dynamic_smem),
            "correlation": int(row.correlation_id),
            "graph_id": int(row.graph_id),
        }
        if row.name in symbols:
            args["mangled"] = symbols[row.name]
        out.ev(
            {"ph": "X", "cat": "kernel", "name": labels[row.name], "pid": pid, "tid": track,
             "ts": ts, "dur": (end - row.start_ns) / 1e3, "args": args}
        )  # fmt: skip
        flows.arrow(call, pid, track, ts, us)


def _write_copies(m, out: _Out, tracks: _Tracks, us, flows: _Arrows) -> None:
    if m.empty:
        return
    for pid, stream, row, end, lane, call in _stream_rows(m, flows):
        name = f"stream {int(stream)} copies" + (f" (overlap {lane})" if lane else "")
        track = tracks.tid(pid, ("memcpy", int(stream), lane), name, sort=1000 + lane)
        ts = us(row.start_ns)
        out.ev(
            {"ph": "X", "cat": "memcpy", "name": f"{row.kind} {int(row.bytes)} B",
             "pid": pid, "tid": track, "ts": ts,
             "dur": (end - row.start_ns) / 1e3,
             "args": {"bytes": int(row.bytes), "correlation": int(row.correlation_id)}}
        )  # fmt: skip
        flows.arrow(call, pid, track, ts, us)


def _write_idle_gaps(t, out: _Out, tracks: _Tracks, us) -> None:
    """The GPU's idle gaps (>= 100 us, inside recorded time; copies are busy) as slices named by
    their cause (kdash.analyses.gpu_time, the accounting the pane and the report use), on one
    track per GPU under its kernels: in the trace the user sees where the GPU waited and on
    what, next to the host thread's calls."""
    from kdash.analyses.gpu_time import account

    k = t["kernels"]
    if k.empty:
        return
    gaps = account(k, t.get("memcpy"), t.get("markers"), t.get("api")).gaps
    if gaps.empty:
        return
    gaps = gaps.sort_values(["device", "start_ns"], kind="stable")
    for g in gaps.itertuples(index=False):
        pid = GPU_PID_BASE + int(g.device)
        tracks.process(pid, f"GPU {int(g.device)}", sort_index=int(g.device))
        track = tracks.tid(pid, "idle", "idle gaps (cause)", real=IDLE_TID, sort=1)
        args: dict[str, Any] = {"cause": g.cause, "next_kernel": g.next_name}
        if g.tid >= 0:
            args["launching_tid"] = int(g.tid)
        if g.prev_call:
            args["call_before_launch"] = g.prev_call
        if g.launch_us == g.launch_us:  # not NaN
            args["launch_after_us"] = round(float(g.launch_us), 1)
        out.ev(
            {"ph": "X", "cat": "gpu_idle", "name": f"idle: {g.cause}", "pid": pid, "tid": track,
             "ts": us(g.start_ns), "dur": max(0, g.end_ns - g.start_ns) / 1e3, "args": args}
        )  # fmt: skip


# markers domains named for what they are on their tracks (others: the domain, or "NVTX")
DOMAIN_TRACKS = {"cpu_op": ("CPU ops", "cpu_op")}


def _write_markers(mk, out: _Out, tracks: _Tracks, us, thread_names: dict) -> None:
    """NVTX ranges (and Kineto's user annotations and CPU ops) on tracks of their own per
    thread and domain, so they never share a track with the thread's CUDA calls."""
    if mk.empty:
        return
    mk = mk.sort_values(["pid", "tid", "domain", "start_ns"], kind="stable")
    for (pid, tid, domain), g in mk.groupby(["pid", "tid", "domain"], sort=True):
        hp = _host_pid(int(pid))
        tracks.process(hp, f"pid {hp}" if hp != UNKNOWN_PID else "unknown process")
        ends = np.maximum(g["end_ns"].to_numpy(), g["start_ns"].to_numpy())
        order = np.lexsort((-(ends - g["start_ns"].to_numpy()), g["start_ns"].to_numpy()))
        g, ends = g.iloc[order], ends[order]
        lanes = _nesting_lanes(g["start_ns"].to_numpy(), ends)
        tname = thread_names.get(tid, "")
        who = f"{tname} ({int(tid)})" if tname else (f"thread {int(tid)}" if tid >= 0 else "")
        label, cat = DOMAIN_TRACKS.get(domain, (domain or "NVTX", "nvtx"))
        base = label + (f" · {who}" if who else "")
        for row, end, lane in zip(
            g.itertuples(index=False), ends.tolist(), lanes.tolist(), strict=True
        ):
            name = base + (f" (overlap {lane})" if lane else "")
            track = tracks.tid(hp, ("nvtx", int(tid), domain, lane), name)
            out.ev(
                {"ph": "X", "cat": cat, "name": row.name, "pid": hp, "tid": track,
                 "ts": us(row.start_ns), "dur": (end - row.start_ns) / 1e3}
            )  # fmt: skip


def _write_counters(t, out: _Out, tracks: _Tracks, us, top_threads: int, thread_names) -> None:
    gs = t["gpu_samples"]
    for col, label in COUNTERS:
        if col not in gs:
            continue
        for ts, gpu, v in gs[["t_ns", "gpu", col]].itertuples(index=False):
            if np.isnan(v):
                continue
            out.ev(
                {"ph": "C", "name": label, "pid": GPU_PID_BASE + int(gpu), "tid": 0,
                 "ts": us(ts), "args": {"value": float(v)}}
            )  # fmt: skip
    th = t["threads"]
    if not len(th):
        return
    hot = th.groupby(["pid", "tid"])["cpu_pct"].mean().sort_values(ascending=False)
    for pid, tid in list(hot.index[:top_threads]):
        hp = _host_pid(int(pid))
        tracks.process(hp, f"pid {hp}")
        sub = th[(th["pid"] == pid) & (th["tid"] == tid)]
        label = f"CPU % {thread_names.get(tid, '')} ({tid})"
        for ts, v in sub[["t_ns", "cpu_pct"]].itertuples(index=False):
            if np.isnan(v):
                continue
            out.ev(
                {"ph": "C", "name": label, "pid": hp, "tid": 0, "ts": us(ts),
                 "args": {"value": float(v)}}
            )  # fmt: skip
    for pid in sorted(set(th["pid"].astype(int).tolist())):
        hp = _host_pid(pid)
        tracks.process(hp, f"pid {hp}")


def _gpu_time(cap: Capture) -> list[dict]:
    """Busy and idle time per GPU, as `kdash report --json` gives it."""
    from kdash.analyses.gpu_time import gpu_time

    t = cap.tables
    return [
        g.to_json() for g in gpu_time(t["kernels"], t.get("memcpy"), t.get("markers"), t.get("api"))
    ]


def _time_cols(tables) -> Iterator[tuple[pd.DataFrame, str]]:
    from kdash import schema

    for name, df in tables.items():
        yield df, schema.TIME_COLUMN[name]


def write_perfetto(cap: Capture, out: Path) -> tuple[Path, int]:
    """Write atomically, as a stream; `.gz` suffix means gzip. Returns (path, event count)."""
    out = Path(out)
    if out.is_dir():
        raise UserError(f"{out} is a folder; give a file name ending .json or .json.gz")
    if not out.parent.exists():
        raise UserError(f"no such folder: {out.parent}")
    from kdash.atomic import new_file

    other = {
        "kdash_version": cap.meta.get("kdash_version"),
        "target": cap.meta.get("target"),
        "window": cap.meta.get("window"),
        "gpu_time": _gpu_time(cap),
    }
    with new_file(out, exclusive=False) as raw:  # a trace, not a capture: replaced, atomically
        # level 6: level 9 took 5x as long for 2% less; 1 MiB buffers so zlib sees big blocks
        gz = (
            gzip.GzipFile(fileobj=raw, mode="wb", compresslevel=6)
            if out.name.endswith(".gz")
            else None
        )
        buf = io.BufferedWriter(gz or raw, buffer_size=1 << 20)  # type: ignore[arg-type]
        text = io.TextIOWrapper(buf, encoding="utf-8")
        try:
            w = _Out(text)
            write_events(cap, w)
            w.close(other)
            text.flush()
        finally:
            text.detach()
            buf.flush()
            buf.detach()
            if gz is not None:
                gz.close()
    return out, w.n
