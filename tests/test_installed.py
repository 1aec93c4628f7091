"""The tests run against the installed kdash: one copy of every module, the wheel's layout.

The wheel puts the repository's collectors/, tui/, kernels/ and themes/ inside the `kdash`
package (pyproject.toml's `package-dir`). Nothing may resolve them beside the checkout's
kdash/ folder: that made `kdash.kdash.schema` a second copy of `kdash.schema` and let the tests
pass against the source tree while the install was broken.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import kdash.collectors
import kdash.tui
import pytest
from conftest import installed_distribution

import kdash
import kdash.schema

REPO = Path(__file__).resolve().parent.parent
SUBPACKAGES = {
    "kdash.collectors": "collectors",
    "kdash.tui": "tui",
    "kdash.kernels": "kernels",
    "kdash.themes": "themes",
}


def _editable() -> bool:
    direct = installed_distribution().read_text("direct_url.json")
    return bool(direct and json.loads(direct).get("dir_info", {}).get("editable"))


def _folder(name: str) -> Path:
    return Path(importlib.import_module(name).__file__).resolve().parent


def test_the_package_has_one_folder_and_no_copy_of_itself():
    assert len(kdash.__path__) == 1, kdash.__path__
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("kdash.kdash")
    assert importlib.util.find_spec("kdash.kdash") is None
    assert importlib.util.find_spec("kdash.schema").origin == kdash.schema.__file__
    assert not [m for m in sys.modules if m.startswith("kdash.kdash")]


def test_subpackages_resolve_where_the_install_puts_them():
    """Installed: inside site-packages' kdash/, not the checkout's folders (a venv may sit
    inside the checkout, as CI's does). Editable: the checkout's top-level folders, as
    pyproject's mapping says."""
    core = _folder("kdash")
    if _editable():
        assert core == (REPO / "kdash").resolve(), core
        for name, folder in SUBPACKAGES.items():
            assert _folder(name) == (REPO / folder).resolve(), name
        return
    site = Path(str(installed_distribution().locate_file(""))).resolve()
    assert core == site / "kdash", core
    assert core != (REPO / "kdash").resolve()
    for name, folder in SUBPACKAGES.items():
        where = _folder(name)
        assert where == site / "kdash" / folder, (name, where)
        assert where != (REPO / folder).resolve(), (name, where)


def test_a_child_started_in_the_checkout_imports_the_same_install():
    """`python -m kdash ...` children of the tests run with the checkout as their folder; they
    must import what this process imports, not ./kdash."""
    code = (
        "import json, kdash, kdash.collectors, kdash.tui\n"
        "print(json.dumps([kdash.__file__, kdash.collectors.__file__, kdash.tui.__file__]))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [kdash.__file__, kdash.collectors.__file__, kdash.tui.__file__]
    v = subprocess.run(
        [sys.executable, "-m", "kdash", "--version"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )
    assert v.returncode == 0 and v.stdout.strip() == f"kdash {kdash.__version__}", v.stderr
