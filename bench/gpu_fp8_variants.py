"""bf16, the default fp8 stage 1 (kernels/decode_fp8.py's hardware conversion), the integer-op
one it replaced and a few launch configs of the default, on the shapes of the bench's
``fp8_speedup`` key, on one GPU: do_bench and CUDA-graph replay, a reference gate
per variant, the compiled stage 1's registers and residency, and a summary per variant.

``fp8_speedup`` is defined by kernels/bench_summary.py: the lowest bf16 time / fp8 time over the
decode shapes with context >= 16k (1 x 128k, 1 x 64k, 8 x 16k at 32/8/128 and 64/8/128,
do_bench median of one ``DecodePlan.run``; ``_graph``: the same from graph replays). Here the
bf16 time of a shape is that of the default bf16 config on the variant's launch path (two
launches, or one fused; the bench's sweep found bf16's 2 and 3 stages within 0.3%). The lognormal
batch is timed too (``--lognormal``, on by default) and reported beside the key as
``min_all``; it is not part of the key.

The H200's figures for the earlier, longer list (every integer-op and conversion config) are in
bench/NOTES-kernels.md and bench/results/fp8-variants-h200.json; the configs that lost there
by a margin are not timed again.

Variants are timed in order of interest and the JSON is rewritten after each one, so a timeout
keeps what was done; ``--budget`` seconds stops starting new variants.

Run (on the GPU machine): python bench/gpu_fp8_variants.py --out $OUT/fp8-variants-h200.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch
from kdash.kernels import bench as kbench
from kdash.kernels import decode_fp8, decode_plan
from kdash.kernels.bench import DecodeCase, lognormal_lens, occupancy_or_error
from kdash.kernels.bench_summary import LONG_CONTEXT
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms, log
from kdash.kernels.decode_attention import (
    DEFAULT_CONFIG,
    DEFAULT_FP8_CONFIG,
    PAIRS_FP8_CONFIG,
    DecodeConfig,
)
from kdash.kernels.decode_fp8 import Fp8Config, conversion_path

HEADS = [(32, 8, 128), (64, 8, 128)]
SHAPES = [(1, 131072), (1, 65536), (8, 16384)]
CVT = DEFAULT_FP8_CONFIG  # the hardware conversion, 128 tokens, 4 warps, 2 stages
PAIRS = PAIRS_FP8_CONFIG  # the same launch config on the integer-op conversion
# name -> (config, fused launch), in the order they are timed (the most likely winners first).
# A variant's speedup is taken against the bf16 config of its own launch path.
BF16 = {
    "bf16": (DEFAULT_CONFIG, False),
    "bf16_fused": (DEFAULT_CONFIG, True),
}
KMMA = replace(CVT, fp8_compute="kmma")  # K to the fp8 tensor cores unconverted, Q in two terms
FP8 = {
    "cvt": CVT,
    "cvt_vstrides": CVT,  # V's addresses from its own strides (decode_fp8.KV_SAME_DEFAULT off)
    "kmma": KMMA,
    "kmma_fused": KMMA,
    "kmma_64_3stages": replace(KMMA, block_n=64, num_stages=3),
    "kmma_3stages": replace(KMMA, num_stages=3),
    "pairs_asm": PAIRS,
    # The two that came closest under graph replay.
    "cvt_64_3stages": replace(CVT, block_n=64, num_stages=3),
    "cvt_maxnreg128": Fp8Config(**{**asdict(CVT), "maxnreg": 128}),
    "cvt_fused": CVT,
    # Not reached by the earlier run's time budget.
    "cvt_3stages": replace(CVT, num_stages=3),
    "cvt_8warps": replace(CVT, num_warps=8),
    "cvt_8warps_3stages": replace(CVT, num_warps=8, num_stages=3),
    "cvt_256_8warps": replace(CVT, block_n=256, num_warps=8),
}
FP8_FUSED = {"cvt_fused", "kmma_fused"}
# Module switches a variant's plans are made under (name -> {decode_fp8 attribute: value}).
FP8_SWITCHES = {"cvt_vstrides": {"KV_SAME_DEFAULT": False}}


@contextlib.contextmanager
def switches(name: str):
    """``decode_fp8``'s module switches as variant ``name`` wants them, then as they were."""
    want = FP8_SWITCHES.get(name, {})
    saved = {k: getattr(decode_fp8, k) for k in want}
    for k, v in want.items():
        setattr(decode_fp8, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(decode_fp8, k, v)


def shape_cases(lognormal: bool) -> list[dict[str, Any]]:
    rows = []
    for hq, hkv, d in HEADS:
        shapes: list[tuple[int, Any]] = list(SHAPES)
        if lognormal:
            shapes.append((64, "lognormal"))
        for batch, ctx in shapes:
            lens = lognormal_lens(batch, 4096) if ctx == "lognormal" else [ctx] * batch
            rows.append(
                dict(
                    heads=f"{hq}/{hkv}/{d}",
                    batch=batch,
                    context=ctx if ctx != "lognormal" else f"lognormal~4096 (max {max(lens)})",
                    long_context=ctx != "lognormal" and ctx >= LONG_CONTEXT,
                    lens=lens,
                    dims=(hq, hkv, d),
                )
            )
    return rows


def time_cfg(case: DecodeCase, cfg: DecodeConfig, fused: bool) -> dict[str, Any]:
    fn, splits = case.fn(cfg, fused)
    plan = case.last_plan
    ms = bench_ms(fn)
    ms_g = bench_graph_ms(fn)
    fn()
    if kbench.DEVICE == "cuda":
        torch.cuda.synchronize()
    return {
        "us": ms * 1e3,
        "us_graph": ms_g * 1e3,
        "splits": splits,
        "stage1": occupancy_or_error(plan),
        "fused": plan.fused,
        "residency_source": plan.residency_source,
        "kv_same": plan._s1.meta.get("KV_SAME") if plan._s1 is not None else None,
    }


def gate(case: DecodeCase, cfg: DecodeConfig, fused: bool) -> dict[str, Any]:
    """The bench's FA-style gate (its first 4 requests), on the variant's launch path."""
    saved = decode_plan.FUSED_DEFAULT
    decode_plan.FUSED_DEFAULT = fused  # DecodeCase.check's one-call form takes the default path
    try:
        return case.check(cfg)
    except Exception as e:  # noqa: BLE001 - a variant that fails to run fails its gate, said why
        return {"passed": False, "detail": f"{type(e).__name__}: {str(e)[:300]}"}
    finally:
        decode_plan.FUSED_DEFAULT = saved


def summarise(result: dict[str, Any]) -> None:
    """Per fp8 variant: speedup per shape against the best bf16 time, and the key's minimum."""
    shapes = result["shapes"]
    out = {}
    for name in result["variants"]:
        per, key, key_g, all_, all_g = [], [], [], [], []
        for s in shapes:
            t = s["times"]
            if name not in t or "us" not in t[name]:
                continue
            fused = name in FP8_FUSED
            bf = [t[b] for b in BF16 if b in t and "us" in t[b] and BF16[b][1] == fused]
            if not bf:
                continue
            x = min(b["us"] for b in bf) / t[name]["us"]
            xg = min(b["us_graph"] for b in bf) / t[name]["us_graph"]
            per.append(dict(shape=f"{s['heads']} {s['batch']}x{s['context']}", x=x, x_graph=xg))
            all_.append(x)
            all_g.append(xg)
            if s["long_context"]:
                key.append(x)
                key_g.append(xg)
        n_key = sum(1 for s in shapes if s["long_context"])
        out[name] = {
            "fp8_speedup": min(key) if len(key) == n_key and key else None,
            "fp8_speedup_graph": min(key_g) if len(key_g) == n_key and key_g else None,
            "min_all": min(all_) if all_ else None,
            "min_all_graph": min(all_g) if all_g else None,
            "shapes_timed": len(per),
            "per_shape": per,
            "gate": result["gates"].get(name),
        }
    result["summary"] = out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget", type=float, default=200.0, help="seconds; no variant starts later")
    ap.add_argument("--only", help="comma-separated fp8 variant names (default: all)")
    ap.add_argument("--no-lognormal", dest="lognormal", action="store_false")
    a = ap.parse_args(argv)
    names = list(FP8)
    if a.only:
        names = [n for n in a.only.split(",") if n]
        bad = [n for n in names if n not in FP8]
        if bad:
            print(
                f"gpu_fp8_variants: unknown variant(s) {bad}; known: {list(FP8)}", file=sys.stderr
            )
            return 2
    on_gpu = kbench.DEVICE == "cuda"  # a CPU test of the wiring sets "cpu" (and stubs the timers)
    if on_gpu and not torch.cuda.is_available():
        print("gpu_fp8_variants: needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    import triton

    result: dict[str, Any] = {
        "command": " ".join(sys.argv),
        "device": torch.cuda.get_device_name(0) if on_gpu else kbench.DEVICE,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "variants": {
            n: {
                **asdict(FP8[n]),
                "fused": n in FP8_FUSED,
                "switches": FP8_SWITCHES.get(n, {}),
                "conversion": conversion_path(FP8[n], False),
            }
            for n in names
        },
        "bf16_configs": {n: {**asdict(c), "fused": f} for n, (c, f) in BF16.items()},
        "gates": {},
        "shapes": [],
        "skipped": [],
    }
    shapes = shape_cases(a.lognormal)
    cases: list[dict[str, DecodeCase]] = []
    for s in shapes:
        hq, hkv, d = s["dims"]
        cases.append({kv: DecodeCase(s["lens"], hq, hkv, d, kv == "fp8") for kv in ("bf16", "fp8")})
        result["shapes"].append(
            {k: v for k, v in s.items() if k not in ("lens", "dims")} | {"times": {}}
        )
    log(f"cases built in {time.monotonic() - t0:.1f}s")

    def save() -> None:
        summarise(result)
        result["seconds"] = time.monotonic() - t0
        a.out.write_text(json.dumps(result, indent=1) + "\n")

    # The gate case of every variant: the equal-length shape of most requests at the first
    # head layout (8 x 16k at 32/8/128), its first 4 requests.
    gate_at = max(
        (
            i
            for i, s in enumerate(shapes)
            if s["dims"] == HEADS[0] and isinstance(s["context"], int)
        ),
        key=lambda i: shapes[i]["batch"],
    )
    todo = [(n, c, f, "bf16") for n, (c, f) in BF16.items()]
    todo += [(n, FP8[n], n in FP8_FUSED, "fp8") for n in names]
    for name, cfg, fused, kv in todo:
        if time.monotonic() - t0 > a.budget:
            result["skipped"].append(name)
            log(f"{name}: skipped (budget {a.budget:.0f}s spent)")
            continue
        if kv == "fp8":
            with switches(name):
                result["gates"][name] = g = gate(cases[gate_at]["fp8"], cfg, fused)
            log(f"{name}: gate {'passed' if g['passed'] else 'FAILED'}: {g['detail']}")
        for s, c in zip(result["shapes"], cases, strict=True):
            try:
                with switches(name):
                    fig = time_cfg(c[kv], cfg, fused)
            except Exception as e:  # noqa: BLE001 - a variant that fails is a finding, not fatal
                fig = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            s["times"][name] = fig
            st = fig.get("stage1") or {}
            log(
                f"{name:>20} {s['heads']} {s['batch']}x{s['context']}: "
                + (
                    f"{fig['us']:7.1f}us graph {fig['us_graph']:7.1f}us splits {fig['splits']} "
                    f"regs {st.get('registers')} spills {st.get('spills')} "
                    f"per SM {st.get('resident_per_sm')} waves {st.get('waves', 0):.2f}"
                    if "us" in fig
                    else fig["error"]
                )
            )
        save()
        if kv == "fp8":
            sm = result["summary"][name]
            log(
                f"summary {name}: fp8_speedup {sm['fp8_speedup']} graph {sm['fp8_speedup_graph']} "
                f"(min over all timed shapes {sm['min_all']}, graph {sm['min_all_graph']})"
            )
    save()
    log(f"wrote {a.out} in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
