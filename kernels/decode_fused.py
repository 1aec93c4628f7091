"""Flash-decoding in one launch: stage 1's split-KV partials, merged by the last split to finish.

The two-launch form (:mod:`kdash.kernels.decode_attention`) writes every split's unnormalised
output and log-sum-exp, then a second kernel merges them. Here the stage-1 program body is run
unchanged (the very ``@triton.jit`` functions of that module, inlined, so their source lines are
the ones a profile of either form points at) and each program then takes a ticket from a counter
of its (request, KV head); the program that draws the last ticket has every partial of that
pair in memory and merges them for the pair's query heads. It resets the counter to zero, so the
next run, or the next replay of a CUDA graph holding this launch, starts from zero again: the
counters are zeroed once, when the plan makes them.

Memory ordering: each program's partial stores come before its ticket (every thread fences at
GPU scope, then a CTA barrier, then the one atomic, itself acquire-release at GPU scope), and
the merging program's loads of the others' partials come after its ticket and bypass L1
(``.cg``), so no line cached on its SM by an earlier run is read.
One launch saves the host a second launch per decode call and the GPU the gap between the two
kernels; the merge itself is the same arithmetic as stage 2's, run by one program per
(request, KV head) over the group's heads instead of one program per query head.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import to_bf16
from .decode_attention import _decode_stage1, _decode_stage1_fp8_pairs
from .decode_fp8 import _decode_stage1_fp8_cvt


def merge_chunk(block_s: int, head_dim: int) -> int:
    """Splits merged per step (never more than the tile holds). Picked from sm_90 compiles on
    the CPU (bench/decode_regs_cpu.py): at 32 for head_dim 128 the fused kernel keeps stage 1's
    programs per SM at 32/8/128 (Triton 3.6, the H200's: bf16 127 registers against 120, 4 an
    SM; fp8 pairs 156 against 146, 3), where 16 and 64 took bf16 to 136-150 (3 an SM)."""
    return max(1, min(block_s, 32 if head_dim >= 128 else 16))


@triton.jit
def _fenced(x, GPU: tl.constexpr):
    """``x``, after every thread of the program has run a GPU-scope acquire-release fence (on the
    GPU; the interpreter runs one program at a time and has nothing to order). Scalars are
    computed by every thread, so each one fences; the result carries the dependence on it."""
    if GPU:
        return tl.inline_asm_elementwise(
            asm="fence.acq_rel.gpu;\n\tmov.b32 $0, $1;",
            constraints="=r,r",
            args=[x],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
    else:
        return x


@triton.jit
def _merge_group(
    OP,
    LSEP,
    Out,
    LSE,
    b,
    kvh,
    q_heads,
    num_splits,
    stride_outb,
    stride_outh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """Stage 2's merge for the ``GROUP`` query heads of KV head ``kvh`` of request ``b``.

    All partial LSEs of the group in one load ([BLOCK_H, BLOCK_S]) give each head's maximum and
    denominator (and the final LSEs), and which splits did work: a request's working splits are
    the first ones (split ``s`` starts at ``s`` split lengths), each with a finite LSE, the rest
    wrote -inf. Then per head, ``CHUNK`` splits a step, the weights and the partial outputs are
    loaded side by side (the mask is known), from L2. The weights are reloaded per step rather
    than picked out of the group's tile in registers: picking them out took the bf16 kernel
    from 112 to 156-159 registers on sm_90 (3 programs an SM instead of 4); recomputing the
    request's cut here instead took it to 160 with Triton 3.6 (its loads and search were
    merged with stage 1's, kept alive across the KV loop).
    """
    offs_h = tl.arange(0, BLOCK_H)
    offs_s = tl.arange(0, BLOCK_S)
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    hmask = offs_h < GROUP
    smask = offs_s < num_splits
    rows0 = (b * q_heads + kvh * GROUP + offs_h).to(tl.int64) * num_splits
    lse = tl.load(
        LSEP + rows0[:, None] + offs_s[None, :],
        mask=hmask[:, None] & smask[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )
    n_live = tl.max(tl.max(tl.where(lse > float("-inf"), offs_s[None, :] + 1, 0), 1), 0)
    m = tl.max(lse, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    denom = tl.sum(tl.where(smask[None, :], tl.exp2(lse - m_safe[:, None]), 0.0), 1)
    denom_safe = tl.where(denom > 0, denom, 1.0)
    lse_out = tl.where(
        denom > 0, (m_safe + tl.log2(denom_safe)) * 0.6931471805599453, -float("inf")
    )
    tl.store(LSE + b * q_heads + kvh * GROUP + offs_h, lse_out, mask=hmask)
    for g in range(GROUP):
        m_g = tl.sum(tl.where(offs_h == g, m_safe, 0.0), 0)
        d_g = tl.sum(tl.where(offs_h == g, denom_safe, 0.0), 0)
        row0 = (b * q_heads + kvh * GROUP + g).to(tl.int64) * num_splits
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for s0 in range(0, num_splits, CHUNK):
            s = s0 + offs_c
            # An empty split wrote no partial output (only its -inf LSE): never read it.
            live = s < n_live
            lse_c = tl.load(LSEP + row0 + s, mask=live, other=float("-inf"), cache_modifier=".cg")
            part = tl.load(
                OP + (row0 + s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=live[:, None],
                other=0.0,
                cache_modifier=".cg",
            )
            w_c = tl.where(live, tl.exp2(lse_c - m_g), 0.0)
            acc += tl.sum(part * w_c[:, None], 0)
        out = acc / d_g
        o_ptr = Out + b * stride_outb + (kvh * GROUP + g) * stride_outh + offs_d
        tl.store(o_ptr, to_bf16(out, EMULATE_RTNE))


# num_splits is not specialised either: folded in as the constant 1, it let LLVM move the merge
# into stage 1's registers (158 with Triton 3.6 at 32/8/128 bf16, 3 programs an SM; 127 as a
# runtime value, 4).
@triton.jit(do_not_specialize=["capacity", "num_splits"])
def _decode_fused(
    Q,
    K,
    V,
    PT,
    LENS,
    KS,
    VS,
    OP,
    LSEP,
    Out,
    LSE,
    TICKETS,
    qk_scale,
    num_splits,
    split_len_hint,
    capacity,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_outb,
    stride_outh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    PAIRS: tl.constexpr,
    IS_FP8: tl.constexpr,
    FP8_FP16: tl.constexpr,
    ASM: tl.constexpr,
    EVICT: tl.constexpr,
    UPCAST: tl.constexpr,
    PREFETCH: tl.constexpr,
    DEVICE_PLAN: tl.constexpr,
    TARGET_VARLEN: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MERGE: tl.constexpr,
    SEARCH: tl.constexpr,
    BLOCK_S: tl.constexpr,
    CHUNK: tl.constexpr,
    CVT: tl.constexpr = False,
):
    """Stage 1 for one (request, KV head, split), then, for the last split of the pair to
    finish, the merge. ``TICKETS``: ``[B, Hkv]`` int32, zero before the launch and after it."""
    if PAIRS and CVT:  # decode_fp8's candidate: the same pairs, the hardware conversion
        _decode_stage1_fp8_cvt(
            Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_ptb, GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT, ASM, UPCAST,
            PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS, MERGE, SEARCH,
        )  # fmt: skip
    elif PAIRS:
        _decode_stage1_fp8_pairs(
            Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_ptb, GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT, ASM, UPCAST,
            PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS, MERGE, SEARCH,
        )  # fmt: skip
    else:
        _decode_stage1(
            Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint, capacity,
            stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs,
            stride_vh, stride_ptb, GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, IS_FP8, FP8_FP16,
            EVICT, UPCAST, PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B, MAX_SPLITS,
            MERGE, SEARCH,
        )  # fmt: skip
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    kv_heads = tl.num_programs(1)
    # Every thread's partial stores are ordered before the ticket at GPU scope: its own fence,
    # then the CTA barrier, then the one atomic (itself a release) taken for the program.
    pair = _fenced(b * kv_heads + kvh, not UPCAST)
    ticket = TICKETS + pair
    tl.debug_barrier()
    done = tl.atomic_add(ticket, 1, sem="acq_rel", scope="gpu")
    if done == num_splits - 1:
        tl.store(ticket, 0)
        _merge_group(
            OP,
            LSEP,
            Out,
            LSE,
            # From the fence's result, which the compiler cannot see through: the merge's
            # address math then stays after the KV loop instead of being hoisted ahead of it
            # and kept in registers across it.
            pair // kv_heads,
            pair % kv_heads,
            kv_heads * GROUP,
            num_splits,
            stride_outb,
            stride_outh,
            GROUP,
            BLOCK_H,
            HEAD_DIM,
            BLOCK_S,
            CHUNK,
            UPCAST,
        )
