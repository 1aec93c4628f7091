"""Where a decode step's fixed cost goes: every program's start and end (GPU machine).

By graph replay a 1 x 64k step (32/8/128) takes ~72 us (bf16) and ~47 us (fp8) where its bytes
at copy speed take 62.7 and 31.4: ~9 and ~15 us that do not scale with the context (run 6's
line through 64k and 128k put ~12.5 us of every step there, bench/NOTES-kernels.md). This
script stamps each stage-1 and merge program with the GPU's global timer (ns) and SM id, from
wrapper kernels that run the library's kernels unchanged between two stamps, replayed from a
CUDA graph as the bench times them. What the stamps separate:
- the launch ramp: when the programs of the first wave start, against the first;
- each program's own time, and how much the programs of one wave differ (the tail: the
  last end against the median end);
- the gap between stage 1's last end and the merge's first start, and the merge's span.
It also scans the split count at 1 x 64k for both KV dtypes (graph and do_bench), since the
wave model picks it without a measurement (``TIMELINE_ONLY=1`` skips the scan), and with
``PT_REVERSE=1`` lays each request's pages out in reverse order (does a split's pace follow its
place in the request or the pages it reads?). Writes $OUT/decode-timeline-h200.json. With
``FUSED=1`` it stamps the one-launch path instead (kdash.kernels.decode_fused, wrapped
unchanged): when stage 1's programs raise their flags, when the merge programs start and end,
and the tail after the last stage-1 program (-> $OUT/decode-timeline-fused-h200.json).
Run: python bench/gpu_decode_timeline.py   (kdash importable, a CUDA GPU with sm_90)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms
from kdash.kernels.decode_attention import _decode_stage1, _decode_stage2, default_config
from kdash.kernels.decode_fp8 import _decode_stage1_fp8_cvt
from kdash.kernels.decode_fused import _decode_fused
from kdash.kernels.decode_plan import DecodePlan


@triton.jit
def _stamp(TS, t0):
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(
        2
    ) + tl.program_id(2)
    t1 = tl.extra.cuda.globaltimer()
    tl.store(TS + pid * 3, t0)
    tl.store(TS + pid * 3 + 1, t1)
    tl.store(TS + pid * 3 + 2, tl.extra.cuda.smid().to(tl.int64))


@triton.jit
def _stage1_stamped(Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                    capacity, s0, s1, s2, s3, s4, s5, s6, s7, s8, TS, GROUP: tl.constexpr,
                    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                    PAGE: tl.constexpr, IS_FP8: tl.constexpr, FP8_FP16: tl.constexpr,
                    EVICT: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
                    DEVICE_PLAN: tl.constexpr, TARGET_VARLEN: tl.constexpr,
                    MIN_SPLIT: tl.constexpr, BLOCK_B: tl.constexpr, MAX_SPLITS: tl.constexpr,
                    MERGE: tl.constexpr, SEARCH: tl.constexpr):  # fmt: skip
    t0 = tl.extra.cuda.globaltimer()
    _decode_stage1(Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                   capacity, s0, s1, s2, s3, s4, s5, s6, s7, s8, GROUP, BLOCK_H, HEAD_DIM,
                   BLOCK_N, PAGE, IS_FP8, FP8_FP16, EVICT, UPCAST, PREFETCH, DEVICE_PLAN,
                   TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS, MERGE, SEARCH)  # fmt: skip
    _stamp(TS, t0)


@triton.jit
def _cvt_stamped(Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                 capacity, s0, s1, s2, s3, s4, s5, s6, s7, s8, TS, GROUP: tl.constexpr,
                 BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGE: tl.constexpr, EVICT: tl.constexpr, ASM: tl.constexpr,
                 UPCAST: tl.constexpr, PREFETCH: tl.constexpr, DEVICE_PLAN: tl.constexpr,
                 TARGET_VARLEN: tl.constexpr, MIN_SPLIT: tl.constexpr, BLOCK_B: tl.constexpr,
                 MAX_SPLITS: tl.constexpr, MERGE: tl.constexpr, SEARCH: tl.constexpr):  # fmt: skip
    t0 = tl.extra.cuda.globaltimer()
    _decode_stage1_fp8_cvt(Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits,
                           split_len_hint, capacity, s0, s1, s2, s3, s4, s5, s6, s7, s8, GROUP,
                           BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT, ASM, UPCAST, PREFETCH,
                           DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS, MERGE,
                           SEARCH)  # fmt: skip
    _stamp(TS, t0)


@triton.jit
def _merge_stamped(OP, LSEP, Out, LSE, num_splits, stride_outb, stride_outh, TS,
                   HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
                   EMULATE_RTNE: tl.constexpr):  # fmt: skip
    t0 = tl.extra.cuda.globaltimer()
    _decode_stage2(OP, LSEP, Out, LSE, num_splits, stride_outb, stride_outh, HEAD_DIM, BLOCK_S,
                   EMULATE_RTNE)  # fmt: skip
    _stamp(TS, t0)


@triton.jit
def _fused_stamped(Q, K, V, PT, LENS, KS, VS, OP, LSEP, Out, LSE, FLAGS, qk_scale, num_splits,
                   split_len_hint, capacity, s0, s1, s2, s3, s4, s5, s6, s7, s8, so_b, so_h, TS,
                   GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, PAGE: tl.constexpr, PAIRS: tl.constexpr,
                   IS_FP8: tl.constexpr, FP8_FP16: tl.constexpr, ASM: tl.constexpr,
                   EVICT: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
                   DEVICE_PLAN: tl.constexpr, TARGET_VARLEN: tl.constexpr,
                   MIN_SPLIT: tl.constexpr, BLOCK_B: tl.constexpr, MAX_SPLITS: tl.constexpr,
                   MERGE: tl.constexpr, SEARCH: tl.constexpr, CHUNK: tl.constexpr,
                   CVT: tl.constexpr = False, POLL_NS: tl.constexpr = 64):  # fmt: skip
    t0 = tl.extra.cuda.globaltimer()
    _decode_fused(Q, K, V, PT, LENS, KS, VS, OP, LSEP, Out, LSE, FLAGS, qk_scale, num_splits,
                  split_len_hint, capacity, s0, s1, s2, s3, s4, s5, s6, s7, s8, so_b, so_h,
                  GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, PAIRS, IS_FP8, FP8_FP16, ASM, EVICT,
                  UPCAST, PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS,
                  MERGE, SEARCH, CHUNK, CVT, POLL_NS)  # fmt: skip
    _stamp(TS, t0)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(p / 100 * len(xs)))]


def spread(xs: list[float]) -> list[float]:
    return [min(xs), pct(xs, 10), pct(xs, 50), pct(xs, 90), max(xs)]


def same_as_plan_run(step, case: bench.DecodeCase, plan: DecodePlan) -> bool:
    """Run the stamped ``step`` once, then the plan's own run: the same output, bit for bit?"""
    step()
    torch.cuda.synchronize()
    want = case.out.clone()
    plan.run(case.q, case.k, case.v)
    torch.cuda.synchronize()
    return bool(torch.equal(want, case.out))


