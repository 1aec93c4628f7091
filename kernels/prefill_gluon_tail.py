"""The tail of a persistent Gluon prefill launch, cut along its keys: a second launch.

kernels/prefill_tail_plan.py decides which tiles go whole to the persistent kernel
(kernels/prefill_gluon.py) and cuts the rest into one run of key tiles a program here. The
kernel has the same loader, consumers and ring; what differs is the work item: the loader
walks its share as segments (a tile, its first and end key tile), each through its request's
own descriptors (made while the segment before it runs, two sets in turn), and hands each
segment to the consumers as three numbers. A consumer runs a segment with the persistent
kernel's own loop (:func:`~kdash.kernels.prefill_gluon._attend`, the same source lines in a
profile); a tile held whole by one program is stored at once, a part of a split tile goes to a
work buffer with its row maxima and sums and is counted done, thread by thread, with a release
add, and the program holding the tile's first key tile (its share's last segment, so the other
parts were started first) waits for those counts with acquire loads and merges them. The plan
splits only launches whose requests look equal (``tokens == batch * max_len``); a shorter
request among them (spare rows after the last) is still right: its keys past its end read as
zeros and are masked, and a part with none of its keys adds nothing to the merge.

A second launch rather than the split inside the persistent kernel: built into one kernel
(commit 2ac56a2) it cost every whole tile 3-7% (more registers, a spill, a longer loop), and
the persistent kernel here is compiled exactly as without a tail.
"""

from __future__ import annotations

import torch

from . import prefill_gluon as pg
from .prefill_tail_plan import TailPlan, flag_count, work_floats

