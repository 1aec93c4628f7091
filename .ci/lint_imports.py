"""Run import-linter's contracts (pyproject.toml, [tool.importlinter]) on kdash as installed.

The wheel puts collectors/, tui/, kernels/ and themes/ inside the `kdash` package, but in the
checkout they sit beside kdash/, and import-linter builds its graph by walking the folder the
package's name resolves to: run from the checkout (or over the editable install) it sees only
kdash/ and reports `kdash.tui` as missing. So this lays the package out as the wheel does, in a
temporary folder, from pyproject's own package mapping, and runs `lint-imports` there with the
checkout's configuration. Arguments go to lint-imports; the exit status is its own.

    python .ci/lint_imports.py [--verbose]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def stage(dest: Path) -> None:
    """Copy each package of pyproject's `package-dir` mapping to where the wheel puts it."""
    setup = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    mapping: dict[str, str] = setup["package-dir"]
    # parents before children, so a child's folder lands inside its parent's copy
    for package in sorted(mapping, key=lambda name: name.count(".")):
        target = dest.joinpath(*package.split("."))
        shutil.copytree(
            ROOT / mapping[package],
            target,
            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
            dirs_exist_ok=True,
        )


def lint_imports_command() -> str | None:
    """The lint-imports script of this interpreter's environment, else the one on PATH."""
    beside = Path(sys.executable).parent / "lint-imports"
    return str(beside) if beside.is_file() else shutil.which("lint-imports")


def main(argv: list[str]) -> int:
    command = lint_imports_command()
    if command is None:
        print("lint_imports: import-linter is not installed (pip install import-linter)")
        return 2
    with tempfile.TemporaryDirectory(prefix="kdash-lint-imports-") as tmp:
        stage(Path(tmp))
        env = dict(os.environ, PYTHONPATH=tmp)
        config = str(ROOT / "pyproject.toml")
        # run in the staged folder: lint-imports puts its working folder first on sys.path
        run = [command, "--no-logo", config, *argv]
        return subprocess.run(run, cwd=tmp, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
