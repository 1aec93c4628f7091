"""Kineto / torch.profiler trace import.

Two kinds of input, each said where used:
- REAL traces: torch.profiler (torch 2.13, CPU build) run in the test on a small workload and
  exported with `export_chrome_trace`, and the shipped tests/data/cpu-mlp.trace.json.gz
  (bench/kineto_cpu_trace.py: a training step on two threads). They carry CPU ops and user
  annotations only; kernels and launch flows come with the GPU traces recorded by
  bench/gpu_kineto_record.py (tests/data/kdash-*.trace.json.gz, used below when present).
  What a test checks in them it counts from the trace's own JSON, never from numbers copied
  from one recording.
- HAND-MADE events for the GPU fields (kernel grid/block/registers/shared memory, memcpy,
  runtime calls): written here in Kineto's shape, to pin down each field and edge case.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from kdash import kineto
from kdash.capture import load_capture
from kdash.errors import UserError

DATA = Path(__file__).parent / "data"
BASE_NS = 1_790_000_000_000_000_000


def _real_cpu_trace(path: Path, steps: int = 3) -> int:
    """Record a REAL torch.profiler trace (CPU activity); returns wall ns before recording."""
    torch = pytest.importorskip("torch")
    from torch.profiler import ProfilerActivity, profile, record_function

    t0 = time.time_ns()
    x = torch.randn(32, 32)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(steps):
            with record_function(f"decode_step_{i}"):
                x = torch.softmax(x @ x, dim=-1)
    prof.export_chrome_trace(str(path))
    return t0


def _kineto_doc(events: list[dict], base: int | None = BASE_NS) -> dict:
    doc: dict = {
        "schemaVersion": 1,
        "deviceProperties": [
            {
                "id": 0,
                "name": "NVIDIA H200",
                "totalGlobalMem": 150_000_000_000,
                "numSms": 132,
                "computeMajor": 9,
                "computeMinor": 0,
            }
        ],
        "displayTimeUnit": "ms",
    }
    if base is not None:
        doc["baseTimeNanoseconds"] = base
    doc["traceEvents"] = events
    doc["traceName"] = "hand-made"
    return doc


def _hand_made_events() -> list[dict]:
    """HAND-MADE events in Kineto's shape (field names as torch 2.x writes them)."""
    return [
        {"ph": "M", "name": "process_name", "pid": 4242, "tid": 0, "args": {"name": "python"}},
        {
            "ph": "X",
            "cat": "cpu_op",
            "name": "aten::mm",
            "pid": 4242,
            "tid": 4243,
            "ts": 10.0,
            "dur": 5.0,
            "args": {},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 4242,
            "tid": 4243,
            "ts": 11.0,
            "dur": 2.5,
            "args": {"cbid": 211, "correlation": 77},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "_fwd_kernel_stage1",
            "pid": 0,
            "tid": 7,
            "ts": 20.125,
            "dur": 3.5,
            "args": {
                "queued": 0,
                "device": 0,
                "context": 1,
                "stream": 7,
                "correlation": 77,
                "registers per thread": 128,
                "shared memory": 49152,
                "blocks per SM": 2.5,
                "warps per SM": 10.0,
                "grid": [32, 8, 1],
                "block": [128, 1, 1],
                "est. achieved occupancy %": 25,
            },
        },
        {
            "ph": "X",
            "cat": "Kernel",
            "name": "void at::native::vectorized_elementwise_kernel",
            "pid": 1,
            "tid": 9,
            "ts": 30.0,
            "dur": 1.0,
            "args": {},
        },  # no args at all
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pageable -> Device)",
            "pid": 0,
            "tid": 7,
            "ts": 40.0,
            "dur": 2.0,
            "args": {"device": 0, "stream": 7, "correlation": 80, "bytes": 4096},
        },
        {
            "ph": "X",
            "cat": "gpu_memset",
            "name": "Memset (Device)",
            "pid": 0,
            "tid": 7,
            "ts": 45.0,
            "dur": 0.5,
            "args": {"device": 0, "stream": 7, "bytes": 256},
        },
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "forward",
            "pid": 4242,
            "tid": 4243,
            "ts": 9.0,
            "dur": 50.0,
        },
        {
            "ph": "X",
            "cat": "gpu_user_annotation",
            "name": "forward",
            "pid": 0,
            "tid": 7,
            "ts": 20.0,
            "dur": 30.0,
        },
        {"ph": "s", "cat": "ac2g", "id": 77, "pid": 4242, "tid": 4243, "ts": 11.0},
        {"ph": "X", "cat": "kernel", "name": "no_ts_kernel", "pid": 0, "tid": 7, "dur": 1.0},
    ]


