"""Benchmark of the attention kernels on one GPU: ``python -m kdash.kernels.bench``.

One run measures, in order:

1. the ceilings: device-to-device copy bandwidth over >= 4 GiB (bytes read + bytes written) and an
   8192^3 bf16 matmul on random data;
2. a short sweep of hand-picked launch configs per shape class (decode bf16 / fp8, prefill per
   head dim and causality) on one representative shape each; the best is used below;
3. decode at the issue's shapes: us, GB/s counting the KV bytes needed plus Q and O, the ratio to
   the copy bandwidth, eagerly (median of ``do_bench``, L2 flushed) and replayed from a CUDA graph;
   bf16 and fp8 KV, hence the fp8 speed-up;
4. prefill (no prefix; packed varlen with equal lengths, 16k tokens per launch): TFLOP/s and the
   ratio to torch SDPA forced to the FLASH_ATTENTION and CUDNN_ATTENTION backends, the three
   timed in turn (medians of six rounds in balanced orders).

Decode is timed as a server runs it: a :class:`~kdash.kernels.decode_plan.DecodePlan` made
once per shape, then ``plan.run`` per call. Besides the GPU time, the host time of one ``run``
(``host_us_nosync``: a CPU timer over many calls in a row, no synchronisation between them, so
the figure is what the host spends, not what it waits for). Every launch path of a plan is
timed on every decode shape, two launches (stage 1, then the merge kernel), one fused launch and
one persistent launch: ``row["paths"]`` and ``summary["by_path"]``; the top-level figures are
those of the path a default plan takes for each shape (``decode_plan.fused_pays``; with
``--persistent``, the persistent kernel where that says two launches). ``--only decode``
skips prefill (its summary keys are then n/a).

It writes ``bench/results/kernels-h200.json`` (``--out``) holding the command, the machine, every
figure, and ``summary`` with the floors and, per key, ``pass`` or ``miss`` (``status``):
decode_bw_ratio, decode_bw_ratio_graph, decode_host_us, fp8_speedup, prefill_vs_sdpa_flash,
prefill_vs_sdpa_cudnn.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from . import bench_configs, decode_persist
from .bench_occupancy import occ, occupancy_or_error, stage1_occupancy  # noqa: F401
from .bench_summary import AT_MOST, FLOORS, LONG_CONTEXT, summarize
from .bench_timing import (
    ROUNDS,
    bench_graph_ms,
    bench_host_calls,
    bench_host_us,
    bench_ms,
    bench_ms_rounds,
    bench_readflush_ms,
    log,
    turn_orders,
)
from .decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from .decode_plan import DecodePlan, decode_attention
from .kv_cache import fp8_scales, quantize_fp8
from .prefill_attention import PrefillConfig, chosen_config, extend_attention
from .prefill_gluon import GluonConfig
from .prefill_hopper import HopperConfig

AnyPrefillConfig = PrefillConfig | HopperConfig | GluonConfig

GiB = 1024**3
DEVICE = "cuda"  # the cases' device; a CPU smoke test of the wiring sets "cpu"

DECODE_SHAPES = [(1, 131072), (1, 65536), (8, 16384), (32, 4096), (128, 1024), (64, "lognormal")]
DECODE_HEADS = [(32, 8, 128), (64, 8, 128)]
PREFILL_SEQS = [512, 1024, 2048, 4096, 8192, 16384]
PREFILL_TOKENS = 16384

DECODE_SWEEP = {
    "bf16": [
        DecodeConfig(),
        DecodeConfig(prefetch_pages=False),
        DecodeConfig(programs_per_sm=3),
        DecodeConfig(programs_per_sm=6),
        DecodeConfig(programs_per_sm=8),
        DecodeConfig(num_stages=3),
        DecodeConfig(num_stages=3, programs_per_sm=8),
    ],
    # fp8: whole waves. Compiled for sm_90 on the CPU machine (Triton 3.9's ptxas), the
    # integer-op 128/4 warps/2 stages kernel takes 140 registers: 3 programs fit an SM, so 8 per
    # SM is 2.67 waves. 64/4/2 takes 96 (5 fit), 64/4/3 126 (4 fit), 128/8/2 95 x 256 threads (2
    # fit). The default (the hardware conversion) at 128/4/2 took 149 on the H200 (3 fit).
    "fp8": [
        DEFAULT_FP8_CONFIG,
        replace(DEFAULT_FP8_CONFIG, prefetch_pages=False),
        replace(DEFAULT_FP8_CONFIG, programs_per_sm=3),
        replace(DEFAULT_FP8_CONFIG, programs_per_sm=6),
        replace(DEFAULT_FP8_CONFIG, programs_per_sm=12),
        replace(DEFAULT_FP8_CONFIG, num_stages=3, programs_per_sm=3),
        replace(DEFAULT_FP8_CONFIG, block_n=64, programs_per_sm=5),
        replace(DEFAULT_FP8_CONFIG, block_n=64, programs_per_sm=10),
        replace(DEFAULT_FP8_CONFIG, block_n=64, num_stages=3, programs_per_sm=4),
        replace(DEFAULT_FP8_CONFIG, block_n=64, num_stages=3, programs_per_sm=8),
        replace(DEFAULT_FP8_CONFIG, num_warps=8, programs_per_sm=2),
        replace(DEFAULT_FP8_CONFIG, fp8_compute="pairs_asm"),
        replace(DEFAULT_FP8_CONFIG, fp8_compute="pairs"),
    ],
}
# Prefill: the Hopper kernel's configs (kernels/prefill_hopper.py; the defaults are the H200's
# fastest per class: 128 x 64, 8 warps, 3 stages, host descriptors, or pointer loads at D=64
# causal) and the pointer kernel's best earlier picks, for comparison.
PREFILL_SWEEP: dict[int, list[AnyPrefillConfig]] = {
    64: [
        HopperConfig(128, 64, 8, 3, descriptors="none"),
        HopperConfig(128, 64, 8, 3),
        HopperConfig(128, 128, 8, 3),
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(64, 64, 4, 4),
    ],
    128: [
        GluonConfig(64, 128, 3),
        GluonConfig(64, 128, 2),
        HopperConfig(128, 64, 8, 3),
        HopperConfig(128, 64, 8, 3, descriptors="none"),
        HopperConfig(128, 128, 8, 2),
        PrefillConfig(128, 64, 8, 3),
        PrefillConfig(128, 128, 8, 3),
    ],
}


def prefill_config_json(cfg: AnyPrefillConfig) -> dict[str, Any]:
    """A prefill config as JSON, with the kernel it runs (``gluon``, ``hopper`` or
    ``pointer``)."""
    if isinstance(cfg, GluonConfig):
        kernel = "gluon"
    else:
        kernel = "hopper" if isinstance(cfg, HopperConfig) else "pointer"
    return {**asdict(cfg), "kernel": kernel}


# ----------------------------------------------------------------------------------- ceilings
def ceilings() -> dict[str, float]:
    """Copy bandwidth (read + written over a 4 GiB copy) and the bf16 matmul rate."""
    n = 4 * GiB // 2  # bf16 elements: a 4 GiB source, 8 GiB moved per copy

    def copy_ms() -> float:
        src = torch.randn(n, device="cuda", dtype=torch.bfloat16)
        dst = torch.empty_like(src)
        return bench_ms(lambda: dst.copy_(src))

    def matmul_ms() -> float:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        return bench_ms(lambda: a @ b)

    ms = copy_ms()
    copy_gbs = 2 * n * 2 / (ms * 1e-3) / 1e9
    ms_mm = matmul_ms()
    tflops = 2 * 8192**3 / (ms_mm * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return {
        "copy_GBps": copy_gbs,
        "copy_bytes_moved": 2 * n * 2,
        "copy_ms": ms,
        "matmul_bf16_TFLOPs": tflops,
        "matmul_ms": ms_mm,
    }


# ------------------------------------------------------------------------------------- decode
def lognormal_lens(batch: int, mean: int, seed: int = 0) -> list[int]:
    """Request lengths drawn lognormal around ``mean`` (sigma 0.6), clamped to [1, 8*mean]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.empty(batch).log_normal_(math.log(mean) - 0.5 * 0.6**2, 0.6, generator=g)
    return [max(1, min(int(v), 8 * mean)) for v in x.tolist()]


