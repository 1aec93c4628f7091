"""The Python a target process really runs, and advice worded for it.

Advice such as "pip install cupti-python" is only useful when it names the interpreter the
target runs: a server started from a virtual environment has `/proc/PID/exe` pointing at the
base interpreter (a venv's `bin/python` is a symlink to it), and a bare `pip` on the user's
PATH may belong to a third Python. The target's own view is `sys.executable` (the path it was
started as) and `sys.prefix` (the venv, marked by a `pyvenv.cfg` beside or above that path);
both are read here from outside, from /proc:

- `/proc/PID/cmdline`'s first word, resolved against the target's PATH and folder, when it
  leads to the same file as `/proc/PID/exe`;
- a `pyvenv.cfg` in that path's folder or the one above (Python's own rule for a venv);
- else `VIRTUAL_ENV` from `/proc/PID/environ`, when that venv's `bin/python` is the running
  binary;
- else `/proc/PID/exe` itself (a system Python, pyenv, conda: its own `-m pip` is right).

`for_target(text, tp)` rewrites the `pip install` of an advice line into
`<that python> -m pip install`; `tree_note(...)` says why a `kdash run` tree has no agent
(no Python in it, an interpreter started with -I/-S/-E, an environment its parent cleared).
Only the standard library and kdash.target's environ reader: this runs on the poll thread.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from kdash.target import read_environ

_PY_NAME = re.compile(r"^(python|pypy)(\d+(\.\d+)*)?[a-z]?$")
_LIBPY = re.compile(rb"libpython\d")
# `pip install` not already run through an interpreter (`... -m pip install`)
_PIP = re.compile(r"(?<![\w/.-])(?<!-m )pip install\b")
# options that make Python skip the start-up hook `kdash run` arms it with
_SKIP_HOOK = {"I": "-I", "S": "-S", "E": "-E"}


@dataclass(frozen=True)
class TargetPython:
    pid: int
    exe: str | None  # /proc/PID/exe: the binary that runs (None: not readable)
    python: str | None  # the path to run this Python as the target does (its sys.executable)
    venv: str | None  # the virtual environment (the target's sys.prefix), when it runs in one
    how: str  # where the venv was seen: "pyvenv.cfg", "VIRTUAL_ENV", or ""
    is_python: bool
    argv: tuple[str, ...] = ()
    env: dict[str, str] | None = None  # None: the environment was not readable

    def pip(self) -> str:
        """The install command for this interpreter, e.g. `/srv/venv/bin/python -m pip install`."""
        return f"{shlex.quote(self.python)} -m pip install" if self.python else "pip install"

    def label(self) -> str:
        """`/srv/venv/bin/python (venv /srv/venv)`, or the interpreter alone, or the binary."""
        if self.python and self.venv:
            return f"{self.python} (venv {self.venv})"
        return self.python or self.exe or f"pid {self.pid}"

    def skips_hook(self) -> str | None:
        """The option (-I, -S or -E) this Python was started with that skips kdash run's
        start-up hook, or None."""
        args = self.argv[1:]
        i = 0
        while i < len(args):
            arg = args[i]
            if not arg.startswith("-") or arg in ("-", "--"):
                return None  # the script: the options are over
            if arg.startswith("--"):
                i += 1  # a long option (--version ...): none of them skips the hook
                continue
            letters = arg[1:]
            for k, ch in enumerate(letters):
                if ch in _SKIP_HOOK:
                    return _SKIP_HOOK[ch]
                if ch in "cm":
                    return None  # the rest is the command or module
                if ch in "WX":  # a value: the rest of this word, or the next word
                    i += k == len(letters) - 1
                    break
            i += 1
        return None


def target_python(pid: int, proc_root: Path = Path("/proc")) -> TargetPython:
    """What /proc says about the interpreter of `pid` (fields None where it cannot be read)."""
    base = proc_root / str(pid)
    try:
        exe: str | None = os.readlink(base / "exe")
    except OSError:
        exe = None
    try:
        argv = tuple(
            a.decode(errors="replace") for a in (base / "cmdline").read_bytes().split(b"\0") if a
        )
    except OSError:
        argv = ()
    try:
        env: dict[str, str] | None = read_environ(pid, proc_root)
    except OSError:
        env = None
    try:
        cwd: str | None = os.readlink(base / "cwd")
    except OSError:
        cwd = None
    is_py = bool(exe and _PY_NAME.match(os.path.basename(exe).removesuffix(" (deleted)")))
    if exe and not is_py:
        is_py = _maps_libpython(base)
    started_as = _started_as(argv[0] if argv else "", env, cwd, base / "exe")
    if started_as is not None:
        venv = _venv_of(started_as)
        if venv is not None:
            return TargetPython(pid, exe, started_as, venv, "pyvenv.cfg", is_py, argv, env)
    venv_env = (env or {}).get("VIRTUAL_ENV")
    if venv_env and os.path.isfile(os.path.join(venv_env, "pyvenv.cfg")):
        for name in ("python", "python3"):
            cand = os.path.join(venv_env, "bin", name)
            if _same_file(cand, base / "exe"):
                return TargetPython(pid, exe, cand, venv_env, "VIRTUAL_ENV", is_py, argv, env)
    return TargetPython(pid, exe, exe if is_py else None, None, "", is_py, argv, env)


def for_target(text: str, tp: TargetPython | None) -> str:
    """`text` with each bare `pip install` run through the target's interpreter, and the
    base binary replaced by the venv's interpreter where the text names it; unchanged when
    the interpreter is not known."""
    if not text or tp is None or not tp.python:
        return text
    pip = tp.pip()
    out = _PIP.sub(lambda _m: pip, text)
    if tp.venv and tp.exe and tp.exe != tp.python:
        # "<base binary> (pid N's interpreter)" is the venv's python to the user
        out = out.replace(f"{tp.exe} (pid {tp.pid}'s interpreter)", f"{tp.label()} (pid {tp.pid})")
    return out.replace(" in the target's Python (", " (")


def tree_note(root: int, tree: list[TargetPython], env_flag: str, why_no_socket: str) -> str:
    """Why a tree that `kdash run` started has no agent, worded for what runs in it.

    `tree` holds the root and its descendants; `env_flag` is the variable `kdash run` arms
    each process with; `why_no_socket` what the socket folders say (for an armed Python whose
    agent has no socket).
    """
    pythons = [t for t in tree if t.is_python]
    if not pythons:
        name = _name(next((t for t in tree if t.pid == root), None)) or f"pid {root}"
        return (
            f"pid {root} ({name}) and its children run no Python yet; kdash's agent runs inside "
            "Python processes (each one this tree starts gets it), so no kernels are recorded "
            "from other programs"
        )
    for t in pythons:
        flag = t.skips_hook()
        if flag:
            return (
                f"pid {t.pid} ({t.label()}) runs with {flag}, which skips the start-up hook "
                f"`kdash run` arms it with: start it without {flag}, or inject the agent with "
                f"`kdash attach --pid {t.pid}`"
            )
    for t in pythons:
        if t.env is not None and t.env.get(env_flag) != "1":
            return (
                f"pid {t.pid} ({t.label()}) was started without the environment `kdash run` "
                f"gave its parent (cleared or replaced on the way): inject the agent with "
                f"`kdash attach --pid {t.pid}`"
            )
    t = pythons[0]
    return (
        f"pid {t.pid} ({t.label()}) was started by `kdash run` but has no agent socket yet "
        f"({why_no_socket})"
    )


def armed(tp: TargetPython, env_flag: str) -> bool:
    """Was this process started with `kdash run`'s start-up hook armed?"""
    return tp.env is not None and tp.env.get(env_flag) == "1"


