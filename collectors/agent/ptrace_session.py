"""The ptrace session that starts kdash's agent in a Python 3.10-3.13 process (x86_64 Linux).

Standard library only: `inject.py` runs this file as a helper process (`python -I -S
ptrace_session.py`, request as JSON on stdin, result as JSON on stdout) in its own session,
so a terminal hang-up or a signal to kdash does not reach it, or, where Yama allows only
ancestors to trace (`ptrace_scope=1` without CAP_SYS_PTRACE), calls `run_session` in-process.

The one rule the session keeps: at every instant its tracer may vanish (SIGKILL, OOM killer),
and the kernel then lets the thread run on from whatever registers it has. So the thread's
registers are only ever in one of two states:

* its own, as the tracer found them (nothing to undo; the stack below the red zone, which the
  session writes, is dead memory by the ABI), or
* pointing at a call that ends by restoring its own state with `rt_sigreturn` from a signal
  frame the session wrote below the red zone before changing a register: general registers,
  flags, the FPU/SSE/AVX state and the signal mask, as the kernel restores them after a signal
  handler. A syscall the thread was interrupted in is re-issued (the frame resumes at the
  `syscall` instruction with the syscall's number), because sigreturn discards the kernel's
  own restart state.

Steps, each started from a stop and each safe to abandon at any point:

1. `mmap` two pages (RW) at a free address the session picks, returning into libc's own
   `rt_sigreturn` trampoline (`__restore_rt`); the session sees the mapping appear in
   /proc/<pid>/maps instead of waiting for the call to return.
2. The stub code is written into the first page, and `mprotect` makes it read+execute only.
3. The thread is pointed at the stub and detached. The stub calls `Py_AddPendingCall` (or, in a
   sleep/poll syscall, `PyGILState_Ensure`, `PyRun_SimpleString`, `PyGILState_Release`),
   writes its result and a done mark into the data page, and sigreturns. Nothing after the
   detach needs a tracer; the session reads the result through /proc/<pid>/mem.

A stop interrupts the thread wherever it is, possibly still inside an earlier step's path;
since each step saves that state in its own frame and restores it, the steps compose.
The only ptrace stops the session ever leaves the thread in are PTRACE_EVENT_STOPs (the kernel
discards those when the tracer goes) or signal-delivery stops of the target's own signals,
which the kernel then delivers as it would have anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import struct
import sys
import time
from typing import Any

PAGE = 4096
MASK64 = 0xFFFFFFFFFFFFFFFF

PTRACE_CONT = 7
PTRACE_GETREGS = 12
PTRACE_SETREGS = 13
PTRACE_GETFPREGS = 14
PTRACE_DETACH = 17
PTRACE_GETREGSET = 0x4204
PTRACE_SEIZE = 0x4206
PTRACE_INTERRUPT = 0x4207
PTRACE_GETSIGMASK = 0x420A
PTRACE_EVENT_STOP = 128
NT_X86_XSTATE = 0x202
WALL = 0x40000000
_NAMES = {
    PTRACE_CONT: "PTRACE_CONT",
    PTRACE_GETREGS: "PTRACE_GETREGS",
    PTRACE_SETREGS: "PTRACE_SETREGS",
    PTRACE_GETFPREGS: "PTRACE_GETFPREGS",
    PTRACE_DETACH: "PTRACE_DETACH",
    PTRACE_GETREGSET: "PTRACE_GETREGSET",
    PTRACE_SEIZE: "PTRACE_SEIZE",
    PTRACE_INTERRUPT: "PTRACE_INTERRUPT",
    PTRACE_GETSIGMASK: "PTRACE_GETSIGMASK",
}

PROT_READ, PROT_WRITE, PROT_EXEC = 1, 2, 4
MAP_PRIVATE, MAP_ANONYMOUS, MAP_FIXED_NOREPLACE = 0x02, 0x20, 0x100000

# the kernel's internal "restart me" errors, as a syscall interrupted by our stop returns them
ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK = 512, 513, 514, 516
EFLAGS_TF, EFLAGS_DF = 0x100, 0x400
RED_ZONE = 128
FP_XSTATE_MAGIC1, FP_XSTATE_MAGIC2 = 0x46505853, 0x46505845
UC_FP_XSTATE, UC_SIGCONTEXT_SS, UC_STRICT_RESTORE_SS = 1, 2, 4
SIGRETURN_GADGETS = (
    b"\x48\xc7\xc0\x0f\x00\x00\x00\x0f\x05",  # mov $15,%rax; syscall (glibc, musl __restore_rt)
    b"\xb8\x0f\x00\x00\x00\x0f\x05",  # mov $15,%eax; syscall
)

# data page layout (second page of the mapping)
D_RESULT, D_DONE, D_SIGRETURN_SP, D_CODE = 0, 8, 16, 64
DONE_MARK = 0x454E4F444853414B  # "KASHDONE", so a zeroed page never reads as done
WAITING_STUB_AT = 0x100

# x86_64 syscalls that CPython and well-behaved extensions make with the GIL released, waiting
# for time or I/O (see inject.py's module doc); futex is not here: it is also the GIL's wait.
WAITING_SYSCALLS = {
    7: "poll",
    23: "select",
    35: "nanosleep",
    230: "clock_nanosleep",
    232: "epoll_wait",
    270: "pselect6",
    271: "ppoll",
    281: "epoll_pwait",
    441: "epoll_pwait2",
}

# struct user_regs_struct (x86_64), in order
_REGS = [
    *("r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx"),
    *("rdx", "rsi", "rdi", "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base"),
    *("gs_base", "ds", "es", "fs", "gs"),
]
# struct sigcontext (x86_64): these 18 words, then cs, gs, fs, ss (u16 each), err, trapno,
# oldmask, cr2, fpstate, reserved[8]
_SIGCONTEXT_WORDS = [
    *("r8", "r9", "r10", "r11", "r12", "r13", "r14", "r15", "rdi", "rsi", "rbp", "rbx"),
    *("rdx", "rax", "rcx", "rsp", "rip", "eflags"),
]


class Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in _REGS]


class _IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class SessionError(Exception):
    """The session stopped; the message is the one line to show."""

    def __init__(self, message: str, seize_refused: bool = False) -> None:
        super().__init__(message)
        self.seize_refused = seize_refused


def _signed(x: int) -> int:
    return ctypes.c_longlong(x & MASK64).value


def _pause() -> None:
    """Widens the windows between the session's steps, for the tests that kill the tracer at
    random moments (KDASH_PTRACE_PAUSE_S); zero otherwise."""
    pause = float(os.environ.get("KDASH_PTRACE_PAUSE_S") or 0)
    if pause > 0:
        time.sleep(pause)


# ---- /proc readers ---------------------------------------------------------------------------


def read_maps(pid: int) -> list[tuple[int, int, str, int, str]]:
    """(start, end, perms, file offset, path) per mapping of `pid`."""
    out = []
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.split(None, 5)
            if len(parts) < 5:
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            path = parts[5].strip() if len(parts) == 6 else ""
            out.append((lo, hi, parts[1], int(parts[2], 16), path))
    return out


def blocked_in(pid: int) -> str | None:
    """The waiting syscall the (stopped) main thread is in, by name, or None."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split()[0]
    except (OSError, IndexError):
        return None
    return WAITING_SYSCALLS.get(int(first)) if first.lstrip("-").isdigit() else None