class DecodeCase:
    """A decode problem on the GPU: a shuffled paged cache (page 16) filled with random KV."""

    def __init__(self, lens: list[int], hq: int, hkv: int, d: int, fp8: bool, page: int = 16):
        self.lens, self.hq, self.hkv, self.d, self.fp8 = lens, hq, hkv, d, fp8
        pages = [-(-n // page) for n in lens]
        total = sum(pages)
        dev = DEVICE
        perm = torch.randperm(total, device=dev, dtype=torch.int64).to(torch.int32)
        self.page_table = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=dev)
        off = 0
        for b, n in enumerate(pages):
            self.page_table[b, :n] = perm[off : off + n]
            off += n
        shape = (total, page, hkv, d)
        k = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        v = torch.randn(shape, device=dev, dtype=torch.bfloat16)
        self.scales: dict[str, torch.Tensor] = {}
        if fp8:
            ks, vs = fp8_scales(k), fp8_scales(v)
            k, v = quantize_fp8(k, ks), quantize_fp8(v, vs)
            self.scales = {"k_scale": ks, "v_scale": vs}
        self.k, self.v = k, v
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
        self.q = torch.randn(len(lens), hq, d, device=dev, dtype=torch.bfloat16)
        self.out = torch.empty_like(self.q)

    def bytes_needed(self) -> int:
        """KV bytes the lengths need (not whole pages) + Q read + O written."""
        elem = 1 if self.fp8 else 2
        kv = 2 * sum(self.lens) * self.hkv * self.d * elem
        return kv + 2 * self.q.numel() * self.q.element_size()

    def plan(
        self, cfg: DecodeConfig, fused: bool | str | None = None, num_splits: int | None = None
    ) -> DecodePlan:
        """The plan for these lengths (host-known: no sync), as a server makes it per batch;
        ``fused``: one launch or two (None: the plan's default); ``num_splits``: the grid's
        split count instead of the plan's own."""
        return DecodePlan(
            self.page_table,
            self.seq_lens,
            self.hq,
            self.hkv,
            self.d,
            self.k.shape[1],
            max_seq_len=max(self.lens),
            total_tokens=sum(self.lens) if num_splits is None else None,
            num_splits=num_splits,
            kv_dtype=self.k.dtype,
            config=cfg,
            out=self.out,
            fused=fused,
            **self.scales,
        )

    def fn(self, cfg: DecodeConfig, fused: bool | str | None = None):
        """The timed call (one ``plan.run``), and its split count."""
        plan = self.plan(cfg, fused)
        self.last_plan = plan
        q, k, v = self.q, self.k, self.v

        def run():
            plan.run(q, k, v)

        return run, plan.num_splits

    def check(self, cfg: DecodeConfig, requests: int = 4) -> dict[str, Any]:
        """The FA-style gate for this config on the first requests, against the fp32 reference."""
        from .reference import decode_reference, error_gate, sdpa_bf16

        n = min(requests, len(self.lens))
        sl = self.seq_lens[:n]
        pt = self.page_table[:n]
        q = self.q[:n]
        out = decode_attention(q, self.k, self.v, pt, sl, config=cfg, **self.scales)
        ref = decode_reference(q, self.k, self.v, pt, sl, **self.scales)
        base = decode_reference(q, self.k, self.v, pt, sl, fn=sdpa_bf16, **self.scales)
        ok, msg = error_gate(out, ref, base, max_factor=4.0, mean_factor=3.0)
        return {"passed": ok, "detail": msg}


def sweep_decode(copy_gbs: float) -> dict[str, Any]:
    """Pick the stage-1 config per KV dtype: the best lowest ratio over the long-context shapes.

    Timed at 32/8/128 on (1, 128k), (1, 64k), (8, 16k) (which decide) and the lognormal batch
    (reported). The chosen config must also pass the error gate, or the next best is taken.
    """
    out: dict[str, Any] = {}
    lens_sets = [[131072], [65536], [16384] * 8, lognormal_lens(64, 4096)]
    for tag in ("bf16", "fp8"):
        cases = [DecodeCase(lens, 32, 8, 128, tag == "fp8") for lens in lens_sets]
        rows = []
        for cfg in DECODE_SWEEP[tag]:
            try:
                times = [bench_ms(c.fn(cfg)[0], rep=50) for c in cases]
            except Exception as e:  # noqa: BLE001 - a config that does not compile or fit is skipped, not fatal
                log(f"  decode config {cfg} failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            ratios = [
                c.bytes_needed() / (t * 1e-3) / 1e9 / copy_gbs
                for c, t in zip(cases, times, strict=True)
            ]
            rows.append({"config": asdict(cfg), "us": [t * 1e3 for t in times], "ratio": ratios})
            log(
                f"  decode {tag} {cfg}: "
                + ", ".join(f"{t * 1e3:.1f}us {r:.2f}" for t, r in zip(times, ratios, strict=True))
            )
        rows.sort(key=lambda r: (min(r["ratio"][:3]), r["ratio"][3]), reverse=True)
        chosen = None
        for r in rows:
            chk = cases[2].check(DecodeConfig(**r["config"]))
            r["check"] = chk
            log(f"  gate for {r['config']}: {chk}")
            if chk["passed"]:
                chosen = r["config"]
                break
        fallback = DEFAULT_FP8_CONFIG if tag == "fp8" else DecodeConfig()
        out[tag] = {"rows": rows, "best": chosen or asdict(fallback)}
        del cases
        torch.cuda.empty_cache()
    return out


def decode_table(
    copy_gbs: float, best: dict[str, DecodeConfig], rows: list | None = None, on_row=None
):
    """The decode shapes' rows, appended to ``rows``; ``on_row`` is called after each shape
    (the bench saves its JSON there, so a timeout keeps the shapes done)."""
    rows = [] if rows is None else rows
    for hq, hkv, d in DECODE_HEADS:
        for batch, ctx in DECODE_SHAPES:
            lens = lognormal_lens(batch, 4096) if ctx == "lognormal" else [ctx] * batch
            row: dict[str, Any] = {
                "heads": f"{hq}/{hkv}/{d}",
                "batch": batch,
                "context": ctx if ctx != "lognormal" else f"lognormal~4096 (max {max(lens)})",
                "tokens": sum(lens),
                "long_context": ctx != "lognormal" and ctx >= LONG_CONTEXT,
            }
            try:
                decode_row(row, lens, hq, hkv, d, copy_gbs, best)
            except Exception as e:  # noqa: BLE001 - keep the rest of the table; the error goes into the JSON
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                log(f"decode {row['heads']} B={batch} ctx={ctx}: {row['error']}")
                torch.cuda.empty_cache()
                rows.append(row)
                if on_row is not None:
                    on_row()
                continue
            torch.cuda.empty_cache()
            rows.append(row)
            b, f = row["bf16"], row["fp8"]
            log(
                f"decode {row['heads']:>10} B={batch:<4} ctx={str(ctx):<9} "
                f"bf16 {b['us']:8.1f}us {b['GBps']:7.0f}GB/s {b['bw_ratio']:.2f} "
                f"(graph {b['us_graph']:7.1f}us {b['bw_ratio_graph']:.2f}, "
                f"readflush {b['bw_ratio_readflush']:.2f}, host {b['host_us_nosync']:.1f}us) | "
                f"fp8 {f['us']:8.1f}us {f['bw_ratio']:.2f} (graph {f['us_graph']:7.1f}us, "
                f"readflush {f['us_readflush']:7.1f}us) | fp8 x{row['fp8_speedup']:.2f} "
                f"(graph x{row['fp8_speedup_graph']:.2f}) | stage-1 regs/waves bf16 "
                f"{occ(b)} fp8 {occ(f)}"
            )
            log(
                f"decode-paths {row['heads']:>10} B={batch:<4} ctx={str(ctx):<9} " + paths_line(row)
            )
            if on_row is not None:
                on_row()
    return rows


def paths_line(row: dict) -> str:
    """Both launch paths of one decode row, side by side: us, graph us, host us, regs/waves."""
    parts = []
    for name, p in row["paths"].items():
        for tag in ("bf16", "fp8"):
            x = p.get(tag)
            if x is None:  # not timed (--default-path-only)
                continue
            if "error" in x:
                parts.append(f"{name} {tag} failed")
                continue
            parts.append(
                f"{name} {tag} {x['us']:7.1f}us {x['bw_ratio']:.2f} graph {x['us_graph']:7.1f}us "
                f"{x['bw_ratio_graph']:.2f} host {x['host_us_nosync']:5.1f}us {occ(x)}"
            )
    return " | ".join(parts)


# A plan's launch path (DecodePlan.path) -> its key in the decode rows, and the plan's ``fused``
# argument that asks for it.
PATH_KEYS = {"two": "two_launch", "fused": "fused", "persistent": "persistent"}
PATH_ARGS: dict[str, bool | str] = {"two_launch": False, "fused": True, "persistent": "persistent"}
# Whether decode_row times the paths a default plan does not take (--default-path-only: no).
OTHER_PATHS = True


def decode_row(row: dict, lens, hq, hkv, d, copy_gbs: float, best: dict[str, DecodeConfig]):
    """Time one decode shape with bf16 and fp8 KV; fills ``row`` in place.

    ``row[kv]`` holds the figures of the launch path a default plan takes (``DecodePlan``'s
    ``FUSED_DEFAULT``, per batch where that is ``"auto"``; ``row[kv]["path"]`` says which);
    ``row["paths"][path][kv]`` those of every path, ``two_launch`` (stage 1 then the merge
    kernel), ``fused`` (one launch) and ``persistent`` (one launch of resident programs,
    :mod:`kdash.kernels.decode_persist`), timed alike on the same case. The other paths' outputs
    are compared with the default's (``max_abs_diff_vs_default``), and a failure is recorded
    there without losing the default's figures.
    """
    paths: dict[str, dict[str, Any]] = {name: {} for name in PATH_ARGS}
    for fp8 in (False, True):
        tag = "fp8" if fp8 else "bf16"
        case = DecodeCase(lens, hq, hkv, d, fp8)
        cfg = best[tag]
        fig, fn = time_path(case, cfg, None, copy_gbs)
        chosen = PATH_KEYS[case.last_plan.path]
        paths[chosen][tag] = fig
        ms_r = bench_readflush_ms(fn)
        nbytes = fig["bytes"]
        row[tag] = {
            **fig,
            "fused": case.last_plan.fused,
            "path": chosen,
            "host_us": bench_host_us(fn),
            "us_readflush": ms_r * 1e3,
            "bw_ratio_readflush": nbytes / (ms_r * 1e-3) / 1e9 / copy_gbs,
        }
        fn()
        torch.cuda.synchronize()
        want = case.out.float().clone()
        for other in (name for name in PATH_ARGS if name != chosen and OTHER_PATHS):
            try:
                fig, fn = time_path(case, cfg, PATH_ARGS[other], copy_gbs)
                fn()
                torch.cuda.synchronize()
                fig["max_abs_diff_vs_default"] = float((case.out.float() - want).abs().max())
            except Exception as e:  # noqa: BLE001 - another path's failure is a finding
                fig = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"decode {other} {tag} B={len(lens)}: {fig['error']}")
            paths[other][tag] = fig
        del case
    for p in paths.values():
        if "us" in p.get("bf16", {}) and "us" in p.get("fp8", {}):
            p["fp8_speedup"] = p["bf16"]["us"] / p["fp8"]["us"]
            p["fp8_speedup_graph"] = p["bf16"]["us_graph"] / p["fp8"]["us_graph"]
    row["paths"] = paths
    row["fp8_speedup"] = row["bf16"]["us"] / row["fp8"]["us"]
    row["fp8_speedup_graph"] = row["bf16"]["us_graph"] / row["fp8"]["us_graph"]


