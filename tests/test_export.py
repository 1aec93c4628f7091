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
    for track in slices:
        if track not in named_threads:
            out.append(f"track without a thread_name: {track}")
        if track[0] not in named_procs:
            out.append(f"process without a process_name: {track[0]}")
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
    # a time lies in a slice of a track when the latest end among slices begun by then is later
    reach: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
    for track, spans in slices.items():
        starts, far, top = [], [], -1
        for s, e in spans:  # sorted above
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
    # NVTX / user annotations on tracks of their own, never a CUDA call's track
    nvtx = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "nvtx"}
    calls = {(e["pid"], e["tid"]) for e in ev if e.get("cat") == "cuda_api"}
    assert nvtx and calls and not nvtx & calls


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
