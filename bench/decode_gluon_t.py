"""Decode stage 1 for Hopper in Gluon, the products transposed: ``S^T = K Q^T``, ``O^T += V^T P^T``.

An experiment, timed by bench/gpu_decode_tform.py (session 23): on an H100 it ran no faster
than the one-warp TMA kernel or the Triton stage 1 (bench/NOTES-kernels.md), so it stays here,
outside the library.

:func:`kdash.kernels.decode_gluon._decode_stage1_gluon` computes ``S = Q K^T`` with the query
heads of a KV head as the ``mma.sync`` rows, padded to 16: at 4 query heads a KV head three
quarters of its tensor-core work, of its Q registers and of its ``O`` accumulator (64 fp32
registers a thread) are padding. Nsight Compute on an H100 (1 x 64k bf16, 32/8;
bench/NOTES-kernels.md, session 23): its one warp executes 415 instructions a page, 215
registers, so at most 9 such warps fit an SM. Here the heads are the columns instead, an
``n8`` tile for up to 8 heads a KV head:

- ``S^T [PAGE, H] = K [PAGE, D] @ Q^T [D, H]``: K straight from the ring slot as the A operand
  (``ldmatrix``), Q^T held in 16 registers a thread;
- the online softmax runs down the columns (a head's tokens), its max and sum over the 16 token
  rows of the tile;
- ``O^T [D, H] += V^T [D, PAGE] @ P^T [PAGE, H]``: V^T from the slot by ``ldmatrix.trans``, the
  accumulator 32 fp32 registers a thread.

Half the ``mma.sync`` of the one-warp kernel at 8 heads or fewer, half its rescaling, and fewer
registers. The rest (grid, arguments, the device-side split search, the TMA ring and the page
indices read a chunk ahead, the tail page's masking) is ``_decode_stage1_gluon``'s. bf16 KV.
"""

from __future__ import annotations

from kdash.kernels.decode_gluon import gluon

