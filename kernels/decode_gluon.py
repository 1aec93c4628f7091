"""Decode for Hopper in Gluon: the paged cache read by TMA, in two launches or one.

bench/gpu_kv_tma.py timed what the H200 reads of a 1 x 64k bf16 cache (8 KV heads, pages of 16
shuffled) with nothing but copies, replayed from CUDA graphs: Triton's ``cp.async`` pipeline in
the stage-1 kernel's tiles took 67.0 us, TMA copies of whole pages 63.2-65.0 us (the same bytes
read flat: 62.0). Stage 1 runs at the speed of its loads (bench/NOTES-kernels.md, session 13),
so :func:`_decode_stage1_gluon` keeps :func:`kdash.kernels.decode_attention._decode_stage1`'s
contract (grid, arguments, partial outputs, the device-side split search) and reads the cache
with TMA, and :func:`_decode_fused_gluon` keeps :mod:`kdash.kernels.decode_fused`'s (merge
programs in the same grid, flags raised with release semantics and polled):

- a program per (request, KV head, split), one warp by default (``TmaConfig.warps``: W warps,
  W pages a ring slot, a warp a page of S, as the Triton stage 1 lays out its tile): each page
  is one TMA copy of ``[PAGE, HEAD_DIM]`` (one head's rows of the page) for K and one for V,
  into a ring of ``STAGES`` slots whose copies complete on the slot's mbarrier; a slot is
  re-filled as soon as its K and V are in registers; the page indices are read 32 at a time, a
  chunk ahead, so the copies never wait on the page table but once;
- ``S = Q K^T`` and ``O += P V`` on the tensor cores (``mma.sync``, the query heads of a KV head
  padded to 16 rows), an online softmax in between, in the log2 domain as stage 1;
- a page past the request's last (the tail tile) is read from page 0 and masked: its scores
  are -inf and, on the tail tile only, its V rows are zeroed before ``P V`` (a 0 weight times
  a NaN left in an unused slot would still be NaN).

A plan runs them for a :class:`TmaConfig` (:func:`plan_choice`). What they do not do
(:func:`unsupported_reason`; the plan keeps the Triton kernels then): KV other than bf16 and
fp8 e4m3, head dims other than 128, pages other than 16, GPUs other than sm_90, the CPU
interpreter (Gluon has none), more than 16 query heads per KV head; a cache whose pages are not
``PAGE`` token rows apart is refused when a plan first sees it (:func:`check_caches`).

fp8 KV (a scale per KV head) is widened to fp16 in registers on its way from shared memory to
the tensor cores, Q and P rounded to fp16, as the Triton kernels' fp16 path does. TMA reads fp8
no faster than Triton's loads (34.5-36.8 us against 34.6 at 1 x 64k); the Triton fp8 stage 1
runs 23% over its loads, on the work per tile (session 13: its conversions, and the converted
operands' trip back through shared memory, which this kernel does not make; what that trip
costs alone was not separable there).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

from . import l2_hint
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
# Warps a program may run (TmaConfig.warps).
WARPS = (1, 2, 4)
# Global scratch a program needs: its two descriptors, 128 bytes each (DecodePlan allocates it
# once; a compiled kernel asking for more takes Triton's allocating launch instead).
SCRATCH_PER_PROGRAM = 256


@dataclass(frozen=True)
class TmaConfig(DecodeConfig):
    """A decode config whose stage 1 is this module's TMA kernel (sm_90; a plan
    that cannot run it keeps the Triton kernel and says why in ``tma_refused``). Of the
    inherited fields ``block_n`` stays the split granularity, and the split model's
    (``programs_per_sm``, ``min_tokens_per_split``, ``max_splits``,
    ``programs_per_sm_varlen``) apply; the Triton launch fields do not. ``stages``: ring slots
    (a page each)."""

    stages: int = STAGES
    # The tile copies ask L2 to evict their lines first (kernels/l2_hint.py).
    l2_evict_first: bool = False
    # Warps a program, and pages a ring slot (one a warp; bench/NOTES-kernels.md, session 25):
    # 1, 2 or 4; the split granularity (block_n) must hold a slot's tokens.
    warps: int = 1
    # A register cap for the compile (0: none), so more programs fit an SM.
    maxnreg: int = 0

    def __post_init__(self) -> None:
        if self.warps not in WARPS:
            raise ValueError(f"TmaConfig.warps must be one of {WARPS} (got {self.warps!r})")
        if self.block_n % (self.warps * PAGE):
            raise ValueError(
                f"TmaConfig.block_n ({self.block_n}) must hold whole steps of {self.warps} pages"
            )


# Whether a plan made without a config takes these kernels where they run (sm_90, and what
# unsupported_reason accepts): off until the H200 says they are faster than the Triton ones
# (bench/NOTES-kernels.md, session 16; `bash bench/device_decode_tma.sh`).
# True: every KV type the kernels read; or a set of KV dtypes (the H200 timed fp8 on TMA slower,
# session 18, and bf16's read-ahead form not yet).
TMA_DEFAULT: bool | frozenset = False
# Whether those default TMA plans also put the L2 evict-first hint on their copies (l2_hint.py):
# off until the H200 has timed it (bench/NOTES-kernels.md, session 19).
L2_HINT_DEFAULT = False


# The cache viewed as rows of tokens x (KV heads x HEAD_DIM) for the TMA descriptor: its row
# count only bounds the copies, and the page table says which rows are read.
_ROWS_MAX = 2**31 - 1

if gluon is not None:
    ROWS_MAX = gl.constexpr(_ROWS_MAX)
    L2_MARKER_ASM = gl.constexpr(l2_hint.MARKER_ASM)
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
    def _issue_step(k_desc, v_desc, cur, offs_c, first, k_smem, v_smem, ready, slot, col,
                    PAGE: gl.constexpr, HEAD_DIM: gl.constexpr, ELT: gl.constexpr,
                    W: gl.constexpr):  # fmt: skip
        """Copy a step's ``W`` pages of this KV head (``cur[first:first + W]``, indices of the
        page table's current chunk) into ring slot ``slot``, one after the other along its
        rows, K and V, all completing on the slot's barrier."""
        bar = ready.index(slot)
        mbarrier.expect(bar, 2 * W * PAGE * HEAD_DIM * ELT)
        k_slot = k_smem.index(slot)
        v_slot = v_smem.index(slot)
        for t in gl.static_range(W):
            page = gl.sum(gl.where(offs_c == first + t, cur, 0), 0)
            _tma_load(k_desc, [page * PAGE, col], bar, k_slot.slice(t * PAGE, PAGE))
            _tma_load(v_desc, [page * PAGE, col], bar, v_slot.slice(t * PAGE, PAGE))

    @gluon.jit
    def _op_type(x, IS_FP8: gl.constexpr):
        """``x`` in the tensor cores' operand type: fp16 beside fp8 KV, else bf16."""
        if IS_FP8:
            return x.to(gl.float16)
        else:
            return x.to(gl.bfloat16)

    @gluon.jit
    def _operands(k_slot, v_slot, t0, end, offs_v, B_OP: gl.constexpr, B_OP4: gl.constexpr,
                  VBLK: gl.constexpr, TOKENS: gl.constexpr, IS_FP8: gl.constexpr):  # fmt: skip
        """A ring slot's K^T and V (``TOKENS`` rows from token ``t0``) as ``mma.sync`` B
        operands. fp8: widened to fp16 in registers (K^T read four bytes a register by ldmatrix
        on byte pairs; V byte by byte, its tokens being the reduction axis). On the tail step
        V's rows at or past ``end`` are zeroed (they may hold anything, NaN included)."""
        kt = k_slot.permute((1, 0))
        if IS_FP8:  # noqa: SIM108 - an if on constexprs compiles one branch
            k_op = gl.convert_layout(kt.load(B_OP4).to(gl.float16), B_OP)
        else:
            k_op = kt.load(B_OP)
        if t0 + TOKENS > end:
            vb = _op_type(v_slot.load(VBLK), IS_FP8)
            vb = gl.where((t0 + offs_v)[:, None] < end, vb, gl.zeros_like(vb))
            v_op = gl.convert_layout(vb, B_OP)
        else:
            v_op = _op_type(v_slot.load(B_OP), IS_FP8)
        return k_op, v_op

    @gluon.jit
    def _stage1(
        Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
        stride_qb, stride_qh, stride_ks, stride_vs, stride_ptb, b, kvh, split, GROUP: gl.constexpr,
        BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
        PAGE: gl.constexpr, STAGES: gl.constexpr, DEVICE_PLAN: gl.constexpr,
        TARGET_VARLEN: gl.constexpr, MIN_SPLIT: gl.constexpr, BLOCK_B: gl.constexpr,
        MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr, SEARCH: gl.constexpr,
        KV_LAYOUT: gl.constexpr, CHUNK: gl.constexpr, IS_FP8: gl.constexpr,
        L2_HINT: gl.constexpr = False, W: gl.constexpr = 1,
    ):  # fmt: skip
        """Split ``split`` of KV head ``kvh`` of request ``b``: its partial output and LSE
        (``CHUNK``: page indices read at a time; ``L2_HINT``: the kernel carries
        :data:`kdash.kernels.l2_hint.MARKER`, so its tile copies get the evict-first policy).
        fp8 KV (e4m3, a scale per KV head in KS and VS) is converted to fp16 in registers on
        its way from shared memory to the tensor cores (K's byte pairs by ldmatrix, V's bytes
        one by one: V's tokens are the reduction axis), and Q and P are rounded to fp16, as the
        Triton kernels' fp16 path does.

        ``W`` warps a program: a ring slot holds ``W`` pages, a step's ``W x PAGE`` tokens, and
        each warp computes the scores of one page (the warps along S's token axis, as the
        Triton stage 1 lays out a tile) and ``O`` for ``HEAD_DIM / W`` columns; the softmax's
        row max and sum and P cross the warps through shared memory, as they do there."""
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, W], instr_shape=[16, 8]
        )
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        # fp8 K^T read four bytes a register (ldmatrix on byte pairs), then widened
        B_OP4: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=4)
        ELT: gl.constexpr = 1 if IS_FP8 else 2
        ROWS: gl.constexpr = gl.SliceLayout(1, MMA)
        COLS: gl.constexpr = gl.SliceLayout(0, MMA)
        VBLK: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [W, 1], [1, 0])
        TILE: gl.constexpr = W * PAGE  # tokens a step

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
            kv_t = K.dtype.element_ty
            k_smem = gl.allocate_shared_memory(kv_t, [STAGES, TILE, HEAD_DIM], KV_LAYOUT)
            v_smem = gl.allocate_shared_memory(kv_t, [STAGES, TILE, HEAD_DIM], KV_LAYOUT)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
            pt_row = PT + b * stride_ptb
            col = kvh * HEAD_DIM
            if L2_HINT:
                col = _after(col, col, L2_MARKER_ASM)
            n_pages = gl.cdiv(end - start, PAGE)
            n_tiles = gl.cdiv(end - start, TILE)
            # Page indices CHUNK at a time (one a lane), the next CHUNK loaded a chunk ahead: the
            # thread that issues the copies waits on no page-table read but the first. Pages
            # past the split's last (a step's tail) read page 0, masked below.
            gl.static_assert(STAGES * W <= CHUNK)
            gl.static_assert(CHUNK % W == 0)
            offs_c = gl.arange(0, CHUNK, layout=L1)
            base = pt_row + start // PAGE
            cur = gl.load(base + offs_c, mask=offs_c < n_pages, other=0)
            nxt = gl.load(base + CHUNK + offs_c, mask=CHUNK + offs_c < n_pages, other=0)
            for i in gl.static_range(STAGES):
                if i < n_tiles:
                    _issue_step(k_desc, v_desc, cur, offs_c, i * W, k_smem, v_smem, ready, i,
                                col, PAGE, HEAD_DIM, ELT, W)  # fmt: skip

            q = gl.load(
                Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None],
                other=0.0,
            )
            scale = qk_scale
            if IS_FP8:
                scale = scale * gl.load(KS + kvh)
            q_op = gl.convert_layout(_op_type(q, IS_FP8), A_OP)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, ROWS)
            l_i = gl.zeros([BLOCK_H], gl.float32, ROWS)
            acc = gl.zeros([BLOCK_H, HEAD_DIM], gl.float32, MMA)
            offs_t = gl.arange(0, TILE, layout=COLS)
            offs_v = gl.arange(0, TILE, layout=gl.SliceLayout(1, VBLK))
            for i in range(n_tiles):
                slot = i % STAGES
                t0 = start + i * TILE
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                k_op, v_op = _operands(
                    k_smem.index(slot), v_smem.index(slot), t0, end, offs_v, B_OP, B_OP4, VBLK,
                    TILE, IS_FP8,
                )  # fmt: skip
                # Every read of the slot is in registers: it may be filled again.
                _cta_barrier()
                fence_async_shared()
                j = i + STAGES
                if j < n_tiles:
                    pj = j * W  # the step's first page
                    if pj % CHUNK == 0:
                        cur = nxt
                        ahead = pj + CHUNK + offs_c
                        nxt = gl.load(base + ahead, mask=ahead < n_pages, other=0)
                    _issue_step(k_desc, v_desc, cur, offs_c, pj % CHUNK, k_smem, v_smem, ready,
                                slot, col, PAGE, HEAD_DIM, ELT, W)  # fmt: skip
                s = mma_v2(q_op, k_op, gl.zeros([BLOCK_H, TILE], gl.float32, MMA)) * scale
                s = gl.where((t0 + offs_t)[None, :] < end, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 1))
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(s - m_new[:, None])
                l_i = l_i * alpha + gl.sum(p, 1)
                p_op = gl.convert_layout(_op_type(p, IS_FP8), A_OP)
                acc = mma_v2(p_op, v_op, acc * alpha[:, None])
                m_i = m_new
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
            if IS_FP8:
                acc = acc * gl.load(VS + kvh)
            l_safe = gl.where(l_i > 0, l_i, 1.0)
            out = acc / l_safe[:, None]
            lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
            gl.store(OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
            gl.store(LSEP + row, lse, mask=hmask)

    @gluon.jit
    def _decode_stage1_gluon(
        Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ptb, GROUP: gl.constexpr, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        DEVICE_PLAN: gl.constexpr, TARGET_VARLEN: gl.constexpr, MIN_SPLIT: gl.constexpr,
        BLOCK_B: gl.constexpr, MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr,
        SEARCH: gl.constexpr, KV_LAYOUT: gl.constexpr, IS_FP8: gl.constexpr = False,
        PT_CHUNK: gl.constexpr = 32, L2_HINT: gl.constexpr = False, W: gl.constexpr = 1,
    ):  # fmt: skip
        """Stage 1 of split-KV decode, arguments as ``_decode_stage1``'s; ``BLOCK_N`` is the
        plan's split granularity; ``W`` the program's warps (``num_warps`` must match)."""
        _stage1(
            Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
            stride_qb, stride_qh, stride_ks, stride_vs, stride_ptb, gl.program_id(0),
            gl.program_id(1), gl.program_id(2), GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, STAGES,
            DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS, MERGE, SEARCH, KV_LAYOUT,
            PT_CHUNK, IS_FP8, L2_HINT, W,
        )  # fmt: skip

    @gluon.jit
    def _after(x, y, ASM: gl.constexpr):
        """``x``, once this thread has run the PTX ``ASM`` (``$2`` is ``y``); what is computed
        from the result comes after it."""
        return gl.inline_asm_elementwise(
            asm=ASM, constraints="=r,r,r", args=[x, y], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _flags_up(FLAGS, row0, s, have, FENCED: gl.constexpr):
        """decode_fused._flags_up: the flags of splits ``s`` (1 where ``have`` is off) by
        GPU-scope acquire loads, or with ``FENCED`` by volatile loads."""
        if FENCED:
            up = gl.load(FLAGS + row0 + s, mask=have, other=1, volatile=True)
        else:
            # A lane past the last split reads the first split's flag (always a valid address).
            up = gl.inline_asm_elementwise(
                asm="ld.acquire.gpu.global.b32 $0, [$1];", constraints="=r,l",
                args=[FLAGS + gl.where(have, row0 + s, row0)], dtype=gl.int32, is_pure=False,
                pack=1,
            )  # fmt: skip
            up = gl.where(have, up, 1)
        return up

    @gluon.jit
    def _merge(OP, LSEP, Out, LSE, FLAGS, b, head, q_heads, num_splits, stride_outb,
               stride_outh, HEAD_DIM: gl.constexpr, CHUNK: gl.constexpr,
               POLL_NS: gl.constexpr, W: gl.constexpr = 1,
               FENCED: gl.constexpr = False):  # fmt: skip
        """decode_fused._merge_online in Gluon (``W`` warps): query head ``head`` of request
        ``b`` merged over its splits ``CHUNK`` at a time as their flags come up (GPU-scope
        acquire loads; ``FENCED``: volatile loads and a fence after them); the flags lowered
        after."""
        MB: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [W, 1], [1, 0])
        offs_c = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, MB))
        offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, MB))
        row0 = (b * q_heads + head).to(gl.int64) * num_splits
        m = gl.max(gl.full([CHUNK], float("-inf"), gl.float32, gl.SliceLayout(1, MB)), 0)
        den = gl.sum(gl.zeros([CHUNK], gl.float32, gl.SliceLayout(1, MB)), 0)
        acc = gl.zeros([HEAD_DIM], gl.float32, gl.SliceLayout(0, MB))
        for s0 in range(0, num_splits, CHUNK):
            s = s0 + offs_c
            have = s < num_splits
            up = _flags_up(FLAGS, row0, s, have, FENCED)
            while gl.min(up, 0) == 0:
                wait = _after(gl.min(up, 0), POLL_NS, "nanosleep.u32 $2;\n\tmov.b32 $0, $1;")
                up = _flags_up(FLAGS, row0 + wait, s, have, FENCED)
            # The flags seen up (acquire, or volatile and then a GPU-scope fence), then the
            # partials (from L2): their addresses come from the flags, so no load is issued
            # before them.
            seen = gl.min(up, 0)
            if FENCED:
                seen = _after(seen, seen, "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;")
            base = seen - 1 + row0
            lse_c = gl.load(LSEP + base + s, mask=have, other=float("-inf"), cache_modifier=".cg")
            part = gl.load(
                OP + (base + s)[:, None] * HEAD_DIM + offs_d[None, :], mask=have[:, None],
                other=0.0, cache_modifier=".cg",
            )  # fmt: skip
            live = have & (lse_c > float("-inf"))
            part = gl.where(live[:, None], part, 0.0)
            m_new = gl.maximum(m, gl.max(lse_c, 0))
            m_safe = gl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = gl.exp2(m - m_safe)
            w = gl.where(live, gl.exp2(lse_c - m_safe), 0.0)
            den = den * alpha + gl.sum(w, 0)
            acc = acc * alpha + gl.sum(part * w[:, None], 0)
            m = m_new
        # This program is the flags' only reader: lowering them readies the next launch.
        for s0 in range(0, num_splits, CHUNK):
            gl.store(
                FLAGS + row0 + s0 + offs_c, gl.zeros_like(offs_c), mask=s0 + offs_c < num_splits
            )
        den_safe = gl.where(den > 0, den, 1.0)
        m_safe = gl.where(m == float("-inf"), 0.0, m)
        lse_out = gl.where(
            den > 0, (m_safe + gl.log2(den_safe)) * 0.6931471805599453, -float("inf")
        )
        gl.store(LSE + b * q_heads + head, lse_out)
        out = (acc / den_safe).to(gl.bfloat16)
        gl.store(Out + b * stride_outb + head * stride_outh + offs_d, out)

    @gluon.jit
    def _decode_fused_gluon(
        Q, K, V, PT, LENS, KS, VS, OP, LSEP, Out, LSE, FLAGS, qk_scale, num_splits,
        split_len_hint, capacity, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh,
        stride_vp, stride_vs, stride_vh, stride_ptb, stride_outb, stride_outh,
        GROUP: gl.constexpr, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        DEVICE_PLAN: gl.constexpr, TARGET_VARLEN: gl.constexpr, MIN_SPLIT: gl.constexpr,
        BLOCK_B: gl.constexpr, MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr,
        SEARCH: gl.constexpr, KV_LAYOUT: gl.constexpr, CHUNK: gl.constexpr,
        IS_FP8: gl.constexpr = False, PT_CHUNK: gl.constexpr = 32, POLL_NS: gl.constexpr = 64,
        L2_HINT: gl.constexpr = False, W: gl.constexpr = 1, FENCED: gl.constexpr = False,
    ):  # fmt: skip
        """decode_fused._decode_fused's protocol around this module's stage 1: grid ``(B, Hkv,
        num_splits + GROUP)``, stage 1 for split ``z < num_splits``, else the merge of query
        head ``kvh * GROUP + z - num_splits``. ``FLAGS``: ``[B, Hq, num_splits]`` int32, zero
        before the launch and after it."""
        b = gl.program_id(0)
        kvh = gl.program_id(1)
        z = gl.program_id(2)
        q_heads = gl.num_programs(1) * GROUP
        if z < num_splits:
            _stage1(
                Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                capacity, stride_qb, stride_qh, stride_ks, stride_vs, stride_ptb, b, kvh, z,
                GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, STAGES, DEVICE_PLAN, TARGET_VARLEN,
                MIN_SPLIT, BLOCK_B, MAX_SPLITS, MERGE, SEARCH, KV_LAYOUT, PT_CHUNK, IS_FP8, L2_HINT,
                W,
            )  # fmt: skip
            # Every thread's partial stores, (its GPU-scope fence,) the CTA barrier, then the
            # flags (release, cumulative over what the barrier ordered before it): a merge
            # program that sees a flag up sees the partial. Opaque either way, so that the
            # flags' addresses are not computed before stage 1 and held through it.
            L1: gl.constexpr = gl.BlockedLayout([1], [32], [W], [0])
            first = b * q_heads + kvh * GROUP
            if FENCED:
                base = _after(first, first, "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;")
            else:
                base = _after(first, first, "mov.b32 $0, $1;")
            _cta_barrier()
            offs_h = gl.arange(0, BLOCK_H, layout=L1)
            rows = (base + offs_h).to(gl.int64) * num_splits + z
            ones = gl.full([BLOCK_H], 1, gl.int32, L1)
            gl.atomic_xchg(FLAGS + rows, ones, mask=offs_h < GROUP, sem="release", scope="gpu")
        else:
            _merge(
                OP, LSEP, Out, LSE, FLAGS, b, kvh * GROUP + z - num_splits, q_heads, num_splits,
                stride_outb, stride_outh, HEAD_DIM, CHUNK, POLL_NS, W, FENCED,
            )  # fmt: skip