def _write(path: Path, doc, gz: bool = False) -> Path:
    data = json.dumps(doc).encode()
    if gz:
        data = gzip.compress(data)
    path.write_bytes(data)
    return path


def _annotations(markers) -> dict:
    sel = markers["domain"] != kineto.CPU_OP_DOMAIN
    return {c: v[sel] for c, v in markers.items()}


def test_real_cpu_trace_markers_times_and_pid(tmp_path):
    path = tmp_path / "real.json"
    t0 = _real_cpu_trace(path)
    tables, infos = kineto.read_traces([path])
    m = _annotations(tables["markers"])
    assert list(m["name"]) == ["decode_step_0", "decode_step_1", "decode_step_2"]
    assert set(m["domain"]) == {"user_annotation"}
    assert (tables["markers"]["pid"] == os.getpid()).all()
    # base + ts is wall time: the steps happened after t0 and within a minute of it
    assert (m["start_ns"] >= t0 - 1_000_000).all() and (m["end_ns"] < t0 + 60e9).all()
    assert (np.diff(m["start_ns"]) > 0).all() and (m["end_ns"] > m["start_ns"]).all()
    info = infos[0]
    raw = json.loads(path.read_text())["traceEvents"]
    ops = [e for e in raw if e.get("ph") == "X" and e.get("cat") == "cpu_op"]
    assert len(ops) >= 6 and info.cpu_ops == len(ops) and "cpu_op" not in info.skipped
    assert info.pid == os.getpid()
    assert schema_len(tables["kernels"]) == 0


CPU_TRACE = DATA / "cpu-mlp.trace.json.gz"


def _json_events(path: Path) -> list[dict]:
    return json.loads(gzip.decompress(path.read_bytes()))["traceEvents"]


def test_shipped_cpu_trace_keeps_every_cpu_op():
    """The REAL CPU-only trace: every CPU op is a markers row (domain cpu_op) with its name,
    thread and times to the nanosecond; what is not kept is metadata, instants and the
    forward-backward flows, each counted."""
    doc = json.loads(gzip.decompress(CPU_TRACE.read_bytes()))
    raw = doc["traceEvents"]
    base = doc["baseTimeNanoseconds"]
    want = sorted(
        (e["tid"], base + round(e["ts"] * 1000), e["name"])
        for e in raw
        if e.get("ph") == "X" and e.get("cat") == "cpu_op"
    )
    tables, (info,) = kineto.read_traces([CPU_TRACE])
    m = tables["markers"]
    ops = m["domain"] == "cpu_op"
    cols = (m["tid"][ops].tolist(), m["start_ns"][ops].tolist(), m["name"][ops])
    got = sorted(zip(*cols, strict=True))
    assert got == want and info.cpu_ops == len(want)
    assert len({t for t, _, _ in want}) >= 2  # the loader thread and the training thread
    dur = {(e["tid"], base + round(e["ts"] * 1000)): round(e["dur"] * 1000) for e in raw
           if e.get("cat") == "cpu_op"}  # fmt: skip
    for tid, s, e in zip(m["tid"][ops], m["start_ns"][ops], m["end_ns"][ops], strict=True):
        assert e - s == dur[(tid, s)]
    annotations = sum(1 for e in raw if e.get("ph") == "X" and e.get("cat") == "user_annotation")
    assert schema_len(m) == len(want) + annotations
    # every X event kept or counted; the flows here are autograd's, not launches
    xs = sum(1 for e in raw if e.get("ph") == "X")
    assert info.kept["markers"] + sum(v for k, v in info.skipped.items() if "flow" not in k) == xs
    fwdbwd = sum(1 for e in raw if e.get("ph") in ("s", "f") and e.get("cat") == "fwdbwd")
    assert info.skipped.get("fwdbwd flow", 0) == fwdbwd > 0
    assert info.flows["pairs"] == 0 and info.flows["linked"] == 0


def schema_len(batch) -> int:
    return len(batch["start_ns"])