def free_address(maps: list[tuple[int, int, str, int, str]], size: int) -> int:
    """An address for `size` bytes well inside a large hole of the address space: 16 MiB above
    the hole's bottom, so it neither touches a neighbour (no merged mapping to mistake for
    ours) nor sits where the kernel's top-down allocator hands out the next mapping."""
    spans = sorted((lo, hi) for lo, hi, *_x in maps if hi <= 0x7FFFFFFFF000)
    for (_lo, prev_hi), (next_lo, _hi) in zip(spans, spans[1:], strict=False):
        if prev_hi >= 0x10000000 and next_lo - prev_hi >= (64 << 20):
            return prev_hi + (16 << 20)
    raise SessionError("no free 64 MiB hole in the target's address space for the agent's page")


def find_sigreturn_gadget(pid: int, maps: list[tuple[int, int, str, int, str]]) -> int:
    """The address of an `rt_sigreturn` trampoline in an executable mapping of libc (glibc and
    musl both keep one for sigaction's sa_restorer), found by its bytes in the file."""
    files = [m for m in maps if "x" in m[2] and m[4].startswith("/")]
    files.sort(key=lambda m: "libc" not in os.path.basename(m[4]))  # libc first
    for lo, hi, _perms, off, path in files:
        try:
            with open(f"/proc/{pid}/root{path}", "rb") as f:
                f.seek(off)
                text = f.read(hi - lo)
        except OSError:
            continue
        for gadget in SIGRETURN_GADGETS:
            at = text.find(gadget)
            if at >= 0:
                return lo + at
    raise SessionError(f"no rt_sigreturn trampoline found in pid {pid}'s executable mappings")