def kv_layout(fp8: bool = False):
    """The shared-memory layout of a page's ``[PAGE, HEAD_DIM]`` rows (TMA's and the ring's),
    bf16 or fp8."""
    return gl.NVMMASharedLayout.get_default_for(
        [PAGE, HEAD_DIM], gl.float8e4nv if fp8 else gl.bfloat16
    )


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
    if kv_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
        return f"TMA decode reads bf16 or fp8 (e4m3) KV (the plan's: {kv_dtype})"
    if head_dim != HEAD_DIM:
        return f"TMA decode is for head dim {HEAD_DIM} (the plan's: {head_dim})"
    if page_size != PAGE:
        return f"TMA decode copies pages of {PAGE} tokens (the plan's: {page_size})"
    if group > BLOCK_H:
        return f"TMA decode takes at most {BLOCK_H} query heads a KV head (the plan: {group})"
    if cache_strides is not None:
        return cache_reason(cache_strides, page_size, head_dim, kv_dtype.itemsize)
    return None


def cache_reason(
    strides: tuple[int, ...], page_size: int, head_dim: int, elt: int = 2
) -> str | None:
    """Why a cache of these ``(page, slot, head, dim)`` strides (``elt`` bytes an element)
    cannot be read by the TMA kernels (their descriptor views it as rows of tokens), or None."""
    sp, ss, sh, sd = strides
    if sd != 1 or sh != head_dim or sp != page_size * ss or (ss * elt) % 16:
        return f"TMA decode needs [pages, {page_size}, Hkv, D] rows (strides {tuple(strides)})"
    return None


