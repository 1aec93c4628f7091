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