def timeline(case: bench.DecodeCase, plan: DecodePlan) -> dict:
    q, k, v = case.q, case.k, case.v
    plan.run(q, k, v)  # binds the arguments (plan._rest1) and compiles the library's kernels
    torch.cuda.synchronize()
    g1 = plan._grid1
    n1 = g1[0] * g1[1] * g1[2]
    ts1 = torch.zeros(n1 * 3, device="cuda", dtype=torch.int64)
    s2 = plan._s2
    n2 = s2.grid[0] * s2.grid[1]
    ts2 = torch.zeros(n2 * 3, device="cuda", dtype=torch.int64)
    kern = _cvt_stamped if plan._kern1.__name__ == "_decode_stage1_fp8_cvt" else _stage1_stamped
    args = (q, k, v, plan.page_table, plan.seq_lens, plan._ks, plan._vs, *plan._rest1)

    meta1 = dict(plan._meta1)
    if kern is _stage1_stamped and plan.resident_per_sm == 4:
        meta1["maxnreg"] = 128  # the stamps must not cost the kernel its fourth program an SM

    def step():
        kern[g1](*args, ts1, **meta1)
        _merge_stamped[(s2.grid[0], s2.grid[1])](*plan._args2, ts2, **s2.meta)

    same = same_as_plan_run(step, case, plan)
    us_graph = bench_graph_ms(step) * 1e3  # the last replay's stamps stay in ts1/ts2
    torch.cuda.synchronize()
    a = ts1.view(n1, 3).tolist()
    b = ts2.view(n2, 3).tolist()
    t_first = min(r[0] for r in a)
    starts = [(r[0] - t_first) / 1e3 for r in a]
    ends = [(r[1] - t_first) / 1e3 for r in a]
    durs = [e - s for s, e in zip(starts, ends, strict=True)]
    m_starts = [(r[0] - t_first) / 1e3 for r in b]
    m_ends = [(r[1] - t_first) / 1e3 for r in b]
    m_durs = [e - s for s, e in zip(m_starts, m_ends, strict=True)]
    sms = len({r[2] for r in a})
    return {
        "programs": n1,
        "sms_used": sms,
        "splits": plan.num_splits,
        "same_output_as_plan_run": same,
        "us_graph_stamped_step": us_graph,
        "stage1": {
            "start_p50_p90_max": [pct(starts, 50), pct(starts, 90), max(starts)],
            "dur_min_p10_p50_p90_max": spread(durs),
            "end_min_p10_p50_p90_max": spread(ends),
        },
        "merge": {
            "start_min_max": [min(m_starts), max(m_starts)],
            "end_max": max(m_ends),
            "gap_after_stage1_us": min(m_starts) - max(ends),
            "dur_p50_max": [pct(m_durs, 50), max(m_durs)],
        },
        "span_us": max(m_ends),
        "raw_sm_start_end": [
            [r[2], round(st, 3), round(en, 3)] for r, st, en in zip(a, starts, ends, strict=True)
        ],
    }  # fmt: skip


