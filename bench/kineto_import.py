"""Import speed (MB/s) and peak memory of `kdash import` on a large trace (runs here, on CPU).

    python3 bench/kineto_import.py [--source TRACE] [--size-mb 1024] [--gz] [--keep DIR]
                                   [--out bench/results/kineto-import-cpu.json]

The large trace is SYNTHESISED BY REPETITION of a real trace's events: the source's header is
kept and its `traceEvents` are written again and again, each copy shifted in time past the
previous one (and correlation ids offset), until the file reaches `--size-mb`. The source is
`--source` (e.g. a GPU trace from tests/data, recorded by bench/gpu_kineto_record.py), else a
REAL torch.profiler trace recorded now on the CPU (CPU ops and annotations; no kernels). The
mix of event kinds is therefore the source's, repeated.

The import runs in a fresh interpreter, so the generator's memory does not count: the body
of `kdash import` (`kdash.kineto.import_traces`) in its two steps, read then write, with the
process's peak RSS (VmHWM) before reading, after reading and after writing (pandas and pyarrow
for the Parquet write weigh ~80 MB by themselves). Writes the figures as JSON
{command, machine, figures}.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Peak RSS from VmHWM: ru_maxrss survives exec, so a child would report its parent's peak.
CHILD = r"""
import json, sys, time
def hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1]) * 1024
from kdash import kineto
import ijson, numpy, pyarrow
from kdash.capture import write_capture
rss0 = hwm()
t0 = time.perf_counter()
# import_traces, in its two steps, to see the reading's own peak apart from the writing's
tables, infos = kineto.read_traces([sys.argv[1]])
t1 = time.perf_counter()
rss_read = hwm()
write_capture(sys.argv[2], kineto.build_meta(infos, None), tables)
dt = time.perf_counter() - t0
peak = hwm()
rows = {k: len(v["start_ns"]) for k, v in tables.items()}
print(json.dumps({"seconds": dt, "read_seconds": t1 - t0, "rss_before": rss0,
                  "rss_after_read": rss_read, "rss_peak": peak, "rows": rows,
                  "events": sum(t.events for t in infos), "backend": ijson.backend}))
"""


def _record_cpu_trace(path: Path) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(128, 128)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for i in range(50):
            with record_function(f"forward_step_{i}"):
                x = torch.softmax(x @ x, dim=-1) + 1.0
    prof.export_chrome_trace(str(path))


def _load(path: Path) -> dict:
    opener = gzip.open if path.read_bytes()[:2] == b"\x1f\x8b" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def _write_big(source: dict, path: Path, size_mb: float, gz: bool) -> dict:
    events = [e for e in source["traceEvents"] if isinstance(e, dict)]
    timed = [e for e in events if isinstance(e.get("ts"), int | float)]
    t_lo = min(e["ts"] for e in timed)
    t_hi = max(e["ts"] + (e.get("dur") or 0) for e in timed)
    span = (t_hi - t_lo) + 10.0
    header = {k: v for k, v in source.items() if k != "traceEvents"}
    target = size_mb * 1e6
    reps = 0
    written = 0
    n = 0
    fh = gzip.open(path, "wt", compresslevel=1) if gz else open(path, "w")  # noqa: SIM115
    with fh:
        head = json.dumps(header)[:-1] + ', "traceEvents": ['
        fh.write(head)
        written += len(head)
        first = True
        while written < target:
            shift = reps * span
            for e in events:
                e2 = dict(e)
                if "ts" in e2 and isinstance(e2["ts"], int | float):
                    e2["ts"] = round(e2["ts"] + shift, 3)
                args = e2.get("args")
                if isinstance(args, dict) and "correlation" in args:
                    e2["args"] = dict(args, correlation=args["correlation"] + reps * 1_000_000)
                s = ("" if first else ",") + json.dumps(e2)
                first = False
                fh.write(s)
                written += len(s)
                n += 1
            reps += 1
        fh.write("]}")
    return {"repetitions": reps, "events": n, "json_mb": round(written / 1e6, 1)}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", type=Path)
    ap.add_argument("--size-mb", type=float, default=1024)
    ap.add_argument("--gz", action="store_true", help="write the big trace gzipped (level 1)")
    ap.add_argument("--keep", type=Path, help="folder to keep the big trace in")
    ap.add_argument("--out", type=Path, default=Path("bench/results/kineto-import-cpu.json"))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kdash-kineto-bench-", dir=args.keep))
    if args.source:
        source_path = args.source
        source_kind = "given trace"
    else:
        source_path = work / "source.trace.json"
        _record_cpu_trace(source_path)
        source_kind = "real torch.profiler CPU trace recorded by this script"
    source = _load(source_path)
    cats: dict[str, int] = {}
    for e in source["traceEvents"]:
        if isinstance(e, dict):
            cats[str(e.get("cat"))] = cats.get(str(e.get("cat")), 0) + 1
    big = work / ("big.trace.json.gz" if args.gz else "big.trace.json")
    t0 = time.perf_counter()
    gen = _write_big(source, big, args.size_mb, args.gz)
    gen_s = time.perf_counter() - t0
    file_mb = big.stat().st_size / 1e6
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(big), str(work / "big.kdash")],
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        print(out.stderr, file=sys.stderr)
        return 1
    child = json.loads(out.stdout.strip().splitlines()[-1])
    capture_mb = (work / "big.kdash").stat().st_size / 1e6
    figures = {
        "source": {"path": str(source_path), "kind": source_kind, "categories": cats},
        "big_trace": {
            "how": "source traceEvents repeated, each copy shifted in time (synthesised)",
            "gzipped": args.gz,
            "file_mb": round(file_mb, 1),
            "json_mb": gen["json_mb"],
            "events": gen["events"],
            "repetitions": gen["repetitions"],
            "generate_s": round(gen_s, 1),
        },
        "import": {
            "seconds": round(child["seconds"], 2),
            "read_seconds": round(child["read_seconds"], 2),
            "json_mb_per_s": round(gen["json_mb"] / child["seconds"], 1),
            "file_mb_per_s": round(file_mb / child["seconds"], 1),
            "events_per_s": round(child["events"] / child["seconds"]),
            "rss_before_mb": round(child["rss_before"] / 1e6, 1),
            "peak_rss_after_read_mb": round(child["rss_after_read"] / 1e6, 1),
            "peak_rss_mb": round(child["rss_peak"] / 1e6, 1),
            "peak_rss_over_json_size": round(child["rss_peak"] / (gen["json_mb"] * 1e6), 3),
            "rows": child["rows"],
            "capture_mb": round(capture_mb, 1),
            "ijson_backend": child["backend"],
        },
    }
    result = {
        "command": " ".join(["python3", *sys.argv]),
        "machine": {
            "host": platform.node(),
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "figures": figures,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(figures["import"], indent=1))
    if not args.keep:
        for p in work.iterdir():
            p.unlink()
        work.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