def check_caches(k_cache, v_cache, page_size: int, head_dim: int) -> None:
    """Refuse (ValueError, the reason) a cache the TMA kernels' descriptors cannot view."""
    for c in (k_cache, v_cache):
        why = cache_reason(c.stride(), page_size, head_dim, c.element_size())
        if why is not None:
            raise ValueError(why)


def default_for(
    base: DecodeConfig, capability: tuple[int, int] | None, kv_dtype: torch.dtype | None = None
) -> DecodeConfig:
    """The config a plan without one runs: ``base`` (the Triton default for its KV type), as a
    :class:`TmaConfig` where :data:`TMA_DEFAULT` is on for ``kv_dtype`` and the GPU is an
    sm_90."""
    on = TMA_DEFAULT if isinstance(TMA_DEFAULT, bool) else kv_dtype in TMA_DEFAULT
    if on and gluon is not None and capability == (9, 0):
        return TmaConfig(**asdict(base), l2_evict_first=L2_HINT_DEFAULT)
    return base


def plan_choice(
    config: DecodeConfig,
    kv_dtype: torch.dtype,
    head_dim: int,
    page_size: int,
    group: int,
    capability: tuple[int, int] | None,
) -> tuple[bool, str | None]:
    """Whether a plan's stage 1 is this module's (asked for by a :class:`TmaConfig`), and why
    not when it was asked for and cannot run."""
    if not isinstance(config, TmaConfig):
        return False, None
    why = unsupported_reason(kv_dtype, head_dim, page_size, group, capability)
    if why is None:
        ensure_allocator()  # Triton's own launch path allocates the descriptors' scratch
    return why is None, why


def l2_meta(config: TmaConfig) -> tuple[dict, str | None]:
    """The kernels' compile-time values for ``config.l2_evict_first``, and why the hint was
    asked for but cannot be given (None otherwise): the hint where the compile-stage hook
    could be installed, else none."""
    if not config.l2_evict_first:
        return {}, None
    why = l2_hint.install()
    return ({}, why) if why else ({"L2_HINT": True}, None)


def scratch(grid: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """The descriptors' global scratch for every program of ``grid``, allocated once."""
    n = math.prod(grid) * SCRATCH_PER_PROGRAM
    return torch.empty(n, device=device, dtype=torch.uint8)
