"""The layering the code states, checked: the headless parts never load Textual, analyses
never load collectors, and the agent's in-target modules load only the standard library (they
are imported into every process `kdash run` arms)."""

from __future__ import annotations

import json
import subprocess
import sys

# The packages that run without the dashboard: the core, the analyses, the collectors with the
# agent, and the demo workload. Every module in them is checked, as installed (a test holds
# this list and TUI_PACKAGES to pyproject's packages, so a new package is classified).
HEADLESS_PACKAGES = (
    "kdash",
    "kdash.analyses",
    "kdash.collectors",
    "kdash.collectors.agent",
    "kdash.kernels",
)
TUI_PACKAGES = ("kdash.tui", "kdash.tui.panes", "kdash.tui.widgets", "kdash.themes")
# What the demo workload's kernels need and a machine may lack: a kernel module that cannot
# be imported for want of them alone is left out (named in the test's output), not failed.
GPU_STACK = ("torch", "triton")
# what an armed process imports before any client comes (wire.py, with numpy, is imported by
# the session only once a kdash client has connected)
IN_TARGET = [
    "kdash.collectors.agent.server",
    "kdash.collectors.agent.detach",
    "kdash.collectors.agent.bootstrap",
]


def modules_of(package: str) -> list[str]:
    """The package and its modules, from the folder it is installed in (`__main__` aside:
    importing it runs the command)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, package
    names = {package}
    for folder in spec.submodule_search_locations:
        for path in Path(folder).glob("*.py"):
            if path.stem not in ("__init__", "__main__"):
                names.add(f"{package}.{path.stem}")
    return sorted(names)


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


# Imports `names` one after another in this fresh interpreter and names the first after which
# a module starting with one of `forbidden` is loaded (once loaded it stays, so a later one
# cannot be told apart; none at the end means none of them loads it). A kernel module missing
# only the GPU stack is skipped and listed.
_IMPORT_EACH = r"""
import importlib, json, sys
names, forbidden, optional = (json.loads(a) for a in sys.argv[1:4])
first, skipped = None, {}
def bad(m):
    return any(m == f or m.startswith(f + ".") for f in forbidden)
for name in names:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        top = (e.name or "").split(".")[0]
        if name.startswith("kdash.kernels") and top in optional:
            skipped[name] = e.name
            continue
        raise
    if first is None and any(bad(m) for m in sys.modules):
        first = name
print(json.dumps({"first": first, "skipped": skipped, "loaded": sorted(sys.modules)}))
"""


def import_each(names: list[str], forbidden: list[str]) -> dict:
    args = [json.dumps(names), json.dumps(forbidden), json.dumps(list(GPU_STACK))]
    r = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",
    )
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_packages_are_all_classified():
    import tomllib

    packages = tomllib.loads((_repo() / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    assert sorted(packages) == sorted(HEADLESS_PACKAGES + TUI_PACKAGES)


def test_headless_modules_never_load_textual():
    """Every module of the core, the analyses, the collectors (the agent's too) and the demo
    workload, imported in one fresh interpreter: Textual and kdash.tui are still not loaded."""
    names = [m for pkg in HEADLESS_PACKAGES for m in modules_of(pkg)]
    assert "kdash.kineto_events" in names and "kdash.collectors.agent.fields" in names
    out = import_each(names, ["textual", "kdash.tui"])
    assert out["first"] is None, f"{out['first']} loads Textual or kdash.tui"
    assert set(out["skipped"]) < {m for m in names if m.startswith("kdash.kernels.")}
    assert set(names) - set(out["skipped"]) <= set(out["loaded"])


def test_analyses_never_load_collectors():
    names = modules_of("kdash.analyses")
    out = import_each(names, ["kdash.collectors"])
    assert out["first"] is None, f"{out['first']} loads kdash.collectors"
    assert set(names) <= set(out["loaded"])


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