def test_real_gzipped_trace_with_sglang_name(tmp_path):
    path = tmp_path / "kdash-1732870000.5-TP-3-DP-1-DECODE.trace.json.gz"
    _real_cpu_trace(path)
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    tables, infos = kineto.read_traces([path])
    assert schema_len(_annotations(tables["markers"])) == 3
    n = infos[0].name
    assert (n.prefix, n.profile_id, n.tp, n.dp, n.pp, n.stage) == (
        "kdash",
        "1732870000.5",
        3,
        1,
        None,
        "DECODE",
    )


def test_trace_names():
    p = kineto.parse_trace_name
    assert p("1732870000.123-TP-0.trace.json.gz").tp == 0
    n = p("my-exp-001-1732870000.1-TP-2-PP-1-EP-4-EXTEND.trace.json.gz")
    assert (n.prefix, n.profile_id, n.tp, n.pp, n.ep, n.stage) == (
        "my-exp-001",
        "1732870000.1",
        2,
        1,
        4,
        "EXTEND",
    )
    assert p("merged-1732870000.1.trace.json.gz").merged
    n = p("kdash-42-1764400000000-20261129-093000-TP-1-DECODE.trace.json.gz")
    assert (n.prefix, n.profile_id, n.tp, n.stage) == (
        "kdash-42-1764400000000",
        "20261129-093000",
        1,
        "DECODE",
    )
    assert p("20261129-093000-TP-0.trace.json.gz").profile_id == "20261129-093000"
    assert p("20261129-093000-TP-0.trace.json.gz").prefix is None
    assert p("trace.json").profile_id is None


def test_hand_made_kernel_fields(tmp_path):
    path = _write(tmp_path / "hand.json", _kineto_doc(_hand_made_events()))
    tables, infos = kineto.read_traces([path])
    k = tables["kernels"]
    assert list(k["name"]) == [
        "_fwd_kernel_stage1",
        "void at::native::vectorized_elementwise_kernel",
    ]
    assert k["start_ns"][0] == BASE_NS + 20_125 and k["end_ns"][0] == BASE_NS + 23_625
    assert (k["grid_x"][0], k["grid_y"][0], k["grid_z"][0]) == (32, 8, 1)
    assert (k["block_x"][0], k["block_y"][0], k["block_z"][0]) == (128, 1, 1)
    assert k["registers"][0] == 128
    assert k["static_smem"][0] + k["dynamic_smem"][0] == 49152
    assert (k["device"][0], k["stream"][0], k["correlation_id"][0]) == (0, 7, 77)
    # kernels belong to the trace's process, not to the device "pid" Kineto gives them
    assert list(k["pid"]) == [4242, 4242]
    # a kernel without args: device/stream from pid/tid, the rest n/a
    assert (k["device"][1], k["stream"][1], k["registers"][1], k["grid_x"][1]) == (1, 9, -1, -1)
    assert k["static_smem"][1] == -1 and k["dynamic_smem"][1] == -1
    a = tables["api"]
    assert list(a["name"]) == ["cudaLaunchKernel"] and a["correlation_id"][0] == 77
    assert (a["pid"][0], a["tid"][0]) == (4242, 4243)
    mc = tables["memcpy"]
    assert list(mc["kind"]) == ["HtoD", "memset"] and list(mc["bytes"]) == [4096, 256]
    mk = tables["markers"]
    assert list(mk["domain"]) == ["cpu_op", "user_annotation", "gpu_user_annotation"]
    assert list(mk["name"]) == ["aten::mm", "forward", "forward"]
    assert list(mk["pid"]) == [4242, 4242, 4242] and list(mk["tid"]) == [4243, 4243, 7]
    assert (mk["start_ns"][0], mk["end_ns"][0]) == (BASE_NS + 10_000, BASE_NS + 15_000)
    info = infos[0]
    assert info.skipped == {"kernel without ts": 1}
    # the one flow start has no end: kept, but it links nothing
    assert info.flows == {"starts": 1, "ends": 0, "pairs": 0, "linked": 0, "filled": 0,
                          "disagree": 0}  # fmt: skip
    assert info.devices[0]["name"] == "NVIDIA H200"


def test_chunked_flush_equals_single_chunk_and_wall_offset(tmp_path):
    events = _hand_made_events() * 5
    path = _write(tmp_path / "many.json.gz", _kineto_doc(events), gz=True)
    one, _ = kineto.read_traces([path])
    small, _ = kineto.read_traces([path], chunk=2)
    for table in one:
        for col in one[table]:
            assert np.array_equal(one[table][col], small[table][col]), (table, col)
    moved, _ = kineto.read_traces([path], wall_offset_ns=BASE_NS - 5)
    assert moved["kernels"]["start_ns"][0] == 5 + 20_125