if gluon is not None:
    from kdash.kernels.decode_gluon import (
        L2_MARKER_ASM,
        ROWS_MAX,
        _after,
        _cta_barrier,
        _device_split_len,
        _issue,
    )
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    @gluon.jit
    def _decode_stage1_t(
        Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
        stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
        stride_ptb, GROUP: gl.constexpr, BLOCK_H: gl.constexpr, HEAD_DIM: gl.constexpr,
        BLOCK_N: gl.constexpr, PAGE: gl.constexpr, STAGES: gl.constexpr,
        DEVICE_PLAN: gl.constexpr, TARGET_VARLEN: gl.constexpr, MIN_SPLIT: gl.constexpr,
        BLOCK_B: gl.constexpr, MAX_SPLITS: gl.constexpr, MERGE: gl.constexpr,
        SEARCH: gl.constexpr, KV_LAYOUT: gl.constexpr, IS_FP8: gl.constexpr = False,
        PT_CHUNK: gl.constexpr = 32, L2_HINT: gl.constexpr = False,
    ):  # fmt: skip
        """Stage 1 of split-KV decode, arguments as ``_decode_stage1_gluon``'s (one warp;
        ``BLOCK_H``: the heads' columns, 8 or 16, at least ``GROUP``)."""
        gl.static_assert(not IS_FP8, "the transposed kernel reads bf16 KV")
        gl.static_assert(GROUP <= BLOCK_H)
        L1: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
        MMA: gl.constexpr = gl.NVMMADistributedLayout(
            version=[2, 0], warps_per_cta=[1, 1], instr_shape=[16, 8]
        )
        A_OP: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B_OP: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        TOK: gl.constexpr = gl.SliceLayout(1, MMA)  # along the rows: tokens, or head dims
        HDS: gl.constexpr = gl.SliceLayout(0, MMA)  # along the columns: query heads
        # V^T of the tail page, loaded plainly so its columns past the end can be zeroed
        VT_BLK: gl.constexpr = gl.BlockedLayout([8, 1], [16, 2], [1, 1], [0, 1])
        ELT: gl.constexpr = 2
        CHUNK: gl.constexpr = PT_CHUNK

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

        offs_h = gl.arange(0, BLOCK_H, layout=HDS)
        offs_d = gl.arange(0, HEAD_DIM, layout=TOK)
        hmask = offs_h < GROUP
        heads = kvh * GROUP + offs_h
        row = (b * q_heads + heads).to(gl.int64) * num_splits + split
        if start >= end:
            gl.store(LSEP + row, gl.full([BLOCK_H], float("-inf"), gl.float32, HDS), mask=hmask)
        else:
            cols = gl.num_programs(1) * HEAD_DIM
            k_desc = tma.make_tensor_descriptor(
                K, [ROWS_MAX, cols], [stride_ks, 1], [PAGE, HEAD_DIM], KV_LAYOUT
            )
            v_desc = tma.make_tensor_descriptor(
                V, [ROWS_MAX, cols], [stride_vs, 1], [PAGE, HEAD_DIM], KV_LAYOUT
            )
            kv_t = K.dtype.element_ty
            k_smem = gl.allocate_shared_memory(kv_t, [STAGES, PAGE, HEAD_DIM], KV_LAYOUT)
            v_smem = gl.allocate_shared_memory(kv_t, [STAGES, PAGE, HEAD_DIM], KV_LAYOUT)
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            for i in gl.static_range(STAGES):
                mbarrier.init(ready.index(i), count=1)
            pt_row = PT + b * stride_ptb
            col = kvh * HEAD_DIM
            if L2_HINT:
                col = _after(col, col, L2_MARKER_ASM)
            n_tiles = gl.cdiv(end - start, PAGE)
            gl.static_assert(STAGES <= CHUNK)
            offs_c = gl.arange(0, CHUNK, layout=L1)
            base = pt_row + start // PAGE
            cur = gl.load(base + offs_c, mask=offs_c < n_tiles, other=0)
            nxt = gl.load(base + CHUNK + offs_c, mask=CHUNK + offs_c < n_tiles, other=0)
            for i in gl.static_range(STAGES):
                if i < n_tiles:
                    page = gl.sum(gl.where(offs_c == i, cur, 0), 0)
                    _issue(k_desc, v_desc, page, k_smem, v_smem, ready, i, col, PAGE, HEAD_DIM,
                           ELT)  # fmt: skip

            # Q^T [D, H] in two halves of D: a query head a column, the padding columns zero.
            # S^T is summed from two independent chains of mma.sync (one a half), not one of
            # eight in a row.
            HALF: gl.constexpr = HEAD_DIM // 2
            offs_dh = gl.arange(0, HALF, layout=TOK)
            q_ptr = Q + b * stride_qb + heads[None, :] * stride_qh + offs_dh[:, None]
            q_lo = gl.load(q_ptr, mask=hmask[None, :], other=0.0)
            q_hi = gl.load(q_ptr + HALF, mask=hmask[None, :], other=0.0)
            q_lo = gl.convert_layout(q_lo.to(gl.bfloat16), B_OP)
            q_hi = gl.convert_layout(q_hi.to(gl.bfloat16), B_OP)
            m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, HDS)
            l_i = gl.zeros([BLOCK_H], gl.float32, HDS)
            acc = gl.zeros([HEAD_DIM, BLOCK_H], gl.float32, MMA)
            offs_t = gl.arange(0, PAGE, layout=TOK)
            offs_vt = gl.arange(0, PAGE, layout=gl.SliceLayout(0, VT_BLK))
            for i in range(n_tiles):
                slot = i % STAGES
                t0 = start + i * PAGE
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                k_slot = k_smem.index(slot)
                k_lo = k_slot.slice(0, HALF, 1).load(A_OP)
                k_hi = k_slot.slice(HALF, HALF, 1).load(A_OP)
                v_t = v_smem.index(slot).permute((1, 0))
                if t0 + PAGE > end:
                    # Slots past the end may hold anything, NaN included: 0 x NaN is NaN.
                    vb = v_t.load(VT_BLK)
                    vb = gl.where((t0 + offs_vt)[None, :] < end, vb, gl.zeros_like(vb))
                    v_op = gl.convert_layout(vb, A_OP)
                else:
                    v_op = v_t.load(A_OP)
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
                    _issue(k_desc, v_desc, page, k_smem, v_smem, ready, slot, col, PAGE, HEAD_DIM,
                           ELT)  # fmt: skip
                zero = gl.zeros([PAGE, BLOCK_H], gl.float32, MMA)
                s = (mma_v2(k_lo, q_lo, zero) + mma_v2(k_hi, q_hi, zero)) * qk_scale
                s = gl.where((t0 + offs_t)[:, None] < end, s, float("-inf"))
                m_new = gl.maximum(m_i, gl.max(s, 0))
                alpha = gl.exp2(m_i - m_new)
                p = gl.exp2(s - m_new[None, :])
                l_i = l_i * alpha + gl.sum(p, 0)
                p_op = gl.convert_layout(p.to(gl.bfloat16), B_OP)
                acc = mma_v2(v_op, p_op, acc * alpha[None, :])
                m_i = m_new
            for i in gl.static_range(STAGES):
                mbarrier.invalidate(ready.index(i))
            l_safe = gl.where(l_i > 0, l_i, 1.0)
            out = acc / l_safe[None, :]
            lse = gl.where(l_i > 0, m_i + gl.log2(l_safe), float("-inf"))
            gl.store(OP + row[None, :] * HEAD_DIM + offs_d[:, None], out, mask=hmask[None, :])
            gl.store(LSEP + row, lse, mask=hmask)
