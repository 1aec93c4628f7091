"""The Perfetto export against Perfetto's JSON import rules, on every shipped capture and trace.

The rules, as read from Perfetto's JSON trace importer: a thread id below 0 or at/above 2**32
is folded into the process's main thread; slices on one track must nest (a partial overlap is
dropped or an error); flows need both ends, each inside a slice of its track. `problems`
applies them to an export, so a regression shows here and not as a silently merged track.
"""

from __future__ import annotations

import bisect
import gzip
import json
import tracemalloc
from collections import defaultdict
from pathlib import Path

import pytest

from kdash import kineto
from kdash.capture import load_capture
from kdash.export import write_perfetto

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests/data"
CAPTURES = [ROOT / "kdash/data/demo-h200.kdash", *sorted(DATA.glob("*.kdash"))]
TRACES = sorted(DATA.glob("*.trace.json.gz"))
SLICE = ("X",)


def _ns(us: float) -> int:
    return round(us * 1000)


def problems(doc: dict) -> list[str]:
    """What Perfetto would fold, drop or refuse in a Chrome JSON trace (empty: nothing)."""
    out: list[str] = []
    ev = doc["traceEvents"]
    named_threads = {
        (e["pid"], e["tid"]) for e in ev if e["ph"] == "M" and e["name"] == "thread_name"
    }
    named_procs = {e["pid"] for e in ev if e["ph"] == "M" and e["name"] == "process_name"}
    slices: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    out += _event_problems(ev, slices)
    for track in slices:
        if track not in named_threads:
            out.append(f"track without a thread_name: {track}")
        if track[0] not in named_procs:
            out.append(f"process without a process_name: {track[0]}")
    out += _overlap_problems(slices)
    out += _flow_problems(ev, slices)
    return out


def _event_problems(
    ev: list[dict], slices: dict[tuple[int, int], list[tuple[int, int]]]
) -> list[str]:
    """Ids out of range and counters without numbers; each track's slices into `slices`."""
    out: list[str] = []
    for e in ev:
        if e["ph"] in (*SLICE, "s", "f", "C", "M") and not 0 <= e["pid"] < 2**32:
            out.append(f"pid out of range: {e}")
        if e["ph"] in (*SLICE, "s", "f") and not 0 < e["tid"] < 2**32:
            out.append(f"tid out of range (folded into the main thread): {e}")
        if e["ph"] in SLICE:
            s = _ns(e["ts"])
            slices[(e["pid"], e["tid"])].append((s, s + _ns(e["dur"])))
        if e["ph"] == "C" and not all(isinstance(v, int | float) for v in e["args"].values()):
            out.append(f"counter without numbers: {e}")
    return out


def _overlap_problems(slices: dict[tuple[int, int], list[tuple[int, int]]]) -> list[str]:
    """Slices that overlap without nesting (the first per track); sorts each track's slices."""
    out: list[str] = []
    for track, spans in slices.items():
        spans.sort(key=lambda se: (se[0], -se[1]))
        stack: list[int] = []
        for s, e in spans:
            while stack and stack[-1] <= s:
                stack.pop()
            if stack and e > stack[-1]:
                out.append(f"partial overlap on {track}: [{s}, {e}] past {stack[-1]}")
                break
            stack.append(e)
    return out


def _flow_problems(
    ev: list[dict], slices: dict[tuple[int, int], list[tuple[int, int]]]
) -> list[str]:
    """Flows without one start and one end, or with an end that binds to no slice."""
    out: list[str] = []
    # a time lies in a slice of a track when the latest end among slices begun by then is later
    reach: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for track, spans in slices.items():
        starts, far, top = [], [], -1
        for s, e in spans:  # sorted by _overlap_problems
            top = max(top, e)
            starts.append(s)
            far.append(top)
        reach[track] = (starts, far)

    def inside(track: tuple[int, int], t: int) -> bool:
        starts, far = reach.get(track, ([], []))
        i = bisect.bisect_right(starts, t) - 1
        return i >= 0 and far[i] >= t

    ends: dict[object, dict[str, list[dict]]] = defaultdict(lambda: {"s": [], "f": []})
    for e in ev:
        if e["ph"] in ("s", "f"):
            ends[e["id"]][e["ph"]].append(e)
    for fid, se in ends.items():
        if len(se["s"]) != 1 or len(se["f"]) != 1:
            out.append(f"flow {fid}: {len(se['s'])} starts, {len(se['f'])} ends")
            continue
        for e in (se["s"][0], se["f"][0]):
            t = _ns(e["ts"])
            if e["ph"] == "f" and e.get("bp") != "e":
                out.append(f"flow {fid} ends without bp 'e' (binds to the next slice): {e}")
            if not inside((e["pid"], e["tid"]), t):
                out.append(f"flow {fid} {e['ph']} is in no slice of its track")
    return out


def _export(cap_path: Path, tmp_path: Path) -> dict:
    out = tmp_path / (cap_path.stem + ".json.gz")
    write_perfetto(load_capture(cap_path), out)
    return json.loads(gzip.decompress(out.read_bytes()))


def _imported(trace: Path, tmp_path: Path) -> Path:
    return kineto.import_traces([trace], tmp_path / (trace.name + ".kdash")).path


