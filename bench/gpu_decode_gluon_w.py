"""The Gluon TMA stage 1 with W pages a ring slot and a warp a page, against the Triton plan and
TMA's own copies. (GPU machine)

``TmaConfig(warps=W)``: a step reads W pages (``W x 16`` tokens) into one ring slot and each of
the program's W warps computes one page's scores, the softmax and P crossing the warps through
shared memory, as the Triton stage 1 lays out its 64-token tile (kernels/decode_gluon.py). The
one-warp kernel ran behind the Triton stage 1 at 4-5.6 warps an SM; TMA's copies alone read the
cache 3.8 us faster than the Triton stage 1 (session 25). Does the Triton tile's layout, fed by
TMA, keep that?

Gates first (the Triton two-launch plan's output is the reference; unused slots NaN): odd
lengths, GQA 2/4/8, 40 one-split requests, a 183-split plan, both paths, bf16 and fp8. Then
per long shape: the Triton default plan and its stage 1 alone; at 1 x 64k the copy-only TMA
reader of bench/gpu_kv_tma.py; each chosen W's TMA plans (two launches, one launch) and their
stage 1 alone. us by do_bench (L2 flushed by writing), graph replay and read-flushed.
One JSON line a row to ``--out`` (appended).
Run: python bench/gpu_decode_gluon_w.py [--out FILE] [--no-timing] [--variants w4_s2 ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling scripts

from gpu_decode_gluon import nan_fill_unused, time_us
from jsonl_rows import emit, start
from kdash.kernels import bench
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.decode_gluon import TmaConfig

GATES = [
    ([1, 15, 16, 17, 1000, 4097], 32, 8),
    ([3, 70000, 129], 64, 8),
    ([33] * 40, 32, 8),
]
SHAPES = [([65536], 32, 8), ([65536], 64, 8)]
# (name, TmaConfig fields): one warp (the module's default), then W pages a slot
VARIANTS = [
    ("w1_s6", {}),
    ("w4_s2", {"warps": 4, "stages": 2}),
    ("w4_s2_r168", {"warps": 4, "stages": 2, "maxnreg": 168}),  # 3 an SM, no spill (sm_90)
    ("w4_s2_r160", {"warps": 4, "stages": 2, "maxnreg": 160}),
    ("w2_s3", {"warps": 2, "stages": 3}),
]


def times(fn, nbytes: int, copy_gbs: float) -> dict:
    got = time_us(fn, readflush=True)
    got["bw_ratio"] = nbytes / (got["us"] * 1e-6) / 1e9 / copy_gbs
    got["bw_ratio_graph"] = nbytes / (got["us_graph"] * 1e-6) / 1e9 / copy_gbs
    return got


def stage1_alone(plan, case: bench.DecodeCase):
    """A plan's stage-1 launch alone, on the arguments its last run bound."""
    args = (case.q, case.k, case.v, case.page_table, case.seq_lens, plan._ks, plan._vs)
    args = (*args, *plan._rest1)
    return lambda: plan._s1(*args)


def gate(lens, hq, hkv, fp8: bool, variants: list) -> dict:
    case = bench.DecodeCase(lens, hq, hkv, 128, fp8)
    nan_fill_unused(case)
    q, k, v = case.q, case.k, case.v
    base = DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()
    ref = case.plan(base, fused=False).run(q, k, v).float().clone()
    diffs, refused = {}, {}
    for tag, over in variants:
        for fused in (False, True):
            plan = case.plan(TmaConfig(**{**base.__dict__, **over}), fused=fused)
            name = f"{tag}_{'fused' if fused else 'two'}"
            if not plan.tma:
                refused[name] = plan.tma_refused
                continue
            plan.out.fill_(float("nan"))
            out = plan.run(q, k, v).float()
            torch.cuda.synchronize()
            finite = bool(torch.isfinite(out).all())
            diffs[name] = float((out - ref).abs().max()) if finite else float("inf")
            if fused:
                diffs[name + "_flags_left"] = float(plan._flags.abs().sum())
    ok = not refused and all(d <= 2e-2 for n, d in diffs.items() if not n.endswith("_left"))
    ok = ok and all(d == 0 for n, d in diffs.items() if n.endswith("_left"))
    lens_s = lens if len(lens) <= 8 else f"{len(lens)} requests"
    return {"gate": True, "lens": lens_s, "heads": f"{hq}/{hkv}", "kv": "fp8" if fp8 else "bf16",
            "max_abs_diff": diffs, "refused": refused, "pass": ok}  # fmt: skip


