"""How fast can the paged KV cache be read at all, in decode's access pattern? (GPU machine)

Decode's stage 1 at 1 x 64k moves its bytes at ~3.6-3.9 TB/s where a copy moves 4.28. The
stamps of bench/gpu_decode_timeline.py show every fp8 program running for most of the step
(durations 26-42 us, one wave), so the programs are not waiting on each other: they are slow
together. One suspect is the access pattern itself: the cache is [pages, 16, Hkv, D] (SGLang's
token-major layout), so one KV head's row of a token is D x 2 bytes (bf16) or D bytes (fp8)
with Hkv x D elements between tokens, and pages are shuffled. This script reads the same
cache with nothing but the loads and a sum (the same tiles, the same software pipeline), in
the order decode reads it and in others:
- ``per_head``: a program per (KV head, split), tiles of BLOCK_N tokens x D, as stage 1;
- ``all_heads``: a program per split reads every KV head of its tokens, [BLOCK_N, Hkv x D],
  contiguous Hkv x D x elt bytes per token;
- ``flat``: the same bytes as one contiguous array, BLOCK_N x D elements a tile;
- ``words`` (fp8 only): G adjacent KV heads a program, read as int16 words as decode's fp8
  kernels read them, at about as many programs as decode runs (the three reads above would
  convert fp8 to fp32 element by element, which makes them compute-bound, so fp8 runs only
  these).
Grids of one wave; do_bench (L2 flushed) and CUDA-graph medians, GB/s of the bytes read.
Writes $OUT/kv-stream-h200.json.
Run: python bench/gpu_kv_stream.py [--fp8-only]   (a CUDA GPU; kdash importable)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_ms


@triton.jit
def _paged(K, V, PT, OUT, n_tokens, split_len, s_kp, s_ks, s_kh, PAGE: tl.constexpr,
           BLOCK_N: tl.constexpr, W: tl.constexpr, G: tl.constexpr,
           WORDS: tl.constexpr):  # fmt: skip
    """A program per (group of G adjacent KV heads, split): tiles of BLOCK_N tokens x G x W
    elements (contiguous in a token), summed. ``WORDS``: the cache read as int16 words, as the
    fp8 kernels read it (no conversion); else the elements converted to fp32."""
    hg = tl.program_id(0)
    s = tl.program_id(1)
    start = s * split_len
    end = tl.minimum(start + split_len, n_tokens)
    if WORDS:
        K = K.to(tl.pointer_type(tl.int16), bitcast=True)
        V = V.to(tl.pointer_type(tl.int16), bitcast=True)
    offs_t = tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, G * W)
    acc = tl.zeros([G * W], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_t
        m = t < end
        page = tl.load(PT + t // PAGE, mask=m, other=0).to(tl.int64)
        off = page[:, None] * s_kp + (t % PAGE)[:, None] * s_ks + hg * G * s_kh + offs_w[None, :]
        k = tl.load(K + off, mask=m[:, None], other=0)
        v = tl.load(V + off, mask=m[:, None], other=0)
        if WORDS:
            acc += tl.sum((k ^ v).to(tl.int32), 0).to(tl.float32)
        else:
            acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(OUT + hg * tl.num_programs(1) + s, tl.sum(acc, 0))


@triton.jit
def _flat(K, V, OUT, n_rows, split_rows, BLOCK_N: tl.constexpr, D: tl.constexpr):
    s = tl.program_id(0)
    start = s * split_rows
    end = tl.minimum(start + split_rows, n_rows)
    offs_t = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        t = n0 + offs_t
        m = t < end
        off = t.to(tl.int64)[:, None] * D + offs_d[None, :]
        k = tl.load(K + off, mask=m[:, None], other=0.0)
        v = tl.load(V + off, mask=m[:, None], other=0.0)
        acc += tl.sum(k.to(tl.float32) + v.to(tl.float32), 0)
    tl.store(OUT + s, tl.sum(acc, 0))


def measure(fn, nbytes: int) -> dict:
    fn()
    torch.cuda.synchronize()
    ms, ms_g = bench_ms(fn), bench_graph_ms(fn)
    return {"us": ms * 1e3, "us_graph": ms_g * 1e3, "GBps": nbytes / ms / 1e6,
            "GBps_graph": nbytes / ms_g / 1e6}  # fmt: skip


def one_dtype(fp8: bool) -> list[dict]:
    tokens, hkv, d = 65536, 8, 128
    case = bench.DecodeCase([tokens], 32, hkv, d, fp8)
    k, v, pt = case.k, case.v, case.page_table[0]
    tag = "fp8" if fp8 else "bf16"
    elt = 1 if fp8 else 2
    nbytes = 2 * tokens * hkv * d * elt
    page, sk = k.shape[1], k.stride()
    out = torch.empty(4096, device="cuda", dtype=torch.float32)
    rows: list[dict] = []

    def record(row: dict) -> None:
        print(row, flush=True)
        rows.append(row)

    if fp8:
        words_rows(k, v, pt, out, tokens, nbytes, record)
        return rows
    for bn, warps, stages in ((64, 4, 2), (128, 4, 2), (64, 4, 3), (128, 8, 3)):
        meta = dict(PAGE=page, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        for splits in (33, 47, 49, 64, 66):
            split_len = triton.cdiv(triton.cdiv(tokens, splits), bn) * bn
            grid = (hkv, splits)
            args = (k, v, pt, out, tokens, split_len, sk[0], sk[1], sk[2])
            fn = lambda g=grid, a=args, m=meta: _paged[g](*a, W=d, G=1, WORDS=False, **m)  # noqa: E731
            row = {"kv": tag, "tile": [bn, warps, stages], "splits": splits}
            record({**row, "per_head": measure(fn, nbytes)})
    heads_cfgs = [(16, 4, 2, 132), (16, 8, 3, 132), (32, 8, 2, 132)]
    heads_cfgs += [(16, 4, 2, 264), (32, 4, 3, 264), (16, 4, 3, 396)]
    for bn, warps, stages, splits in heads_cfgs:
        meta = dict(PAGE=page, BLOCK_N=bn, num_warps=warps, num_stages=stages)
        split_len = triton.cdiv(triton.cdiv(tokens, splits), bn) * bn
        args = (k, v, pt, out, tokens, split_len, sk[0], sk[1], sk[2])
        fn = lambda g=(1, splits), a=args, m=meta: _paged[g](*a, W=d, G=hkv, WORDS=False, **m)  # noqa: E731
        row = {"kv": tag, "tile": [bn, warps, stages], "splits": splits}
        record({**row, "all_heads": measure(fn, nbytes)})
    kf, vf = k.reshape(-1, d), v.reshape(-1, d)
    n_rows = kf.shape[0]
    for bn, warps, stages, progs in ((128, 4, 2, 376), (128, 4, 2, 512), (64, 4, 3, 528)):
        meta = dict(BLOCK_N=bn, num_warps=warps, num_stages=stages)
        split_rows = triton.cdiv(triton.cdiv(n_rows, progs), bn) * bn
        args = (kf, vf, out, n_rows, split_rows)
        fn = lambda g=(progs,), a=args, m=meta: _flat[g](*a, D=d, **m)  # noqa: E731
        row = {"kv": tag, "tile": [bn, warps, stages], "programs": progs}
        record({**row, "flat": measure(fn, 2 * n_rows * d * elt)})
    return rows


def words_rows(k, v, pt, out, tokens: int, nbytes: int, record) -> None:
    """fp8 read as int16 words, G heads a program, splits scaled with G so that the programs
    stay near decode's count (376-512); each row goes to ``record``."""
    hkv, d = k.shape[2], k.shape[3]
    page, sw = k.shape[1], tuple(x // 2 for x in k.stride()[:3])  # strides in int16 words
    for g, bn in ((1, 128), (2, 64), (4, 32), (8, 16)):
        for base in (47, 64):
            splits = base * g
            split_len = triton.cdiv(triton.cdiv(tokens, splits), bn) * bn
            meta = dict(PAGE=page, BLOCK_N=bn, W=d // 2, G=g, WORDS=True, num_warps=4, num_stages=2)
            args = (k, v, pt, out, tokens, split_len, *sw)
            grid = (hkv // g, splits)
            fn = lambda g_=grid, a=args, m=meta: _paged[g_](*a, **m)  # noqa: E731
            row = {"kv": "fp8", "tile": [bn, 4, 2], "heads_per_program": g, "splits": splits}
            record({**row, "programs": grid[0] * grid[1], "words": measure(fn, nbytes)})


def main() -> int:
    res: dict = {"command": "python bench/gpu_kv_stream.py", "gpu": torch.cuda.get_device_name(0)}
    res["triton"] = triton.__version__
    res["cases"] = [] if "--fp8-only" in sys.argv else one_dtype(False)
    torch.cuda.empty_cache()
    res["cases"] += one_dtype(True)
    dest = Path(os.environ.get("OUT") or ".") / "kv-stream-h200.json"
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