def timeline_fused(case: bench.DecodeCase, plan: DecodePlan) -> dict:
    """The one-launch path's programs: when stage 1's raise their flags, when the merge
    programs (the grid's last GROUP split slices) start and finish, and the tail after the last
    stage-1 program."""
    q, k, v = case.q, case.k, case.v
    plan.run(q, k, v)
    torch.cuda.synchronize()
    b, h, z = plan._grid1
    splits = plan.num_splits
    ts = torch.zeros(b * h * z * 3, device="cuda", dtype=torch.int64)
    args = (q, k, v, plan.page_table, plan.seq_lens, plan._ks, plan._vs, *plan._rest1)

    meta = dict(plan._meta1)
    # The stamps must not cost the kernel a program an SM: the plan's residency's register budget.
    meta["maxnreg"] = (65536 // (plan.resident_per_sm * 32 * meta["num_warps"])) // 8 * 8

    def step():
        _fused_stamped[plan._grid1](*args, ts, **meta)

    same = same_as_plan_run(step, case, plan)
    us_graph = bench_graph_ms(step) * 1e3
    us_plain = bench_graph_ms(lambda: plan.run(q, k, v)) * 1e3
    torch.cuda.synchronize()
    rows = ts.view(b, h, z, 3)
    s1 = rows[:, :, :splits].reshape(-1, 3).tolist()
    mg = rows[:, :, splits:].reshape(-1, 3).tolist()
    t_first = min(r[0] for r in s1)
    ends = [(r[1] - t_first) / 1e3 for r in s1]
    m_starts = [(r[0] - t_first) / 1e3 for r in mg]
    m_ends = [(r[1] - t_first) / 1e3 for r in mg]
    return {
        "programs_stage1": len(s1),
        "programs_merge": len(mg),
        "splits": splits,
        "flags_zero_after": bool((plan._flags == 0).all().item()),
        "same_output_as_plan_run": same,
        "us_graph_stamped_step": us_graph,
        "us_graph_plan_run": us_plain,
        "stage1_end_min_p10_p50_p90_max": spread(ends),
        "merge_start_min_p50_max": [min(m_starts), pct(m_starts, 50), max(m_starts)],
        "merge_end_min_p50_max": [min(m_ends), pct(m_ends, 50), max(m_ends)],
        "tail_after_last_stage1_us": max(m_ends) - max(ends),
    }


def split_scan(fp8: bool, counts: list[int]) -> list[dict]:
    case = bench.DecodeCase([65536], 32, 8, 128, fp8)
    cfg = default_config(case.k.dtype)
    out = []
    for n in [None, *counts]:
        plan = bench.DecodePlan(
            case.page_table, case.seq_lens, 32, 8, 128, case.k.shape[1], max_seq_len=65536,
            total_tokens=65536, kv_dtype=case.k.dtype, config=cfg, out=case.out, num_splits=n,
            **case.scales,
        )  # fmt: skip
        q, k, v = case.q, case.k, case.v

        def run(plan=plan, q=q, k=k, v=v):
            plan.run(q, k, v)

        run()
        out.append(
            {"splits": plan.num_splits, "planned": n is None,
             "us_graph": bench_graph_ms(run) * 1e3, "us": bench_ms(run) * 1e3}
        )  # fmt: skip
        print("scan", "fp8" if fp8 else "bf16", out[-1], flush=True)
    return out


def main() -> int:
    t0 = time.time()
    res: dict = {
        "command": "python bench/gpu_decode_timeline.py",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "timelines": {},
    }
    for name, lens, fp8 in (
        ("1x64k bf16", [65536], False),
        ("1x64k fp8", [65536], True),
        ("8x16k bf16", [16384] * 8, False),
        ("1x128k bf16", [131072], False),
    ):
        case = bench.DecodeCase(lens, 32, 8, 128, fp8)
        if os.environ.get("PT_REVERSE") == "1":
            # Each request's pages in reverse order: whether a split's pace follows its place in
            # the request or the pages it reads.
            for b, n in enumerate(lens):
                used = -(-n // case.k.shape[1])
                case.page_table[b, :used] = case.page_table[b, :used].flip(0)
        fused = os.environ.get("FUSED") == "1"
        plan = case.plan(default_config(case.k.dtype), fused)
        try:
            res["timelines"][name] = (timeline_fused if fused else timeline)(case, plan)
        except Exception as e:  # noqa: BLE001 - one shape's failure is reported, the rest run
            res["timelines"][name] = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
        brief = {k: v for k, v in res["timelines"][name].items() if k != "raw_sm_start_end"}
        print(name, json.dumps(brief), flush=True)
        del case, plan
        torch.cuda.empty_cache()
    if os.environ.get("TIMELINE_ONLY") == "1":
        res["split_scan_1x64k"] = "not run (TIMELINE_ONLY=1)"
    else:
        res["split_scan_1x64k"] = {
            "fp8": split_scan(True, [24, 32, 40, 56, 64, 80, 94]),
            "bf16": split_scan(False, [33, 41, 49, 57, 80, 98]),
        }
    res["elapsed_s"] = time.time() - t0
    name = "decode-timeline-fused-h200.json" if os.environ.get("FUSED") == "1" else None
    dest = Path(os.environ.get("OUT") or ".") / (name or "decode-timeline-h200.json")
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest, f"{res['elapsed_s']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
