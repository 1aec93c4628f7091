"""How much of the K/V stream the L2 evict-first hint should cover. (GPU machine)

Session 20 found the hint's effect by do_bench (L2 flushed by writing 256 MiB, so the call
starts with L2 full of dirty lines) to follow the bytes a call streams: -4 us at 134 MB, ~0 at
268 MB, +5 to +7 us at 536 MB, while graph replay gained 1-3 us everywhere. The policy the hint
makes is ``createpolicy.fractional.L2::evict_first`` with fraction 1.0 (every copied line). Here
the fraction is a variable: ``--policy first:F`` makes the hooked copies carry evict-first on a
fraction F of lines (the rest keep their priority), ``normal:1.0`` the same instruction form
with no priority change (the control for the rewrite itself), ``plain`` no hint at all.

Triton 3.6 does not key its cache on the hook, so each policy runs in its own process with its
own ``TRITON_CACHE_DIR`` (the caller's job: bench/device_s25.sh). Per shape the default
plan's do_bench, graph-replay and read-flushed us (``--rounds``, in turn), the first request's
output against the fp32 reference, the registers and the copies hinted. One JSON line per row,
appended to ``--out``.
Run: python bench/gpu_decode_l2frac.py --policy first:0.5 [--out FILE] [--shapes ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
from kdash.kernels import bench, l2_hint
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.reference import decode_reference

# (batch x context, heads, kv): 268 MB, 268 MB, 536 MB, 134 MB a call
SHAPES = "1x65536:64/8:bf16,1x65536:32/8:bf16,1x131072:32/8:bf16,1x65536:64/8:fp8"
PRIORITIES = {"first": "L2::evict_first", "normal": "L2::evict_normal", "last": "L2::evict_last"}


def policy_line(policy: str) -> str | None:
    """The ``createpolicy`` line the hook puts before each copy, or None for no hint."""
    if policy == "plain":
        return None
    kind, _, frac = policy.partition(":")
    f = float(frac or "1.0")
    if kind not in PRIORITIES or not 0.0 < f <= 1.0:
        raise SystemExit(f"bad --policy {policy!r}: plain, or first|normal|last:F with 0 < F <= 1")
    return f"createpolicy.fractional.{PRIORITIES[kind]}.b64 \t{l2_hint.POLICY_REG}, {f!r};"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--policy", required=True)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "l2frac.jsonl")
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--copy-gbs", type=float, help="the copy ceiling measured already (GB/s)")
    a = ap.parse_args(argv)
    line = policy_line(a.policy)
    if not torch.cuda.is_available():
        print("gpu_decode_l2frac.py needs a CUDA GPU", file=sys.stderr)
        return 2
    if line is not None:
        l2_hint._MAKE = line  # read by the hook at each rewrite
    machine = bench.machine()
    copy_gbs = a.copy_gbs or bench.ceilings()["copy_GBps"]
    cases = []
    for spec in a.shapes.split(","):
        shape, heads, kv = spec.split(":")
        batch, ctx = (int(x) for x in shape.split("x"))
        hq, hkv = (int(x) for x in heads.split("/"))
        fp8 = kv == "fp8"
        case = bench.DecodeCase([ctx] * batch, hq, hkv, 128, fp8)
        cfg = replace(DEFAULT_FP8_CONFIG if fp8 else DecodeConfig(), evict_first=line is not None)
        fn, splits = case.fn(cfg, None)
        plan = case.last_plan
        fn()
        torch.cuda.synchronize()
        # the first request against the fp32 reference (the plan's own output, all requests run)
        ref = decode_reference(
            case.q[:1], case.k, case.v, case.page_table[:1], case.seq_lens[:1], **case.scales
        )
        err = float((case.out[:1].float() - ref.float()).abs().max())
        ck = plan._s1._compiled if plan._s1 is not None else None
        cases.append((spec, case, fn, splits, plan, ck, err))
    for r in range(a.rounds):
        for spec, case, fn, splits, plan, ck, err in cases:
            ms, ms_g, ms_r = bench_ms(fn), bench_graph_ms(fn), bench_readflush_ms(fn)
            nbytes = case.bytes_needed()
            row = {
                "policy": a.policy,
                "createpolicy": line,
                "round": r,
                "shape": spec,
                "machine": machine,
                "copy_GBps": copy_gbs,
                "path": plan.path,
                "splits": splits,
                "registers": bench.occupancy_or_error(plan).get("registers"),
                "l2_refused": plan.l2_refused,
                "hinted_copies": l2_hint.hinted(ck) if ck is not None else None,
                "max_abs_err_vs_ref": err,
                "us": ms * 1e3,
                "us_graph": ms_g * 1e3,
                "us_readflush": ms_r * 1e3,
                "bw_ratio": nbytes / (ms * 1e-3) / 1e9 / copy_gbs,
                "bw_ratio_graph": nbytes / (ms_g * 1e-3) / 1e9 / copy_gbs,
            }
            with a.out.open("a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"{a.policy:>11} r{r} {spec:<22} do_bench {row['us']:7.1f} graph "
                f"{row['us_graph']:7.1f} readflush {row['us_readflush']:7.1f} us "
                f"({row['bw_ratio']:.3f} / {row['bw_ratio_graph']:.3f}) "
                f"hinted {row['hinted_copies']} err {err:.2e}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
