"""Decode in one launch at any number of waves: persistent programs that take stage-1 work and
then the merge off one counter.

Why: a run of two launches costs ~6 us of host time each on the H200's machine (the driver's
launch, bench/NOTES-kernels.md, session 12), so ``decode_host_us`` <= 10 needs one launch. The
one-launch form of :mod:`kdash.kernels.decode_fused` pays where stage 1 is one wave and its
merge programs are few; with many waves it is 9-40% slower than two launches: every stage-1
program fences before it raises its flags, and its ``B x Hq`` merge programs carry stage 1's
warps and registers, so they run as waves of their own (session 14).

Here the grid is at most what the GPU holds at once, and each program loops over work items
taken off a counter (``COUNTERS[0]``, one atomic add an item): first the stage-1 items, one per
(request, KV head, split) that has tokens (the cut of the two-launch kernels, read from the
lengths in memory; a grid sized for longer lengths has empty splits, which would each cost a
take here), then ``B x Hkv`` merge items, each the query heads of one KV head (a program's items
run one after another, each merge a chain of L2 round trips: fewer, wider items end the launch
sooner). A program counts the stage-1 items it finished and publishes the count once (its
threads' GPU-scope fence, a CTA barrier, one release add to ``COUNTERS[1]``) when it takes its
first merge item or runs out of items; a merge item waits until that sum is every stage-1 item,
then reads the partials from L2. So each program fences once, not once an item, and the merge
runs on programs already resident.

Why it cannot deadlock, whatever the GPU holds at once: items are taken in counter order, so when
a program takes a merge item every stage-1 item has been taken by a program that is running; such
a program finishes its item and, at its next take (a merge item or none), publishes before it can
wait. No program waits on one that has not started, so no co-residency is assumed (unlike a grid
barrier). The last program to finish (``COUNTERS[2]``, an acquire-release add) sets the three
counters back to zero for the next launch or graph replay.

The stage-1 bodies are the two-launch kernels' own where they can be called (fp8:
:func:`kdash.kernels.decode_fp8._fp8_cvt_span`); the bf16 one and the device-side split search are
written again here with the request and KV head as arguments, since those of
:mod:`kdash.kernels.decode_attention` read the grid's program ids (and keep their lines: recorded
GPU profiles point at them). In the interpreter programs run one after another: the first takes
every item and the others find none, so the order of takes and the counts are checked there; the
concurrency only on the GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import mma, to_bf16
from .decode_attention import MAX_DEVICE_PLAN_BATCH, _tile_pages, _wave_split_len
from .decode_fp8 import _fp8_cvt_span
from .decode_fused import _fenced, _pause, merge_chunk

# Whether a plan on the auto rule (decode_plan.FUSED_DEFAULT == "auto") takes this kernel where
# decode_fused's one launch does not pay, instead of two launches. Off until the H200 has timed
# it against two launches at many waves (bench/device_decode_persist.sh).
PERSISTENT_DEFAULT = False
# The register cap a plan gives the fp8 kernel (Triton's maxnreg). Left to itself ptxas gives it
# 192 registers on sm_90, 2 programs an SM against the two-launch fp8 stage 1's 3; at 168 it is 3,
# and its spills (16-48 bytes stored and loaded at the bench's fp8 layouts) are before and after
# the KV loop, none in it (bench/decode_regs_cpu.py with Triton 3.6). The bf16 kernel is left
# alone: 128 (4 an SM) puts spill loads in the loop, and at its 163 (3 an SM) the two-launch
# stage 1 of the 64/8 layout (154) is within 2% of the 32/8 one (120, 4 an SM) on the H200
# (bench/NOTES-kernels.md, session 16).
FP8_MAXNREG = 168
# int32 counters a plan keeps zeroed for the kernel: the next item, stage-1 items published,
# programs finished (and one for alignment).
COUNTERS = 4


def unsupported_reason(tma: bool, is_fp8: bool, cvt: bool, batch: int = 1) -> str | None:
    """Why a plan cannot take this kernel (None: it can): it has bf16 stage 1 and the
    hardware-conversion fp8 one, not the Gluon (TMA) kernels or the other fp8 conversions, and
    reads the whole batch's lengths at once (one lane a request, as the device-side split
    search does)."""
    if batch > MAX_DEVICE_PLAN_BATCH:
        return f"the persistent decode takes at most {MAX_DEVICE_PLAN_BATCH} requests"
    if tma:
        return "the persistent decode runs the Triton stage 1, not the TMA kernels"
    if is_fp8 and not cvt:
        return "the persistent decode takes fp8 only with fp8_compute='cvt'"
    return None


def items(batch: int, kv_heads: int, splits: int) -> int:
    """The most work items of one launch: stage-1 (request, KV head, split), then one merge a
    (request, KV head) for its group of query heads (fewer where requests need fewer splits)."""
    return batch * kv_heads * splits + batch * kv_heads


def programs(capacity: int, batch: int, kv_heads: int, splits: int) -> int:
    """The grid: what the GPU holds at once (``capacity``), never more programs than items."""
    return max(1, min(capacity, items(batch, kv_heads, splits)))


def merge_meta(group: int, head_dim: int) -> dict[str, int]:
    """The merge's constexprs: the group padded to a power of two (``MERGE_H``), and the splits
    a step (``MERGE_S``) that keep a step's tile at decode_fused's chunk of rows (32 at head
    dim 128, 16 below: at most 32 fp32 registers a thread at 4 warps)."""
    h = 1 << max(0, (group - 1).bit_length())
    return {"MERGE_H": h, "MERGE_S": max(1, merge_chunk(head_dim) // h)}


@triton.jit
def _split_len_of(
    LENS,
    batch,
    kv_heads,
    capacity,
    TARGET_VARLEN: tl.constexpr,
    MIN_SPLIT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_B: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    MERGE: tl.constexpr,
    SEARCH: tl.constexpr,
):
    """``decode_attention._device_split_len`` with the batch and KV heads as arguments (the
    grid here is not ``(B, Hkv, splits)``): the same integer arithmetic, so both cut alike."""
    offs = tl.arange(0, BLOCK_B)
    n = tl.load(LENS + offs, mask=offs < batch, other=0)
    total = tl.maximum(tl.sum(n.to(tl.int64), 0), 1)
    longest = tl.maximum(tl.max(n, 0), 1)
    varlen = 2 * batch * longest.to(tl.int64) > 3 * total
    by_work = tl.maximum(tl.cdiv(total * kv_heads, TARGET_VARLEN), MIN_SPLIT)
    by_work = (tl.cdiv(by_work, BLOCK_N) * BLOCK_N).to(tl.int32)
    by_waves = _wave_split_len(
        longest, batch * kv_heads, capacity, BLOCK_N, MIN_SPLIT, MAX_SPLITS, MERGE, SEARCH
    )
    return tl.where(varlen, by_work, by_waves)


@triton.jit
def _request_items(LENS, batch, kv_heads, num_splits, hint, BLOCK_B: tl.constexpr):
    """Per request (a lane each, ``BLOCK_B >= batch``): its stage-1 items (the splits its length
    needs at split length ``hint``, as the two-launch kernels cut it, times the KV heads), and
    their inclusive prefix sum: item ``i`` belongs to the request whose sum first passes ``i``.
    Only splits with tokens are items: a grid sized for the longest request (or, replayed, for
    the longest length allowed) has many empty ones, each of which would cost a take."""
    offs_b = tl.arange(0, BLOCK_B)
    n = tl.load(LENS + offs_b, mask=offs_b < batch, other=0)
    splits = tl.minimum(tl.maximum(tl.cdiv(n, hint), 1), num_splits)
    per = tl.where(offs_b < batch, splits * kv_heads, 0)
    return offs_b, per, tl.cumsum(per, 0)


@triton.jit
def _item_of(LENS, item, batch, kv_heads, num_splits, hint, BLOCK_B: tl.constexpr):
    """``(request, KV head, split)`` of stage-1 item ``item``: requests in order, each one's
    items split-major (KV heads fastest). The lanes are read again at every item (from L1/L2)
    rather than kept across the KV loop, where they would hold registers."""
    offs_b, per, cum = _request_items(LENS, batch, kv_heads, num_splits, hint, BLOCK_B)
    b = tl.sum((cum <= item).to(tl.int32), 0)
    j = item - tl.sum(tl.where(offs_b < b, per, 0), 0)
    return b, j % kv_heads, j // kv_heads


@triton.jit
def _bf16_span(
    Q, K, V, PT, OP, LSEP, qk_scale, stride_qb, stride_qh, stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh, stride_ptb, b, kvh, start, end, row, hmask, heads,
    BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
    EVICT: tl.constexpr, UPCAST: tl.constexpr, PREFETCH: tl.constexpr,
):  # fmt: skip
    """Tokens ``[start, end)`` (not empty) of request ``b`` for KV head ``kvh``'s query heads
    ``heads``: the partial output and log2-domain LSE written to rows ``row`` of ``OP``/``LSEP``.
    The body of ``decode_attention._decode_stage1`` for 16-bit KV."""
    offs_d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)
    pt_row = PT + b * stride_ptb
    offs_t = tl.arange(0, BLOCK_N)
    if PREFETCH:
        page_next = _tile_pages(pt_row, start + offs_t, end, PAGE)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + offs_t
        nmask = offs_n < end
        if PREFETCH:
            page = page_next.to(tl.int64)
            page_next = _tile_pages(pt_row, offs_n + BLOCK_N, end, PAGE)
        else:
            page = _tile_pages(pt_row, offs_n, end, PAGE).to(tl.int64)
        slot = offs_n % PAGE
        kv_off = page[:, None] * stride_kp + slot[:, None] * stride_ks + kvh * stride_kh
        k = tl.load(K + kv_off + offs_d[None, :], mask=nmask[:, None], other=0.0,
                    eviction_policy=EVICT)  # fmt: skip
        vv_off = page[:, None] * stride_vp + slot[:, None] * stride_vs + kvh * stride_vh
        v = tl.load(V + vv_off + offs_d[None, :], mask=nmask[:, None], other=0.0,
                    eviction_policy=EVICT)  # fmt: skip
        qk = mma(q, tl.trans(k), UPCAST) * qk_scale  # log2 domain
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + mma(to_bf16(p, UPCAST), v, UPCAST)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
    tl.store(OP + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=hmask[:, None])
    tl.store(LSEP + row, lse, mask=hmask)


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
    used,
    stride_outb,
    stride_outh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    MERGE_H: tl.constexpr,
    MERGE_S: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """Merge the ``GROUP`` query heads of KV head ``kvh`` of request ``b`` over the ``used``
    splits its length has (every partial is published; rows are ``num_splits`` apart): an
    online softmax over the partial LSEs, ``MERGE_S`` splits of every head (``MERGE_H``, the
    group padded to a power of two) a step, each step's LSEs and partials loaded together from
    L2 (a request of no tokens wrote lse = -inf and no output: it is weighted 0).
    One item a group, not a head: a program's items run one after another, each a chain of L2
    round trips, so fewer and wider items end the launch sooner."""
    offs_g = tl.arange(0, MERGE_H)
    offs_s = tl.arange(0, MERGE_S)
    offs_d = tl.arange(0, HEAD_DIM)
    gmask = offs_g < GROUP
    heads = kvh * GROUP + offs_g
    row0 = (b * q_heads + heads).to(tl.int64) * num_splits  # [H]
    m = tl.full([MERGE_H], float("-inf"), tl.float32)
    den = tl.zeros([MERGE_H], tl.float32)
    acc = tl.zeros([MERGE_H, HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, used, MERGE_S):
        s = s0 + offs_s
        have = gmask[:, None] & (s < used)[None, :]  # [H, S]
        rows = row0[:, None] + s[None, :]
        lse_c = tl.load(LSEP + rows, mask=have, other=float("-inf"), cache_modifier=".cg")
        part = tl.load(
            OP + rows[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=have[:, :, None],
            other=0.0,
            cache_modifier=".cg",
        )
        live = have & (lse_c > float("-inf"))
        part = tl.where(live[:, :, None], part, 0.0)
        m_new = tl.maximum(m, tl.max(lse_c, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.where(live, tl.exp2(lse_c - m_safe[:, None]), 0.0)
        den = den * alpha + tl.sum(w, 1)
        acc = acc * alpha[:, None] + tl.sum(part * w[:, :, None], 1)
        m = m_new
    den_safe = tl.where(den > 0, den, 1.0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    lse_out = tl.where(den > 0, (m_safe + tl.log2(den_safe)) * 0.6931471805599453, -float("inf"))
    tl.store(LSE + b * q_heads + heads, lse_out, mask=gmask)
    out = acc / den_safe[:, None]
    o_ptr = Out + b * stride_outb + heads[:, None] * stride_outh + offs_d[None, :]
    tl.store(o_ptr, to_bf16(out, EMULATE_RTNE), mask=gmask[:, None])


@triton.jit
def _publish(DONE, done, GPU: tl.constexpr):
    """Add this program's count of finished stage-1 items to ``DONE``, after its partials: every
    thread's GPU-scope fence, a CTA barrier, then one release add."""
    n = _fenced(done, GPU)
    tl.debug_barrier()
    tl.atomic_add(DONE, n, sem="release", scope="gpu")


