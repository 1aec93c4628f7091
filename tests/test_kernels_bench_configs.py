"""The decode configs the kernel bench's flags ask for (kernels/bench_configs.py): each flag's
change, and one clear line, exit 2, for a bad value or combination (checked through the bench's
own ``main``, which refuses before it looks for a GPU)."""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

pytest.importorskip("torch")
pytest.importorskip("triton")

from kdash.kernels import bench, bench_configs
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig
from kdash.kernels.decode_fp8 import Fp8Config
from kdash.kernels.decode_gluon import TmaConfig

BEST = {"bf16": DecodeConfig(), "fp8": DEFAULT_FP8_CONFIG}


def flags(**kw) -> argparse.Namespace:
    base = dict(
        decode_tma=False,
        evict_first=False,
        no_evict_first=False,
        max_resident=None,
        max_registers=None,
    )
    return argparse.Namespace(**{**base, **kw})


def test_no_flag_keeps_the_defaults() -> None:
    assert bench_configs.apply_flags(flags(), BEST) == BEST


def test_the_cap_reaches_both_dtypes_and_the_register_cap_bf16_only() -> None:
    got = bench_configs.apply_flags(flags(max_resident=3, max_registers=128), BEST)
    assert got["bf16"].max_resident_per_sm == 3 and got["fp8"].max_resident_per_sm == 3
    assert isinstance(got["bf16"], Fp8Config) and got["bf16"].maxnreg == 128
    assert not isinstance(got["fp8"], Fp8Config)  # fp8 keeps the registers its kernel takes
    # everything else of the bf16 config is unchanged
    assert got["bf16"].block_n == BEST["bf16"].block_n and got["bf16"].evict_first


def test_the_hint_flags_set_the_field_of_the_kernel_they_run() -> None:
    off = bench_configs.apply_flags(flags(no_evict_first=True), BEST)
    assert not off["bf16"].evict_first and not off["fp8"].evict_first
    tma = bench_configs.apply_flags(flags(decode_tma=True, evict_first=True), BEST)
    assert all(isinstance(c, TmaConfig) and c.l2_evict_first for c in tma.values())


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--max-resident", "-1"], "--max-resident must be 0 or more"),
        (["--max-registers", "300"], "--max-registers must be from 24 to 255"),
        (["--max-registers", "128", "--decode-tma"], "not --decode-tma"),
    ],
)
def test_bad_flags_get_one_line_and_exit_2(argv, said, capsys) -> None:
    assert bench.main(argv) == 2
    err = capsys.readouterr().err
    assert said in err and err.count("\n") == 1
