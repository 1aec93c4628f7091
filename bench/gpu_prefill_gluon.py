"""The Gluon prefill kernel (kernels/prefill_gluon.py) on the H200: gates, then timing against
the default prefill kernel and torch SDPA's cuDNN and FLASH backends.

Gates (each against an fp32 reference per request; the default kernel's error beside it): ragged
4096 + 4089 at D=128 and D=64, causal and full; GQA 32/8/128 at lengths 1000, 37, 1, 129;
lengths 1, 5, 100, 500; spare NaN rows after the last request, which must not reach any
output; and non-causal requests of one length (4 x 4096, GQA 3 x 2048, 5 x 4000; at full size
also GQA 2 x 8192, 4 heads x 16384, and 4 x 4096 with NaN rows filling out a shorter last
request). A gate passes when the error is at most twice the default kernel's plus 1e-2, and at
most 0.05 (on sm_90 the default path is this kernel at both head dims).

Timing: do_bench (L2 flushed) at the kernel bench's prefill shapes with S >= 4096 (16k tokens a
launch), the contenders in turns (six rounds in bench_timing.turn_orders' orders, the median kept,
every round's figure in the row): the default prefill path, a few Gluon configs (persistent or
one program a tile), with ``--against FILE`` another version of kernels/prefill_gluon.py loaded
beside this one, and SDPA.
``--smoke`` runs the gates on small shapes only. Writes ``--out`` (JSON) after every step, so a
hang or a kill keeps what ran.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from kdash.kernels import prefill_gluon as pg
from kdash.kernels.bench import PrefillCase
from kdash.kernels.bench_timing import bench_ms_rounds
from kdash.kernels.prefill_attention import extend_attention


def reference(q, k, v, cu, causal: bool) -> torch.Tensor:
    """fp32 attention per request (SDPA math on the CPU-free GPU path)."""
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    g = q.shape[1] // k.shape[1]
    bounds = cu.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b == a:
            continue
        qq = q[a:b].float().transpose(0, 1)
        kk = k[a:b].float().repeat_interleave(g, dim=1).transpose(0, 1)
        vv = v[a:b].float().repeat_interleave(g, dim=1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, is_causal=causal)
        out[a:b] = o.transpose(0, 1)
    return out


def gate(name, lens, hq, hkv, d, causal, spare_nan=0, cfg=None) -> dict[str, Any]:
    dev = "cuda"
    total = sum(lens)
    rows = total + spare_nan
    q = torch.randn(rows, hq, d, device=dev, dtype=torch.bfloat16)
    k = torch.randn(rows, hkv, d, device=dev, dtype=torch.bfloat16)
    v = torch.randn(rows, hkv, d, device=dev, dtype=torch.bfloat16)
    if spare_nan:
        for t in (q, k, v):
            t[total:] = float("nan")
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=dev, dtype=torch.int32)
    assert pg.unsupported_reason(q, k, v) is None, pg.unsupported_reason(q, k, v)
    out = pg.prefill_gluon(q, k, v, cu, max(lens), causal=causal, config=cfg)
    base = extend_attention(q, k, v, None, None, None, None, cu, max(lens), causal=causal)
    torch.cuda.synchronize()
    ref = reference(q[:total], k[:total], v[:total], cu, causal)
    err = (out[:total].float() - ref).abs().max().item()
    err_base = (base[:total].float() - ref).abs().max().item()
    finite = bool(torch.isfinite(out[:total]).all().item())
    # Against the default path and on its own: on sm_90 the default path is this kernel.
    ok = finite and err <= 2 * err_base + 1e-2 and err <= 0.05
    row = {
        "gate": name,
        "lens": lens if len(lens) <= 8 else f"{len(lens)} requests",
        "heads": f"{hq}/{hkv}/{d}",
        "causal": causal,
        "config": repr(cfg or pg.DEFAULT_CONFIG),
        "max_abs_err": err,
        "max_abs_err_default": err_base,
        "finite": finite,
        "passed": ok,
    }
    print(json.dumps(row), flush=True)
    return row


def gates(smoke: bool, cfg=None) -> list[dict[str, Any]]:
    rows = []
    big = [512, 509] if smoke else [4096, 4089]
    for d, h in ((128, 16), (64, 32)):
        for causal in (True, False):
            rows.append(gate(f"ragged d{d}", big, h, h, d, causal, cfg=cfg))
    for causal in (True, False):
        rows.append(gate("gqa", [1000, 37, 1, 129], 32, 8, 128, causal, cfg=cfg))
        rows.append(gate("short", [1, 5, 100, 500], 16, 16, 128, causal, cfg=cfg))
        rows.append(gate("spare nan", [300, 77], 16, 4, 128, causal, spare_nan=50, cfg=cfg))
    # Requests of one length, as the bench's (non-causal: every tile reads every key tile).
    rows.append(gate("equal", [512] * 4 if smoke else [4096] * 4, 16, 16, 128, False, cfg=cfg))
    rows.append(gate("equal gqa", [2048] * 3, 32, 8, 128, False, cfg=cfg))
    rows.append(gate("equal odd", [500] * 5 if smoke else [4000] * 5, 16, 16, 128, False, cfg=cfg))
    if not smoke:  # launches that end on a partial round of programs (132 SMs)
        rows.append(gate("equal gqa 8k", [8192] * 2, 32, 8, 128, False, cfg=cfg))
        rows.append(gate("one 16k", [16384], 4, 4, 128, False, cfg=cfg))
        fill = [4096, 4096, 4096, 3968]  # NaN rows fill the last request out to 4 x 4096
        rows.append(gate("equal nan fill", fill, 16, 16, 128, False, spare_nan=128, cfg=cfg))
    return rows


def load_against(path: Path):
    """``path`` (another version of kernels/prefill_gluon.py) as a module of kdash.kernels, so
    that its relative imports resolve; its defaults are its own."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("kdash.kernels._prefill_gluon_against", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def time_shape(hq, hkv, d, causal, s, configs, against=None) -> dict[str, Any]:
    """Every contender at one shape, timed in turns (six rounds of do_bench each in
    bench_timing.turn_orders' orders, the median kept; each round's figure in ``rounds_us``):
    the default prefill path, each Gluon config, ``against`` (another version of the kernel's
    module) if given, SDPA's cuDNN and FLASH backends."""
    from torch.nn.attention import SDPBackend

    case = PrefillCase(s, hq, hkv, d, causal)
    row: dict[str, Any] = {"heads": f"{hq}/{hkv}/{d}", "causal": causal, "seq": s}
    fns = {"default": case.ours(None)}
    for cfg in configs:

        def run(cfg=cfg, case=case):
            pg.prefill_gluon(
                case.q, case.k, case.v, case.cu, s, causal=causal, config=cfg, out=case.out
            )

        fns[f"gluon {cfg!r}"] = run
    if against is not None:

        def other(case=case):
            against.prefill_gluon(case.q, case.k, case.v, case.cu, s, causal=causal, out=case.out)

        fns["against"] = other
    failed = {}
    for key, backend in (("cudnn", "CUDNN_ATTENTION"), ("flash", "FLASH_ATTENTION")):
        try:  # a backend that cannot run the shape is noted, the rest run
            fns[key] = case.sdpa(getattr(SDPBackend, backend))
        except Exception as e:  # noqa: BLE001 - its error goes into the row
            failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    got = {**bench_ms_rounds(fns), **failed}
    row["rounds_us"] = {
        k: v if isinstance(v, str) else [x * 1e3 for x in v] for k, v in got.items()
    }
    for name, times in got.items():
        if isinstance(times, str):
            row[f"{name}_error"] = times
        else:
            row[f"{name}_us"] = sorted(times)[len(times) // 2] * 1e3
    gl_us = [v for k, v in row.items() if k.startswith("gluon") and k.endswith("_us")]
    if gl_us and "cudnn_us" in row:
        row["best_gluon_us"] = min(gl_us)
        row["gluon_vs_cudnn"] = row["cudnn_us"] / min(gl_us)
        row["default_vs_cudnn"] = row["cudnn_us"] / row["default_us"]
    print(json.dumps(row), flush=True)
    del case
    torch.cuda.empty_cache()
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("prefill-gluon-h200.json"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--budget-s", type=float, default=400)
    ap.add_argument("--dims", default="128,64", help="head dims to time (comma-separated)")
    ap.add_argument("--pingpong", action="store_true", help="gate and time ping-pong too")
    ap.add_argument(
        "--against",
        type=Path,
        help="another version of kernels/prefill_gluon.py (a file) to time beside this one",
    )
    ap.add_argument("--seqs", default="4096,8192,16384", help="sequence lengths to time")
    ap.add_argument("--no-timing", action="store_true", help="the gates only, at full size")
    ap.add_argument("--no-gates", action="store_true", help="timing only (gated in an earlier run)")
    args = ap.parse_args()
    t0 = time.time()
    result: dict[str, Any] = {
        "command": "python " + " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
    }
    import triton

    result["triton"] = triton.__version__

    def save():
        result["seconds"] = round(time.time() - t0, 1)
        args.out.write_text(json.dumps(result, indent=1))

    result["gates"] = [] if args.no_gates else gates(args.smoke)
    if args.pingpong and not args.no_gates:
        pp = pg.GluonConfig(pingpong=True)
        result["gates"] += gates(args.smoke, cfg=pp)
    against = load_against(args.against) if args.against else None
    if against is not None:
        result["against"] = str(args.against)
    save()
    if not all(r["passed"] for r in result["gates"]):
        print("gates failed: no timing", flush=True)
        return 1
    if args.smoke or args.no_timing:
        return 0
    C = pg.GluonConfig
    result["timing"] = []
    plan = []
    by_dim = {
        128: [C()]
        if args.against
        else [C(), C(pingpong=True) if args.pingpong else C(persistent=False)],
        64: [C(64, 128, 3), C(64, 128, 5), C(64, 64, 6)],
    }
    dims = {int(x) for x in args.dims.split(",")}
    for d, h in ((128, 16), (64, 32)):
        if d not in dims:
            continue
        for causal in (False, True):
            for s in [int(x) for x in args.seqs.split(",")]:
                plan.append((h, h, d, causal, s, by_dim[d]))
    for causal in (False, True):
        if 128 in dims:
            plan.append((32, 8, 128, causal, 8192, by_dim[128]))
    for hq, hkv, d, causal, s, cfgs in plan:
        if time.time() - t0 > args.budget_s:
            result["cut_by_budget"] = True
            break
        result["timing"].append(time_shape(hq, hkv, d, causal, s, cfgs, against))
        save()
    ratios = [r["gluon_vs_cudnn"] for r in result["timing"] if "gluon_vs_cudnn" in r]
    base = [r["default_vs_cudnn"] for r in result["timing"] if "default_vs_cudnn" in r]
    result["summary"] = {
        "gluon_vs_cudnn_min": min(ratios) if ratios else None,
        "default_vs_cudnn_min": min(base) if base else None,
        "shapes": len(ratios),
    }
    print(json.dumps(result["summary"]), flush=True)
    save()
    return 0 if not math.isnan(float(len(ratios))) else 1


if __name__ == "__main__":
    sys.exit(main())
