"""Getting the agent into a live Python process that was started without kdash.

`check_injectable(pid)` runs the preconditions in order and returns the first one that fails
as a one-line reason that says what to do; `inject(pid)` then starts the agent inside the
target. Nothing here is tried when a check fails, and `kdash attach --no-inject` never calls it.

Preconditions (why each matters):

* the process exists and is not a zombie;
* it has no agent yet (then there is nothing to do);
* it runs as our uid: the agent only accepts clients of its own uid (SO_PEERCRED), so even a
  root kdash could not talk to an agent it put into another user's process;
* it is Python (the executable or a mapped libpython says so), version 3.10 or newer;
* the kernel lets us trace it: `kernel.yama.ptrace_scope` 0, or 1 when the target is our
  descendant or we hold CAP_SYS_PTRACE, 2 only with CAP_SYS_PTRACE, 3 never;
* on 3.14+, remote debugging is not switched off in the target (PYTHON_DISABLE_REMOTE_DEBUG,
  `-X disable_remote_debug`);
* the target's interpreter, with the target's own environment and working folder, can import
  numpy and cupti-python (otherwise the agent would only say "unavailable"; better to say
  what to install now).

Mechanisms:

* Python 3.14+: `sys.remote_exec(pid, script)`, run by the target's own interpreter binary.
* Python 3.10-3.13 on x86_64 Linux: ptrace (`ptrace_session.py`). The main thread is
  stopped (PTRACE_SEIZE + PTRACE_INTERRUPT, no SIGSTOP), made to `mmap` two pages (the stub
  code, made read+execute only, and the data: boot code and result), and then pointed at a
  stub that calls `Py_AddPendingCall(PyRun_SimpleString, boot code)` and restores the thread's
  own registers, FPU state and signal mask with `rt_sigreturn`, and is released. CPython runs
  pending calls in the main thread at its next bytecode boundary, with the GIL held, so the
  boot code runs as ordinary Python: it loads the agent through loader.py by path and calls
  `start_agent()`. Py_AddPendingCall needs neither the GIL nor a thread state, which is why no
  other thread has to be stopped. The boot code catches everything (a pending call that fails
  without an exception set would raise SystemError into the target) and records failures in
  `<socket folder>/<pid>.unavailable`. Two 4 KiB pages stay mapped in the target afterwards.
  A main thread stopped inside a sleep or poll syscall (`WAITING_SYSCALLS`: one long
  `time.sleep`, an idle event loop's epoll_wait, a blocking zmq poll) runs no bytecode until it
  wakes, which may be never on an idle server; there the stub calls `PyGILState_Ensure`,
  `PyRun_SimpleString` and `PyGILState_Release` instead, as a C callback would. Those
  syscalls are made with the GIL released, at a point where the interpreter is between
  operations, and the syscall is re-issued when the thread's state is restored, so the wait
  goes on to its end.
  Every call the thread makes for us returns into code that restores its state, and the
  session runs in a helper process of its own session with terminal signals blocked: killing
  kdash, or the helper, at any moment leaves the target running (see ptrace_session.py).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import platform
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kdash.collectors.agent import bootstrap, loader, ptrace_session, server
from kdash.collectors.agent.client import agent_failure_note, find_agent_socket

CAP_SYS_PTRACE = 19
MIN_PYTHON = (3, 10)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


@dataclass
class Injectability:
    """The verdict of `check_injectable`: `reason` is the one line to show when not `ok`."""

    pid: int
    ok: bool = False
    reason: str = ""
    method: str | None = None  # "remote_exec" | "ptrace" | "already"
    python: str | None = None  # "3.12"
    exe: str | None = None
    checks: list[Check] = field(default_factory=list)

    def fail(self, name: str, detail: str) -> Injectability:
        self.checks.append(Check(name, False, detail))
        self.ok, self.reason = False, detail
        return self

    def passed(self, name: str, detail: str = "") -> None:
        self.checks.append(Check(name, True, detail))


# ---- small readers of /proc -----------------------------------------------------------------


def _status_fields(pid: int) -> dict[str, str]:
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            out[k] = v.strip()
    return out


def has_cap_sys_ptrace() -> bool:
    try:
        cap = int(_status_fields(os.getpid()).get("CapEff", "0"), 16)
    except (OSError, ValueError):
        return False
    return bool(cap >> CAP_SYS_PTRACE & 1)


def ptrace_scope() -> int:
    """kernel.yama.ptrace_scope; 0 when Yama is not there (classic ptrace rules)."""
    try:
        return int(Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip())
    except (OSError, ValueError):
        return 0


def is_descendant(pid: int, ancestor: int | None = None) -> bool:
    ancestor = os.getpid() if ancestor is None else ancestor
    seen = 0
    while pid > 1 and seen < 4096:
        try:
            ppid = int(_status_fields(pid).get("PPid", "0"))
        except (OSError, ValueError):
            return False
        if ppid == ancestor:
            return True
        pid, seen = ppid, seen + 1
    return False


def ptrace_refusal(scope: int, descendant: bool, cap: bool) -> str | None:
    """Why Yama would refuse our attach, or None (same uid is checked separately)."""
    if scope <= 0:
        return None
    if scope == 1:
        if descendant or cap:
            return None
        return (
            "kernel.yama.ptrace_scope=1 lets you attach only to your own child processes: "
            "start the target with `kdash run -- CMD`, or run `sudo sysctl "
            "kernel.yama.ptrace_scope=0`, or run kdash with CAP_SYS_PTRACE"
        )
    if scope == 2:
        if cap:
            return None
        return (
            "kernel.yama.ptrace_scope=2 allows attaching only with CAP_SYS_PTRACE: run kdash "
            "as root (containers: --cap-add SYS_PTRACE), or start the target with `kdash run`"
        )
    return (
        f"kernel.yama.ptrace_scope={scope} forbids attaching to any process until reboot: "
        "start the target with `kdash run -- CMD`"
    )


_maps = ptrace_session.read_maps


_LIBPY = re.compile(r"libpython(3\.\d+)")
_EXEPY = re.compile(r"python(3\.\d+)")


def python_version_of(pid: int, exe: str) -> tuple[str | None, str | None]:
    """("3.12", where it was seen) from a mapped libpython or the executable's name."""
    try:
        for *_x, path in _maps(pid):
            m = _LIBPY.search(os.path.basename(path))
            if m:
                return m.group(1), path
    except OSError:
        pass  # fall through to the executable's name
    m = _EXEPY.search(os.path.basename(exe))
    if m:
        return m.group(1), exe
    return None, None


