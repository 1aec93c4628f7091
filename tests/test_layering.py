"""The layering the code states, checked: the headless parts never load Textual, analyses
never load collectors, and the agent's in-target modules load only the standard library (they
are imported into every process `kdash run` arms)."""

from __future__ import annotations

import json
import subprocess
import sys

HEADLESS = [
    "kdash.schema",
    "kdash.store",
    "kdash.capture",
    "kdash.report",
    "kdash.export",
    "kdash.kineto",
    "kdash.prom",
    "kdash.snapshot",
    "kdash.commands",
    "kdash.session",
    "kdash.analyses.cost",
    "kdash.analyses.findings",
    "kdash.analyses.gpu_time",
    "kdash.analyses.kernel_findings",
    "kdash.analyses.kernels",
    "kdash.collectors.nvml",
    "kdash.collectors.sched",
    "kdash.collectors.agents",
    "kdash.collectors.sglang_http",
    "kdash.collectors.sglang_tree",
    "kdash.collectors.agent.client",
    "kdash.collectors.agent.inject",
]
ANALYSES = [m for m in HEADLESS if m.startswith("kdash.analyses.")]
# what an armed process imports before any client comes (wire.py, with numpy, is imported by
# the session only once a kdash client has connected)
IN_TARGET = [
    "kdash.collectors.agent.server",
    "kdash.collectors.agent.detach",
    "kdash.collectors.agent.bootstrap",
]


def modules_after_import(name: str) -> list[str]:
    """The modules a fresh interpreter holds after `import name` (from outside the repo)."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({name!r})\n"
        "print(json.dumps(sorted(sys.modules)))\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd="/"
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_headless_modules_never_load_textual():
    for name in HEADLESS:
        mods = modules_after_import(name)
        assert not [m for m in mods if m == "textual" or m.startswith("textual.")], name
        assert not [m for m in mods if m.startswith("kdash.tui")], name


def test_analyses_never_load_collectors():
    for name in ANALYSES:
        assert not [m for m in modules_after_import(name) if m.startswith("kdash.collectors")], name


def test_the_agent_loads_only_the_standard_library():
    allowed = set(sys.stdlib_module_names) | {"kdash", "_distutils_hack"}
    for name in IN_TARGET:
        tops = {m.split(".")[0] for m in modules_after_import(name)}
        foreign = sorted(t for t in tops - allowed if not t.startswith("_"))
        assert foreign == [], (name, foreign)


# -- import-linter's contracts (pyproject.toml), run here so CI, which runs pytest, runs them --
def _repo():
    from pathlib import Path

    return Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    """`lint-imports` over the package laid out as the wheel installs it (.ci/lint_imports.py
    stages it: in the checkout collectors/ and tui/ sit beside kdash/)."""
    import importlib.util

    if importlib.util.find_spec("importlinter") is None:
        import pytest

        pytest.skip("import-linter is not installed (it is in the test extra)")
    r = subprocess.run(
        [sys.executable, str(_repo() / ".ci" / "lint_imports.py")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "0 broken" in r.stdout, r.stdout


def test_core_contract_names_every_core_module():
    """A module added to kdash/ is checked too: the core contract lists every top-level module
    (the package's own __init__ aside: as a source it would stand for the whole package)."""
    import tomllib

    repo = _repo()
    contracts = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["importlinter"][
        "contracts"
    ]
    core = next(c for c in contracts if c["name"].startswith("The core never"))
    on_disk = {f"kdash.{p.stem}" for p in (repo / "kdash").glob("*.py") if p.stem != "__init__"}
    missing = sorted(on_disk - set(core["source_modules"]))
    assert missing == [], f"add to the core contract in pyproject.toml: {missing}"