# The runtime sizes are not specialised: one compiled kernel serves every batch of a layout.
@triton.jit(do_not_specialize=["capacity", "num_splits", "batch", "kv_heads"])
def _decode_persistent(
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
    COUNTERS,
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
    batch,
    kv_heads,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE: tl.constexpr,
    IS_FP8: tl.constexpr,
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
    MERGE_H: tl.constexpr,
    MERGE_S: tl.constexpr,
    POLL_NS: tl.constexpr = 64,
):
    """Grid ``(P,)``, ``P`` at most the programs resident at once. Arguments as
    ``decode_fused._decode_fused``'s (fp8: int16-pair strides and ``decode_fp8``'s conversion),
    ``COUNTERS`` in place of its flags (int32 ``[4]``, zero before the launch and after it),
    then the batch size and KV heads; ``MERGE_H``/``MERGE_S`` from :func:`merge_meta`."""
    q_heads = kv_heads * GROUP
    if DEVICE_PLAN:
        hint = _split_len_of(
            LENS, batch, kv_heads, capacity, TARGET_VARLEN, MIN_SPLIT, BLOCK_N, BLOCK_B,
            MAX_SPLITS, MERGE, SEARCH,
        )  # fmt: skip
    else:
        hint = split_len_hint
    n_stage1 = tl.sum(_request_items(LENS, batch, kv_heads, num_splits, hint, BLOCK_B)[1], 0)
    n_items = n_stage1 + batch * kv_heads
    offs_h = tl.arange(0, BLOCK_H)
    hmask = offs_h < GROUP
    done = 0
    unpublished = 1
    item = tl.atomic_add(COUNTERS, 1, sem="relaxed", scope="gpu")
    while item < n_items:
        # The next take, before this item's work. Triton hands a scalar atomic's result to
        # every thread through shared memory behind a barrier, so the program still waits for
        # it here; an asynchronous take (one thread's inline atom, read after the item) is the
        # refinement to try if the H200 shows the takes.
        nxt = tl.atomic_add(COUNTERS, 1, sem="relaxed", scope="gpu")
        if item < n_stage1:
            b, kvh, split = _item_of(LENS, item, batch, kv_heads, num_splits, hint, BLOCK_B)
            seq_len = tl.load(LENS + b)
            n_here = tl.minimum(tl.maximum(tl.cdiv(seq_len, hint), 1), num_splits)
            split_len = tl.cdiv(tl.cdiv(seq_len, n_here), BLOCK_N) * BLOCK_N
            start = split * split_len
            end = tl.minimum(start + split_len, seq_len)
            heads = kvh * GROUP + offs_h
            row = (b * q_heads + heads).to(tl.int64) * num_splits + split
            if start < end:
                if IS_FP8:
                    _fp8_cvt_span(
                        Q, K, V, PT, KS, VS, OP, LSEP, qk_scale, stride_qb, stride_qh,
                        stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                        stride_ptb, b, kvh, start, end, row, hmask, heads, BLOCK_H, HEAD_DIM,
                        BLOCK_N, PAGE, EVICT, ASM, UPCAST, PREFETCH,
                    )  # fmt: skip
                else:
                    _bf16_span(
                        Q, K, V, PT, OP, LSEP, qk_scale, stride_qb, stride_qh, stride_kp,
                        stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, b, kvh,
                        start, end, row, hmask, heads, BLOCK_H, HEAD_DIM, BLOCK_N, PAGE, EVICT,
                        UPCAST, PREFETCH,
                    )  # fmt: skip
            else:
                # A request of no tokens: its one split says so (lse = -inf, weighed as zero).
                tl.store(LSEP + row, float("-inf"), mask=hmask)
            done += 1
        else:
            if unpublished:
                _publish(COUNTERS + 1, done, not UPCAST)
                unpublished = 0
            seen = tl.load(COUNTERS + 1, volatile=True)
            while seen < n_stage1:
                wait = _pause(seen - seen, POLL_NS, not UPCAST)
                seen = tl.load(COUNTERS + 1 + wait, volatile=True)
            # Every partial is out; the fence's result feeds the loads' addresses, so none is
            # issued before it.
            m = item - n_stage1 + _fenced(seen - seen, not UPCAST)
            b = m // kv_heads
            used = tl.minimum(tl.maximum(tl.cdiv(tl.load(LENS + b), hint), 1), num_splits)
            _merge_group(
                OP, LSEP, Out, LSE, b, m % kv_heads, q_heads, num_splits, used, stride_outb,
                stride_outh, GROUP, HEAD_DIM, MERGE_H, MERGE_S, UPCAST,
            )  # fmt: skip
        item = nxt
    if unpublished:
        _publish(COUNTERS + 1, done, not UPCAST)
    # Every take and publish of this program comes before its finish (acquire-release), so the
    # last program to finish may zero the counters: nobody reads them again in this launch.
    finished = tl.atomic_add(COUNTERS + 2, 1, sem="acq_rel", scope="gpu")
    if finished == tl.num_programs(0) - 1:
        tl.store(COUNTERS, 0)
        tl.store(COUNTERS + 1, 0)
        tl.store(COUNTERS + 2, 0)