def host_figures(calls: dict[str, float]) -> dict[str, Any]:
    """A row's host figures from :func:`bench_timing.bench_host_calls`: the median run's mean
    per call (``host_us_nosync``, what ``decode_host_us`` takes), the median call
    (``host_us_call``) and the rest of the spread."""
    return {"host_us_call": calls["per_call_us"], "host_us_nosync": calls["run_mean_us"],
            "host_calls": calls}  # fmt: skip


def time_path(case: DecodeCase, cfg: DecodeConfig, fused: bool | str | None, copy_gbs: float):
    """One launch path's figures on ``case`` (do_bench, graph replay, host time), and its call
    (``fused`` None: the path a default plan takes; else the plan's ``fused`` argument)."""
    fn, splits = case.fn(cfg, fused)
    ms = bench_ms(fn)
    ms_g = bench_graph_ms(fn)
    nbytes = case.bytes_needed()
    fig = {
        "splits": splits,
        "stage1": occupancy_or_error(case.last_plan),
        "stage1_kernel": case.last_plan._kern1.__name__,
        **host_figures(bench_host_calls(fn)),
        "us": ms * 1e3,
        "us_graph": ms_g * 1e3,
        "bytes": nbytes,
        "GBps": nbytes / (ms * 1e-3) / 1e9,
        "GBps_graph": nbytes / (ms_g * 1e-3) / 1e9,
        "bw_ratio": nbytes / (ms * 1e-3) / 1e9 / copy_gbs,
        "bw_ratio_graph": nbytes / (ms_g * 1e-3) / 1e9 / copy_gbs,
    }
    slot = case.last_plan._slot
    # Whether its runs went through the plan's graph (kdash.kernels.graph_launch), and if
    # not, why.
    fig["graph_launch"] = slot is not None and bool(slot.graphs)
    fig["graph_refused"] = case.last_plan.graph_refused
    # The L2 hint on the K/V copies the config asked for (kernels/l2_hint.py), if it was refused.
    fig["l2_refused"] = case.last_plan.l2_refused
    return fig, fn