# ---- helpers --------------------------------------------------------------------------------


def _started_as(argv0: str, env: dict[str, str] | None, cwd: str | None, exe: Path) -> str | None:
    """argv[0] as a path, when it leads to the running binary (else None)."""
    if not argv0:
        return None
    if "/" in argv0:
        if os.path.isabs(argv0):
            cand = argv0
        elif cwd:
            cand = os.path.normpath(os.path.join(cwd, argv0))
        else:
            return None
    else:
        path = (env or {}).get("PATH")
        if path is None:
            return None
        cand = shutil.which(argv0, path=path) or ""
    return cand if cand and _same_file(cand, exe) else None


def _same_file(a: str | Path, b: str | Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False


def _venv_of(python: str) -> str | None:
    """The venv folder of an interpreter path: `pyvenv.cfg` beside it or one folder up."""
    here = os.path.dirname(os.path.abspath(python))
    for d in (here, os.path.dirname(here)):
        if os.path.isfile(os.path.join(d, "pyvenv.cfg")):
            return d
    return None


def _maps_libpython(base: Path) -> bool:
    """An embedded Python (uwsgi, a C++ server): libpython mapped into the process."""
    try:
        with open(base / "maps", "rb") as f:
            return any(_LIBPY.search(line) for line in f)
    except OSError:
        return False


def _name(tp: TargetPython | None) -> str:
    if tp is None:
        return ""
    if tp.argv:
        return os.path.basename(tp.argv[0])
    return os.path.basename(tp.exe or "")
