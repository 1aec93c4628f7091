"""bench/gpu_prefill_probe.py without a GPU: one line on stderr and exit 2 (the probe itself
times CUDA kernels)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "gpu_prefill_probe.py"


def test_without_a_gpu_it_says_so_and_exits_2(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA GPU is present: the probe would run")
    spec = importlib.util.spec_from_file_location("gpu_prefill_probe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "probe.json"
    assert mod.main(["--energy", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "gpu_prefill_probe: no CUDA GPU here"
    assert not out.exists()
