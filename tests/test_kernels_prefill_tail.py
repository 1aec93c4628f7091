"""Where the Gluon prefill splits its last partial round into a second launch
(kernels/prefill_tail_plan.py), and that the shares and parts the tail kernel computes (the
same integer expressions as :func:`share`, :func:`parts` and the loader's segment walk) cover
every key tile of the tail once, with each split tile's first key tile in the program that
merges it and every other part in a work-buffer slot of its own. The kernel runs on sm_90 only:
its GPU test is in tests/test_kernels_prefill.py, its gates in bench/gpu_prefill_gluon.py."""

from __future__ import annotations

import itertools

import pytest
from kdash.kernels.prefill_tail_plan import (
    MIN_SAVED,
    MIN_SHARE,
    TailPlan,
    flag_count,
    parts,
    share,
    tail_plan,
    work_floats,
)


def test_the_bench_shapes_on_132_sms_split_their_last_round() -> None:
    # 16/16/128 non-causal, 4 x 4096: 2048 tiles of 128 rows, 15 whole rounds and 68 tiles of
    # 32 key tiles, 16-17 key tiles a program.
    assert tail_plan(2048, 132, 4, 4 * 4096, 4096, False, 64, 128) == TailPlan(
        1980, 2176, 32, 132, 3
    )
    # 1 x 16384: the same tiles, 128 key tiles each.
    assert tail_plan(2048, 132, 1, 16384, 16384, False, 64, 128) == TailPlan(
        1980, 8704, 128, 132, 3
    )
    # GQA 32/8/128 at 2 x 8192: 4096 tiles, 31 rounds and 4 tiles, cut over 32 programs
    # (shares of MIN_SHARE key tiles) rather than 132 shares of two.
    plan = tail_plan(4096, 132, 2, 2 * 8192, 8192, False, 64, 128)
    assert plan == TailPlan(4092, 256, 64, 256 // MIN_SHARE, 9)


def test_fewer_tiles_than_programs_all_go_to_the_tail() -> None:
    # 1 x 16k, one head: 64 tiles of 128 key tiles on 132 SMs, two programs a tile.
    plan = tail_plan(64, 132, 1, 16384, 16384, False, 64, 128)
    assert plan is not None and plan.whole == 0 and plan.tiles == 64 and plan.programs == 132


@pytest.mark.parametrize(
    ("tiles", "programs", "batch", "tokens", "max_len", "causal", "why"),
    [
        (2048, 132, 4, 16384, 4096, True, "causal: the counter balances it"),
        (2048, 132, 4, 16000, 4096, False, "requests of different lengths"),
        (2560, 132, 5, 20000, 4000, False, "a length that is no whole number of tiles"),
        (2048, 128, 4, 16384, 4096, False, "a whole number of rounds"),
        (2048, 132, 8, 16384, 2048, False, "shares of 9 key tiles against tiles of 16"),
        (2048, 132, 32, 16384, 512, False, "tiles of 4 key tiles"),
        (128, 132, 1, 8192, 8192, False, "128 tiles on 132 programs: nothing to gain"),
    ],
)
def test_no_split(tiles, programs, batch, tokens, max_len, causal, why) -> None:
    assert tail_plan(tiles, programs, batch, tokens, max_len, causal, 64, 128) is None, why


def segments(p: int, plan: TailPlan) -> list[tuple[int, int, int]]:
    """Program ``p``'s walk over its share as the tail kernel's loader makes it
    (prefill_gluon_tail._segment): (tail tile, first key tile, end key tile)."""
    u, end = share(p, plan.units, plan.programs)
    out = []
    while u < end:
        k0 = u % plan.nk
        k1 = min(plan.nk, k0 + end - u)
        out.append((u // plan.nk, k0, k1))
        u += k1 - k0
    return out


@pytest.mark.parametrize(
    ("tiles", "programs", "nk"),
    [(2048, 132, 32), (2048, 132, 128), (4096, 132, 64), (3000, 114, 40), (690, 78, 64),
     (64, 132, 128), (1000, 132, 40)],
)  # fmt: skip
def test_shares_and_parts_cover_the_tail_once(tiles: int, programs: int, nk: int) -> None:
    max_len = nk * 128
    plan = tail_plan(tiles, programs, 1, max_len, max_len, False, 64, 128)
    assert plan is not None and plan.nk == nk
    assert plan.whole % programs == 0 and 0 < plan.tiles <= programs
    assert plan.whole + plan.tiles == tiles and plan.units == plan.tiles * nk
    assert plan.programs <= programs
    covered = [0] * plan.units
    merger: dict[int, int] = {}
    slots: set[tuple[int, int]] = set()
    for p in range(plan.programs):
        start, end = share(p, plan.units, plan.programs)
        assert end - start >= MIN_SHARE
        assert nk - (end - start) >= MIN_SAVED  # every share well short of a tile
        for tile, k0, k1 in segments(p, plan):
            first, last = parts(tile, nk, plan.units, plan.programs)
            assert first <= p <= last and last - first + 1 <= plan.max_parts
            if k0 == 0:
                assert p == first and tile not in merger
                merger[tile] = p
            else:  # its slot in the work buffer, one a part
                assert 0 < p - first < plan.max_parts and (tile, p - first) not in slots
                slots.add((tile, p - first))
            for x in range(tile * nk + k0, tile * nk + k1):
                covered[x] += 1
    assert covered == [1] * plan.units
    assert sorted(merger) == list(range(plan.tiles))
    for tile in range(plan.tiles):
        first, last = parts(tile, nk, plan.units, plan.programs)
        # the merger waits for exactly the parts that exist
        assert {(tile, i) for i in range(1, last - first + 1)} == {s for s in slots if s[0] == tile}
        for p, q in itertools.pairwise(range(first, last + 1)):
            assert share(p, plan.units, plan.programs)[1] == share(q, plan.units, plan.programs)[0]
        # A merger's own segment of the tile is the last of its share (the others started
        # earlier), unless its share starts on the tile's first key tile.
        segs = segments(merger[tile], plan)
        assert segs[-1][0] == tile or segs[0][:2] == (tile, 0)


def test_a_waiting_segment_never_waits_on_one_that_waits() -> None:
    """No cycle: only a tile's first part waits, and what it waits for are parts that start
    past the tile's first key tile, which never wait."""
    plan = tail_plan(2048, 132, 4, 4 * 4096, 4096, False, 64, 128)
    assert plan is not None
    for p in range(plan.programs):
        for tile, k0, _ in segments(p, plan):
            if k0 == 0:
                first, last = parts(tile, plan.nk, plan.units, plan.programs)
                for q in range(first + 1, last + 1):
                    # q's segment of this tile starts past its first key tile
                    assert any(t == tile and a > 0 for t, a, _ in segments(q, plan))


def test_buffers_sized_for_every_part() -> None:
    plan = tail_plan(2048, 132, 4, 4 * 4096, 4096, False, 64, 128)
    assert plan is not None
    assert flag_count(plan) == 68 * 3 * 2
    # the highest block the kernel writes: (tile, part, half) with part < max_parts
    top = ((plan.tiles - 1) * plan.max_parts + plan.max_parts - 1) * 2 + 1
    assert top < flag_count(plan)
    assert work_floats(plan, 64, 128) == flag_count(plan) * 64 * (128 + 2)
