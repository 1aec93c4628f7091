"""Decode stage 1 for Hopper in Gluon: the paged cache read by TMA.

bench/gpu_kv_tma.py timed what the H200 reads of a 1 x 64k bf16 cache (8 KV heads, pages of 16
shuffled) with nothing but copies, replayed from CUDA graphs: Triton's ``cp.async`` pipeline in
the stage-1 kernel's tiles took 67.0 us, TMA copies of whole pages 63.2-65.0 us (the same bytes
read flat: 62.0). Stage 1 runs at the speed of its loads (bench/NOTES-kernels.md, session 13),
so this kernel keeps :func:`kdash.kernels.decode_attention._decode_stage1`'s contract (grid,
arguments, partial outputs, the device-side split search) and reads the cache with TMA:

- a program per (request, KV head, split), one warp: each page of a tile is one TMA copy of
  ``[PAGE, HEAD_DIM]`` (one head's rows of the page) for K and one for V, into a ring of
  ``STAGES`` tiles whose copies complete on the tile's mbarrier; a tile is re-filled as soon as
  its K and V are in registers;
- ``S = Q K^T`` and ``O += P V`` on the tensor cores (``mma.sync``, the query heads of a KV head
  padded to 16 rows), an online softmax in between, in the log2 domain as stage 1;
- a page past the request's last (the tail tile) is read from page 0 and masked: its scores
  are -inf and, on the tail tile only, its V rows are zeroed before ``P V`` (a 0 weight times
  a NaN left in an unused slot would still be NaN).

What it does not do (:func:`unsupported_reason`): fp8 KV, head dims other than 128, pages other
than 16, caches whose page stride is not ``PAGE`` token rows, GPUs other than sm_90, the CPU
interpreter (Gluon has none), more than 16 query heads per KV head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._common import ensure_allocator
from .decode_attention import NEAR_TIE_PCT as _NEAR_TIE_PCT
from .decode_attention import WAVES_MAX as _WAVES_MAX
from .decode_attention import DecodeConfig

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    # Triton 3.6 (the H200's) names the TMA tile load async_copy_global_to_shared; later ones
    # async_load.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    # and its CTA barrier thread_barrier; later ones barrier.
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # a Triton without Gluon's Hopper ops: the Triton kernels run
    gluon = None

HEAD_DIM = 128
PAGE = 16
BLOCK_H = 16  # query heads of a KV head, padded to one mma.sync tile of rows
# Ring slots (a page each): 6 x 16 tokens x (K + V) x 256 B = 48 KiB of shared memory a program.
STAGES = 6
# Global scratch a program needs: its two descriptors, 128 bytes each (DecodePlan allocates it
# once; a compiled kernel asking for more takes Triton's allocating launch instead).
SCRATCH_PER_PROGRAM = 256


@dataclass(frozen=True)
class TmaConfig(DecodeConfig):
    """A decode config whose stage 1 is this module's TMA kernel (bf16 KV on sm_90; a plan
    that cannot run it keeps the Triton kernel and says why in ``tma_refused``). Of the
    inherited fields ``block_n`` stays the split granularity, and the split model's
    (``programs_per_sm``, ``min_tokens_per_split``, ``max_splits``,
    ``programs_per_sm_varlen``) apply; the Triton launch fields do not. ``stages``: ring slots
    (a page each)."""

    stages: int = STAGES


# The cache viewed as rows of tokens x (KV heads x HEAD_DIM) for the TMA descriptor: its row
# count only bounds the copies, and the page table says which rows are read.
_ROWS_MAX = 2**31 - 1

if gluon is not None:
    ROWS_MAX = gl.constexpr(_ROWS_MAX)
    WAVES_MAX = gl.constexpr(_WAVES_MAX.value)
    NEAR_TIE_PCT = gl.constexpr(_NEAR_TIE_PCT.value)

    @gluon.jit
    def _wave_split_len(longest, programs, capacity, BLOCK_N: gl.constexpr,
                        MIN_SPLIT: gl.constexpr, MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr,
                        SEARCH: gl.constexpr, L: gl.constexpr):  # fmt: skip
        """decode_attention._wave_split_len with Gluon's explicit layout (the same integer
        arithmetic, so a plan cuts alike whichever kernel runs)."""
        s = gl.arange(0, SEARCH, layout=L) + 1
        cap = gl.maximum(gl.minimum(WAVES_MAX * capacity // programs, MAX_SPLITS), 1)
        tokens = gl.cdiv(gl.cdiv(longest, s), BLOCK_N) * BLOCK_N
        ok = (s <= cap) & ((s == 1) | (tokens >= MIN_SPLIT))
        waves = gl.cdiv(programs * s, capacity)
        score = (
            waves.to(gl.int64) * (tokens + BLOCK_N).to(gl.int64) * capacity
            + (s * programs).to(gl.int64) * MERGE
        )
        score = gl.where(ok, score, 1 << 56)
        best = gl.min(score, 0)
        near = ok & (score * 100 <= best * (100 + NEAR_TIE_PCT))
        n = gl.min(gl.where(near, s, SEARCH + 1), 0)
        return gl.cdiv(gl.cdiv(longest, n), BLOCK_N) * BLOCK_N

    @gluon.jit
    def _device_split_len(LENS, capacity, TARGET_VARLEN: gl.constexpr,
                          MIN_SPLIT: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_B: gl.constexpr,
                          MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr, SEARCH: gl.constexpr,
                          L: gl.constexpr):  # fmt: skip
        """decode_attention._device_split_len in Gluon."""
        batch = gl.num_programs(0)
        kv_heads = gl.num_programs(1)
        offs = gl.arange(0, BLOCK_B, layout=L)
        n = gl.load(LENS + offs, mask=offs < batch, other=0)
        total = gl.maximum(gl.sum(n.to(gl.int64), 0), 1)
        longest = gl.maximum(gl.max(n, 0), 1)
        varlen = 2 * batch * longest.to(gl.int64) > 3 * total
        by_work = gl.maximum(gl.cdiv(total * kv_heads, TARGET_VARLEN), MIN_SPLIT)
        by_work = (gl.cdiv(by_work, BLOCK_N) * BLOCK_N).to(gl.int32)
        by_waves = _wave_split_len(
            longest, batch * kv_heads, capacity, BLOCK_N, MIN_SPLIT, MAX_SPLITS, MERGE, SEARCH, L
        )
        return gl.where(varlen, by_work, by_waves)

    @gluon.jit
    def _issue(k_desc, v_desc, page, k_smem, v_smem, ready, slot, col, PAGE: gl.constexpr,
               HEAD_DIM: gl.constexpr):  # fmt: skip
        """Copy one page's rows of this KV head into ring slot ``slot`` (K and V, completing on
        the slot's barrier)."""
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * PAGE * HEAD_DIM * 2)
        _tma_load(k_desc, [page * PAGE, col], bar, k_smem.index(slot))
        _tma_load(v_desc, [page * PAGE, col], bar, v_smem.index(slot))

    @gluon.jit
    def _decode_stage1_gluon(
        Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ptb, GROUP: gl.constexpr, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        DEVICE_PLAN: gl.constexpr, TARGET_VARLEN: gl.constexpr, MIN_SPLIT: gl.constexpr,
        BLOCK_B: gl.constexpr, MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr,
        SEARCH: gl.constexpr, KV_LAYOUT: gl.constexpr, CHUNK: gl.constexpr = 32,
    ):  # fmt: skip
        """Stage 1 of split-KV decode (bf16 KV), arguments as ``_decode_stage1``'s; ``BLOCK_N``
        is the plan's split granularity; a ring slot holds one page. KS and VS are
        not read (no fp8 here)."""
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
        )
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        VBLK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])

        b = gl.program_id(0)
        kvh = gl.program_id(1)
        split = gl.program_id(2)
        q_heads = gl.num_programs(1) * GROUP
        seq_len = gl.load(LENS + b)
        if DEVICE_PLAN:
            hint = _device_split_len(
                LENS, capacity, TARGET_VARLEN, MIN_SPLIT, BLOCK_N, BLOCK_B, MAX_SPLITS, MERGE,
                SEARCH, L1,
            )  # fmt: skip
        else:
            hint = split_len_hint
        n_here = gl.minimum(gl.maximum(gl.cdiv(seq_len, hint), 1), num_splits)
        split_len = gl.cdiv(gl.cdiv(seq_len, n_here), BLOCK_N) * BLOCK_N
        start = split * split_len
        end = gl.minimum(start + split_len, seq_len)

        offs_h = gl.arange(0, BLOCK_H, layout=ROWS)
        offs_d = gl.arange(0, HEAD_DIM, layout=COLS)
        hmask = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        # Partials are contiguous [B, Hq, num_splits, D] and [B, Hq, num_splits].
        row = (b * q_heads + heads).to(gl.int64) * num_splits + split
        if start >= end:
            # An empty split only says so: lse = -inf, which the merge reads as zero weight.
            gl.store(LSEP + row, gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS), mask=hmask)
        else:
            cols = gl.num_programs(1) * HEAD_DIM
            k_desc = tma.make_tensor_descriptor(
                K, [ROWS_MAX, cols], [stride_ks, 1], [PAGE, HEAD_DIM], KV_LAYOUT
            )
            v_desc = tma.make_tensor_descriptor(
                V, [ROWS_MAX, cols], [stride_vs, 1], [PAGE, HEAD_DIM], KV_LAYOUT
            )
            k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, HEAD_DIM], KV_LAYOUT)
            v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, PAGE, HEAD_DIM], KV_LAYOUT)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
            pt_row = PT + b * stride_ptb
            col = kvh * HEAD_DIM
            n_tiles = gl.cdiv(end - start, PAGE)
            # Page indices CHUNK at a time (one a lane), the next CHUNK loaded a chunk ahead: the
            # warp that issues the copies waits on no page-table read but the first.
            gl.static_assert(STAGES <= CHUNK)
            offs_c = gl.arange(0, CHUNK, layout=L1)
            base = pt_row + start // PAGE
            cur = gl.load(base + offs_c, mask=offs_c < n_tiles, other=0)
            nxt = gl.load(base + CHUNK + offs_c, mask=CHUNK + offs_c < n_tiles, other=0)
            for i in gl.static_range(STAGES):
                if i < n_tiles:
                    page = gl.sum(gl.where(offs_c == i, cur, 0), 0)
                    _issue(k_desc, v_desc, page, k_smem, v_smem, ready, i, col, PAGE, HEAD_DIM)

            q = gl.load(
                Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None],
                other=0.0,
            )
            q_op = gl.convert_layout(q.to(gl.bfloat16), A_OP)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
            acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, MMA)
            offs_t = gl.arange(0, PAGE, layout=COLS)
            offs_v = gl.arange(0, PAGE, layout=gl.SliceLayout(1, VBLK))
            for i in range(n_tiles):
                slot = i % STAGES
                t0 = start + i * PAGE
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                k_op = k_smem.index(slot).permute((1, 0)).load(B_OP)
                if t0 + PAGE > end:
                    # The tail: rows past the request may hold anything, NaN included.
                    vb = v_smem.index(slot).load(VBLK)
                    vb = gl.where((t0 + offs_v)[:, None] < end, vb, gl.zeros_like(vb))
                    v_op = gl.convert_layout(vb, B_OP)
                else:
                    v_op = v_smem.index(slot).load(B_OP)
                # Every read of the slot is in registers: it may be filled again.
                _cta_barrier()
                fence_async_shared()
                j = i + STAGES
                if j < n_tiles:
                    if j % CHUNK == 0:
                        cur = nxt
                        ahead = j + CHUNK + offs_c
                        nxt = gl.load(base + ahead, mask=ahead < n_tiles, other=0)
                    page = gl.sum(gl.where(offs_c == j % CHUNK, cur, 0), 0)
                    _issue(k_desc, v_desc, page, k_smem, v_smem, ready, slot, col, PAGE, HEAD_DIM)
                s = mma_v2(q_op, k_op, gl.zeros([BLOCK_H, PAGE], gl.float32, MMA)) * qk_scale
                s = gl.where((t0 + offs_t)[None, :] < end, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p, 1)
                p_op = gl.convert_layout(p.to(gl.bfloat16), A_OP)
                acc = mma_v2(p_op, v_op, acc * alpha[:, None])
                m_i = m_new
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
            l_safe = gl.where(l_i > 0, l_i, 1.0)
            out = acc / l_safe[:, None]
            lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
            gl.store(OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
            gl.store(LSEP + row, lse, mask=hmask)


def kv_layout():
    """The shared-memory layout of a page's ``[PAGE, HEAD_DIM]`` bf16 rows (TMA's and the
    ring's)."""
    return gl.NVMMASharedLayout.get_default_for([PAGE, HEAD_DIM], gl.bfloat16)


def unsupported_reason(
    kv_dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    group: int,
    capability: tuple[int, int] | None,
    cache_strides: tuple[int, ...] | None = None,
) -> str | None:
    """Why this kernel cannot run a plan (None: it can). ``cache_strides``: a cache's
    ``(page, slot, head, dim)`` strides, when known."""
    if gluon is None:
        return "this Triton has no Gluon Hopper ops"
    if capability != (9, 0):
        return f"TMA decode is written for sm_90 (this GPU: {capability})"
    if kv_dtype != torch.bfloat16:
        return f"TMA decode reads bf16 KV (the plan's: {kv_dtype})"
    if head_dim != HEAD_DIM:
        return f"TMA decode is for head dim {HEAD_DIM} (the plan's: {head_dim})"
    if page_size != PAGE:
        return f"TMA decode copies pages of {PAGE} tokens (the plan's: {page_size})"
    if group > BLOCK_H:
        return f"TMA decode takes at most {BLOCK_H} query heads a KV head (the plan: {group})"
    if cache_strides is not None:
        sp, ss, sh, sd = cache_strides
        if sd != 1 or sh != head_dim or sp != page_size * ss or (ss * 2) % 16:
            return f"TMA decode needs [pages, {page_size}, Hkv, D] rows (strides {cache_strides})"
    return None


def plan_choice(
    config: DecodeConfig,
    kv_dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    group: int,
    capability: tuple[int, int] | None,
    fused: bool | str | None,
) -> tuple[bool, str | None]:
    """Whether a plan's stage 1 is this kernel (asked for by a :class:`TmaConfig`), and why not
    when it was asked for and cannot run. ``fused``: the plan's argument (one launch asked for
    by the caller keeps the Triton kernels; the module's default gives way)."""
    if not isinstance(config, TmaConfig):
        return False, None
    if fused is True:
        return False, "one launch was asked for: the TMA kernel has no merge programs"
    why = unsupported_reason(kv_dtype, head_dim, page_size, group, capability)
    if why is None:
        ensure_allocator()  # Triton's own launch path allocates the descriptors' scratch
    return why is None, why


def scratch(grid: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The descriptors' global scratch for every program of ``grid``, allocated once."""
    programs = 1
    for g in grid:
        programs *= g
    return torch.empty(programs * SCRATCH_PER_PROGRAM, device=device, dtype=torch.uint8)
