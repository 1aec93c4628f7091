"""Prefill attention for Hopper written in Gluon: a loader warp and two consumer warpgroups.

Nsight Compute put the Triton prefill kernel's tensor pipe at 54% busy against cuDNN's 73% at
D=128 (bench/NOTES-kernels.md, session 13): cuDNN runs a producer warpgroup and two consumer
warpgroups (FA3's split), so one consumer's softmax runs while the other's matrix products do,
and Triton's two warpgroups of one program meet at a barrier every tile. Gluon (Triton's
explicit-layout dialect) lets the schedule be written out. A tile is ``2 * BLOCK_M`` query rows
of one (request, query head):

- **Loader** (one warp): for each tile, makes its Q, K and V tensor descriptors in the kernel,
  bounded by the request (rows past its end read as zeros, so a tail tile never sees the next
  request's rows), copies the two Q halves and then K and V tiles into a ring of ``STAGES``
  shared-memory slots, each slot's copies completing on its ``ready`` barrier. It waits on a
  slot's ``empty`` barrier (both consumers arrive on it) before reusing it, and on ``q_empty``
  before the next tile's Q. Two sets of descriptors are used in turn, so the next tile's are
  made while the consumers work on this one.
- **Two consumers** (a warpgroup each; the default partition and a worker): consumer ``c``
  owns query rows ``c * BLOCK_M`` to ``(c + 1) * BLOCK_M`` of the tile. Per key tile ``j`` it
  issues ``S_j = Q K_j^T`` and ``O += P_{j-1} V_{j-1}`` as asynchronous wgmma, waits for
  ``S_j`` only, runs the online softmax of ``S_j`` (in FFMA form), then waits for the P V,
  frees slot ``j - 1``, makes P bf16 and rescales ``O``. That is FA3's overlap inside a
  warpgroup as the PTX asks for it, but ptxas moves the second wait ahead of the softmax (in
  the SASS), so a consumer's softmax runs under the other consumer's products, not its own; a
  schedule that kept the wait behind the softmax gained nothing (bench/NOTES-kernels.md,
  session 28).
- **Persistent, tiles handed out as programs free up**: one program an SM; the loader takes
  each next tile off a counter (zeroed per launch) and passes its id to the consumers through
  shared memory, so the next tile's Q and first keys load while the last one's final P V and
  store run, and causal tiles (whose work differs up to the sequence length) balance. Tiles go
  (request, head) pair by pair, so the programs running at once share keys and values in L2.

Masks (causal diagonal, the request's last partial tile) are applied only on the tiles that
need them. The output is stored with a row mask. It is the default prefill at D=128 and D=64 on
sm_90 (:data:`GLUON_DEFAULTS`). What it does not do: a cached prefix (the page-table gather
stays with the Triton kernels), head dims other than 64 and 128, GPUs other than sm_90, and the
CPU interpreter (Gluon has none):
:func:`unsupported_reason` says why a call cannot run here, and
:func:`kdash.kernels.prefill_attention.extend_attention` falls back for the default (an explicit
:class:`GluonConfig` it cannot run is refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton

from ._common import ensure_allocator, sm_count
from .prefill_hopper import _capability, _descriptor_ok

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )

    # Triton 3.6 (the H200's) names the TMA tile load async_copy_global_to_shared; later ones
    # async_load, and refuse the old name.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # a Triton without Gluon's Hopper ops: the Triton kernels run
    gluon = None

LOG2E = math.log2(math.e)
HEAD_DIMS = (64, 128)


@dataclass(frozen=True)
class GluonConfig:
    """Rows per consumer, keys per tile and ring depth (the program takes ``2 * block_m`` query
    rows). At D=128 and 3 stages: Q 2 x 16 KiB + 3 x (K + V) 2 x 32 KiB = 224 KiB of the 227
    KiB of shared memory."""

    block_m: int = 64
    block_n: int = 128
    stages: int = 3
    # One program an SM taking tiles as it frees up (the next tile's Q and first keys load
    # while the last one's final P V and store run), or a grid of one program a tile.
    persistent: bool = True
    # The two consumers issue their matrix products in turns (FA3's ping-pong).
    pingpong: bool = False


# Where this kernel is the default, per head dim. D=128: the H200's pick (bench/NOTES-kernels.md,
# session 15). D=64: within 2% of the Triton kernel either way on the H200 in session 15; with
# session 28's softmax 1.5-7% ahead of it at five of six shapes on an H100, five stages a hair
# ahead of three (session 30, bench/results/prefill-gluon-d64-h100-s30-*.json).
GLUON_DEFAULTS = {128: GluonConfig(64, 128, 3), 64: GluonConfig(64, 128, 5)}
DEFAULT_CONFIG = GLUON_DEFAULTS[128]

if gluon is not None:

    @gluon.jit
    def _tile(t, total, CU, nblk, q_heads, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr):  # fmt: skip
        """Tile ``t``'s query head, request start and length, first row and key-tile count.
        Tiles go (request, head) pair by pair, so the programs running at once read few pairs'
        keys and values, from L2 (ordered block-major, 132 programs read 132 pairs' and the
        H200 ran 20% slower); within a pair from the last query block to the first, the
        heaviest first under causality."""
        pair = t // nblk
        r = t % nblk
        b = pair // q_heads
        h = pair % q_heads
        live = t < total  # past the last tile: no request (a zero length)
        q_start = gl.load(CU + b, mask=live, other=0)
        q_len = gl.load(CU + b + 1, mask=live, other=0) - q_start
        m0 = (nblk - 1 - r) * (2 * BLOCK_M)
        kv_end = gl.minimum(m0 + 2 * BLOCK_M, q_len) if CAUSAL else q_len
        return h, q_start, q_len, m0, gl.cdiv(kv_end, BLOCK_N)

    @gluon.jit
    def _ticket(COUNTER):
        """The next number off the launch's tile counter: one lane of the (one-warp) loader
        takes it, the others get it by shuffle."""
        return gl.inline_asm_elementwise(
            asm="""{
            .reg .pred first;
            .reg .b32 lane;
            mov.u32 lane, %laneid;
            setp.eq.u32 first, lane, 0;
            @first atom.global.add.u32 $0, [$1], 1;
            shfl.sync.idx.b32 $0, $0, 0, 0x1f, 0xffffffff;
            }""",
            constraints="=r,l",
            args=[COUNTER],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _claim(t, COUNTER, total, CU, nblk, q_heads, CAUSAL: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):  # fmt: skip
        """From tile ``t`` on, the first tile with work (a short request's last query blocks
        have none), each further try a number off the counter past the programs' first tiles;
        ``total`` or more when none is left."""
        _, _, q_len, m0, _ = _tile(t, total, CU, nblk, q_heads, CAUSAL, BLOCK_M, BLOCK_N)
        while (t < total) & (m0 >= q_len):
            t = _ticket(COUNTER) + gl.num_programs(0)
            _, _, q_len, m0, _ = _tile(t, total, CU, nblk, q_heads, CAUSAL, BLOCK_M, BLOCK_N)
        return t

    @gluon.jit
    def _descriptors(t, Q, K, V, CU, total, nblk, q_heads, stride_qt, stride_kt, stride_vt,
                     GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, Q_LAYOUT: gl.constexpr,
                     KV_LAYOUT: gl.constexpr):  # fmt: skip
        """Tile ``t``'s Q, K and V descriptors, bounded by its request: TMA fills rows at or
        past the request's end with zeros, so a tail tile never reads the next request's
        rows (or spare rows after the last)."""
        h, q_start, q_len, _, _ = _tile(t, total, CU, nblk, q_heads, CAUSAL, BLOCK_M, BLOCK_N)
        rows = gl.maximum(q_len, 1)  # past the last tile: a valid, unused descriptor
        kvh = h // GROUP
        q_desc = tma.make_tensor_descriptor(
            Q + q_start.to(gl.int64) * stride_qt + h * HEAD_DIM,
            [rows, HEAD_DIM], [stride_qt, 1], [BLOCK_M, HEAD_DIM], Q_LAYOUT,
        )  # fmt: skip
        k_desc = tma.make_tensor_descriptor(
            K + q_start.to(gl.int64) * stride_kt + kvh * HEAD_DIM,
            [rows, HEAD_DIM], [stride_kt, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT,
        )  # fmt: skip
        v_desc = tma.make_tensor_descriptor(
            V + q_start.to(gl.int64) * stride_vt + kvh * HEAD_DIM,
            [rows, HEAD_DIM], [stride_vt, 1], [BLOCK_N, HEAD_DIM], KV_LAYOUT,
        )  # fmt: skip
        return q_desc, k_desc, v_desc

    @gluon.jit
    def _load_tile(
        t, q_desc, k_desc, v_desc, it, c, CU, q_smem, k_smem, v_smem, q_ready, q_empty, ready,
        empty, tile_ids, tile_bar, total, nblk, q_heads, HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Hand tile ``t`` (the program's ``it``-th) to the consumers and load its Q and key
        tiles into the ring from key tile ``c`` on; the ring's position after it."""
        TILE_IDS: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        _, _, _, m0, n_tiles = _tile(t, total, CU, nblk, q_heads, CAUSAL, BLOCK_M, BLOCK_N)
        # Both consumers are past the last tile's final Q K^T: its Q is free, they have read
        # its id, and every copy through its descriptors has landed.
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        tile_ids.index(it % 2).store(gl.full([1], t, gl.int32, TILE_IDS))
        mbarrier.arrive(tile_bar.index(it % 2), count=1)
        mbarrier.expect(q_ready, 2 * BLOCK_M * HEAD_DIM * 2)
        _tma_load(q_desc, [m0, 0], q_ready, q_smem.index(0))
        _tma_load(q_desc, [m0 + BLOCK_M, 0], q_ready, q_smem.index(1))
        for j in range(n_tiles):
            slot = (c + j) % STAGES
            # A fresh barrier counts as having completed the phase before its first, so the
            # first pass over the ring does not wait.
            mbarrier.wait(empty.index(slot), (((c + j) // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * BLOCK_N * HEAD_DIM * 2)
            _tma_load(k_desc, [j * BLOCK_N, 0], bar, k_smem.index(slot))
            _tma_load(v_desc, [j * BLOCK_N, 0], bar, v_smem.index(slot))
        return c + n_tiles

    @gluon.jit
    def _load_and_claim(
        t, q_desc, k_desc, v_desc, it, c, Q, K, V, CU, COUNTER, q_smem, k_smem, v_smem, q_ready,
        q_empty, ready, empty, tile_ids, tile_bar, total, nblk, q_heads, stride_qt, stride_kt,
        stride_vt, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        """Load tile ``t`` through its descriptors, take the next tile and make its descriptors
        (each call site its own set: the loader alternates two)."""
        Q_LAYOUT: gl.constexpr = q_smem.type.layout
        KV_LAYOUT: gl.constexpr = k_smem.type.layout
        c = _load_tile(
            t, q_desc, k_desc, v_desc, it, c, CU, q_smem, k_smem, v_smem, q_ready, q_empty,
            ready, empty, tile_ids, tile_bar, total, nblk, q_heads, HEAD_DIM, BLOCK_M, BLOCK_N,
            STAGES, CAUSAL,
        )  # fmt: skip
        # Tiles are handed out as programs free up: under causality they differ up to the
        # sequence's length in work, and a fixed share per program left some SMs with twice
        # the others' (the H200: 2.6 ms against 2.0 at 16k causal).
        t = _claim(_ticket(COUNTER) + gl.num_programs(0), COUNTER, total, CU, nblk, q_heads,
                   CAUSAL, BLOCK_M, BLOCK_N)  # fmt: skip
        nq, nk, nv = _descriptors(
            t, Q, K, V, CU, total, nblk, q_heads, stride_qt, stride_kt, stride_vt, GROUP,
            HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, Q_LAYOUT, KV_LAYOUT,
        )  # fmt: skip
        return t, it + 1, c, nq, nk, nv

    @gluon.jit
    def _loader(
        Q, K, V, CU, COUNTER, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tile_ids,
        tile_bar, total, nblk, q_heads, stride_qt, stride_kt, stride_vt, GROUP: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    ):  # fmt: skip
        Q_LAYOUT: gl.constexpr = q_smem.type.layout
        KV_LAYOUT: gl.constexpr = k_smem.type.layout
        TILE_IDS: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        it = 0  # tiles this program has run (the Q and tile-id barriers' phase)
        c = 0  # key tiles it has loaded (the ring's slot and phase)
        # Two sets of descriptors, taken in turn: the next tile's are made while the consumers
        # work on this one (making three took the loader ~2 us a tile, between the consumers'
        # tiles), and a set is remade only after its tile's copies have all landed.
        t = _claim(gl.program_id(0), COUNTER, total, CU, nblk, q_heads, CAUSAL, BLOCK_M, BLOCK_N)
        qa, ka, va = _descriptors(
            t, Q, K, V, CU, total, nblk, q_heads, stride_qt, stride_kt, stride_vt, GROUP,
            HEAD_DIM, BLOCK_M, BLOCK_N, CAUSAL, Q_LAYOUT, KV_LAYOUT,
        )  # fmt: skip
        while t < total:
            t, it, c, qb, kb, vb = _load_and_claim(
                t, qa, ka, va, it, c, Q, K, V, CU, COUNTER, q_smem, k_smem, v_smem, q_ready,
                q_empty, ready, empty, tile_ids, tile_bar, total, nblk, q_heads, stride_qt,
                stride_kt, stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
            )  # fmt: skip
            if t < total:
                t, it, c, qa, ka, va = _load_and_claim(
                    t, qb, kb, vb, it, c, Q, K, V, CU, COUNTER, q_smem, k_smem, v_smem, q_ready,
                    q_empty, ready, empty, tile_ids, tile_bar, total, nblk, q_heads, stride_qt,
                    stride_kt, stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL,
                )  # fmt: skip
        # No tile left: the consumers read an id past the end and stop.
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        tile_ids.index(it % 2).store(gl.full([1], total, gl.int32, TILE_IDS))
        mbarrier.arrive(tile_bar.index(it % 2), count=1)

    @gluon.jit
    def _masked(s, j, row0, q_len, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
                BLOCK_N: gl.constexpr, S_LAYOUT: gl.constexpr):  # fmt: skip
        offs_n = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_LAYOUT))
        keep = gl.expand_dims(offs_n < q_len, 0)
        if CAUSAL:
            offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_LAYOUT))
            keep = keep & (gl.expand_dims(offs_m, 1) >= gl.expand_dims(offs_n, 0))
        return gl.where(keep, s, float("-inf"))

    @gluon.jit
    def _my_turn(turn, g, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        """Ping-pong (FA3): the consumers issue their wgmma in turns, issue point ``g`` of one
        after point ``g`` of the first and ``g - 1`` of the second, so one warpgroup's matrix
        products run while the other's softmax does instead of the two drifting into step."""
        if PINGPONG:
            # The first consumer's first wait passes on the fresh barrier's previous phase.
            mbarrier.wait(turn.index(HALF), (g & 1) ^ (1 - HALF))

    @gluon.jit
    def _their_turn(turn, HALF: gl.constexpr, PINGPONG: gl.constexpr):
        if PINGPONG:
            mbarrier.arrive(turn.index(1 - HALF), count=1)

    @gluon.jit
    def _consumer(
        Out, CU, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tile_ids, tile_bar,
        turn, total, nblk, q_heads, qk_scale, stride_ot, HALF: gl.constexpr,
        HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr, CAUSAL: gl.constexpr, PINGPONG: gl.constexpr,
    ):  # fmt: skip
        S_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        P_LAYOUT: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_LAYOUT, k_width=2)
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        TILE_IDS: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        q_tile = q_smem.index(HALF)
        it = 0
        c = 0
        mbarrier.wait(tile_bar.index(0), 0)
        t = gl.max(tile_ids.index(0).load(TILE_IDS), 0)
        while t < total:
            h, q_start, q_len, m0, n_tiles = _tile(
                t, total, CU, nblk, q_heads, CAUSAL, BLOCK_M, BLOCK_N
            )
            row0 = m0 + HALF * BLOCK_M
            # A key tile needs a mask from the first key past this consumer's first row
            # (causal) or past the request's end.
            mask_from = gl.minimum(row0, q_len) if CAUSAL else q_len
            mbarrier.wait(q_ready, it & 1)
            g = c + it  # issue points before this tile: n_tiles + 1 a tile
            slot = c % STAGES
            mbarrier.wait(ready.index(slot), (c // STAGES) & 1)
            _my_turn(turn, g, HALF, PINGPONG)
            s = warpgroup_mma(
                q_tile, k_smem.index(slot).permute((1, 0)),
                gl.zeros([BLOCK_M, BLOCK_N], gl.float32, S_LAYOUT),
                use_acc=False, is_async=True,
            )  # fmt: skip
            _their_turn(turn, HALF, PINGPONG)
            s = warpgroup_mma_wait(0, deps=(s,))
            if mask_from < BLOCK_N:
                s = _masked(s, 0, row0, q_len, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
            m = gl.max(s, 1)
            # exp2(s * scale - m * scale): one FFMA an element, where (s - m) * scale took an
            # FADD and an FMUL.
            p = gl.exp2(s * qk_scale - gl.expand_dims(m * qk_scale, 1))
            l_i = gl.sum(p, 1)
            # P is made bf16 in the tile that computed it: the loop carries 32 registers of
            # P rather than 64 (bench/NOTES-kernels.md, session 28).
            p16 = gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT)
            acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, O_LAYOUT)
            for j in range(1, n_tiles):
                slot = (c + j) % STAGES
                prev = (c + j - 1) % STAGES
                mbarrier.wait(ready.index(slot), ((c + j) // STAGES) & 1)
                _my_turn(turn, g + j, HALF, PINGPONG)
                # The last tile's score registers take the new scores (use_acc=False
                # ignores them): no zero tile kept alive across the loop.
                s = warpgroup_mma(q_tile, k_smem.index(slot).permute((1, 0)), s,
                                  use_acc=False, is_async=True)  # fmt: skip
                acc = warpgroup_mma(p16, v_smem.index(prev), acc, is_async=True)
                _their_turn(turn, HALF, PINGPONG)
                # S_j was issued first, so it completes first. The wait for P_{j-1} V_{j-1}
                # is written after the softmax, but ptxas moves it to the top of its block
                # (checked in the SASS): the softmax does not run under that product, only
                # under the other consumer's.
                s = warpgroup_mma_wait(1, deps=(s,))
                if (j + 1) * BLOCK_N > mask_from:
                    s = _masked(s, j, row0, q_len, CAUSAL, BLOCK_M, BLOCK_N, S_LAYOUT)
                m_new = gl.maximum(m, gl.max(s, 1))
                m_scaled = m_new * qk_scale
                alpha = gl.exp2(m * qk_scale - m_scaled)
                p = gl.exp2(s * qk_scale - gl.expand_dims(m_scaled, 1))
                l_i = l_i * alpha + gl.sum(p, 1)
                m = m_new
                acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
                mbarrier.arrive(empty.index(prev), count=1)
                p16 = gl.convert_layout(p.to(gl.bfloat16), P_LAYOUT)
                acc = acc * gl.expand_dims(gl.convert_layout(alpha, ROW_O), 1)
            # Every Q K^T of the tile is done: the loader may bring the next tile's Q
            # while this one's last P V and store run.
            mbarrier.arrive(q_empty, count=1)
            last = (c + n_tiles - 1) % STAGES
            _my_turn(turn, g + n_tiles, HALF, PINGPONG)
            acc = warpgroup_mma(p16, v_smem.index(last), acc, is_async=True)
            _their_turn(turn, HALF, PINGPONG)
            acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
            mbarrier.arrive(empty.index(last), count=1)

            out = acc / gl.expand_dims(gl.convert_layout(l_i, ROW_O), 1)
            offs_m = row0 + gl.arange(0, BLOCK_M, layout=ROW_O)
            offs_d = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
            ptrs = (
                Out
                + gl.expand_dims((q_start + offs_m).to(gl.int64) * stride_ot, 1)
                + h * HEAD_DIM
                + gl.expand_dims(offs_d, 0)
            )
            gl.store(ptrs, out.to(gl.bfloat16), mask=gl.expand_dims(offs_m < q_len, 1))
            c += n_tiles
            it += 1
            mbarrier.wait(tile_bar.index(it % 2), (it // 2) & 1)
            t = gl.max(tile_ids.index(it % 2).load(TILE_IDS), 0)

    @gluon.jit
    def _prefill_ws_kernel(
        Q,
        K,
        V,
        Out,
        CU,
        COUNTER,
        qk_scale,
        stride_qt,
        stride_kt,
        stride_vt,
        stride_ot,
        total,
        nblk,
        q_heads,
        GROUP: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        CAUSAL: gl.constexpr,
        PINGPONG: gl.constexpr,
        Q_LAYOUT: gl.constexpr,
        KV_LAYOUT: gl.constexpr,
    ):
        """Tiles ``program_id, program_id + programs, ...`` of ``total``; a grid of ``total``
        programs runs one tile each, a smaller one runs persistent programs."""
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], Q_LAYOUT)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The loader hands each tile's id to the consumers here (two slots: it may run one
        # tile ahead).
        tile_ids = gl.allocate_shared_memory(
            gl.int32, [2, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        tile_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tile_bar.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)  # both consumers free Q
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)  # both consumers free a slot
        gl.warp_specialize(
            [
                # The default partition takes query rows 0..BLOCK_M of each tile, a worker the rest.
                (
                    _consumer,
                    (Out, CU, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tile_ids,
                     tile_bar, turn, total, nblk, q_heads, qk_scale, stride_ot, 0, HEAD_DIM,
                     BLOCK_M, BLOCK_N, STAGES, CAUSAL, PINGPONG),
                ),
                (
                    _consumer,
                    (Out, CU, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tile_ids,
                     tile_bar, turn, total, nblk, q_heads, qk_scale, stride_ot, 1, HEAD_DIM,
                     BLOCK_M, BLOCK_N, STAGES, CAUSAL, PINGPONG),
                ),
                (
                    _loader,
                    (Q, K, V, CU, COUNTER, q_smem, k_smem, v_smem, q_ready, q_empty, ready,
                     empty, tile_ids, tile_bar, total, nblk, q_heads, stride_qt, stride_kt,
                     stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, CAUSAL),
                ),
            ],
            [4, 1],
            [240, 24],
        )  # fmt: skip
        mbarrier.invalidate(q_ready)
        mbarrier.invalidate(q_empty)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))
        for i in gl.static_range(2):
            mbarrier.invalidate(tile_bar.index(i))
            mbarrier.invalidate(turn.index(i))


def _out_ok(out: torch.Tensor, q: torch.Tensor) -> bool:
    """The output is stored by pointer, a row stride apart, each head ``D`` elements on."""
    if out.shape != q.shape or out.dtype != torch.bfloat16 or out.device != q.device:
        return False
    heads, d = out.shape[1], out.shape[2]
    return out.stride(2) == 1 and (heads == 1 or out.stride(1) == d)


def unsupported_reason(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor | None = None,
    has_prefix: bool = False,
) -> str | None:
    """Why :func:`prefill_gluon` cannot run this call, or None when it can: it needs Gluon's
    Hopper ops, an sm_90 GPU, bf16, no cached prefix, D of 64 or 128, and layouts its
    descriptors take (heads side by side, 16-byte aligned rows)."""
    if gluon is None:
        return "this Triton has no Gluon Hopper ops"
    if has_prefix:
        return "a cached prefix (the Gluon kernel reads only new tokens)"
    if q.device.type != "cuda":
        return "not a CUDA device (Gluon has no interpreter)"
    if q.shape[-1] not in HEAD_DIMS:
        return f"head dim {q.shape[-1]} (the Gluon kernel takes {HEAD_DIMS})"
    if any(t.dtype != torch.bfloat16 for t in (q, k, v)):
        return "not bf16"
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    if _capability(index) != (9, 0):
        return f"compute capability {_capability(index)} (wgmma and setmaxnreg are sm_90's)"
    if not all(_descriptor_ok(t) for t in (q, k, v)):
        return "a q/k/v layout the descriptors cannot take"
    if out is not None and not _out_ok(out, q):
        return "an output whose heads are not side by side (or not shaped like q)"
    return None


def default_gluon_config(head_dim: int, device: torch.device) -> GluonConfig | None:
    """The Gluon kernel's config where it is the default prefill (an sm_90 GPU, a head dim in
    :data:`GLUON_DEFAULTS`, Gluon present), else None."""
    if gluon is None or device.type != "cuda" or head_dim not in GLUON_DEFAULTS:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return GLUON_DEFAULTS[head_dim] if _capability(index) == (9, 0) else None


def prefill_gluon(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    *,
    causal: bool = True,
    sm_scale: float | None = None,
    config: GluonConfig | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Packed varlen prefill (``q [T, Hq, D]``, ``k``/``v [T, Hkv, D]``, bf16, no cached prefix)
    on sm_90. A call it cannot run (:func:`unsupported_reason`) raises ValueError."""
    why = unsupported_reason(q, k, v, out)
    if why is not None:
        raise ValueError(f"the Gluon prefill kernel cannot run this call: {why}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads {q.shape[1]} not a multiple of KV heads {k.shape[1]}")
    return launch(q, k, v, cu_seqlens, max_len, causal, sm_scale, config, out)


def launch(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_len: int,
    causal: bool,
    sm_scale: float | None,
    config: GluonConfig | None,
    out: torch.Tensor | None,
) -> torch.Tensor:
    """:func:`prefill_gluon` for a caller that has already checked the call (heads, dtypes and
    :func:`unsupported_reason`): the launch alone, no second pass over the checks."""
    total, q_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    cfg = config or GLUON_DEFAULTS.get(head_dim, DEFAULT_CONFIG)
    if out is None:
        out = torch.empty_like(q)
    batch = cu_seqlens.numel() - 1
    if batch == 0 or total == 0 or max_len == 0:
        return out
    ensure_allocator()
    scale = sm_scale if sm_scale is not None else 1.0 / math.sqrt(head_dim)
    q_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_m, head_dim], gl.bfloat16)
    kv_layout = gl.NVMMASharedLayout.get_default_for([cfg.block_n, head_dim], gl.bfloat16)
    nblk = triton.cdiv(max_len, 2 * cfg.block_m)
    total_tiles = nblk * q_heads * batch
    index = q.device.index if q.device.index is not None else torch.cuda.current_device()
    programs = min(total_tiles, sm_count(index)) if cfg.persistent else total_tiles
    _prefill_ws_kernel[(programs,)](
        q,
        k,
        v,
        out,
        cu_seqlens,
        # Tiles past the programs' first are handed out off this counter, zero at the launch.
        torch.zeros(1, dtype=torch.int32, device=q.device),
        scale * LOG2E,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        total_tiles,
        nblk,
        q_heads,
        GROUP=q_heads // kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        CAUSAL=causal,
        PINGPONG=cfg.pingpong,
        Q_LAYOUT=q_layout,
        KV_LAYOUT=kv_layout,
        num_warps=4,
        maxnreg=168,
    )
    return out
