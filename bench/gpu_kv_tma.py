"""Can TMA read the paged KV cache faster than decode's cp.async pipeline? (GPU machine)

bench/gpu_kv_stream.py (session 13) found Triton's loads-only stage 1 at 66.8-68.0 us for a
1 x 64k bf16 cache (8 KV heads, pages of 16 shuffled; ~4.0 TB/s) against 64.2 us for the same
bytes read flat, and decode's stage 1 as fast as its loads. Before writing a decode kernel in
Gluon (a loader warp feeding TMA copies into a ring, as kernels/prefill_gluon.py does), this
measures what TMA's bulk copies alone reach on the same cache, with nothing but the copies: a
program issues page copies into a ring of ``STAGES`` slots of ``P`` pages (K and V) and
re-issues into a slot as soon as its copies land.

- ``per_head``: a program per (KV head, split) as stage 1; a page is [16 tokens, D] of one head
  (bf16: two 16 x 64 boxes; fp8: one 16 x 128 box);
- ``all_heads``: a program per split, a page's K is one contiguous 32 KiB box (every head);
- ``flat``: as ``all_heads`` with the pages in order (no page table);
- the Triton loads-only kernels of gpu_kv_stream.py and ``DecodePlan.run`` beside, same run.

CUDA-graph and do_bench medians; writes $OUT/kv-tma-h200.json.
Run: python bench/gpu_kv_tma.py   (a CUDA GPU with Triton's Gluon; kdash importable)
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import triton
from kdash.kernels import bench
from kdash.kernels._common import ensure_allocator
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_kv_stream import _flat, _paged, measure  # the Triton readers, timed beside

_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@gluon.jit
def _issue(K_desc, V_desc, PT, k_smem, v_smem, ready, step, slot, p0, col0,
           USE_PT: gl.constexpr, P: gl.constexpr, NBOX: gl.constexpr, PAGE_ROWS: gl.constexpr,
           BOX_R: gl.constexpr, BOX_C: gl.constexpr, ELT: gl.constexpr):  # fmt: skip
    bar = ready.index(slot)
    mbarrier.expect(bar, 2 * P * NBOX * BOX_R * BOX_C * ELT)
    for p in gl.static_range(P):
        idx = p0 + step * P + p
        pg = gl.load(PT + idx) if USE_PT else idx
        for b in gl.static_range(NBOX):
            j = (slot * P + p) * NBOX + b
            _tma_load(K_desc, [pg * PAGE_ROWS, col0 + b * BOX_C], bar, k_smem.index(j))
            _tma_load(V_desc, [pg * PAGE_ROWS, col0 + b * BOX_C], bar, v_smem.index(j))


@gluon.jit
def _stream(K, V, PT, n_rows, row_elems, pages_per_split, head_cols,
            USE_PT: gl.constexpr, P: gl.constexpr, STAGES: gl.constexpr, NBOX: gl.constexpr,
            PAGE_ROWS: gl.constexpr, BOX_R: gl.constexpr, BOX_C: gl.constexpr,
            ELT: gl.constexpr, LAYOUT: gl.constexpr):  # fmt: skip
    h = gl.program_id(0)
    s = gl.program_id(1)
    col0 = h * head_cols
    p0 = s * pages_per_split
    steps = pages_per_split // P
    K_desc = tma.make_tensor_descriptor(
        K, [n_rows, row_elems], [row_elems, 1], [BOX_R, BOX_C], LAYOUT
    )
    V_desc = tma.make_tensor_descriptor(
        V, [n_rows, row_elems], [row_elems, 1], [BOX_R, BOX_C], LAYOUT
    )
    k_smem = gl.allocate_shared_memory(
        K.dtype.element_ty, [STAGES * P * NBOX, BOX_R, BOX_C], LAYOUT
    )
    v_smem = gl.allocate_shared_memory(
        V.dtype.element_ty, [STAGES * P * NBOX, BOX_R, BOX_C], LAYOUT
    )
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
    for i in gl.static_range(STAGES):
        _issue(K_desc, V_desc, PT, k_smem, v_smem, ready, i, i, p0, col0, USE_PT, P, NBOX,
               PAGE_ROWS, BOX_R, BOX_C, ELT)  # fmt: skip
    for i in range(steps):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        if i + STAGES < steps:
            _issue(K_desc, V_desc, PT, k_smem, v_smem, ready, i + STAGES, slot, p0, col0,
                   USE_PT, P, NBOX, PAGE_ROWS, BOX_R, BOX_C, ELT)  # fmt: skip
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))


def reader(case: bench.DecodeCase, mode: str, splits: int, p: int, stages: int, warps: int):
    """``(fn, smem_bytes, programs)``: the copy-only TMA reader of ``case``'s cache (one
    request) in ``mode`` (module docstring), ``p`` pages a ring slot, ``stages`` slots."""
    k, v, pt = case.k, case.v, case.page_table[0].to(torch.int32).contiguous()
    page, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    n_pages = -(-case.lens[0] // page)
    if case.fp8:  # TMA copies bytes: read the fp8 cache as uint8
        k, v = k.view(torch.uint8), v.view(torch.uint8)
    elt = k.element_size()
    gdt = gl.uint8 if case.fp8 else gl.bfloat16
    box_c = 128 // elt
    if mode == "per_head":
        rows, cols, box_r = n_pages * page, hkv * d, page
        nbox, page_rows, head_cols, grid0 = d * elt // 128, page, d, hkv
    else:  # every head of a page: one box of rows of 128 bytes
        rows, cols = n_pages * page * hkv * d // box_c, box_c
        box_r = page_rows = page * hkv * d // box_c
        nbox, head_cols, grid0 = 1, 0, 1
    assert n_pages % splits == 0 and (n_pages // splits) % p == 0, (mode, splits, p)
    pps = n_pages // splits
    layout = gl.NVMMASharedLayout.get_default_for([box_r, box_c], gdt)
    kk, vv = k.reshape(rows, cols), v.reshape(rows, cols)
    meta = dict(USE_PT=mode != "flat", P=p, STAGES=stages, NBOX=nbox, PAGE_ROWS=page_rows,
                BOX_R=box_r, BOX_C=box_c, ELT=elt, LAYOUT=layout, num_warps=warps)  # fmt: skip
    grid = (grid0, splits)

    def fn() -> None:
        _stream[grid](kk, vv, pt, rows, cols, pps, head_cols, **meta)

    return fn, 2 * stages * p * nbox * box_r * box_c * elt, grid0 * splits


def tma_rows(fp8: bool, record) -> None:
    tokens, hkv, d = 65536, 8, 128
    case = bench.DecodeCase([tokens], 32, hkv, d, fp8)
    tag = "fp8" if fp8 else "bf16"
    nbytes = 2 * tokens * hkv * d * (1 if fp8 else 2)

    def run(mode: str, splits: int, p: int, stages: int, warps: int) -> None:
        fn, smem, programs = reader(case, mode, splits, p, stages, warps)
        row = {"kv": tag, "mode": mode, "splits": splits, "pages_per_stage": p, "stages": stages,
               "warps": warps, "smem_KiB": smem / 1024, "programs": programs}  # fmt: skip
        try:
            record({**row, "tma": measure(fn, nbytes)})
        except Exception as exc:  # noqa: BLE001 - one variant that fails must not cost the others
            record({**row, "error": f"{type(exc).__name__}: {exc}"[:400]})

    if fp8:
        for splits, p, stages, warps in (
            (64, 1, 6, 4),
            (64, 2, 4, 4),
            (32, 2, 6, 4),
            (128, 1, 6, 4),
            (64, 4, 4, 1),
        ):
            run("per_head", splits, p, stages, warps)
    else:
        bf16_cfgs = ((64, 1, 4, 4), (64, 2, 3, 4), (64, 1, 6, 4), (64, 2, 3, 1), (32, 2, 6, 4),
                     (128, 1, 3, 4), (64, 4, 2, 4), (32, 4, 3, 1))  # fmt: skip
        for splits, p, stages, warps in bf16_cfgs:
            run("per_head", splits, p, stages, warps)
        for mode in ("all_heads", "flat"):
            for splits, stages in ((128, 3), (64, 3), (256, 1)):
                run(mode, splits, 1, stages, 4)


def reference_rows(record) -> None:
    """The Triton loads-only kernels of gpu_kv_stream.py and the plan's own run, this run."""
    tokens, hkv, d = 65536, 8, 128
    for fp8 in (False, True):
        case = bench.DecodeCase([tokens], 32, hkv, d, fp8)
        tag = "fp8" if fp8 else "bf16"
        nbytes = 2 * tokens * hkv * d * (1 if fp8 else 2)
        cfg = bench.DEFAULT_FP8_CONFIG if fp8 else bench.DecodeConfig()
        fn, splits = case.fn(cfg)
        record({"kv": tag, "mode": "plan_run", "splits": splits, "run": measure(fn, nbytes)})
        if not fp8:
            k, v, pt = case.k, case.v, case.page_table[0]
            sk = k.stride()
            out = torch.empty(4096, device="cuda", dtype=torch.float32)
            split_len = 1024
            args = (k, v, pt, out, tokens, split_len, sk[0], sk[1], sk[2])
            meta = dict(PAGE=k.shape[1], BLOCK_N=128, num_warps=4, num_stages=2)
            fn = lambda a=args, m=meta: _paged[(hkv, 64)](*a, W=d, G=1, WORDS=False, **m)  # noqa: E731
            record({"kv": tag, "mode": "triton_per_head", "splits": 64, "run": measure(fn, nbytes)})
            kf, vf = k.reshape(-1, d), v.reshape(-1, d)
            n_rows = kf.shape[0]
            flat = (kf, vf, out, n_rows, n_rows // 512)
            meta = dict(BLOCK_N=128, D=d, num_warps=4, num_stages=2)
            fn = lambda a=flat, m=meta: _flat[(512,)](*a, **m)  # noqa: E731
            record({"kv": tag, "mode": "triton_flat", "programs": 512, "run": measure(fn, nbytes)})
        del case
        torch.cuda.empty_cache()


def main() -> int:
    ensure_allocator()
    rows: list[dict] = []

    def record(row: dict) -> None:
        print(json.dumps(row), flush=True)
        rows.append(row)

    res = {"command": "python bench/gpu_kv_tma.py", "gpu": torch.cuda.get_device_name(0),
           "triton": triton.__version__, "cases": rows}  # fmt: skip
    for fp8 in (False, True):
        tma_rows(fp8, record)
        torch.cuda.empty_cache()
    try:
        reference_rows(record)
    except Exception as exc:  # noqa: BLE001 - the TMA rows above are kept either way
        record({"mode": "reference", "error": f"{type(exc).__name__}: {exc}"[:400]})
    dest = Path(os.environ.get("OUT") or ".") / "kv-tma-h200.json"
    dest.write_text(json.dumps(res, indent=1))
    print("wrote", dest, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
