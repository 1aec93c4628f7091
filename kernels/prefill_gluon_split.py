"""The split of a persistent prefill launch's last partial round (kernels/prefill_gluon.py).

With 2048 equal tiles on 132 SMs, persistent programs take 16 rounds where 15.5 would do: the
last round leaves about half the SMs idle. :func:`tail_plan` cuts that round's tiles along
their keys into one share a program (a run of ``units`` key tiles, ``nk`` a tile, cut evenly);
a tile split between programs has its parts merged by the program holding its first key tile
(:func:`split_epilogue`): the others leave their unnormalised rows, row maxima and sums in a
work buffer and count themselves done, thread by thread, with release adds the merging
program reads with acquire loads. Share ``p`` begins at key tile ``p * units // programs`` of
the run, so every program knows which programs share a tile without asking.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: prefill_gluon.py says why it cannot run
    gluon = None


@dataclass(frozen=True)
class TailPlan:
    """The split of a launch's last partial round: tiles ``whole`` and on are cut along their
    keys into one share a program of ``units`` key tiles in all (``nk`` a tile); a tile has
    at most ``max_parts`` parts."""

    whole: int
    units: int
    nk: int
    max_parts: int


def tail_plan(
    tiles: int, programs: int, batch: int, tokens: int, max_len: int, causal: bool,
    block_m: int, block_n: int,
) -> TailPlan | None:  # fmt: skip
    """Where the last round of persistent programs would leave SMs idle (``tiles`` not a
    multiple of ``programs``), its tiles split along their keys evenly over the programs.
    Only non-causal (causal tiles are balanced by the counter, heaviest first); requests of
    one length (``tokens == batch * max_len``: no rows but theirs) that is a whole number of
    query and key tiles, so descriptors over all tokens serve every tile without reading a
    row of another request; and shares of at least two key tiles. Else None."""
    if causal or tokens != batch * max_len or max_len % block_n or max_len % (2 * block_m):
        return None
    rest = tiles % programs
    if tiles <= programs or rest == 0:
        return None
    nk = triton.cdiv(max_len, block_n)
    units = rest * nk
    if units < 2 * programs:
        return None
    return TailPlan(tiles - rest, units, nk, triton.cdiv(nk, units // programs) + 1)


def share(program: int, units: int, programs: int) -> tuple[int, int]:
    """Program ``program``'s share of the run of ``units`` key tiles: ``[start, end)``, as the
    loader computes it in the kernel."""
    return program * units // programs, (program + 1) * units // programs


def parts(tail_tile: int, nk: int, units: int, programs: int) -> tuple[int, int]:
    """The first and last program whose share holds key tiles of tail tile ``tail_tile``, as
    :func:`split_epilogue` computes them in the kernel: the share holding key tile ``x`` is
    the largest ``p`` with ``p * units // programs <= x``."""
    first = ((tail_tile * nk + 1) * programs - 1) // units
    last = (((tail_tile + 1) * nk) * programs - 1) // units
    return first, last


if gluon is not None:

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
    def _acquire_wait(ptr, want):
        """Until every thread of the warpgroup reads ``*ptr >= want`` (acquire, GPU scope)."""
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
        ptrs = ptr + gl.arange(0, 128, layout=ONE) * 0
        seen = gl.inline_asm_elementwise(
            asm="ld.acquire.gpu.global.u32 $0, [$1];",
            constraints="=r,l",
            args=[ptrs],
            dtype=gl.int32,
            is_pure=False,
            pack=1,
        )
        while gl.min(seen, 0) < want:
            seen = gl.inline_asm_elementwise(
                asm="ld.acquire.gpu.global.u32 $0, [$1];",
                constraints="=r,l",
                args=[ptrs],
                dtype=gl.int32,
                is_pure=False,
                pack=1,
            )

    @gluon.jit
    def split_epilogue(
        acc, m, l_o, tail_tile, k0, FLAGS, WORK, tail_units, nk, maxc, qk_scale,
        HALF: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
        O_LAYOUT: gl.constexpr,
    ):  # fmt: skip
        """A split tile's part (its key tiles from ``k0``): a program that does not hold the
        tile's first keys leaves its unnormalised rows, their maxima and sums in ``WORK`` and
        counts itself done; the one that does waits for the others and merges them into its
        own. Parts are numbered from the program holding the tile's first key tile (share
        ``p`` of the run of ``tail_units`` key tiles begins at ``p * tail_units // programs``).
        Returns the rows, their sums and whether to store them."""
        ROW_O: gl.constexpr = gl.SliceLayout(1, O_LAYOUT)
        programs = gl.num_programs(0)
        first = ((tail_tile * nk + 1) * programs - 1) // tail_units
        last = (((tail_tile + 1) * nk) * programs - 1) // tail_units
        rows = gl.arange(0, BLOCK_M, layout=ROW_O)
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, O_LAYOUT))
        tile_off = gl.expand_dims(rows, 1) * HEAD_DIM + gl.expand_dims(cols, 0)
        # WORK: (tail tile, part, half) blocks of BLOCK_M x HEAD_DIM rows, then BLOCK_M maxima
        # and BLOCK_M sums each.
        blocks = (tail_units // nk) * maxc * 2
        stats = WORK + blocks.to(gl.int64) * (BLOCK_M * HEAD_DIM)
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
                m_n = gl.maximum(m, m_c)
                a = gl.exp2((m - m_n) * qk_scale)
                b = gl.exp2((m_c - m_n) * qk_scale)
                acc = acc * gl.expand_dims(a, 1) + o_c * gl.expand_dims(b, 1)
                l_o = l_o * a + l_c * b
                m = m_n
            store = True
        return acc, l_o, store