# ------------------------------------------------------------------------------------ prefill
class PrefillCase:
    """Packed equal-length requests with no prefix, plus the same memory viewed for SDPA."""

    def __init__(self, seq: int, hq: int, hkv: int, d: int, causal: bool):
        self.seq, self.hq, self.hkv, self.d, self.causal = seq, hq, hkv, d, causal
        self.batch = max(1, PREFILL_TOKENS // seq)
        t = self.batch * seq
        dev = DEVICE
        self.q = torch.randn(t, hq, d, device=dev, dtype=torch.bfloat16)
        self.k = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
        self.v = torch.randn(t, hkv, d, device=dev, dtype=torch.bfloat16)
        self.cu = torch.arange(0, t + 1, seq, device=dev, dtype=torch.int32)
        self.out = torch.empty_like(self.q)

    def flops(self) -> float:
        f = 4.0 * self.batch * self.seq * self.seq * self.hq * self.d
        return f / 2 if self.causal else f

    def ours(self, cfg: AnyPrefillConfig | None):
        def run():
            extend_attention(
                self.q,
                self.k,
                self.v,
                None,
                None,
                None,
                None,
                self.cu,
                self.seq,
                causal=self.causal,
                config=cfg,
                out=self.out,
            )

        return run

    def sdpa(self, backend):
        import torch.nn.functional as F
        from torch.nn.attention import sdpa_kernel

        def bhsd(x):
            return x.view(self.batch, self.seq, x.shape[1], self.d).transpose(1, 2)

        q, k, v = bhsd(self.q), bhsd(self.k), bhsd(self.v)
        kw: dict[str, Any] = {}
        if self.hq != self.hkv:
            kw["enable_gqa"] = True

        def run():
            with sdpa_kernel(backend):
                F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, **kw)

        try:
            run()
            torch.cuda.synchronize()
        except Exception:
            if not kw:
                raise
            # The backend has no GQA path: give it KV expanded beforehand (not timed).
            g = self.hq // self.hkv
            k = k.repeat_interleave(g, dim=1)
            v = v.repeat_interleave(g, dim=1)
            kw = {}
        return run


