"""DRAM bytes a decode call reads and writes after each kind of L2 flush. (GPU machine, under ncu)

``decode_bw_ratio`` is timed by ``do_bench``, which flushes L2 by zeroing 256 MiB before every
call, so the call starts with L2 full of dirty lines; the read-flushed figure (a 256 MiB sum
first: clean lines) runs 7-10 us faster at 268 MB a call, and no cache priority on the K/V
copies closed the gap (bench/NOTES-kernels.md, sessions 20 and 25). This script gives Nsight
Compute the calls to count: per shape, the default plan's run after a zeroing flush, after a
reading flush and right after another run (no flush), ``--reps`` times each, between
``cudaProfilerStart``/``Stop``. Run it under ncu with the caches and clocks left alone and only
the decode kernels counted (the flushes are kernels too), then read the report back as CSV in
base units (bytes, ns), as bench/device_s33.sh does::

    ncu --profile-from-start off --cache-control none --clock-control none -k regex:^_decode \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        -f -o dram python bench/gpu_decode_dram.py --labels labels.json [--plain]
    ncu --import dram.ncu-rep --csv --page raw --print-units base > ncu.csv

``--labels`` gets the profiled calls in launch order (shape, flush, rep, the kernels each call
launched), which ``--join`` pairs with ncu's CSV rows::

    python bench/gpu_decode_dram.py --join labels.json ncu.csv --out dram.json

``--plain`` turns the L2 hint off (Triton 3.6 does not key its cache on the hint's hook: give
each policy its own ``TRITON_CACHE_DIR``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

SHAPES = "1x65536:64/8:bf16,1x65536:64/8:fp8,1x131072:32/8:bf16"
FLUSHES = ("zero", "read", "none")
FLUSH_BYTES = 256 * 1024 * 1024
METRICS = ("dram__bytes_read.sum", "dram__bytes_write.sum", "gpu__time_duration.sum")


def parse_shape(spec: str) -> tuple[int, int, int, int, bool]:
    """``BxCTX:HQ/HKV:bf16|fp8`` as (batch, context, q heads, kv heads, fp8)."""
    try:
        shape, heads, kv = spec.split(":")
        batch, ctx = (int(x) for x in shape.split("x"))
        hq, hkv = (int(x) for x in heads.split("/"))
    except ValueError:
        raise SystemExit(f"bad shape {spec!r}: BxCTX:HQ/HKV:bf16|fp8") from None
    if kv not in ("bf16", "fp8") or min(batch, ctx, hq, hkv) < 1 or hq % hkv:
        raise SystemExit(f"bad shape {spec!r}: BxCTX:HQ/HKV:bf16|fp8")
    return batch, ctx, hq, hkv, kv == "fp8"


def measure(shapes: list[str], reps: int, plain: bool) -> list[dict]:
    """Run the calls (the caller's ncu profiles them); the labels, in launch order."""
    import torch
    from kdash.kernels import bench
    from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig

    cache = torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    readbuf = torch.randn(FLUSH_BYTES // 4, device="cuda")
    flush = {"zero": cache.zero_, "read": readbuf.sum, "none": lambda: None}
    cases = []
    for spec in shapes:
        batch, ctx, hq, hkv, fp8 = parse_shape(spec)
        case = bench.DecodeCase([ctx] * batch, hq, hkv, 128, fp8)
        cfg = replace(DEFAULT_FP8_CONFIG if fp8 else DecodeConfig(), evict_first=not plain)
        fn, splits = case.fn(cfg, None)
        for _ in range(3):  # compiled, bound, and its graph captured (the second key sighting)
            fn()
        cases.append((spec, case, fn, splits))
    torch.cuda.synchronize()
    labels = []
    torch.cuda.profiler.start()
    for rep in range(reps):
        for spec, case, fn, splits in cases:
            plan = case.last_plan
            for how in FLUSHES:  # "none" comes right after the read-flushed call
                flush[how]()
                fn()
                labels.append(label(spec, how, rep, plan, splits, case, plain))
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()
    return labels


def label(spec: str, how: str, rep: int, plan: Any, splits: int, case: Any, plain: bool) -> dict:
    """One profiled call: what ran, and how many kernels ncu will list for it."""
    return {
        "shape": spec,
        "flush": how,
        "rep": rep,
        "path": plan.path,
        "kernels": 1 if plan.fused else 2,
        "splits": splits,
        "bytes_needed": case.bytes_needed(),
        "l2_hint": not plain and plan.l2_refused is None,
        "l2_refused": plan.l2_refused,
    }


def read_ncu_csv(path: Path) -> list[dict]:
    """ncu's ``--csv --page raw`` rows (kernel name and the metrics), launch order."""
    text = path.read_text(errors="replace").splitlines()
    start = next((i for i, ln in enumerate(text) if ln.startswith('"ID"')), None)
    if start is None:
        raise SystemExit(f'{path}: no ncu CSV header ("ID",...) found')
    rows = list(csv.DictReader(text[start:]))
    out = []
    for r in rows[1:] if rows and not rows[0]["ID"].strip().isdigit() else rows:  # units row
        got = {"kernel": r.get("Kernel Name", "")}
        for m in METRICS:
            v = r.get(m, "").replace(",", "")
            got[m] = float(v) if v not in ("", "n/a") else None
        out.append(got)
    return out


def join(labels: list[dict], rows: list[dict]) -> list[dict]:
    """Each call's label with its kernels' counters summed (bytes) and durations added."""
    need = sum(lb["kernels"] for lb in labels)
    if need != len(rows):
        raise SystemExit(f"{need} kernels labelled, {len(rows)} rows from ncu: not the same run")
    out, i = [], 0
    for lb in labels:
        ks = rows[i : i + lb["kernels"]]
        i += lb["kernels"]
        rd = sum(k["dram__bytes_read.sum"] or 0 for k in ks)
        wr = sum(k["dram__bytes_write.sum"] or 0 for k in ks)
        ns = sum(k["gpu__time_duration.sum"] or 0 for k in ks)
        out.append(
            dict(
                lb,
                kernel_names=[k["kernel"][:60] for k in ks],
                dram_read_MB=rd / 1e6,
                dram_write_MB=wr / 1e6,
                read_over_needed=rd / lb["bytes_needed"],
                us_under_ncu=ns / 1e3,
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--labels", type=Path, help="write the profiled calls' labels here")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--plain", action="store_true", help="no L2 hint on the K/V copies")
    ap.add_argument("--join", nargs=2, type=Path, metavar=("LABELS", "NCU_CSV"))
    ap.add_argument("--out", type=Path, help="with --join: the joined rows as JSON")
    a = ap.parse_args(argv)
    if a.join:
        labels_path, csv_path = a.join
        for p in (labels_path, csv_path):
            if not p.is_file():
                print(f"no such file: {p}", file=sys.stderr)
                return 2
        rows = join(json.loads(labels_path.read_text()), read_ncu_csv(csv_path))
        for r in rows:
            print(
                f"{r['shape']:<22} hint={r['l2_hint']!s:<5} {r['flush']:<7} r{r['rep']} "
                f"read {r['dram_read_MB']:7.1f} MB ({r['read_over_needed']:.3f} of needed) "
                f"write {r['dram_write_MB']:6.1f} MB  {r['us_under_ncu']:6.1f} us"
            )
        if a.out:
            a.out.write_text(json.dumps(rows, indent=1) + "\n")
        return 0
    if a.labels is None:
        ap.error("--labels FILE (or --join LABELS NCU_CSV)")
    shapes = a.shapes.split(",")
    for s in shapes:
        parse_shape(s)
    import torch

    if not torch.cuda.is_available():
        print("gpu_decode_dram.py needs a CUDA GPU", file=sys.stderr)
        return 2
    a.labels.write_text(json.dumps(measure(shapes, a.reps, a.plain), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