# ---- frames and stub code ----------------------------------------------------------------------


def resume_state(regs: Regs) -> Regs:
    """The registers to resume the thread with after our detour, without the kernel's help: a
    syscall the stop interrupted (orig_rax >= 0, rax a restart code) is re-issued with its
    own arguments (rip back over the 2-byte `syscall`, rax its number), as the kernel would
    restart it; anything else resumes exactly where it was."""
    out = Regs.from_buffer_copy(regs)
    restart = (ERESTARTSYS, ERESTARTNOINTR, ERESTARTNOHAND, ERESTART_RESTARTBLOCK)
    if _signed(regs.orig_rax) >= 0 and -_signed(regs.rax) in restart:
        out.rax = regs.orig_rax
        out.rip = regs.rip - 2
    return out


def fp_image(xstate: bytes | None, fxsave: bytes) -> tuple[bytes, int]:
    """The FPU state as a signal frame holds it, and the uc_flags bit that goes with it.

    ptrace hands out the XSAVE image with XCR0 in the first word of the software-reserved
    bytes; a signal frame has the kernel's fx_sw_bytes there and a second magic after the
    image, without which the kernel restores only the legacy 512-byte part."""
    if not xstate or len(xstate) < 576:
        return fxsave, 0
    xcr0 = struct.unpack_from("<Q", xstate, 464)[0]
    size = len(xstate)
    sw = struct.pack("<IIQI", FP_XSTATE_MAGIC1, size + 4, xcr0, size).ljust(48, b"\0")
    return xstate[:464] + sw + xstate[512:] + struct.pack("<I", FP_XSTATE_MAGIC2), UC_FP_XSTATE


def build_frame(regs: Regs, fp: bytes, uc_fp: int, sigmask: int, ret: int) -> tuple[int, bytes]:
    """A signal frame (rt_sigframe) below `regs`' red zone that resumes `resume_state(regs)`.

    Returns (base, bytes to write at base). The frame's return-address slot is at base+8 and
    holds `ret`, so a function called with rsp = base+8 returns into `ret` with rsp where
    rt_sigreturn looks for the frame (rsp-8); base+8 is 8 mod 16, as rsp is at a function's
    entry. The FPU image is 64-byte aligned at base+512, as XRSTOR needs."""
    res = resume_state(regs)
    total = 512 + len(fp)
    base = (regs.rsp - RED_ZONE - 256 - total) & ~63
    words = [getattr(res, n) & MASK64 for n in _SIGCONTEXT_WORDS]
    sc = struct.pack("<18Q", *words)
    sc += struct.pack("<4H", res.cs & 0xFFFF, 0, 0, res.ss & 0xFFFF)
    sc += struct.pack("<5Q", 0, 0, 0, 0, base + 512) + b"\0" * 64  # err..cr2, fpstate, reserved
    assert len(sc) == 256
    uc_flags = uc_fp | UC_SIGCONTEXT_SS | UC_STRICT_RESTORE_SS
    # uc_stack: ss_flags 3 is no valid mode, so sigreturn's sigaltstack step leaves the thread's
    # alternate signal stack as it is (the kernel ignores that step's errors other than EFAULT)
    uc = struct.pack("<QQQiiQ", uc_flags, 0, 0, 3, 0, 0) + sc + struct.pack("<Q", sigmask)
    assert len(uc) == 304
    frame = struct.pack("<QQ", 0, ret & MASK64) + uc
    frame = frame.ljust(512, b"\0") + fp
    assert len(frame) == total
    return base, frame


def _imm(x: int) -> bytes:
    return struct.pack("<Q", x & MASK64)