@pytest.mark.parametrize("path", CAPTURES, ids=lambda p: p.name)
def test_captures_export_as_perfetto_imports_them(path, tmp_path):
    doc = _export(path, tmp_path)
    assert problems(doc) == []


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_imported_traces_export_as_perfetto_imports_them(trace, tmp_path):
    doc = _export(_imported(trace, tmp_path), tmp_path)
    assert problems(doc) == []
    ev = doc["traceEvents"]
    # NVTX / user annotations and CPU ops on tracks of their own, never a CUDA call's track
    nvtx = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "nvtx"}
    ops = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "cpu_op"}
    calls = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "cuda_api"}
    assert nvtx and ops and not nvtx & calls and not ops & calls and not ops & nvtx
    assert calls or "cpu" in trace.name  # the CPU-only trace has no CUDA call


def _raw_events(trace: Path) -> list[dict]:
    return json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


@pytest.mark.parametrize("trace", TRACES, ids=lambda p: p.name)
def test_cpu_ops_on_a_track_per_thread(trace, tmp_path):
    """Every CPU op of the trace, counted here from its JSON, is a slice of the export, on
    one "CPU ops" track per thread (plus overlap lanes: none in a real trace)."""
    raw = [e for e in _raw_events(trace) if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    per_thread: dict[int, int] = defaultdict(int)
    for e in raw:
        per_thread[e["tid"]] += 1
    ev = _export(_imported(trace, tmp_path), tmp_path)["traceEvents"]
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    got: dict[str, int] = defaultdict(int)
    for e in ev:
        if e.get("cat") == "cpu_op":
            got[names[(e["pid"], e["tid"])]] += 1
    assert dict(got) == {f"CPU ops · thread {tid}": n for tid, n in per_thread.items()}
    if "cpu" in trace.name:
        assert len(per_thread) >= 2  # the shipped CPU trace has a loader thread


GPU_TRACES = [t for t in TRACES if "-TP-" in t.name]


@pytest.mark.parametrize("trace", GPU_TRACES, ids=lambda p: p.name)
def test_launch_flows_of_a_trace_are_arrows_of_its_export(trace, tmp_path):
    """Kineto's launch flows (ac2g) that go from a CUDA call to a kernel or copy, counted here
    from the JSON: each is one arrow of the export, from that call's track to that GPU row."""
    raw = _raw_events(trace)
    at = {(e["pid"], e["tid"], e["ts"]): e for e in raw if e.get("ph") == "X"}
    ends: dict[int, dict[str, dict]] = defaultdict(dict)
    for e in raw:
        if e.get("ph") in ("s", "f") and e.get("cat") == "ac2g":
            x = at.get((e["pid"], e["tid"], e["ts"]))
            if x is not None:
                ends[e["id"]][e["ph"]] = x
    kind = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memcpy"}
    # (call, kernel or copy, ns from the call's start to the GPU row's): the same in both
    want = sorted(
        (se["s"]["name"], kind[se["f"]["cat"]], _ns(se["f"]["ts"]) - _ns(se["s"]["ts"]))
        for se in ends.values()
        if set(se) == {"s", "f"}
        and se["s"]["cat"] in ("cuda_runtime", "cuda_driver")
        and se["f"]["cat"] in kind
    )
    assert len(want) > 20
    doc = _export(_imported(trace, tmp_path), tmp_path)
    ev = doc["traceEvents"]
    slices = {(e["pid"], e["tid"], round(e["ts"], 3)): e for e in ev if e["ph"] == "X"}
    pairs: dict[int, dict[str, dict]] = defaultdict(dict)
    for e in ev:
        if e["ph"] in ("s", "f"):
            pairs[e["id"]][e["ph"]] = slices[(e["pid"], e["tid"], round(e["ts"], 3))]
    got = sorted(
        (p["s"]["name"], p["f"]["cat"], _ns(p["f"]["ts"]) - _ns(p["s"]["ts"]))
        for p in pairs.values()
    )
    assert got == want


def test_demo_tracks_flows_and_counters(tmp_path):
    doc = _export(CAPTURES[0], tmp_path)
    ev = doc["traceEvents"]
    tracks = {(e["pid"], e["tid"]) for e in ev if e["ph"] == "X"}
    names = {(e["pid"], e["tid"]): e["args"]["name"] for e in ev if e["name"] == "thread_name"}
    assert len(tracks) >= 5 and all(0 < t < 2**32 for _, t in tracks)
    assert len({names[t] for t in tracks}) == len(tracks)  # every track its own name
    kernels = [e for e in ev if e.get("cat") == "kernel"]
    flows = [e for e in ev if e["ph"] == "f"]
    assert len(flows) > 0.9 * len(kernels)  # a launch call for (nearly) every kernel
    assert any(e["ph"] == "C" and e["name"].startswith("SM clock") for e in ev)
    # kernel slices carry the tables' label, the full name and the symbol in their args
    mangled = [e for e in kernels if "mangled" in e["args"]]
    assert mangled and all(e["args"]["mangled"].startswith("_Z") for e in mangled)
    assert not any(e["name"].startswith("_Z") for e in kernels)


def test_export_streams_in_flat_memory(tmp_path):
    """Held in memory, the demo's 346k events took 307 MB (tracemalloc) to write; streamed,
    what is held is the capture's columns and their lanes."""
    cap = load_capture(CAPTURES[0])
    tracemalloc.start()
    try:
        _, n = write_perfetto(cap, tmp_path / "demo.json.gz")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n > 300_000
    assert peak < 128 * 2**20, f"{peak / 2**20:.0f} MiB"
