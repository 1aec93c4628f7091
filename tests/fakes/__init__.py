"""Stand-ins for what cannot run on a machine without an NVIDIA GPU (test fixtures only):
`cupti/cupti.py` for cupti-python's `cupti.cupti`, `controller.py` for the agent's CUPTI
controller, `libcupti.c` for the parts of libcupti the agent calls through ctypes.

This folder goes first on the PYTHONPATH of a child that should find the stand-in `cupti`
(the `fake_cupti` fixture in conftest.py)."""

from __future__ import annotations

from pathlib import Path

FAKES = Path(__file__).resolve().parent


def fake_cupti_module():
    """A fresh copy of the stand-in `cupti.cupti`, loaded in this process: fresh, because it
    reads some FAKE_CUPTI_* variables when it is loaded."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cupti_fake", FAKES / "cupti" / "cupti.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