def timing(lens, hq, hkv, copy_gbs: float, out: Path, variants: list) -> bool:
    case = bench.DecodeCase(lens, hq, hkv, 128, False)
    nbytes = case.bytes_needed()
    q, k, v = case.q, case.k, case.v
    shape = f"{len(lens)}x{lens[0]} {hq}/{hkv}"

    def row(name: str, plan, fn, **extra) -> None:
        try:
            got = times(fn, nbytes, copy_gbs)
        except Exception as exc:  # noqa: BLE001 - recorded; the other variants still run
            got = {"error": f"{type(exc).__name__}: {exc}"[:400]}
        facts = {}
        if plan is not None:
            facts = {"splits": plan.num_splits, "per_sm": plan.resident_per_sm,
                     "path": plan.path, "tma": plan.tma}  # fmt: skip
        emit(out, {"shape": shape, "variant": name, **facts, **extra, **got})

    default = case.plan(DecodeConfig())
    row("triton_default", default, lambda: default.run(q, k, v))
    two = case.plan(DecodeConfig(), fused=False)
    two.run(q, k, v)
    row("triton_stage1", two, stage1_alone(two, case))
    if lens == [65536]:
        from gpu_kv_tma import reader

        fn, _, _ = reader(case, "per_head", 64, 2, 3, 1)
        row("tma_copies_only", None, fn, config="per_head 64 splits x 2 pages x 3 slots, 1 warp")
    for tag, over in variants:
        for fused in (False, True):
            plan = case.plan(TmaConfig(**over), fused=fused)
            if not plan.tma:
                emit(out, {"shape": shape, "variant": tag, "refused": plan.tma_refused})
                return False
            path = "fused" if fused else "two"
            row(f"tma_{tag}_{path}", plan, lambda p=plan: p.run(q, k, v), **over)
            if not fused:
                row(f"tma_{tag}_stage1", plan, stage1_alone(plan, case), **over)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "gluon_w.jsonl")
    ap.add_argument("--no-timing", action="store_true")
    names = [tag for tag, _ in VARIANTS]
    ap.add_argument("--variants", nargs="+", choices=names, default=names, help="TMA ones to time")
    a = ap.parse_args(argv)
    # timed in the order asked
    variants = [(tag, dict(VARIANTS)[tag]) for tag in dict.fromkeys(a.variants)]
    if not start(a.out, "gpu_decode_gluon_w.py", argv):
        return 2
    gates_ok = True
    for lens, hq, hkv in GATES:
        for fp8 in (False, True):
            if fp8 and len(lens) > 3:
                continue
            try:
                g = gate(lens, hq, hkv, fp8, VARIANTS[1:])
            except Exception as exc:  # noqa: BLE001 - recorded; the other gates still run
                g = {"gate": True, "lens": str(lens)[:40], "error": f"{exc!r}"[:500], "pass": False}
            emit(a.out, g)
            gates_ok = gates_ok and g["pass"]
    if a.no_timing or not gates_ok:
        return 0 if gates_ok else 1
    copy_gbs = bench.ceilings()["copy_GBps"]
    emit(a.out, {"copy_GBps": copy_gbs})
    for lens, hq, hkv in SHAPES:
        timing(lens, hq, hkv, copy_gbs, a.out, variants)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