def _stub_tail(data: int) -> bytes:
    return (
        b"\x48\xb8" + _imm(DONE_MARK)  # mov rax, DONE_MARK
        + b"\x48\xa3" + _imm(data + D_DONE)  # movabs [done], rax
        + b"\x48\xa1" + _imm(data + D_SIGRETURN_SP)  # movabs rax, [sigreturn sp]
        + b"\x48\x89\xc4"  # mov rsp, rax
        + b"\xb8\x0f\x00\x00\x00"  # mov eax, 15 (rt_sigreturn)
        + b"\x0f\x05"  # syscall: never returns
        + b"\x0f\x0b"  # ud2
    )  # fmt: skip


def stub_code(fn: dict[str, int], data: int) -> bytes:
    """The code page: the pending-call stub at 0, the in-a-wait stub at WAITING_STUB_AT. Entered
    with rsp 16-byte aligned below the frame, so `call` meets the ABI; rbx (callee-saved)
    carries PyGILState_Ensure's result over the calls."""
    code = data + D_CODE
    pending = (
        b"\x48\xbf" + _imm(fn["PyRun_SimpleString"])  # mov rdi, PyRun_SimpleString
        + b"\x48\xbe" + _imm(code)  # mov rsi, boot code
        + b"\x48\xb8" + _imm(fn["Py_AddPendingCall"])  # mov rax, Py_AddPendingCall
        + b"\xff\xd0"  # call rax
        + b"\x48\xa3" + _imm(data + D_RESULT)  # movabs [result], rax
        + _stub_tail(data)
    )  # fmt: skip
    waiting = (
        b"\x48\xb8" + _imm(fn["PyGILState_Ensure"])  # mov rax, PyGILState_Ensure
        + b"\xff\xd0"  # call rax
        + b"\x89\xc3"  # mov ebx, eax
        + b"\x48\xbf" + _imm(code)  # mov rdi, boot code
        + b"\x48\xb8" + _imm(fn["PyRun_SimpleString"])  # mov rax, PyRun_SimpleString
        + b"\xff\xd0"  # call rax
        + b"\x48\xa3" + _imm(data + D_RESULT)  # movabs [result], rax
        + b"\x89\xdf"  # mov edi, ebx
        + b"\x48\xb8" + _imm(fn["PyGILState_Release"])  # mov rax, PyGILState_Release
        + b"\xff\xd0"  # call rax
        + _stub_tail(data)
    )  # fmt: skip
    assert len(pending) <= WAITING_STUB_AT
    return pending.ljust(WAITING_STUB_AT, b"\xcc") + waiting


# ---- the tracer ------------------------------------------------------------------------------


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.ptrace.restype = ctypes.c_long
    libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    return libc