def _target_env(pid: int) -> dict[str, str]:
    from kdash.target import read_environ

    return read_environ(pid)


_PROBE = """
import importlib.util, json, sys
out = {"version": "%d.%d" % sys.version_info[:2], "missing": []}
for name in ("numpy", "cupti"):
    try:
        if importlib.util.find_spec(name) is None:
            out["missing"].append(name)
    except Exception as e:
        out["missing"].append(name + " (" + type(e).__name__ + ")")
print(json.dumps(out))
"""


def target_interpreter(pid: int, env: dict[str, str], cwd: str) -> str:
    """The interpreter path to re-run for the target, as the target itself was started.

    Not /proc/<pid>/exe: that resolves a virtual environment's `bin/python` symlink to the
    base interpreter, which then no longer finds the venv's site-packages (seen on the H200:
    "cannot import numpy" for a target that had it). argv[0] as started, resolved against
    the target's PATH and folder, keeps the venv; /proc/<pid>/exe is the fallback.
    """
    import shutil

    try:
        argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
    except (OSError, UnicodeDecodeError, IndexError):
        argv0 = ""
    if argv0:
        if "/" in argv0:
            cand = argv0 if os.path.isabs(argv0) else os.path.join(cwd, argv0)
        else:
            cand = shutil.which(argv0, path=env.get("PATH")) or ""
        if cand and os.access(cand, os.X_OK):
            try:
                if os.path.samefile(os.path.realpath(cand), f"/proc/{pid}/exe"):
                    return cand
            except OSError:
                pass  # not comparable: use the executable itself below
    return f"/proc/{pid}/exe"


