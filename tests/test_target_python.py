"""The interpreter a target really runs, read from /proc of real processes, and the advice
worded for it (kdash.target_python)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kdash import target_python as tpy

BASE_PYTHON = os.path.realpath(sys.executable)  # the binary a venv's bin/python leads to


def _wait_started(p: subprocess.Popen, exe_hint: str) -> None:
    """Until the child has exec'd (its /proc cmdline is the interpreter's, not ours)."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            argv0 = Path(f"/proc/{p.pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            argv0 = ""
        if exe_hint in argv0 and Path(f"/proc/{p.pid}/exe").exists():
            return
        time.sleep(0.02)
    raise AssertionError(f"pid {p.pid} did not start {exe_hint}")


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A real virtual environment made with `python -m venv` (no pip: not needed to run)."""
    where = tmp_path_factory.mktemp("tp") / "srv-venv"
    subprocess.run(
        [BASE_PYTHON, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120
    )
    assert (where / "pyvenv.cfg").is_file()
    return where


def _start(argv: list[str], env: dict[str, str] | None = None, cwd: str | None = None):
    p = subprocess.Popen(
        [*argv, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=env,
        cwd=cwd,
    )
    _wait_started(p, os.path.basename(argv[0]))
    return p


def _stop(p: subprocess.Popen) -> None:
    assert p.stdin is not None
    p.stdin.close()
    p.wait(timeout=20)


def test_a_venv_python_is_named_with_its_venv_not_the_base_binary(venv):
    p = _start([str(venv / "bin" / "python")])
    try:
        tp = tpy.target_python(p.pid)
        # /proc/PID/exe resolves the venv's symlink: the base interpreter...
        assert os.path.realpath(tp.exe or "") == os.path.realpath(BASE_PYTHON)
        # ...but the target runs as the venv's python, with the venv as its sys.prefix
        assert tp.python == str(venv / "bin" / "python")
        assert tp.venv == str(venv) and tp.how == "pyvenv.cfg"
        assert tp.is_python
        hint = "cupti-python is not installed; pip install 'cupti-python~=13.0.0' (match it)"
        said = tpy.for_target(hint, tp)
        assert f"{venv}/bin/python -m pip install 'cupti-python~=13.0.0'" in said
        assert " pip install" not in said.replace("-m pip install", "")
    finally:
        _stop(p)


def test_a_bare_argv0_is_found_on_the_targets_own_path(venv, tmp_path):
    """`python` started from a shell whose PATH leads to the venv: resolved with the target's
    PATH (from /proc/PID/environ), not kdash's."""
    env = {**os.environ, "PATH": f"{venv / 'bin'}:/usr/bin:/bin"}
    env.pop("VIRTUAL_ENV", None)
    p = subprocess.Popen(
        ["python", "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=env,
        cwd=tmp_path,
        executable=str(venv / "bin" / "python"),
    )
    _wait_started(p, "python")
    try:
        tp = tpy.target_python(p.pid)
        assert tp.python == str(venv / "bin" / "python") and tp.venv == str(venv)
    finally:
        _stop(p)


def test_virtual_env_from_the_environment_when_argv0_says_nothing(venv, tmp_path):
    """argv[0] rewritten (as a process title setter or a launcher does): VIRTUAL_ENV in the
    target's environment names the venv, since its bin/python is the running binary."""
    env = {**os.environ, "VIRTUAL_ENV": str(venv)}
    p = subprocess.Popen(
        ["my-server", "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=env,
        executable=str(venv / "bin" / "python"),
    )
    _wait_started(p, "my-server")
    try:
        tp = tpy.target_python(p.pid)
        assert tp.how == "VIRTUAL_ENV" and tp.venv == str(venv)
        assert tp.python is not None and tp.python.startswith(str(venv / "bin"))
    finally:
        _stop(p)


def test_a_python_outside_any_venv_is_advised_through_its_own_binary():
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    p = _start([BASE_PYTHON], env=env)
    try:
        tp = tpy.target_python(p.pid)
        assert tp.venv is None and tp.python == os.readlink(f"/proc/{p.pid}/exe")
        said = tpy.for_target("pip install numpy into that environment", tp)
        assert said == f"{tp.python} -m pip install numpy into that environment"
    finally:
        _stop(p)


def test_the_inject_check_wording_names_the_venv_python(venv):
    """The injection check names /proc/PID/exe (the base binary); the advice says the venv."""
    p = _start([str(venv / "bin" / "python")])
    try:
        tp = tpy.target_python(p.pid)
        text = (
            f"{tp.exe} (pid {p.pid}'s interpreter) cannot import cupti-python: pip install "
            "'cupti-python~=13.0.0' 'nvidia-cuda-cupti~=13.0.0' in the target's Python "
            "(the driver supports CUDA 13.0)"
        )
        said = tpy.for_target(text, tp)
        assert said.startswith(f"{venv}/bin/python (venv {venv}) (pid {p.pid}) cannot import")
        assert f"{venv}/bin/python -m pip install 'cupti-python~=13.0.0'" in said
        assert BASE_PYTHON not in said
    finally:
        _stop(p)


def test_advice_is_left_alone_when_the_interpreter_is_unknown():
    tp = tpy.target_python(2**22 + 12345)  # no such process
    assert tp.python is None and tp.exe is None
    assert tpy.for_target("pip install x", tp) == "pip install x"
    already = "/srv/venv/bin/python -m pip install x"
    known = tpy.TargetPython(1, "/usr/bin/python3", "/usr/bin/python3", None, "", True)
    assert tpy.for_target(already, known) == already  # not run through twice


def test_kdash_run_tree_without_python_says_so(tmp_path):
    sleeper = subprocess.Popen(["sleep", "30"], env={**os.environ, "KDASH_AGENT": "1"})
    try:
        deadline = time.monotonic() + 10
        while b"KDASH_AGENT=1" not in Path(f"/proc/{sleeper.pid}/environ").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        root = tpy.target_python(sleeper.pid)
        assert not root.is_python and tpy.armed(root, "KDASH_AGENT")
        note = tpy.tree_note(sleeper.pid, [root], "KDASH_AGENT", "no socket in /tmp/x")
        assert "run no Python" in note and "sleep" in note
        assert "start the target with `kdash run" not in note
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize(
    ("flags", "said"),
    [(["-I"], "-I"), (["-u", "-S"], "-S"), (["-bE"], "-E"), (["-X", "dev", "-I"], "-I")],
)
def test_kdash_run_tree_whose_python_skips_the_hook_names_the_option(venv, flags, said):
    env = {**os.environ, "KDASH_AGENT": "1"}
    p = subprocess.Popen(
        [str(venv / "bin" / "python"), *flags, "-c", "import sys; sys.stdin.read()"],
        stdin=subprocess.PIPE,
        env=env,
    )
    _wait_started(p, "python")
    try:
        tp = tpy.target_python(p.pid)
        assert tp.skips_hook() == said
        note = tpy.tree_note(p.pid, [tp], "KDASH_AGENT", "no socket")
        assert f"runs with {said}" in note and f"kdash attach --pid {p.pid}" in note
        assert str(venv / "bin" / "python") in note
    finally:
        _stop(p)


def test_options_after_the_command_do_not_count():
    tp = tpy.TargetPython(1, "/usr/bin/python3", "/usr/bin/python3", None, "", True)
    for argv in (
        ("python", "-c", "pass", "-I"),
        ("python", "app.py", "-S"),
        ("python", "-m", "x", "-E"),
    ):
        assert tpy.TargetPython(**{**tp.__dict__, "argv": argv}).skips_hook() is None


def test_kdash_run_tree_with_a_scrubbed_environment_says_inject_instead(venv):
    """The root is armed, its Python child was started with an environment its parent
    cleared: the note names that child and the way out."""
    shell = subprocess.Popen(
        ["sh", "-c", f"env -i {venv}/bin/python -c 'import sys; sys.stdin.read()'"],
        stdin=subprocess.PIPE,
        env={**os.environ, "KDASH_AGENT": "1"},
    )
    try:
        deadline = time.monotonic() + 20
        child = None
        while child is None:
            assert time.monotonic() < deadline, "the child did not start"
            kids = Path(f"/proc/{shell.pid}/task/{shell.pid}/children").read_text().split()
            for k in kids:
                with_py = b"python" in Path(f"/proc/{k}/cmdline").read_bytes()
                if with_py:
                    child = int(k)
            time.sleep(0.02)
        tree = [tpy.target_python(shell.pid), tpy.target_python(child)]
        note = tpy.tree_note(shell.pid, tree, "KDASH_AGENT", "no socket")
        assert f"pid {child}" in note and "without the environment" in note
        assert f"kdash attach --pid {child}" in note
    finally:
        assert shell.stdin is not None
        shell.stdin.close()
        shell.wait(timeout=20)


def test_the_agent_source_of_a_kdash_run_tree_without_python_says_what_runs(tmp_path):
    """What `kdash run -- sleep 30` (headless or not) shows for kernels: the real situation,
    not "start the target with `kdash run`", which it was."""
    from kdash.collectors.agents import AgentTreeSource

    from kdash.target import Target

    sleeper = subprocess.Popen(["sleep", "30"], env={**os.environ, "KDASH_AGENT": "1"})
    try:
        deadline = time.monotonic() + 10
        while b"KDASH_AGENT=1" not in Path(f"/proc/{sleeper.pid}/environ").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.02)
        src = AgentTreeSource(Target(sleeper.pid), try_inject=False)
        src.start()
        why = str(src.health)
        assert why.startswith("unavailable:") and "run no Python" in why, why
        assert "start the target with `kdash run" not in why
    finally:
        sleeper.kill()
        sleeper.wait()


def test_attach_to_a_venv_target_advises_its_venv_python(venv):
    """`kdash attach --pid` to a Python running from a venv that lacks the agent's imports:
    the injection check's advice installs into that venv, not into the base interpreter."""
    from kdash.collectors.agents import AgentTreeSource

    from kdash.target import Target

    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    p = _start([str(venv / "bin" / "python")], env=env)
    try:
        src = AgentTreeSource(Target(p.pid))
        src.start()
        deadline = time.monotonic() + 60
        while src.injections.get(p.pid, "injecting") == "injecting":
            assert time.monotonic() < deadline, "the injection attempt did not end"
            time.sleep(0.1)
        src.poll(0)
        why = str(src.health)
        if src.injections[p.pid] == "ok":
            pytest.skip("the venv could import the agent's modules here")
        assert f"{venv}/bin/python -m pip install" in why, why
        assert f"{BASE_PYTHON} (pid" not in why
    finally:
        _stop(p)