class Tracee:
    """The seized main thread of `pid`."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.libc = _libc()
        self.seized = False

    def _pt(self, req: int, addr: int = 0, data: int = 0) -> int:
        ctypes.set_errno(0)
        r = self.libc.ptrace(req, self.pid, ctypes.c_void_p(addr), ctypes.c_void_p(data))
        err = ctypes.get_errno()
        if r == -1 and err:
            what = _NAMES.get(req, str(req))
            hint = ""
            if req == PTRACE_SEIZE and err in (1, 13):  # EPERM, EACCES
                hint = (
                    " (another debugger such as py-spy or gdb may be attached, or a seccomp "
                    "policy forbids ptrace: containers need --cap-add SYS_PTRACE)"
                )
            raise SessionError(
                f"{what} on pid {self.pid}: {os.strerror(err)}{hint}",
                seize_refused=req == PTRACE_SEIZE and err in (1, 13),
            )
        return r

    def seize(self) -> None:
        self._pt(PTRACE_SEIZE)
        self.seized = True

    def _reap(self, block: bool) -> int | None:
        """One wait status of the thread, or None when there is none yet."""
        wpid, status = os.waitpid(self.pid, (0 if block else os.WNOHANG) | WALL)
        if wpid != self.pid:
            return None
        if os.WIFEXITED(status) or os.WIFSIGNALED(status):
            self.seized = False
            raise SessionError(f"pid {self.pid} exited during injection")
        return status

    def _pass_on(self, status: int) -> None:
        """Let the thread go on from a stop that is not ours: its own signal is delivered now
        (not held: a held signal would be lost if we died holding it); a group stop resumes."""
        sig = os.WSTOPSIG(status) if status >> 16 == 0 else 0
        self._pt(PTRACE_CONT, 0, sig)

    def stop(self, timeout: float = 10.0) -> None:
        """Interrupt the thread and wait for the PTRACE_EVENT_STOP, passing on its signals."""
        self._pt(PTRACE_INTERRUPT)
        end = time.monotonic() + timeout
        while True:
            status = self._reap(block=False)
            if status is not None:
                if os.WIFSTOPPED(status) and status >> 16 == PTRACE_EVENT_STOP:
                    return
                self._pass_on(status)
            elif time.monotonic() > end:
                raise SessionError(f"pid {self.pid} did not stop within {timeout:.0f} s")
            else:
                time.sleep(0.0005)

    def run_until(self, done: Any, timeout: float, what: str) -> None:
        """Resume the thread and wait for `done()`, passing on the thread's own stops."""
        self._pt(PTRACE_CONT, 0, 0)
        end = time.monotonic() + timeout
        while not done():
            status = self._reap(block=False)
            if status is not None:
                self._pass_on(status)
            if time.monotonic() > end:
                raise SessionError(f"{what} in pid {self.pid} did not happen in {timeout:.0f} s")
            time.sleep(0.0005)

    def getregs(self) -> Regs:
        regs = Regs()
        self._pt(PTRACE_GETREGS, 0, ctypes.addressof(regs))
        return regs

    def setregs(self, regs: Regs) -> None:
        self._pt(PTRACE_SETREGS, 0, ctypes.addressof(regs))

    def fp_state(self) -> tuple[bytes, int]:
        buf = ctypes.create_string_buffer(1 << 16)
        iov = _IoVec(ctypes.addressof(buf), len(buf))
        xstate = None
        try:
            self._pt(PTRACE_GETREGSET, NT_X86_XSTATE, ctypes.addressof(iov))
            xstate = buf.raw[: iov.len]
        except SessionError:
            pass  # no XSAVE: the legacy FXSAVE image below is the whole state
        fx = ctypes.create_string_buffer(512)
        if xstate is None:
            self._pt(PTRACE_GETFPREGS, 0, ctypes.addressof(fx))
        return fp_image(xstate, fx.raw)

    def sigmask(self) -> int:
        mask = ctypes.c_uint64()
        self._pt(PTRACE_GETSIGMASK, 8, ctypes.addressof(mask))
        return mask.value

    def write(self, addr: int, data: bytes) -> None:
        with open(f"/proc/{self.pid}/mem", "r+b", buffering=0) as f:
            f.seek(addr)
            f.write(data)

    def frame_for_now(self, ret: int) -> tuple[Regs, int]:
        """Write a frame that restores the thread's present state; (present regs, base)."""
        regs = self.getregs()
        fp, uc_fp = self.fp_state()
        base, frame = build_frame(regs, fp, uc_fp, self.sigmask(), ret)
        self.write(base, frame)
        return regs, base

    def call_and_restore(
        self, gadget: int, func: int, args: list[int], done: Any, what: str
    ) -> None:
        """Run `func(*args)` in the thread, returning into the sigreturn gadget; wait for its
        effect (`done()`), then stop the thread again wherever it is."""
        regs, base = self.frame_for_now(ret=gadget)
        _pause()
        call = Regs.from_buffer_copy(regs)
        call.rip, call.rsp, call.rax = func, base + 8, 0
        call.orig_rax = MASK64  # not in a syscall: no restart logic when it resumes
        call.eflags &= ~(EFLAGS_TF | EFLAGS_DF)  # the ABI's state at a call
        for name, value in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args, strict=False):
            setattr(call, name, value & MASK64)
        self.setregs(call)  # from here the thread is on a path that ends in its own state
        _pause()
        self.run_until(done, 10.0, what)
        _pause()
        self.stop()

    def detach(self) -> None:
        if self.seized:
            self.seized = False
            self._pt(PTRACE_DETACH, 0, 0)


def _mapped(pid: int, lo: int, hi: int, perms: str) -> bool:
    return any(m[0] == lo and m[1] == hi and m[2].startswith(perms) for m in read_maps(pid))


def _read_data(pid: int, addr: int) -> tuple[int, int]:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
        f.seek(addr)
        return struct.unpack("<QQ", f.read(16))


