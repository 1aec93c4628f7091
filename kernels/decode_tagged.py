"""The two-launch decode's merge over tagged partials, launched before stage 1 ends.

In the two-launch form the merge kernel starts after stage 1's last program has finished and
its writes are flushed: a launch's edges and the merge's own ramp follow the slowest split. Here
stage 1 (``_decode_stage1`` with ``TAGGED``) stores every partial value as one int64, the value's
fp32 bits under this launch's tag (:func:`kdash.kernels._common.store`), and lets the merge
launch as soon as its own programs have started (``griddepcontrol.launch_dependents``); the
merge is launched with programmatic dependent launch and never waits for the grid: it polls the
LSEs until every one of a chunk of splits carries the tag it expects, then reads the chunk's
partials, so its programs take the slots stage 1's programs leave during stage 1's tail and
read the last split's partial two round trips after it is stored. A stale value (the last
launch's) carries the last tag and is never taken. The tag a merge program expects is one more
than ``EP[b, head]``, which it alone reads and raises at its end; stage 1 takes one more than
the tag its own LSE slot holds, and both move by one a launch (every slot is written every
launch, an empty split's LSE included).

Off by default (``TAGGED_DEFAULT``; the bench's ``--tagged-two``): right on an H100 but slower
there than the plain two launches, 3-5 us a step replayed (bench/NOTES-kernels.md, session 32).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import tag_of, tagged_value
from .decode_fused import _pause, fold_chunk, store_merged

# Two-launch bf16 plans made after the switch merge tagged partials (the bench's --tagged-two).
TAGGED_DEFAULT = False
CHUNK = 32  # splits a merge program reads at once (its own registers: stage 1's are apart)
POLL_NS = 64
# Polls of a chunk before a merge program gives up on it and writes NaN, on the GPU (about a
# second); in the interpreter, which runs stage 1 to its end first, two.
MAX_POLLS = 1 << 20
# The merge launched with programmatic dependent launch (off: after stage 1, as the plain merge
# is; the tags then only check what the grid boundary already ensures).
PDL = True


@triton.jit
def _lse_missing(lp, rows, have, tag):
    """How many of the chunk's LSEs do not carry ``tag`` yet (volatile loads, past L1)."""
    lt = tl.load(lp + rows, mask=have, other=0, volatile=True)
    return tl.sum((have & (tag_of(lt) != tag)).to(tl.int32), 0)


@triton.jit
def _read(lp, op, rows, offs_d, have, tag, HEAD_DIM: tl.constexpr):
    """``(lse, out, short)``: the chunk's LSEs and output rows as values, each NaN where its
    tag is not ``tag`` (an empty split's LSE -inf, its output row never weighed), and how many
    rows are short: an LSE, or an output value of a split with keys, not under ``tag``."""
    lt = tl.load(lp + rows, mask=have, other=0, volatile=True)
    ot = tl.load(
        op + rows[:, None] * HEAD_DIM + offs_d[None, :],
        mask=have[:, None],
        other=0,
        volatile=True,
    )
    l_in = tag_of(lt) == tag
    lse = tl.where(have, tl.where(l_in, tagged_value(lt), float("nan")), float("-inf"))
    o_in = tag_of(ot) == tag
    out = tl.where(o_in, tagged_value(ot), float("nan"))
    live = have & l_in & (lse > float("-inf"))
    o_short = tl.sum((live[:, None] & (o_in == 0)).to(tl.int32), 1) > 0
    short = tl.sum((have & (l_in == 0)).to(tl.int32), 0) + tl.sum(o_short.to(tl.int32), 0)
    return lse, out, short


@triton.jit
def _decode_merge_tagged(
    OP,
    LSEP,
    Out,
    LSE,
    EP,
    num_splits,
    stride_outb,
    stride_outh,
    HEAD_DIM: tl.constexpr,
    CHUNK: tl.constexpr,
    POLL_NS: tl.constexpr,
    MAX_POLLS: tl.constexpr,
    GPU: tl.constexpr,
    EMULATE_RTNE: tl.constexpr,
):
    """Grid ``(B, Hq)``: head ``h`` of request ``b`` over its splits, ``CHUNK`` at a time: the
    chunk's LSEs polled until every one carries the tag, then the LSEs and output rows read
    (:func:`_read`, again while an output value of a split with keys is not under the tag),
    then folded in split order (the result does not depend on which split finished first).
    Only counts cross a poll: on the GPU, polls that carried the partials and a mask of the
    rows still missing lost rows now and then, and values read beside their tags in one poll
    could be older than the tags (session 32). A chunk still short after
    ``MAX_POLLS`` polls makes the output NaN: a bug shows as a wrong result, never as a
    hang."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    q_heads = tl.num_programs(1)
    hrow = b * q_heads + h
    row0 = hrow.to(tl.int64) * num_splits
    tag = tl.load(EP + hrow, cache_modifier=".cg") + 1
    lp = LSEP.to(tl.pointer_type(tl.int64))
    op = OP.to(tl.pointer_type(tl.int64))
    offs_c = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, HEAD_DIM)
    m = tl.full([], float("-inf"), tl.float32)
    den = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        s = s0 + offs_c
        have = s < num_splits
        rows = row0 + s
        left = _lse_missing(lp, rows, have, tag)
        rounds = 1
        while (left > 0) & (rounds < MAX_POLLS):
            zero = _pause(left * 0, POLL_NS, GPU)
            left = _lse_missing(lp, rows + zero, have, tag)
            rounds += 1
        # Read again after the poll that saw every LSE: Triton may load a volatile value once
        # for each layout it is used in, so a poll's values can be older than its tags.
        zero = _pause(left * 0, 0, GPU)
        lse_c, part, short = _read(lp, op, rows + zero, offs_d, have, tag, HEAD_DIM)
        while (short > 0) & (rounds < MAX_POLLS):  # outputs are stored before, unfenced
            zero = _pause(short * 0, POLL_NS, GPU)
            lse_c, part, short = _read(lp, op, rows + zero, offs_d, have, tag, HEAD_DIM)
            rounds += 1
        m, den, acc = fold_chunk(m, den, acc, lse_c, part, have)
        lost = (left > 0) | (short > 0)
        acc = tl.where(lost, float("nan"), acc)  # NaN stays through the later chunks
    tl.store(EP + hrow, tag)
    out_at = Out + b * stride_outb + h * stride_outh + offs_d
    store_merged(m, den, acc, LSE + hrow, out_at, EMULATE_RTNE)
