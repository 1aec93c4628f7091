"""The split of the Gluon prefill's last partial round (kernels/prefill_gluon_split.py): when a
launch splits, and that the shares and parts the kernel computes (the same integer expressions
as :func:`share` and :func:`parts`) cover every key tile of the tail once, with the first key
tile of each split tile in the program that merges it. The kernel itself runs on sm_90 only
(its GPU gates: tests/test_kernels_prefill.py, bench/gpu_prefill_gluon.py)."""

from __future__ import annotations

import itertools
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

pytest.importorskip("triton")

from kdash.kernels.prefill_gluon_split import TailPlan, parts, share, tail_plan


def test_the_bench_shapes_on_132_sms_split_their_last_round() -> None:
    # 16/16/128 non-causal, 4 x 4096: 2048 tiles of 128 rows, 15 whole rounds and 68 tiles.
    assert tail_plan(2048, 132, 4, 4 * 4096, 4096, False, 64, 128) == TailPlan(1980, 2176, 32, 3)
    # 1 x 16384: the same tiles, 128 key tiles each.
    assert tail_plan(2048, 132, 1, 16384, 16384, False, 64, 128) == TailPlan(1980, 8704, 128, 3)


@pytest.mark.parametrize(
    ("tiles", "programs", "batch", "tokens", "max_len", "causal", "why"),
    [
        (2048, 132, 4, 16384, 4096, True, "causal: the counter balances it"),
        (2048, 132, 4, 16000, 4096, False, "requests of different lengths"),
        (2560, 132, 5, 20000, 4000, False, "a length that is no whole number of tiles"),
        (2048, 128, 4, 16384, 4096, False, "a whole number of rounds"),
        (64, 132, 1, 4096, 4096, False, "one round"),
        (133, 132, 1, 133 * 128, 133 * 128, False, "a share under two key tiles"),
    ],
)
def test_no_split(tiles, programs, batch, tokens, max_len, causal, why) -> None:
    assert tail_plan(tiles, programs, batch, tokens, max_len, causal, 64, 128) is None, why


@pytest.mark.parametrize(
    ("tiles", "programs", "nk"),
    [(2048, 132, 32), (2048, 132, 128), (1536, 132, 16), (3000, 114, 7), (700, 78, 64)],
)
def test_shares_and_parts_cover_the_tail_once(tiles: int, programs: int, nk: int) -> None:
    max_len = nk * 128
    batch = 1
    plan = tail_plan(tiles, programs, batch, max_len, max_len, False, 64, 128)
    assert plan is not None and plan.nk == nk
    rest = tiles - plan.whole
    assert plan.whole % programs == 0 and 0 < rest < programs and plan.units == rest * nk
    covered = [0] * plan.units
    merger = {}
    for p in range(programs):
        start, end = share(p, plan.units, programs)
        assert end - start >= 2
        # The loader's walk over its share, tile by tile (kernels/prefill_gluon.py, _loader).
        u = start
        while u < end:
            tile, k0 = divmod(u, nk)
            k1 = min(nk, k0 + end - u)
            first, last = parts(tile, nk, plan.units, programs)
            assert first <= p <= last and last - first + 1 <= plan.max_parts
            if k0 == 0:
                assert p == first and tile not in merger
                merger[tile] = p
            else:
                assert 0 < p - first < plan.max_parts  # its slot in the work buffer
            for x in range(u, u + k1 - k0):
                covered[x] += 1
            u += k1 - k0
    assert covered == [1] * plan.units
    assert sorted(merger) == list(range(rest))
    # Every part a merger waits for is a share that holds key tiles of that tile.
    for tile in range(rest):
        first, last = parts(tile, nk, plan.units, programs)
        for p, q in itertools.pairwise(range(first, last + 1)):
            assert share(p, plan.units, programs)[1] == share(q, plan.units, programs)[0]
        assert share(first, plan.units, programs)[0] <= tile * nk
        assert share(last, plan.units, programs)[1] >= (tile + 1) * nk
