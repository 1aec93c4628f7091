"""Where a persistent Gluon prefill launch leaves SMs idle, and how its last tiles are cut.

With 2048 equal tiles on 132 SMs the persistent programs of kernels/prefill_gluon.py take 16
rounds where 15.5 would do: the last round runs 68 tiles and leaves 64 SMs idle for a whole
tile (at 16/16/128 x 4k, 32 key tiles of ~1.9 us on an H100). :func:`tail_plan` hands the whole
rounds to that launch and cuts the tiles past them (the tail) along their keys into one share
per program of a second launch (kernels/prefill_gluon_tail.py): the tail's key tiles laid end
to end, ``units`` in all, share ``p`` from ``p * units // programs`` on. A tile cut between
programs is merged by the program holding its first key tile. Pure integer arithmetic, the same
expressions the kernel computes, so the tests check the cover on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

# A share of at least this many key tiles: each part pays its own Q load, epilogue and, for
# the merger, a read of the other parts.
MIN_SHARE = 8
# Split only where the longest share is at least this many key tiles shorter than a whole
# tile: the second launch's gap, Q loads and merge cost about four.
MIN_SAVED = 8


@dataclass(frozen=True)
class TailPlan:
    """Tiles ``0 .. whole`` go whole to the persistent launch; tiles ``whole`` on (``nk`` key
    tiles each, ``units`` in all) to ``programs`` programs of the tail launch, a tile in at
    most ``max_parts`` parts."""

    whole: int
    units: int
    nk: int
    programs: int
    max_parts: int

    @property
    def tiles(self) -> int:
        """Tiles in the tail."""
        return self.units // self.nk


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tail_plan(
    tiles: int, programs: int, batch: int, tokens: int, max_len: int, causal: bool,
    block_m: int, block_n: int,
) -> TailPlan | None:  # fmt: skip
    """The split of a launch of ``tiles`` tiles on ``programs`` persistent programs, or None
    where it does not pay or cannot be made: causal launches (their tiles differ in work; the
    tile counter balances them, heaviest first), requests of different lengths or a length
    that is not a whole number of query and key tiles (the tail kernel's descriptors span all
    tokens and read no masks), a whole number of rounds, or a longest share less than
    :data:`MIN_SAVED` key tiles shorter than a tile."""
    if causal or tokens != batch * max_len or max_len % block_n or max_len % (2 * block_m):
        return None
    rest = tiles % programs
    if rest == 0:
        return None
    nk = max_len // block_n
    units = rest * nk
    tail_programs = min(programs, units // MIN_SHARE)
    if tail_programs == 0 or nk - _cdiv(units, tail_programs) < MIN_SAVED:
        return None
    return TailPlan(tiles - rest, units, nk, tail_programs, _cdiv(nk, units // tail_programs) + 1)


def share(program: int, units: int, programs: int) -> tuple[int, int]:
    """Program ``program``'s share of the tail's ``units`` key tiles: ``[start, end)``, as the
    tail kernel's loader computes it."""
    return program * units // programs, (program + 1) * units // programs


def parts(tail_tile: int, nk: int, units: int, programs: int) -> tuple[int, int]:
    """The first and last program whose share holds key tiles of tail tile ``tail_tile``, as
    the tail kernel's merge computes them: the share holding key tile ``x`` is the largest
    ``p`` with ``p * units // programs <= x``."""
    first = ((tail_tile * nk + 1) * programs - 1) // units
    last = ((tail_tile + 1) * nk * programs - 1) // units
    return first, last


def work_floats(plan: TailPlan, block_m: int, head_dim: int) -> int:
    """The tail launch's work buffer, fp32: a block of rows for every (tail tile, part,
    consumer), then each block's row maxima and sums."""
    blocks = plan.tiles * plan.max_parts * 2
    return blocks * block_m * (head_dim + 2)


def flag_count(plan: TailPlan) -> int:
    """Done-counts of the tail launch, one per (tail tile, part, consumer); zero at launch."""
    return plan.tiles * plan.max_parts * 2
