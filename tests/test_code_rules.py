"""The rules the code states about itself, checked over the package as installed: modules
small enough to read, comments that keep the why without pointing at a tracker, and the
lint gates of pyproject.toml (ruff with BLE, C90 at complexity 15, RUF100), run here so CI,
which runs pytest, runs them."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
from test_layering import HEADLESS_PACKAGES, TUI_PACKAGES

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 800
# "(issue 3 item 4)", "item 9", "#12", "ticket 7": history belongs in bench/NOTES*.md, and the
# tracker's numbering means nothing to a reader of the code
TRACKER_REF = re.compile(r"\b(issue|item|card|ticket)\s+#?\d+\b|(^|[\s(])#\d+\b", re.IGNORECASE)


def package_files() -> list[Path]:
    """Every .py file of the package's folders, as installed."""
    import importlib.util

    files: set[Path] = set()
    for package in HEADLESS_PACKAGES + TUI_PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, package
        for folder in spec.submodule_search_locations:
            files.update(Path(folder).resolve().glob("*.py"))
    assert len(files) > 50
    return sorted(files)


def comments_and_strings(path: Path) -> list[tuple[int, str]]:
    """(line, text) of each comment and string literal of a Python file."""
    out = []
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    for tok in tokens:
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            out.append((tok.start[0], tok.string))
    return out


def test_no_module_of_the_package_is_over_max_lines():
    lines = {f"{p.parent.name}/{p.name}": len(p.read_text().splitlines()) for p in package_files()}
    assert {name: n for name, n in lines.items() if n > MAX_LINES} == {}


def test_comments_carry_no_tracker_references():
    found = [
        f"{path.parent.name}/{path.name}:{line}: {m.group(0).strip()}"
        for path in package_files()
        for line, text in comments_and_strings(path)
        for m in [TRACKER_REF.search(text)]
        if m
    ]
    assert found == []


def test_the_reference_pattern_finds_what_it_is_for():
    for text in ("# (issue 3 item 4)", "# Themes (item 9)", "# see #12", '"""Per issue 12."""'):
        assert TRACKER_REF.search(text), text
    for text in (
        '"#121212"',
        "# `f(...)::{lambda()#1}` reads as f",
        "# the issue detector",
        "# 3 items",
    ):
        assert not TRACKER_REF.search(text), text


def test_ruff_gates_hold():
    """`ruff check` with pyproject's configuration (BLE, C90 max-complexity 15, RUF100 on)."""
    import importlib.util

    if importlib.util.find_spec("ruff") is None:
        pytest.skip("ruff is not installed (it is in the test extra)")
    r = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "."],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert r.returncode == 0, r.stdout + r.stderr