def sweep_prefill() -> tuple[dict[str, Any], dict[str, AnyPrefillConfig]]:
    """Each class's configs timed at S=4096: the figures, and the fastest config per class."""
    out: dict[str, Any] = {}
    picked: dict[str, AnyPrefillConfig] = {}
    for d, hq in ((64, 32), (128, 16)):
        for causal in (True, False):
            case = PrefillCase(4096, hq, hq, d, causal)
            timed: list[tuple[AnyPrefillConfig, dict[str, Any]]] = []
            for cfg in PREFILL_SWEEP[d]:
                try:
                    ms = bench_ms(case.ours(cfg), rep=50)
                except Exception as e:  # noqa: BLE001 - a failing case is logged and skipped, the rest runs
                    log(f"  prefill config {cfg} failed: {type(e).__name__}: {e}")
                    continue
                tf = case.flops() / (ms * 1e-3) / 1e12
                timed.append(
                    (cfg, {"config": prefill_config_json(cfg), "us": ms * 1e3, "TFLOPs": tf})
                )
                log(f"  prefill d={d} causal={causal} {cfg}: {tf:.0f} TFLOP/s")
            best_cfg, best = max(timed, key=lambda t: t[1]["TFLOPs"])
            key = f"d{d}-{'causal' if causal else 'full'}"
            picked[key] = best_cfg
            out[key] = {"rows": [r for _, r in timed], "best": best["config"]}
            del case
    torch.cuda.empty_cache()
    return out, picked