def run_session(req: dict[str, Any]) -> dict[str, Any]:
    """Start the boot code (`req["code"]`) in pid's main thread; see the module doc.

    req: pid, code (str), fn ({name: address} of mmap, mprotect, Py_AddPendingCall,
    PyRun_SimpleString, PyGILState_Ensure, PyGILState_Release), done_wait_s.
    Returns {"how": "pending call" | "run in <syscall>", "rc": int | None} or
    {"error": str, "seize_refused": bool}."""
    pid, fn = int(req["pid"]), {k: int(v) for k, v in req["fn"].items()}
    code = req["code"].encode() + b"\0"
    if len(code) > PAGE - D_CODE:
        return {"error": f"boot code is {len(code)} bytes, more than fits the page"}
    t = Tracee(pid)
    try:
        maps = read_maps(pid)
        gadget = find_sigreturn_gadget(pid, maps)
        t.seize()
        t.stop()
        first_wait = blocked_in(pid)
        addr = free_address(read_maps(pid), 2 * PAGE)
        data = addr + PAGE
        flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED_NOREPLACE
        t.call_and_restore(
            gadget,
            fn["mmap"],
            [addr, 2 * PAGE, PROT_READ | PROT_WRITE, flags, -1, 0],
            lambda: _mapped(pid, addr, addr + 2 * PAGE, "rw"),
            "mmap",
        )
        t.write(addr, stub_code(fn, data))
        t.call_and_restore(
            gadget,
            fn["mprotect"],
            [addr, PAGE, PROT_READ | PROT_EXEC],
            lambda: _mapped(pid, addr, addr + PAGE, "r-x"),
            "mprotect",
        )
        waiting = blocked_in(pid)
        # a thread that waited may be caught on the way back from the steps above: let it
        # get back into its wait, where the boot code can run at once
        for _ in range(200):
            if waiting or not first_wait:
                break
            t.run_until(lambda: True, 1.0, "resume")
            time.sleep(0.002)
            t.stop()
            waiting = blocked_in(pid)
        regs, base = t.frame_for_now(ret=gadget)
        # rt_sigreturn reads the frame at rsp-8, past its return-address slot at base+8
        t.write(data, struct.pack("<QQQ", 0, 0, base + 16).ljust(D_CODE, b"\0") + code)
        _pause()
        entry = Regs.from_buffer_copy(regs)
        entry.rip = addr + (WAITING_STUB_AT if waiting else 0)
        entry.rsp = base - 256  # 16-byte aligned, below the frame
        entry.orig_rax = MASK64
        entry.eflags &= ~(EFLAGS_TF | EFLAGS_DF)
        t.setregs(entry)  # from here the stub runs to its sigreturn with or without us
        _pause()
        t.detach()
    except (SessionError, OSError) as e:
        with contextlib.suppress(SessionError):  # gone already: the kernel detached it
            t.detach()
        return {"error": str(e), "seize_refused": getattr(e, "seize_refused", False)}
    how = f"run in {waiting}" if waiting else "pending call"
    end = time.monotonic() + float(req.get("done_wait_s", 10.0))
    while time.monotonic() < end:
        try:
            result, done = _read_data(pid, data)
        except OSError:
            return {"how": how, "rc": None}  # exited: the caller sees that next
        if done == DONE_MARK:
            return {"how": how, "rc": ctypes.c_int32(result & 0xFFFFFFFF).value}
        time.sleep(0.002)
    return {"how": how, "rc": None}


HELPER_BLOCKED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGTERM,
    signal.SIGQUIT,
    signal.SIGTSTP,
    signal.SIGPIPE,
)


def main() -> int:
    """Helper process: one request on stdin, one JSON line on stdout. The signals a terminal or
    a supervisor sends stay blocked for the helper's whole (short) life, so only SIGKILL can
    end it mid-session, and the session is safe even then."""
    signal.pthread_sigmask(signal.SIG_BLOCK, HELPER_BLOCKED)
    try:
        req = json.loads(sys.stdin.read())
    except ValueError:
        return 2  # kdash went away before the request was complete: nothing was touched
    try:
        result = run_session(req)
    except Exception as e:  # noqa: BLE001 - reported as the one line, never a traceback
        result = {"error": f"{type(e).__name__}: {e}"}
    try:
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    except OSError:
        pass  # kdash is gone; the session is finished either way
    return 0


if __name__ == "__main__":
    sys.exit(main())