if pg.gluon is not None:
    gluon = pg.gluon
    gl = pg.gl
    mbarrier = pg.mbarrier
    tma = pg.tma

    @gluon.jit
    def _publish(items, tile_bar, it, t, k0, k1):
        """Work item ``it`` for the consumers: tile ``t``, key tiles ``k0`` to ``k1``, a field
        in two rows of ``items`` (two slots in turn; the loader publishes item ``it`` only once
        both consumers are past item ``it - 1``'s last Q K^T, so they have read item
        ``it - 2``'s slot)."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        items.index(it % 2).store(gl.full([1], t, gl.int32, ONE))
        items.index(2 + it % 2).store(gl.full([1], k0, gl.int32, ONE))
        items.index(4 + it % 2).store(gl.full([1], k1, gl.int32, ONE))
        mbarrier.arrive(tile_bar.index(it % 2), count=1)

    @gluon.jit
    def _field(items, f: gl.constexpr, slot):
        # Every thread reads the one element (as the persistent kernel reads its tile id), so
        # ptxas keeps what is computed from it on the uniform datapath; fields packed into one
        # vector and summed across lanes took 48 R2UR and ~100 vector instructions more a key
        # tile in the consumers' loop.
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        return gl.max(items.index(2 * f + slot).load(ONE), 0)

    @gluon.jit
    def _read_item(items, tile_bar, it):
        """Work item ``it`` as :func:`_publish` left it: (tile, first key tile, end key tile)."""
        mbarrier.wait(tile_bar.index(it % 2), (it // 2) & 1)
        slot = it % 2
        return _field(items, 0, slot), _field(items, 1, slot), _field(items, 2, slot)

    @gluon.jit
    def _release_add(ptr):
        """Each thread of the warpgroup adds one to ``*ptr`` (release, GPU scope) after its own
        stores: a reader that sees the warpgroup's 128 sees all of them."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ptrs = ptr + gl.arange(0, 128, layout=ONE) * 0
        gl.inline_asm_elementwise(
            asm="red.release.gpu.global.add.u32 [$1], 1; mov.u32 $0, 0;",
            constraints="=r,l",
            args=[ptrs],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _acquire_load(ptrs):
        return gl.inline_asm_elementwise(
            asm="ld.acquire.gpu.global.u32 $0, [$1];",
            constraints="=r,l",
            args=[ptrs],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )

    @gluon.jit
    def _acquire_wait(ptr, want):
        """Until every thread of the warpgroup reads ``*ptr >= want`` (acquire, GPU scope)."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ptrs = ptr + gl.arange(0, 128, layout=ONE) * 0
        seen = _acquire_load(ptrs)
        while gl.min(seen, 0) < want:
            seen = _acquire_load(ptrs)

    @gluon.jit
    def _split_epilogue(
        acc, m, l_o, tail_tile, k0, FLAGS, WORK, units, nk, maxc, qk_scale,
        HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        O_LAYOUT: gl.constexpr,
    ):  # fmt: skip
        """A tile's part (its key tiles from ``k0``). A tile held whole is stored as it is. A
        part that is not the tile's first leaves its unnormalised rows, their maxima and sums
        in ``WORK`` and counts itself done; the first part waits for the others and merges
        them into its own. Parts are numbered from the program holding the tile's first key
        tile. Returns the rows, their sums and whether to store them."""
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        programs = gl.num_programs(0)
        first = ((tail_tile * nk + 1) * programs - 1) // units
        last = ((tail_tile + 1) * nk * programs - 1) // units
        rows = gl.arange(0, BLOCK_M, layout=ROW_O)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
        tile_off = gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0)
        # WORK: (tail tile, part, half) blocks of BLOCK_M x HEAD_DIM rows, then BLOCK_M maxima
        # and BLOCK_M sums a block.
        blocks = (units // nk) * maxc * 2
        stats = WORK + blocks.to(gl.int64) * (BLOCK_M * HEAD_DIM)
        store = True
        if k0 > 0:
            idx = ((tail_tile * maxc + gl.program_id(0) - first) * 2 + HALF).to(gl.int64)
            gl.store(WORK + idx * (BLOCK_M * HEAD_DIM) + tile_off, acc)
            gl.store(stats + idx * (2 * BLOCK_M) + rows, m)
            gl.store(stats + idx * (2 * BLOCK_M) + BLOCK_M + rows, l_o)
            _release_add(FLAGS + idx)
            store = False
        else:
            for part in range(1, last - first + 1):
                idx = ((tail_tile * maxc + part) * 2 + HALF).to(gl.int64)
                _acquire_wait(FLAGS + idx, 128)
                o_c = gl.load(WORK + idx * (BLOCK_M * HEAD_DIM) + tile_off, cache_modifier=".cg")
                m_c = gl.load(stats + idx * (2 * BLOCK_M) + rows, cache_modifier=".cg")
                l_c = gl.load(stats + idx * (2 * BLOCK_M) + BLOCK_M + rows, cache_modifier=".cg")
                # A part whose keys all lie past a shorter request's end has no sum (its rows
                # are NaN): it adds nothing.
                has = l_c > 0
                m_n = gl.where(has, gl.maximum(m, m_c), m)
                a = gl.exp2((m - m_n) * qk_scale)
                b = gl.where(has, gl.exp2((m_c - m_n) * qk_scale), 0.0)
                mixed = acc * gl.expand_dims(a, 1) + o_c * gl.expand_dims(b, 1)
                acc = gl.where(gl.expand_dims(has, 1), mixed, acc)
                l_o = gl.where(has, l_o * a + l_c * b, l_o)
                m = m_n
        return acc, l_o, store

    @gluon.jit
    def _segment(u, u_end, whole, nk):
        """The segment of a share from key tile ``u`` of the tail on: its tile, first and end
        key tile."""
        k0 = u % nk
        return whole + u // nk, k0, gl.minimum(nk, k0 + u_end - u)

    @gluon.jit
    def _load_segment(
        u, u_end, q_desc, k_desc, v_desc, it, c, Q, K, V, CU, q_smem, k_smem, v_smem, q_ready,
        q_empty, ready, empty, tile_ids, tile_bar, total, whole, nk, nblk, q_heads, stride_qt,
        stride_kt, stride_vt, GROUP: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        """Hand the segment at ``u`` to the consumers, load its Q and key tiles through its
        tile's descriptors, then make the next segment's (each call site its own set, as the
        persistent kernel's loader alternates two: a set is remade only once its copies have
        all landed)."""
        Q_LAYOUT: gl.constexpr = q_smem.type.layout
        KV_LAYOUT: gl.constexpr = k_smem.type.layout
        t, k0, k1 = _segment(u, u_end, whole, nk)
        _, _, _, m0, _ = pg._tile(t, total, CU, nblk, q_heads, False, BLOCK_M, BLOCK_N)
        # Both consumers are past the last segment's final Q K^T (see the persistent kernel).
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        _publish(tile_ids, tile_bar, it, t, k0, k1)
        mbarrier.expect(q_ready, 2 * BLOCK_M * HEAD_DIM * 2)
        pg._tma_load(q_desc, [m0, 0], q_ready, q_smem.index(0))
        pg._tma_load(q_desc, [m0 + BLOCK_M, 0], q_ready, q_smem.index(1))
        for j in range(k0, k1):
            i = c + j - k0
            slot = i % STAGES
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)
            bar = ready.index(slot)
            mbarrier.expect(bar, 2 * BLOCK_N * HEAD_DIM * 2)
            pg._tma_load(k_desc, [j * BLOCK_N, 0], bar, k_smem.index(slot))
            pg._tma_load(v_desc, [j * BLOCK_N, 0], bar, v_smem.index(slot))
        u += k1 - k0
        t, _, _ = _segment(u, u_end, whole, nk)
        nq, nk_, nv = pg._descriptors(
            gl.where(u < u_end, t, total), Q, K, V, CU, total, nblk, q_heads, stride_qt,
            stride_kt, stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, False, Q_LAYOUT, KV_LAYOUT,
        )  # fmt: skip
        return u, it + 1, c + k1 - k0, nq, nk_, nv

    @gluon.jit
    def _tail_loader(
        Q, K, V, CU, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tile_ids, tile_bar,
        total, whole, units, nk, nblk, q_heads, stride_qt, stride_kt, stride_vt,
        GROUP: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        Q_LAYOUT: gl.constexpr = q_smem.type.layout
        KV_LAYOUT: gl.constexpr = k_smem.type.layout
        programs = gl.num_programs(0)
        u = (gl.program_id(0) * units) // programs
        u_end = ((gl.program_id(0) + 1) * units) // programs
        it = 0  # segments this program has run (the Q and item barriers' phase)
        c = 0  # key tiles it has loaded (the ring's slot and phase)
        # Descriptors bounded by the segment's request, as the persistent kernel's: key rows
        # past its end read as zeros (and are masked), so no other request's rows, nor spare
        # rows after the last, reach a part.
        t, _, _ = _segment(u, u_end, whole, nk)
        qa, ka, va = pg._descriptors(
            t, Q, K, V, CU, total, nblk, q_heads, stride_qt, stride_kt, stride_vt, GROUP,
            HEAD_DIM, BLOCK_M, BLOCK_N, False, Q_LAYOUT, KV_LAYOUT,
        )  # fmt: skip
        while u < u_end:
            u, it, c, qb, kb, vb = _load_segment(
                u, u_end, qa, ka, va, it, c, Q, K, V, CU, q_smem, k_smem, v_smem, q_ready,
                q_empty, ready, empty, tile_ids, tile_bar, total, whole, nk, nblk, q_heads,
                stride_qt, stride_kt, stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
            )  # fmt: skip
            if u < u_end:
                u, it, c, qa, ka, va = _load_segment(
                    u, u_end, qb, kb, vb, it, c, Q, K, V, CU, q_smem, k_smem, v_smem, q_ready,
                    q_empty, ready, empty, tile_ids, tile_bar, total, whole, nk, nblk, q_heads,
                    stride_qt, stride_kt, stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES,
                )  # fmt: skip
        # No work left: the consumers read a tile past the end and stop.
        mbarrier.wait(q_empty, (it & 1) ^ 1)
        _publish(tile_ids, tile_bar, it, total, 0, 0)

    @gluon.jit
    def _tail_consumer(
        Out, CU, FLAGS, WORK, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty, tile_ids,
        tile_bar, turn, total, whole, units, nk, maxc, nblk, q_heads, qk_scale, stride_ot,
        HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    ):  # fmt: skip
        O_LAYOUT: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, HEAD_DIM, 16]
        )
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        q_tile = q_smem.index(HALF)
        it = 0
        c = 0
        t, k0, k1 = _read_item(tile_ids, tile_bar, 0)
        while t < total:
            h, q_start, q_len, m0, _ = pg._tile(
                t, total, CU, nblk, q_heads, False, BLOCK_M, BLOCK_N
            )
            n = k1 - k0
            row0 = m0 + HALF * BLOCK_M
            mbarrier.wait(q_ready, it & 1)
            # Whole key tiles of one request: no mask (mask_from is the request's length).
            acc, m, l_i = pg._attend(
                q_tile, k_smem, v_smem, q_empty, ready, empty, turn, c, c + it, n, k0, row0,
                q_len, q_len, qk_scale, HALF, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES, False, False,
            )  # fmt: skip
            acc, l_o, store = _split_epilogue(
                acc, gl.convert_layout(m, ROW_O), gl.convert_layout(l_i, ROW_O), t - whole, k0,
                FLAGS, WORK, units, nk, maxc, qk_scale, HALF, HEAD_DIM, BLOCK_M, O_LAYOUT,
            )  # fmt: skip
            if store:
                pg._store_rows(Out, acc, l_o, row0, q_start, q_len, h, stride_ot, HEAD_DIM,
                               BLOCK_M, O_LAYOUT)  # fmt: skip
            c += n
            it += 1
            t, k0, k1 = _read_item(tile_ids, tile_bar, it)

    @gluon.jit
    def _prefill_tail_kernel(
        Q,
        K,
        V,
        Out,
        CU,
        FLAGS,
        WORK,
        qk_scale,
        stride_qt,
        stride_kt,
        stride_vt,
        stride_ot,
        total,
        nblk,
        q_heads,
        whole,
        units,
        nk,
        maxc,
        GROUP: gl.constexpr,
        HEAD_DIM: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        STAGES: gl.constexpr,
        Q_LAYOUT: gl.constexpr,
        KV_LAYOUT: gl.constexpr,
    ):
        """Share ``program_id`` of the tail's ``units`` key tiles (tiles ``whole`` to ``total``,
        ``nk`` key tiles each), one program an SM at most."""
        q_smem = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_M, HEAD_DIM], Q_LAYOUT)
        k_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
        v_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_N, HEAD_DIM], KV_LAYOUT)
        q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        # The work items' fields (tile, first and end key tile), two slots each: 6 x 1.
        tile_ids = gl.allocate_shared_memory(
            gl.int32, [6, 1], gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        )
        tile_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(tile_bar.index(i), count=1)
            mbarrier.init(turn.index(i), count=1)
        mbarrier.init(q_ready, count=1)
        mbarrier.init(q_empty, count=2)
        for i in gl.static_range(STAGES):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=2)
        gl.warp_specialize(
            [
                (
                    _tail_consumer,
                    (Out, CU, FLAGS, WORK, q_smem, k_smem, v_smem, q_ready, q_empty, ready,
                     empty, tile_ids, tile_bar, turn, total, whole, units, nk, maxc, nblk,
                     q_heads, qk_scale, stride_ot, 0, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES),
                ),
                (
                    _tail_consumer,
                    (Out, CU, FLAGS, WORK, q_smem, k_smem, v_smem, q_ready, q_empty, ready,
                     empty, tile_ids, tile_bar, turn, total, whole, units, nk, maxc, nblk,
                     q_heads, qk_scale, stride_ot, 1, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES),
                ),
                (
                    _tail_loader,
                    (Q, K, V, CU, q_smem, k_smem, v_smem, q_ready, q_empty, ready, empty,
                     tile_ids, tile_bar, total, whole, units, nk, nblk, q_heads, stride_qt,
                     stride_kt, stride_vt, GROUP, HEAD_DIM, BLOCK_M, BLOCK_N, STAGES),
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


def launch_tail(
    plan: TailPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    cu_seqlens: torch.Tensor,
    flags: torch.Tensor,
    qk_scale: float,
    total_tiles: int,
    nblk: int,
    cfg: pg.GluonConfig,
    q_layout: object,
    kv_layout: object,
) -> None:
    """The tail launch of ``plan`` after the persistent one: ``flags`` holds
    :func:`~kdash.kernels.prefill_tail_plan.flag_count` zeros."""
    q_heads, head_dim = q.shape[1:]
    work = torch.empty(work_floats(plan, cfg.block_m, head_dim), dtype=torch.float32,
                       device=q.device)  # fmt: skip
    assert flags.numel() >= flag_count(plan)
    _prefill_tail_kernel[(plan.programs,)](
        q,
        k,
        v,
        out,
        cu_seqlens,
        flags,
        work,
        qk_scale,
        q.stride(0),
        k.stride(0),
        v.stride(0),
        out.stride(0),
        total_tiles,
        nblk,
        q_heads,
        plan.whole,
        plan.units,
        plan.nk,
        plan.max_parts,
        GROUP=q_heads // k.shape[1],
        HEAD_DIM=head_dim,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        STAGES=cfg.stages,
        Q_LAYOUT=q_layout,
        KV_LAYOUT=kv_layout,
        num_warps=4,
        maxnreg=168,
    )
