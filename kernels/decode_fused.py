"""Flash-decoding in one launch: stage 1's split-KV partials, merged while stage 1 still runs.

The two-launch form (:mod:`kdash.kernels.decode_attention`) writes every split's unnormalised
output and log-sum-exp, then a second kernel merges them after a launch gap. Here the grid has
``GROUP`` more slices along its split axis, one merge program per (request, query head); the
stage-1 program body is run unchanged (the very ``@triton.jit`` functions of that module,
inlined, so their source lines are the ones a profile of either form points at). The hardware
hands out a grid's programs in order of their linear index, the split axis slowest, so every
stage-1 program has started before any merge program takes a slot: a merge program waits only
on programs that are running, never on one that needs its slot.

Each stage-1 program publishes its partial by raising one flag per query head
(``FLAGS[b, head, split]``) after its stores: a CTA barrier, then a GPU-scope release exchange
(a release is cumulative: it publishes what the barrier ordered before it, every thread's
stores, as cooperative groups' grid sync relies on). A merge program walks its head's splits
``CHUNK`` at a time in split order (later splits finish last), waits until a chunk's flags are
all up (GPU-scope acquire loads, a short sleep between reads), and folds the chunk into a
running maximum, denominator and output (the online softmax over partial LSEs). With no fence
on either side the chain after the last stage-1 program is shorter than the fenced form's by
0.8-1.5 us a step. When the last split finishes
only its own chunk is left to merge. The merge program lowers its flags when done (lowering
each chunk's flags inside the merge loop hung on the H200: not understood, not kept), so the
next launch, or the next replay of a CUDA graph holding this one, starts from zero: the plan
zeroes them once, when it makes them.

The earlier one-launch form merged a (request, KV head) in the last of its programs to finish
(a ticket counter): the whole merge ran after the slowest split, a serial chain of L2 round
trips by one program, ~7 us slower than two launches at every long shape on the H200
(bench/NOTES-kernels.md, session 14).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import to_bf16
from .decode_attention import _decode_stage1, _decode_stage1_fp8_pairs
from .decode_fp8 import _decode_stage1_fp8_cvt

# The fenced publish and poll (a GPU-scope fence in every stage-1 thread, volatile polls and a
# fence after them) in place of the default's release and acquire: the bench's --fenced-merge,
# for an A/B on one machine (plans made after the switch take it).
FENCED_MERGE = False

# Stage 1's query-head mask built from an opaque value (decode_attention._decode_stage1's
# OPAQUE_HEADS) in one-launch plans made after the switch (the bench's --opaque-heads): 128
# registers at 32/8 with the L2 hint, 4 programs an SM, where the known mask takes 155 (3 an
# SM). Off: the H100 runs 32/8 0.7-1.3 us slower replayed at 4 an SM (bench/NOTES-kernels.md,
# session 31); the H200, whose key 32/8 sets, is not measured yet.
OPAQUE_HEADS = False


# Tiles of each split's K and V that a one-launch bf16 plan made after the switch asks L2 for
# before stage 1 starts (the bench's --warm-tiles; 0: none): the page-table read for the split's
# first tokens goes out beside the lengths' read instead of after it and the split search, and
# the tiles' lines are on their way when the software pipeline asks for them. Two: on an H100
# the 1 x 64k and 1 x 128k steps ran 2.5-3.8 us faster replayed and 1.1-2.1 us by do_bench,
# outputs bit for bit the same; four lost at 64/8 (bench/NOTES-kernels.md, session 34).
WARM_TILES = 2

# The same for one-launch fp8 pair plans (the bench's --warm-tiles-fp8): their tiles are 128
# tokens of one 128-byte line a row at head size 128, read as int16 pairs. Off: on an H100 two
# tiles made 1 x 64k and 1 x 128k steps 2.0-2.9 us faster replayed but 0.2-0.8 us slower by
# do_bench, which fp8_speedup counts (bench/NOTES-kernels.md, session 35).
WARM_TILES_FP8 = 0


def merge_chunk(head_dim: int) -> int:
    """Splits a merge program folds per step. On the H200 at 1 x 64k (64 splits) 32 left no
    tail past two launches, 16 cost 2.5 us and 8 cost 9 (each step waits on its own flags, then
    reads from L2; bench/results/decode-overlap-h200.json)."""
    return 32 if head_dim >= 128 else 16


@triton.jit
def _after(x, y, ASM: tl.constexpr, GPU: tl.constexpr):
    """``x``, once every thread of the program has run the PTX ``ASM`` (``$2`` is ``y``) on the
    GPU; the interpreter runs one program at a time and has nothing to order or wait for. The
    result carries the dependence, so what is computed from it comes after."""
    if GPU:
        return tl.inline_asm_elementwise(
            asm=ASM, constraints="=r,r,r", args=[x, y], dtype=tl.int32, is_pure=False, pack=1
        )
    else:
        return x


@triton.jit
def _fenced(x, GPU: tl.constexpr):
    """``x`` after a GPU-scope acquire-release fence (scalars are computed by every thread, so
    each one fences)."""
    return _after(x, x, "fence.acq_rel.gpu;\n\tmov.b32 $0, $1;", GPU)


@triton.jit
def _flags_up(FLAGS, row0, s, have, GPU: tl.constexpr, ACQUIRE: tl.constexpr):
    """The flags of splits ``s`` (1 where ``have`` is off): a volatile load, or with
    ``ACQUIRE`` a GPU-scope acquire load, after which this thread's later loads see what the
    flag's release published (no separate fence)."""
    if GPU and ACQUIRE:
        # A lane past the last split reads the first split's flag (always a valid address).
        ptrs = FLAGS + tl.where(have, row0 + s, row0)
        up = tl.inline_asm_elementwise(
            asm="ld.acquire.gpu.global.b32 $0, [$1];",
            constraints="=r,l",
            args=[ptrs],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
        return tl.where(have, up, 1)
    else:
        return tl.load(FLAGS + row0 + s, mask=have, other=1, volatile=True)


@triton.jit
def _pause(x, NS: tl.constexpr, GPU: tl.constexpr):
    """``x`` after a sleep of about ``NS`` ns."""
    return _after(x, tl.full([], NS, tl.int32), "nanosleep.u32 $2;\n\tmov.b32 $0, $1;", GPU)


@triton.jit
def _now(x):
    """The GPU's nanosecond clock (``%globaltimer``), read once ``x`` is computed."""
    return tl.inline_asm_elementwise(
        asm="mov.u64 $0, %globaltimer;", constraints="=l,r", args=[x], dtype=tl.int64,
        is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _stamp(FLAGS, b, kvh, z, num_splits, q_heads, GROUP: tl.constexpr, t0, t1, t2):
    """A program's clock readings and its SM, 4 int64 past the flags (the buffer is made that
    much longer by whoever asks for STAMP; bench/gpu_decode_stamps.py)."""
    n_flags = tl.num_programs(0) * q_heads * num_splits
    prog = (b * tl.num_programs(1) + kvh) * (num_splits + GROUP) + z
    at = FLAGS.to(tl.pointer_type(tl.int64)) + (n_flags + 1) // 2 + prog.to(tl.int64) * 4
    sm = tl.inline_asm_elementwise(
        asm="mov.u32 $0, %smid;", constraints="=r,r", args=[b], dtype=tl.int32, is_pure=False,
        pack=1,
    )  # fmt: skip
    offs = tl.arange(0, 4)
    vals = tl.where(offs == 0, t0, tl.where(offs == 1, t1, tl.where(offs == 2, t2, sm)))
    tl.store(at + offs, vals)


@triton.jit
def _warm(
    K, V, PT, LENS, b, kvh, z, split_len_hint, stride_kp, stride_ks, stride_kh, stride_vp,
    stride_vs, stride_vh, stride_ptb, TOKENS: tl.constexpr, LINES: tl.constexpr,
    LINE: tl.constexpr, PAGE: tl.constexpr, PAIRS: tl.constexpr = False,
):  # fmt: skip
    """An L2 prefetch of the first ``TOKENS`` tokens' K and V rows of split ``z`` (``LINES``
    lines of ``LINE`` elements a row), where the plan's split length puts them. ``PAIRS``: fp8
    caches whose strides are in int16 units, read as the pair kernels read them (a line is then
    ``LINE // 2`` pairs).

    Stage 1 finds its start only after the lengths' read and the split search, then reads the
    page table, then the tiles: three dependent trips before the first byte of K streams, with
    every program waiting on them at once. Here the page-table read goes out beside the lengths'
    read, from the split length the plan computed on the host (the one the lengths it was made
    for give; where a replay's lengths cut elsewhere, only the prefetch is wasted). A token
    past the request's length is not fetched (its page entry may be anything); the page-table
    read stays inside its row.
    """
    if PAIRS:
        K = K.to(tl.pointer_type(tl.int16), bitcast=True)
        V = V.to(tl.pointer_type(tl.int16), bitcast=True)
    seq_len = tl.load(LENS + b)
    offs = z * split_len_hint + tl.arange(0, TOKENS)
    idx = offs // PAGE
    page = tl.load(PT + b * stride_ptb + idx, mask=idx < stride_ptb, other=0).to(tl.int64)
    ok = (offs < seq_len).to(tl.int32)[:, None] + tl.zeros([TOKENS, LINES], tl.int32)
    at = (offs % PAGE)[:, None] + tl.zeros([TOKENS, LINES], tl.int64)
    line = (tl.arange(0, LINES) * (LINE // 2 if PAIRS else LINE))[None, :]
    k_at = K + page[:, None] * stride_kp + at * stride_ks + kvh * stride_kh + line
    v_at = V + page[:, None] * stride_vp + at * stride_vs + kvh * stride_vh + line
    _prefetch_l2(k_at, ok)
    _prefetch_l2(v_at, ok)


@triton.jit
def _prefetch_l2(ptrs, ok):
    """``prefetch.global.L2`` of each of ``ptrs`` where ``ok`` is non-zero."""
    tl.inline_asm_elementwise(
        asm="{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.b32 $0, 0; }",
        constraints="=r,l,r", args=[ptrs, ok], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _merge_online(
    OP,
    LSEP,
    Out,
    LSE,
    FLAGS,
    b,
    head,
    q_heads,
    num_splits,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    POLL_NS: tl.constexpr,
    GPU: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
    ACQUIRE: tl.constexpr = False,
):
    """Merge head ``head`` of request ``b`` over its splits as their flags come up."""
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    row0 = (b * q_heads + head).to(tl.int64) * num_splits
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        s = s0 + offs_c
        have = s < num_splits
        up = _flags_up(FLAGS, row0, s, have, GPU, ACQUIRE)
        while tl.min(up, 0) == 0:
            wait = _pause(tl.min(up, 0), POLL_NS, GPU)
            up = _flags_up(FLAGS, row0 + wait, s, have, GPU, ACQUIRE)
        # The flags seen up, then (volatile polls) a GPU-scope fence, then the partials (from
        # L2, past L1): the loads' addresses come from the flags (and the fence's result), so
        # none is issued before them.
        seen = tl.min(up, 0)
        if not ACQUIRE:
            seen = _fenced(seen, GPU)
        base = seen - 1 + row0
        # Both loads at once (one round trip): an empty split wrote no partial output, so what
        # its row holds is dropped by the select below, never weighted.
        lse_c = tl.load(LSEP + base + s, mask=have, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            OP + (base + s)[:, None] * HEAD_DIM + offs_d[None, :],
            mask=have[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m, den, acc = fold_chunk(m, den, acc, lse_c, part, have)
    # This program is the flags' only reader: lowering them readies the next launch.
    for s0 in range(0, num_splits, CHUNK):
        tl.store(FLAGS + row0 + s0 + offs_c, 0, mask=s0 + offs_c < num_splits)
    out_at = Out + b * stride_outb + head * stride_outh + offs_d
    store_merged(m, den, acc, LSE + b * q_heads + head, out_at, EMULATE_RTNE)


@triton.jit
def fold_chunk(m, den, acc, lse_c, part, have):
    """``(m, den, acc)`` with a chunk of splits folded in: the online softmax over their log2
    LSEs ``lse_c`` and outputs ``part`` (a split with no keys, LSE -inf, weighs nothing and
    its row is not read)."""
    live = have & (lse_c > float("-inf"))
    part = tl.where(live[:, None], part, 0.0)
    m_new = tl.maximum(m, tl.max(lse_c, 0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m - m_safe)
    w = tl.where(live, tl.exp2(lse_c - m_safe), 0.0)
    den = den * alpha + tl.sum(w, 0)
    acc = acc * alpha + tl.sum(part * w[:, None], 0)
    return m_new, den, acc


@triton.jit
def store_merged(m, den, acc, lse_at, out_at, EMULATE_RTNE: tl.constexpr):
    """The merged output (bf16) at ``out_at`` and its natural-log LSE at ``lse_at``."""
    den_safe = tl.where(den > 0, den, 1.0)
    out = acc / den_safe
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse_out = tl.where(den > 0, (m_safe + tl.log2(den_safe)) * 0.6931471805599453, -float("inf"))
    tl.store(lse_at, lse_out)
    tl.store(out_at, to_bf16(out, EMULATE_RTNE))


# num_splits is not specialised: folded in as the constant 1, it let LLVM move the merge's
# address math into stage 1's registers (more registers, fewer programs an SM).
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
    FLAGS,
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
    CHUNK: tl.constexpr,
    CVT: tl.constexpr = False,
    POLL_NS: tl.constexpr = 64,
    KMMA: tl.constexpr = False,
    KV_SAME: tl.constexpr = False,
    PUBLISH_FENCE: tl.constexpr = False,
    ACQUIRE_POLL: tl.constexpr = True,
    STAMP: tl.constexpr = False,
    OPAQUE_HEADS: tl.constexpr = False,
    WARM: tl.constexpr = 0,
    WARM_LINES: tl.constexpr = 1,
):
    """Grid ``(B, Hkv, num_splits + GROUP)``: stage 1 for split ``z < num_splits``, else the
    merge of query head ``kvh * GROUP + z - num_splits``. ``FLAGS``: ``[B, Hq, num_splits]``
    int32, zero before the launch and after it. By default the CTA barrier and the flags'
    release (cumulative) publish the partials and the merge polls with acquire loads, no fence
    on either side; ``PUBLISH_FENCE`` adds a GPU-scope fence in every stage-1 thread before the
    barrier and ``ACQUIRE_POLL=False`` polls with volatile loads and fences after them, the
    form before session 23, 0.8-1.5 us slower a step on an H100
    (bench/results/decode-publish-h100-s23.json). ``STAMP`` (a diagnostic, GPU only): every
    program writes when it started, when its stage 1 or merge was done and when it finished, and
    its SM, past the flags (:func:`_stamp`). ``OPAQUE_HEADS``: see :data:`OPAQUE_HEADS`.
    ``WARM`` tiles of each split asked of L2 first (:func:`_warm`, :data:`WARM_TILES`,
    :data:`WARM_TILES_FP8`)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    z = tl.program_id(2)
    kv_heads = tl.num_programs(1)
    q_heads = kv_heads * GROUP
    if STAMP:
        t_start = _now(b)
        t_mid = t_start
    if z < num_splits:
        if WARM > 0 and not UPCAST:
            _warm(
                K, V, PT, LENS, b, kvh, z, split_len_hint, stride_kp, stride_ks, stride_kh,
                stride_vp, stride_vs, stride_vh, stride_ptb, WARM * BLOCK_N, WARM_LINES,
                HEAD_DIM // WARM_LINES, PAGE, PAIRS,
            )  # fmt: skip
        if PAIRS and CVT:
            _decode_stage1_fp8_cvt(
                Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                capacity, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp,
                stride_vs, stride_vh, stride_ptb, GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT,
                ASM, UPCAST, PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B,
                MAX_SPLITS, MERGE, SEARCH, KMMA, KV_SAME,
            )  # fmt: skip
        elif PAIRS:
            _decode_stage1_fp8_pairs(
                Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                capacity, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp,
                stride_vs, stride_vh, stride_ptb, GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT,
                ASM, UPCAST, PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT, BLOCK_B,
                MAX_SPLITS, MERGE, SEARCH,
            )  # fmt: skip
        else:
            _decode_stage1(
                Q, K, V, PT, LENS, KS, VS, OP, LSEP, qk_scale, num_splits, split_len_hint,
                capacity, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh, stride_vp,
                stride_vs, stride_vh, stride_ptb, GROUP, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE,
                IS_FP8, FP8_FP16, EVICT, UPCAST, PREFETCH, DEVICE_PLAN, TARGET_VARLEN, MIN_SPLIT,
                BLOCK_B, MAX_SPLITS, MERGE, SEARCH, OPAQUE_HEADS,
            )  # fmt: skip
        if STAMP:
            t_mid = _now(b)
        # Every thread's partial stores, (its GPU-scope fence,) the CTA barrier, then the
        # flags (release, cumulative over what the barrier ordered before it): a merge program
        # that sees a flag up sees the partial.
        offs_h = tl.arange(0, BLOCK_H)
        base = b * q_heads + kvh * GROUP
        if PUBLISH_FENCE:
            base = _fenced(base, not UPCAST)
        else:
            # Opaque all the same: computed before stage 1, the flags' addresses would hold
            # registers through it (118 -> 154-157 at 32/8 and 64/8 on sm_90).
            base = _after(base, base, "mov.b32 $0, $1;", not UPCAST)
        tl.debug_barrier()
        rows = (base + offs_h).to(tl.int64) * num_splits + z
        ones = tl.full([BLOCK_H], 1, tl.int32)
        tl.atomic_xchg(FLAGS + rows, ones, mask=offs_h < GROUP, sem="release", scope="gpu")
    else:
        _merge_online(
            OP,
            LSEP,
            Out,
            LSE,
            FLAGS,
            b,
            kvh * GROUP + z - num_splits,
            q_heads,
            num_splits,
            stride_outb,
            stride_outh,
            HEAD_DIM,
            CHUNK,
            POLL_NS,
            not UPCAST,
            UPCAST,
            ACQUIRE_POLL,
        )
    if STAMP:
        _stamp(FLAGS, b, kvh, z, num_splits, q_heads, GROUP, t_start, t_mid, _now(b))
