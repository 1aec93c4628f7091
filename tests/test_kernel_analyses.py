"""Kernel-name display and the launch-latency join, on names recorded on the H200."""

import shutil

import pytest

from kdash.analyses.kernels import demangle_all, short_name

REDUCE = (  # recorded on the H200 (kdash/data/demo-h200.kdash)
    "_ZN2at6native13reduce_kernelILi512ELi1ENS0_8ReduceOpIfNS0_7MeanOpsIffffEEjfLi4ELi4EEEEEvT1_"
)


@pytest.mark.skipif(shutil.which("c++filt") is None, reason="no c++filt (binutils) here")
def test_mangled_names_are_demangled_and_cut():
    demangle_all([REDUCE])
    assert short_name(REDUCE) == "at::native::reduce_kernel<…>"


def test_plain_names_kept_and_long_names_elided():
    assert short_name("_decode_stage1") == "_decode_stage1"
    long = "nvjet_sm90_tst_64x16_64x16_2x1_v_bz_splitK_NNT_with_a_very_long_suffix"
    s = short_name(long, 30)
    assert len(s) == 30 and "…" in s and s.startswith("nvjet")