def prefill_table(best: dict[str, AnyPrefillConfig]) -> list[dict[str, Any]]:
    """The issue's prefill shapes: hidden 2048 at D=64 and 128, causal and not, S 512..16k, GQA."""
    shapes = []
    for d, hq in ((64, 32), (128, 16)):
        for causal in (True, False):
            for s in PREFILL_SEQS:
                shapes.append((f"h2048 d{d}", hq, hq, d, causal, s))
    for causal in (True, False):
        for s in (2048, 8192):
            shapes.append(("gqa 32/8/128", 32, 8, 128, causal, s))
    rows = []
    for name, hq, hkv, d, causal, s in shapes:
        try:
            rows.append(prefill_row(name, hq, hkv, d, causal, s, best))
        except Exception as e:  # noqa: BLE001 - keep the rest of the table; the error goes into the JSON
            err = f"{type(e).__name__}: {str(e)[:300]}"
            log(f"prefill {name} causal={causal} S={s}: {err}")
            rows.append({"shape": name, "causal": causal, "seq": s, "error": err})
        torch.cuda.empty_cache()
    return rows


def prefill_row(name, hq, hkv, d, causal, s, best: dict[str, AnyPrefillConfig]) -> dict[str, Any]:
    """Time one prefill shape against SDPA's FLASH_ATTENTION and CUDNN_ATTENTION backends, the
    three in turn over six rounds in balanced orders (``round_orders``; medians, each round's
    figure kept in ``rounds_us``)."""
    from torch.nn.attention import SDPBackend

    case = PrefillCase(s, hq, hkv, d, causal)
    cfg = best[f"d{d}-{'causal' if causal else 'full'}"]
    fns, failed = {"ours": case.ours(cfg)}, {}
    for key, backend in (("sdpa_flash", "FLASH_ATTENTION"), ("sdpa_cudnn", "CUDNN_ATTENTION")):
        try:  # a backend that cannot run the shape is logged and skipped, the rest runs
            fns[key] = case.sdpa(getattr(SDPBackend, backend))
        except Exception as e:  # noqa: BLE001 - its error goes into the row
            failed[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    got = {**bench_ms_rounds(fns, rounds=ROUNDS), **failed}
    if isinstance(got["ours"], str):
        raise RuntimeError(got["ours"])
    ms = sorted(got["ours"])[len(got["ours"]) // 2]
    row: dict[str, Any] = {"shape": name, "heads": f"{hq}/{hkv}/{d}", "causal": causal, "seq": s,
                           "batch": case.batch, "kernel": prefill_config_json(cfg)["kernel"],
                           "us": ms * 1e3, "TFLOPs": case.flops() / (ms * 1e-3) / 1e12,
                           "rounds_us": {k: v if isinstance(v, str) else [t * 1e3 for t in v]
                                         for k, v in got.items()},
                           "round_orders": turn_orders(list(fns), ROUNDS)}  # fmt: skip
    for key in ("sdpa_flash", "sdpa_cudnn"):
        if isinstance(times := got[key], str):
            row[f"{key}_error"] = times
            continue
        ms_b = sorted(times)[len(times) // 2]
        row[f"{key}_us"] = ms_b * 1e3
        row[f"{key}_TFLOPs"] = case.flops() / (ms_b * 1e-3) / 1e12
        row[f"vs_{key}"] = ms_b / ms
    del case
    nan = float("nan")
    log(
        f"prefill {name:>13} {'causal' if causal else 'full  '} S={s:<6} B={row['batch']:<3} "
        f"{row['TFLOPs']:6.0f} TFLOP/s | flash {row.get('sdpa_flash_TFLOPs', nan):6.0f}"
        f" x{row.get('vs_sdpa_flash', nan):.2f} | cudnn "
        f"{row.get('sdpa_cudnn_TFLOPs', nan):6.0f} x{row.get('vs_sdpa_cudnn', nan):.2f}"
    )
    return row


# --------------------------------------------------------------------------------------- main
def machine() -> dict[str, Any]:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "sms": p.multi_processor_count,
        "memory_GiB": round(p.total_memory / GiB, 1),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "python": platform.python_version(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kdash.kernels.bench", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--out", default="bench/results/kernels-h200.json")
    ap.add_argument(
        "--sweep",
        choices=["all", "decode", "prefill", "none"],
        default="all",
        help="which shape classes get the short config sweep (others use the defaults)",
    )
    ap.add_argument(
        "--only",
        choices=["all", "decode", "prefill"],
        default="all",
        help="decode: the decode table only (no prefill sweep or table; prefill keys are n/a); "
        "prefill: the prefill table only (decode keys are n/a)",
    )
    ap.add_argument(
        "--decode-tma",
        action="store_true",
        help="decode's stage 1 is the TMA kernel, bf16 and fp8 (decode_gluon.TmaConfig on the "
        "decode configs the run uses; a plan that cannot take it keeps the Triton kernel)",
    )
    hint = ap.add_mutually_exclusive_group()
    hint.add_argument(
        "--evict-first",
        action="store_true",
        help="decode's configs ask for the L2 evict-first hint on the K/V copies, the TMA "
        "kernel's too (the Triton kernels' defaults ask already; a plan whose ptxas cannot "
        "encode it runs without and says why: row[kv]['l2_refused'])",
    )
    hint.add_argument(
        "--no-evict-first",
        action="store_true",
        help="decode's configs do not ask for the L2 evict-first hint (the baseline without it)",
    )
    ap.add_argument(
        "--max-resident",
        type=int,
        default=None,
        metavar="N",
        help="decode's configs hold at most N stage-1 programs an SM "
        "(DecodeConfig.max_resident_per_sm; 0: as many as fit)",
    )
    ap.add_argument(
        "--max-registers",
        type=int,
        default=None,
        metavar="N",
        help="bf16 decode's stage 1 compiled with at most N registers a thread (Triton's "
        "maxnreg; fp8's kernel keeps its own)",
    )
    ap.add_argument(
        "--persistent",
        action="store_true",
        help="default plans take the persistent one-launch kernel where the fused one does not "
        "pay (decode_persist.PERSISTENT_DEFAULT), so the top-level figures are of that rule",
    )
    bench_configs.add_switches(ap)
    ap.add_argument(
        "--default-path-only",
        action="store_true",
        help="time only the launch path a default plan takes on each decode shape (a third of "
        "the decode table's time; row['paths'] then holds that path alone)",
    )
    args = ap.parse_args(argv)
    bad = bench_configs.flag_error(args)
    if bad:
        print(bad, file=sys.stderr)
        return 2
    if args.default_path_only:
        global OTHER_PATHS
        OTHER_PATHS = False
    if args.persistent:
        decode_persist.PERSISTENT_DEFAULT = True
    bench_configs.apply_switches(args)
    if not torch.cuda.is_available():
        print("kdash.kernels.bench needs a CUDA GPU", file=sys.stderr)
        return 2
    t0 = time.time()
    result: dict[str, Any] = {
        "command": "python -m kdash.kernels.bench "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    log(f"machine: {result['machine']}")
    ceil = ceilings()
    result["ceilings"] = ceil
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    copy = ceil["copy_GBps"]
    log(
        f"ceilings: copy {copy:.0f} GB/s (read+written, 4 GiB), "
        f"bf16 matmul 8192^3 {ceil['matmul_bf16_TFLOPs']:.0f} TFLOP/s"
    )

    best_dec = {"bf16": DecodeConfig(), "fp8": DEFAULT_FP8_CONFIG}
    best_pre = {
        f"d{d}-{'causal' if c else 'full'}": chosen_config(d, c, torch.device("cuda"))
        for d in (64, 128)
        for c in (True, False)
    }
    result["sweep"] = {}
    if args.sweep in ("all", "decode") and args.only != "prefill":
        log("sweep: decode configs")
        sd = sweep_decode(copy)
        best_dec = {k: DecodeConfig(**v["best"]) for k, v in sd.items()}
        result["sweep"]["decode"] = sd
    best_dec = bench_configs.apply_flags(args, best_dec)
    if args.sweep in ("all", "prefill") and args.only != "decode":
        log("sweep: prefill configs")
        sp, best_pre = sweep_prefill()
        result["sweep"]["prefill"] = sp
    log(f"configs at {time.time() - t0:.0f}s: decode {best_dec}, prefill {best_pre}")
    result["configs_used"] = {
        "decode": {k: asdict(v) for k, v in best_dec.items()},
        "prefill": {k: prefill_config_json(v) for k, v in best_pre.items()},
        "switches": bench_configs.switches(),
    }
    out = Path(args.out)

    def save() -> None:
        # Written after every section, atomically, so a crash late in the run keeps the figures.
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)

    save()
    result["decode"] = []
    if args.only != "prefill":
        decode_table(copy, best_dec, result["decode"], save)
        save()
    result["prefill"] = prefill_table(best_pre) if args.only != "decode" else []
    result["summary"] = summarize(result["decode"], result["prefill"])
    result["seconds"] = time.time() - t0
    save()
    s = result["summary"]
    for k in FLOORS:
        v = s[k]
        rel = "<=" if k in AT_MOST else ">="
        shown = "n/a" if v is None else f"{v:.3f}"
        log(f"summary {k:<24} {shown:>8}  floor {rel} {FLOORS[k]:<5} {s['status'][k]}")
    for name, p in s["by_path"].items():
        shown = ", ".join(
            f"{k} {'n/a' if v is None else (f'{v:.3f}' if isinstance(v, float | int) else v)}"
            for k, v in p.items()
            if k != "status"
        )
        log(f"summary path {name:<10} {shown}")
    log(f"wrote {out} in {result['seconds']:.0f}s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