def test_bare_event_array(tmp_path):
    path = _write(tmp_path / "array.json", _hand_made_events())
    tables, infos = kineto.read_traces([path])
    assert schema_len(tables["kernels"]) == 2
    assert tables["kernels"]["start_ns"][0] == 20_125 and infos[0].base_ns == 0


@pytest.mark.parametrize(
    "content, message",
    [
        (b"", "is empty"),
        (b"\x00\x01binary\xff", "not a JSON trace"),
        (b'{"schemaVersion": 1, "other": [1, 2]}', "without traceEvents"),
        (b'"just a string"', "not an object"),
        (b'{"traceEvents": []}', "no events"),
    ],
)
def test_not_traces_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "bad.json"
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as ei:
        kineto.read_traces([path])
    assert "\n" not in str(ei.value)


def test_truncated_gzip_and_truncated_json(tmp_path):
    full = gzip.compress(json.dumps(_kineto_doc(_hand_made_events() * 200)).encode())
    cut = tmp_path / "cut.trace.json.gz"
    cut.write_bytes(full[: len(full) // 2])
    with pytest.raises(UserError, match="truncated gzip"):
        kineto.read_traces([cut])
    text = json.dumps(_kineto_doc(_hand_made_events() * 20))
    half = tmp_path / "half.json"
    half.write_text(text[: len(text) // 2])
    with pytest.raises(UserError, match="truncated JSON after"):
        kineto.read_traces([half])
    with pytest.raises(UserError, match="no such file"):
        kineto.read_traces([tmp_path / "missing.json"])
    with pytest.raises(UserError, match="is a folder"):
        kineto.read_traces([tmp_path])


def test_streaming_memory_stays_small(tmp_path):
    """A ~25 MB trace of events that are not kept must not be held in memory: peak RSS of a
    fresh interpreter grows by far less than the file (json.load would need ~8x the file)."""
    filler = {
        "ph": "X",
        "cat": "python_function",
        "name": "torch/nn/modules/module.py(1751): _call_impl",
        "pid": 1,
        "tid": 1,
        "ts": 1.0,
        "dur": 1.0,
        "args": {"External id": 1, "Record function id": 0, "Ev Idx": 1},
    }
    path = tmp_path / "big.json"
    with open(path, "w") as fh:
        fh.write('{"baseTimeNanoseconds": 0, "traceEvents": [')
        fh.write(",".join([json.dumps(filler)] * 150_000))
        fh.write("]}")
    size = path.stat().st_size
    assert size > 20e6
    # VmHWM (peak RSS of this process image), not ru_maxrss: ru_maxrss survives exec and would
    # report pytest's own peak as the child's.
    script = (
        "import json, sys\n"
        "from kdash import kineto\n"
        "import ijson, numpy\n"
        "def hwm():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "before = hwm()\n"
        "tables, infos = kineto.read_traces([sys.argv[1]])\n"
        "after = hwm()\n"
        "print(json.dumps([before, after, infos[0].events, infos[0].skipped]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(path)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, after, events, skipped = json.loads(out.stdout.strip().splitlines()[-1])
    assert events == 150_000 and skipped == {"python_function": 150_000}
    assert after - before < size / 5, (
        f"RSS grew {(after - before) / 1e6:.1f} MB for {size / 1e6:.1f} MB"
    )


def test_cmd_import_writes_a_loadable_capture_and_never_overwrites(tmp_path, capsys):
    a = _write(tmp_path / "exp-123.5-TP-0.trace.json.gz", _kineto_doc(_hand_made_events()), True)
    b = tmp_path / "exp-123.5-TP-1.trace.json.gz"
    _real_cpu_trace(b)
    args = SimpleNamespace(traces=[a, b], output=None)
    assert kineto.cmd_import(args) == 0
    out = tmp_path / "exp-123.5.kdash"
    assert out.exists()
    assert "2 kernels" in capsys.readouterr().out
    cap = load_capture(out)
    ops = sum(1 for e in _json_events(b) if e.get("cat") == "cpu_op")
    mk = cap.tables["markers"]
    assert len(cap.tables["kernels"]) == 2 and len(mk) == 5 + 1 + ops
    assert (mk["domain"] == "cpu_op").sum() == 1 + ops
    assert cap.meta["origin"] == "kineto-import"
    assert [t["name"].get("tp") for t in cap.meta["traces"]] == [0, 1]
    assert cap.meta["gpus"][0]["name"] == "NVIDIA H200"
    assert cap.meta["clock"]["domain"] == "unix wall ns"
    with pytest.raises(UserError, match="never overwrites"):
        kineto.cmd_import(args)
    from kdash.report import summarize

    top = summarize(cap)["top_kernels"]
    assert top[0]["name"] in {
        "_fwd_kernel_stage1",
        "void at::native::vectorized_elementwise_kernel",
    }
    # single file: named after it
    assert kineto.default_output([a]).name == "exp-123.5-TP-0.kdash"
    assert kineto.default_output([tmp_path / "x.json"]).name == "x.kdash"


def test_cmd_import_notes_a_trace_without_kernels(tmp_path, capsys):
    path = tmp_path / "cpu.json"
    _real_cpu_trace(path)
    assert kineto.cmd_import(SimpleNamespace(traces=[path], output=tmp_path / "o")) == 0
    out = capsys.readouterr().out
    assert "0 kernels" in out and "another CUPTI client" in out
    assert (tmp_path / "o.kdash").exists()


GPU_TRACES = sorted(DATA.glob("kdash-*-TP-*.trace.json.gz"))


@pytest.mark.skipif(not GPU_TRACES, reason="no GPU-recorded trace in tests/data yet")
def test_real_gpu_trace_has_kernels():
    """REAL traces recorded on the H200 by bench/gpu_kineto_record.py."""
    tables, infos = kineto.read_traces(GPU_TRACES)
    k = tables["kernels"]
    assert schema_len(k) > 0
    assert (k["end_ns"] >= k["start_ns"]).all()
    assert (k["grid_x"] > 0).mean() > 0.9 and (k["block_x"] > 0).mean() > 0.9
    assert (k["registers"] > 0).mean() > 0.9
    assert (k["correlation_id"] >= 0).all()
    # every kernel's correlation id has its launch in the runtime table
    assert set(k["correlation_id"]) <= set(tables["api"]["correlation_id"])
    assert all(i.name.tp == 0 for i in infos)


def test_odd_values_fall_back_per_value(tmp_path):
    """HAND-MADE odd values (strings, nulls, floats where ints belong) do not stop an import."""
    events = [
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "m",
            "pid": 99,
            "tid": 5,
            "ts": 0.5,
            "dur": "n/a",
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaLaunchKernel",
            "pid": 99,
            "tid": 5,
            "ts": 1.0,
            "dur": 1.0,
            "args": {"correlation": 1},
        },
        {
            "ph": "X",
            "cat": "cuda_runtime",
            "name": "cudaMemcpyAsync",
            "pid": "Spans",
            "tid": None,
            "ts": 2.0,
            "dur": 1.0,
            "args": {"correlation": "2"},
        },
        {
            "ph": "X",
            "cat": "kernel",
            "name": "k",
            "pid": 0,
            "tid": 7,
            "ts": 3.0,
            "dur": 1.0,
            "args": {
                "device": "0",
                "stream": 7.0,
                "grid": [2, 1],
                "block": None,
                "registers per thread": None,
                "shared memory": 1024.0,
                "correlation": 1,
            },
        },
    ]
    tables, _ = kineto.read_traces([_write(tmp_path / "odd.json", _kineto_doc(events))])
    a = tables["api"]
    assert list(a["pid"]) == [99, 99]  # the unreadable pid is the trace's process
    assert list(a["tid"]) == [5, -1] and list(a["correlation_id"]) == [1, 2]
    k = tables["kernels"]
    assert (k["device"][0], k["stream"][0], k["pid"][0]) == (0, 7, 99)
    assert (k["grid_x"][0], k["grid_y"][0], k["grid_z"][0]) == (2, 1, -1)
    assert (k["block_x"][0], k["registers"][0]) == (-1, -1)
    assert (k["static_smem"][0], k["dynamic_smem"][0]) == (0, 1024)
    m = tables["markers"]
    assert m["end_ns"][0] == m["start_ns"][0]  # a dur that is not a number counts as 0


def test_cmd_import_of_a_folder_takes_its_rank_traces(tmp_path, capsys):
    folder = tmp_path / "profiles"
    folder.mkdir()
    for tp in (1, 0):
        _write(folder / f"kdash-77.5-TP-{tp}.trace.json.gz", _kineto_doc(_hand_made_events()), True)
    (folder / "server.log").write_text("not a trace")
    assert kineto.expand_trace_args([folder]) == [
        folder / "kdash-77.5-TP-0.trace.json.gz",
        folder / "kdash-77.5-TP-1.trace.json.gz",
    ]
    assert kineto.cmd_import(SimpleNamespace(traces=[folder], output=None)) == 0
    assert (folder / "kdash-77.5.kdash").exists()
    assert "4 kernels" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no trace files"):
        kineto.cmd_import(SimpleNamespace(traces=[empty], output=None))
    with pytest.raises(UserError, match="no such file"):
        kineto.cmd_import(SimpleNamespace(traces=[tmp_path / "nope.json"], output=None))


def _direct_launch_flows(raw: list[dict]) -> list[tuple[dict, dict]]:
    """(call, GPU event) per ac2g flow of the JSON whose start lies on a CUDA call and whose
    end on a kernel, copy or memset: found here by the events' own pid, tid and ts."""
    at = {(e["pid"], e["tid"], e["ts"]): e for e in raw if e.get("ph") == "X"}
    ends: dict[int, dict[str, dict]] = {}
    for e in raw:
        if e.get("ph") in ("s", "f") and e.get("cat") == "ac2g":
            x = at.get((e["pid"], e["tid"], e["ts"]))
            if x is not None:
                ends.setdefault(e["id"], {})[e["ph"]] = x
    return [
        (se["s"], se["f"])
        for se in ends.values()
        if set(se) == {"s", "f"}
        and se["s"]["cat"] in ("cuda_runtime", "cuda_driver")
        and se["f"]["cat"] in ("kernel", "gpu_memcpy", "gpu_memset")
    ]


def _check_launches(raw: list[dict], base: int, tables: dict, info) -> None:
    """Every kernel and copy with a launch flow has that launch in the api table, under one
    correlation id; the import's counts are the flows counted from the JSON."""
    pairs = _direct_launch_flows(raw)
    flows = [e for e in raw if e.get("ph") in ("s", "f") and e.get("cat") == "ac2g"]
    assert info.flows["starts"] == sum(e["ph"] == "s" for e in flows)
    assert info.flows["ends"] == sum(e["ph"] == "f" for e in flows)
    starts = {e["id"] for e in flows if e["ph"] == "s"}
    assert info.flows["pairs"] == len(starts & {e["id"] for e in flows if e["ph"] == "f"})
    assert info.flows["linked"] == len(pairs) > 20 and info.flows["disagree"] == 0
    a = tables["api"]
    call_at = {
        (int(p), int(t), int(s)): int(c)
        for p, t, s, c in zip(a["pid"], a["tid"], a["start_ns"], a["correlation_id"], strict=True)
    }
    gpu_at = {}
    for name in ("kernels", "memcpy"):
        g = tables[name]
        for d, st, s, c in zip(
            g["device"], g["stream"], g["start_ns"], g["correlation_id"], strict=True
        ):
            gpu_at[(int(d), int(st), int(s))] = int(c)
    for call, work in pairs:
        c = call_at[(call["pid"], call["tid"], base + round(call["ts"] * 1000))]
        w = gpu_at[
            (work["args"]["device"], work["args"]["stream"], base + round(work["ts"] * 1000))
        ]
        assert c == w >= 0, (call["name"], work["name"])
    # and the kernels with a flow are every kernel of these traces
    kernel_flows = sum(1 for _, w in pairs if w["cat"] == "kernel")
    assert kernel_flows == sum(1 for e in raw if e.get("ph") == "X" and e.get("cat") == "kernel")


@pytest.mark.skipif(not GPU_TRACES, reason="no GPU-recorded trace in tests/data yet")
@pytest.mark.parametrize("trace", GPU_TRACES, ids=lambda p: p.name)
def test_launch_flows_of_real_gpu_traces(trace):
    """REAL SGLang traces from the H200: the flows tie each kernel and copy to its launch."""
    doc = json.loads(gzip.decompress(trace.read_bytes()))
    tables, (info,) = kineto.read_traces([trace])
    _check_launches(doc["traceEvents"], doc["baseTimeNanoseconds"], tables, info)
    assert info.flows["filled"] == 0  # Kineto wrote each correlation id in the args too


@pytest.mark.skipif(not GPU_TRACES, reason="no GPU-recorded trace in tests/data yet")
def test_launch_flows_fill_correlation_ids_a_trace_lacks(tmp_path):
    """The REAL DECODE trace with every `correlation` arg removed (as a tool that writes only
    the flows would): the ids come from the flows, the same links as with them, also when the
    rows are split over many chunks."""
    trace = next(t for t in GPU_TRACES if "DECODE" in t.name)
    doc = json.loads(gzip.decompress(trace.read_bytes()))
    with_args, _ = kineto.read_traces([trace])
    for e in doc["traceEvents"]:
        if isinstance(e.get("args"), dict):
            e["args"].pop("correlation", None)
    path = _write(tmp_path / "no-correlation.json", doc)
    for chunk in (kineto.CHUNK, 7):
        tables, (info,) = kineto.read_traces([path], chunk=chunk)
        _check_launches(doc["traceEvents"], doc["baseTimeNanoseconds"], tables, info)
        assert info.flows["filled"] == 2 * info.flows["linked"]
        for name in ("kernels", "memcpy"):
            assert np.array_equal(tables[name]["correlation_id"], with_args[name]["correlation_id"])
        # calls that launched nothing keep "no id"; the launches have theirs
        linked = tables["api"]["correlation_id"] >= 0
        assert linked.sum() == info.flows["linked"]
        assert np.array_equal(
            tables["api"]["correlation_id"][linked], with_args["api"]["correlation_id"][linked]
        )


def test_flows_bind_by_thread_and_time_only(tmp_path):
    """HAND-MADE: a flow whose end is on another stream than the kernel binds nothing, and a
    call and kernel with different correlation args are counted, not changed."""
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": 6,
         "ts": 1.0, "dur": 1.0, "args": {}},
        {"ph": "X", "cat": "kernel", "name": "k1", "pid": 0, "tid": 7, "ts": 3.0, "dur": 1.0,
         "args": {"device": 0, "stream": 7}},
        {"ph": "s", "cat": "ac2g", "id": 1, "pid": 5, "tid": 6, "ts": 1.0},
        {"ph": "f", "cat": "ac2g", "id": 1, "pid": 0, "tid": 8, "ts": 3.0, "bp": "e"},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 5, "tid": 6,
         "ts": 5.0, "dur": 1.0, "args": {"correlation": 2}},
        {"ph": "X", "cat": "kernel", "name": "k2", "pid": 0, "tid": 7, "ts": 6.0, "dur": 1.0,
         "args": {"device": 0, "stream": 7, "correlation": 3}},
        {"ph": "s", "cat": "ac2g", "id": 2, "pid": 5, "tid": 6, "ts": 5.0},
        {"ph": "f", "cat": "ac2g", "id": 2, "pid": 0, "tid": 7, "ts": 6.0, "bp": "e"},
        {"ph": "s", "cat": "ac2g", "id": "not an id", "pid": 5, "tid": 6, "ts": 5.0},
    ]  # fmt: skip
    tables, (info,) = kineto.read_traces([_write(tmp_path / "f.json", _kineto_doc(events))])
    assert info.flows == {"starts": 2, "ends": 2, "pairs": 2, "linked": 1, "filled": 0,
                          "disagree": 1}  # fmt: skip
    assert info.skipped == {"ac2g flow": 1}
    assert list(tables["kernels"]["correlation_id"]) == [-1, 3]
    assert list(tables["api"]["correlation_id"]) == [-1, 2]


def test_flow_events_are_bounded(tmp_path, monkeypatch):
    """Two flow events per row a table may hold; past that, one line and no capture."""
    from kdash import limits

    monkeypatch.setattr(limits, "MAX_ROWS", 1)
    events = [
        {"ph": "X", "cat": "cuda_runtime", "name": "c", "pid": 1, "tid": 1, "ts": 1.0, "dur": 1},
        *({"ph": "s", "cat": "ac2g", "id": i, "pid": 1, "tid": 1, "ts": 1.0} for i in range(3)),
    ]
    path = _write(tmp_path / "flows.json", _kineto_doc(events))
    with pytest.raises(UserError, match="more than 2 flow events") as ei:
        kineto.read_traces([path])
    assert "\n" not in str(ei.value)