def probe_interpreter(pid: int, exe: str) -> tuple[dict | None, str]:
    """Run the target's interpreter with the target's environment and folder: its version and
    which of numpy / cupti-python it cannot find."""
    try:
        env = _target_env(pid)
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError as e:
        return None, f"cannot read pid {pid}'s environment ({e})"
    interp = target_interpreter(pid, env, cwd)
    env = bootstrap.disarmed_env(env)  # the probe itself must not start an agent
    try:
        r = subprocess.run(
            [interp, "-c", _PROBE],
            env=env,
            cwd=cwd if os.path.isdir(cwd) else None,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"cannot run {exe} ({e})"
    if r.returncode != 0:
        return None, f"{exe} failed to start: {r.stderr.strip()[-300:]}"
    try:
        return json.loads(r.stdout.strip().splitlines()[-1]), ""
    except (ValueError, IndexError):
        return None, f"{exe} printed {r.stdout.strip()[-200:]!r}"


# ---- the checks -----------------------------------------------------------------------------


def check_injectable(pid: int, probe: bool = True) -> Injectability:
    """Every precondition of `inject(pid)`, in order; the first failure is the reason."""
    v = Injectability(pid)
    st = _check_exists(v, pid)
    if st is None:
        return v
    sock = find_agent_socket(pid)
    if sock:
        v.passed("agent", f"already has an agent at {sock}")
        v.ok, v.method, v.reason = True, "already", f"pid {pid} already has a kdash agent"
        return v
    v.passed("agent", "none yet")
    if not (_check_uid(v, pid, st) and _check_python(v, pid) and _check_mechanism(v, pid)):
        return v
    why = ptrace_refusal(ptrace_scope(), is_descendant(pid), has_cap_sys_ptrace())
    if why:
        return v.fail("ptrace_scope", why)
    v.passed("ptrace_scope", f"kernel.yama.ptrace_scope={ptrace_scope()}")
    if probe and not _check_imports(v, pid, v.exe or ""):
        return v
    v.ok = True
    return v


# Each check below records itself in `v` and returns whether the next one may run.


def _check_exists(v: Injectability, pid: int) -> dict[str, str] | None:
    """The process's /proc status fields, or None (and the reason in `v`)."""
    try:
        st = _status_fields(pid)
    except FileNotFoundError:
        v.fail("exists", f"no such process: {pid}")
        return None
    except OSError as e:
        v.fail("exists", f"cannot read /proc/{pid}/status ({e})")
        return None
    if st.get("State", "").startswith("Z"):
        v.fail("exists", f"process {pid} has exited (zombie)")
        return None
    v.passed("exists")
    return st


def _check_uid(v: Injectability, pid: int, st: dict[str, str]) -> bool:
    uid = int(st.get("Uid", "-1").split()[1]) if st.get("Uid") else -1
    me = os.geteuid()
    if uid != me:
        v.fail(
            "uid",
            f"pid {pid} runs as uid {uid} and kdash as uid {me}: the agent accepts only its "
            f"own user, so run kdash as that user (e.g. `sudo -u '#{uid}' kdash attach ...`)",
        )
        return False
    v.passed("uid", f"uid {uid}")
    return True


def _check_python(v: Injectability, pid: int) -> bool:
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
    except OSError as e:
        v.fail("python", f"cannot read pid {pid}'s executable ({e})")
        return False
    v.exe = exe
    ver, seen = python_version_of(pid, exe)
    if ver is None:
        v.fail(
            "python",
            f"pid {pid} is not a Python process ({exe}); kernel activity of non-Python "
            "programs needs them started under a CUPTI tool",
        )
        return False
    v.python = ver
    if tuple(int(x) for x in ver.split(".")) < MIN_PYTHON:
        v.fail("python", f"pid {pid} runs Python {ver}; the kdash agent needs Python 3.10 or newer")
        return False
    v.passed("python", f"Python {ver} ({seen})")
    return True


def _check_mechanism(v: Injectability, pid: int) -> bool:
    """sys.remote_exec on 3.14+ (unless the target switched remote debugging off), else ptrace
    (x86_64 only)."""
    if tuple(int(x) for x in (v.python or "0.0").split(".")) < (3, 14):
        v.method = "ptrace"
        if platform.machine() != "x86_64":
            v.fail(
                "arch",
                f"ptrace injection is built for x86_64 only, not {platform.machine()}: start "
                "the target with `kdash run -- CMD`",
            )
            return False
        v.passed("arch", "x86_64")
        return True
    v.method = "remote_exec"
    try:
        env = _target_env(pid)
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError as e:
        v.fail("remote_debug", f"cannot read pid {pid}'s environment ({e})")
        return False
    if env.get("PYTHON_DISABLE_REMOTE_DEBUG") or b"disable_remote_debug" in b" ".join(cmd):
        v.fail(
            "remote_debug",
            f"pid {pid} was started with remote debugging disabled "
            "(PYTHON_DISABLE_REMOTE_DEBUG or -X disable_remote_debug): restart it without",
        )
        return False
    v.passed("remote_debug")
    return True


def _check_imports(v: Injectability, pid: int, exe: str) -> bool:
    """The target's interpreter, run as the target was, finds numpy and cupti-python."""
    info, err = probe_interpreter(pid, exe)
    if info is None:
        v.fail("imports", err)
        return False
    missing = [m for m in info.get("missing", []) if not m.startswith("cupti")]
    if missing:
        v.fail(
            "imports",
            f"{exe} (pid {pid}'s interpreter) cannot import {', '.join(missing)}: "
            f"pip install numpy into that environment",
        )
        return False
    if any(m.startswith("cupti") for m in info.get("missing", [])):
        hint = server.install_hint(server.driver_cuda_version()[0])
        v.fail("imports", f"{exe} (pid {pid}'s interpreter) cannot import cupti-python: {hint}")
        return False
    v.passed("imports", "numpy and cupti-python found")
    return True


# ---- the boot code that runs inside the target ----------------------------------------------


def boot_code(pid: int) -> str:
    """Python source run inside the target: load the agent's loader by path, load the agent
    with it (loader.load_agent), start it, never raise.

    Names it defines in `__main__` are removed again; failures go to the `.unavailable` note
    that the client reads.
    """
    loader_py = str(Path(loader.__file__).resolve())
    pkgs = os.pathsep.join(bootstrap.package_dirs())
    note = os.path.join(server.socket_dirs()[0], f"{pid}.unavailable")
    return (
        "def _kdash_boot():\n"
        "    import importlib.util, os, sys\n"
        "    name = 'kdash.collectors.agent.loader'\n"
        "    mod = sys.modules.get(name)\n"
        "    if mod is None:\n"
        f"        spec = importlib.util.spec_from_file_location(name, {loader_py!r})\n"
        "        mod = importlib.util.module_from_spec(spec)\n"
        "        sys.modules[name] = mod\n"
        "        try:\n"
        "            spec.loader.exec_module(mod)\n"
        "        except BaseException:\n"
        "            sys.modules.pop(name, None)\n"
        "            raise\n"
        f"    os.environ.setdefault('KDASH_AGENT_PKGS', {pkgs!r})\n"
        "    mod = mod.load_agent()\n"
        "    if mod.start_agent() is None:\n"
        "        raise RuntimeError('the agent could not listen: ' + mod.start_error())\n"
        "try:\n"
        "    _kdash_boot()\n"
        "except BaseException as _kdash_e:\n"
        "    try:\n"
        f"        with open({note!r}, 'w') as _kdash_f:\n"
        "            _kdash_f.write('injected agent failed: %s: %s' % (type(_kdash_e).__name__,"
        " _kdash_e))\n"
        "        del _kdash_f\n"
        "    except BaseException:\n"
        "        pass  # not even the note could be written: nowhere left to report\n"
        "finally:\n"
        "    _kdash_boot = None\n"
        "    del _kdash_boot\n"
    )


# ---- ELF symbols ------------------------------------------------------------------------------


def elf_dynamic_symbols(path: str, wanted: set[str]) -> tuple[dict[str, int], int, int]:
    """({name: st_value} for `wanted` from .dynsym, e_type, lowest PT_LOAD vaddr) of a 64-bit
    little-endian ELF file."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise InjectError(f"{path} is not a 64-bit little-endian ELF file")
    e_type = struct.unpack_from("<H", data, 16)[0]
    e_phoff, e_shoff = struct.unpack_from("<QQ", data, 32)
    e_phentsize, e_phnum, e_shentsize, e_shnum = struct.unpack_from("<HHHH", data, 54)
    low = None
    for i in range(e_phnum):
        p_type, _flags, _off, p_vaddr = struct.unpack_from("<IIQQ", data, e_phoff + i * e_phentsize)
        if p_type == 1 and (low is None or p_vaddr < low):  # PT_LOAD
            low = p_vaddr
    sections = []
    for i in range(e_shnum):
        sh = struct.unpack_from("<IIQQQQIIQQ", data, e_shoff + i * e_shentsize)
        sections.append(sh)  # name, type, flags, addr, offset, size, link, info, align, entsize
    found: dict[str, int] = {}
    for sh in sections:
        if sh[1] != 11:  # SHT_DYNSYM
            continue
        strtab = sections[sh[6]]
        str_off = strtab[4]
        for j in range(sh[5] // 24):
            st_name, _info, _other, st_shndx, st_value, _size = struct.unpack_from(
                "<IBBHQQ", data, sh[4] + j * 24
            )
            if not st_value or st_shndx == 0:
                continue
            end = data.index(b"\0", str_off + st_name)
            name = data[str_off + st_name : end].decode(errors="replace")
            if name in wanted:
                found[name] = st_value
    return found, e_type, (low or 0) & ~0xFFF


def resolve_symbols(pid: int, wanted: set[str], path_pattern: re.Pattern[str]) -> dict[str, int]:
    """Addresses in `pid` of `wanted` symbols exported by a mapped file matching the pattern."""
    maps = _maps(pid)
    paths = []
    for *_x, path in maps:
        wanted_file = path.startswith("/") and path_pattern.search(os.path.basename(path))
        if wanted_file and path not in paths:
            paths.append(path)
    for path in paths:
        base = min((lo for lo, _hi, _p, off, pth in maps if pth == path and off == 0), default=None)
        if base is None:
            continue
        try:
            syms, e_type, low = elf_dynamic_symbols(f"/proc/{pid}/root{path}", wanted)
        except (OSError, InjectError):
            continue
        if not wanted.issubset(syms):
            continue
        bias = 0 if e_type == 2 else base - low  # ET_EXEC: absolute addresses
        return {k: bias + v for k, v in syms.items()}
    raise InjectError(
        f"could not find {', '.join(sorted(wanted))} in pid {pid}'s mapped files "
        f"(looked in {len(paths)} matching {path_pattern.pattern!r})"
    )


# ---- ptrace ---------------------------------------------------------------------------------


class InjectError(Exception):
    """Injection failed; the message is the one line to show."""


WAITING_SYSCALLS = ptrace_session.WAITING_SYSCALLS
blocked_in = ptrace_session.blocked_in
SESSION_PY = Path(ptrace_session.__file__).resolve()
# The helper's own work takes milliseconds; the rest is waiting for the stub's done mark
# (a main thread that waits in a syscall first takes the GIL, which may be busy for a while).
DONE_WAIT_S = 30.0
HELPER_WAIT_S = DONE_WAIT_S + 60.0

# An in-process session (see `_session`) is safe to abandon at any instant, but abandoning it
# leaves the agent unstarted; kdash's exit waits for an open one so the injection completes.
_IN_FLIGHT = threading.Lock()
EXIT_WAIT_S = 120.0


def _wait_for_injection_at_exit() -> None:
    if _IN_FLIGHT.acquire(timeout=EXIT_WAIT_S):
        _IN_FLIGHT.release()


atexit.register(_wait_for_injection_at_exit)


def helper_can_trace() -> bool:
    """Whether a helper process (a child of kdash, not an ancestor of the target) may trace:
    Yama's ptrace_scope=1 lets only ancestors trace without CAP_SYS_PTRACE, and the target,
    which passed `ptrace_refusal` as kdash's descendant, is no descendant of the helper."""
    scope = ptrace_scope()
    return scope <= 0 or has_cap_sys_ptrace()


def _run_helper(request: dict) -> dict:
    """The session in a helper process in its own session (setsid): a hang-up of kdash's
    terminal or a signal to kdash's process group does not reach it, and it finishes the
    session and exits if kdash dies meanwhile. It is never killed from here: abandoning it
    is safe, killing it would only leave the agent unstarted."""
    proc = subprocess.Popen(
        [sys.executable, "-I", "-S", str(SESSION_PY)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    try:
        out, err = proc.communicate(json.dumps(request).encode(), timeout=HELPER_WAIT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"the injection helper (pid {proc.pid}) did not finish in "
                f"{HELPER_WAIT_S:.0f} s"}  # fmt: skip
    try:
        return json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = err.decode(errors="replace").strip()[-300:]
        return {"error": f"the injection helper exited with {proc.returncode}: {tail}"}


def _run_in_process(request: dict) -> dict:
    """The session in this thread, with the signals a terminal or supervisor sends blocked in
    it (other threads of kdash may still take them; the session is safe if kdash dies)."""
    with _IN_FLIGHT:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, ptrace_session.HELPER_BLOCKED)
        try:
            return ptrace_session.run_session(request)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _session(request: dict, helper: bool | None) -> dict:
    if helper is None:
        helper = helper_can_trace()
    if helper:
        result = _run_helper(request)
        if not result.get("seize_refused"):
            return result
        # the helper may lack a right kdash has (capabilities not inherited over exec):
        # nothing was changed in the target when the seize failed, so try from here
    return _run_in_process(request)


def inject_ptrace(pid: int, helper: bool | None = None) -> str:
    """Run the boot code in pid's main thread: at once when the thread waits in a sleep/poll
    syscall (see WAITING_SYSCALLS), else as a CPython pending call at its next bytecode (see
    the module doc and ptrace_session.py). Returns how: "pending call" or "run in <syscall>".

    `helper`: run the session in a helper process (True), here (False), or whichever the
    kernel allows (None)."""
    code = boot_code(pid)
    if len(code.encode()) + 1 > 4096 - ptrace_session.D_CODE:
        raise InjectError(f"boot code is {len(code.encode())} bytes, more than one page")
    py = resolve_symbols(
        pid,
        {"Py_AddPendingCall", "PyRun_SimpleString", "PyGILState_Ensure", "PyGILState_Release"},
        re.compile(r"libpython3|python3"),
    )
    libc = resolve_symbols(pid, {"mmap", "mprotect"}, re.compile(r"^libc[.-]"))
    request = {"pid": pid, "code": code, "fn": {**py, **libc}, "done_wait_s": DONE_WAIT_S}
    result = _session(request, helper)
    if "error" in result:
        raise InjectError(result["error"])
    rc = result.get("rc")
    if result["how"] == "pending call" and rc not in (0, None):
        raise InjectError(f"Py_AddPendingCall in pid {pid} returned {rc} (queue full?)")
    return result["how"]


def inject_remote_exec(pid: int, exe: str) -> None:
    """Python 3.14+: the target's own interpreter calls sys.remote_exec(pid, script)."""
    folder = server.socket_dirs()[0]
    server.ensure_private_dir(folder)
    script = os.path.join(folder, f"inject-{pid}.py")
    with open(script, "w") as f:
        f.write(boot_code(pid))
    r = subprocess.run(
        [f"/proc/{pid}/exe", "-c", f"import sys; sys.remote_exec({pid}, {script!r})"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if r.returncode != 0:
        raise InjectError(f"sys.remote_exec into pid {pid} failed: {r.stderr.strip()[-300:]}")


def inject(pid: int, wait_s: float = 5.0, checked: Injectability | None = None) -> str | None:
    """Start the agent in `pid`; None once its socket is there, else the reason (one line).

    The boot code runs when the target's main thread next executes Python bytecode (or at
    once when it waits in a sleep/poll syscall), so a target whose main thread is blocked in
    other C code for long may take longer than `wait_s`.
    """
    v = checked or check_injectable(pid)
    if not v.ok:
        return v.reason
    if v.method == "already":
        return None
    with contextlib.suppress(OSError):
        server.ensure_private_dir(server.socket_dirs()[0])
    try:
        if v.method == "remote_exec":
            inject_remote_exec(pid, v.exe or "")
        else:
            inject_ptrace(pid)
    except (InjectError, OSError, subprocess.SubprocessError) as e:
        return f"injection into pid {pid} failed: {e}"
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if find_agent_socket(pid):
            return None
        note = agent_failure_note(pid)
        if note:
            return f"injected, but the agent did not start in pid {pid}: {note}"
        time.sleep(0.02)
    return (
        f"injected into pid {pid}, but no agent after {wait_s:.0f} s: its main thread has not "
        "run Python code since (blocked in C?); try again, or start it with `kdash run`"
    )
