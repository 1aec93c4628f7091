"""The watched process tree: the pid the user named and its descendants."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from kdash.errors import UserError


@dataclass
class Target:
    pid: int
    cmdline: list[str] = field(default_factory=list)
    host: str = field(default_factory=socket.gethostname)
    # (monotonic s, pids) of the last walk: the scheduler and agent sources both rescan the
    # tree each second, and one walk reads every process's /proc stat on the machine
    _walked: tuple[float, list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    PIDS_MAX_AGE_S = 0.5

    @classmethod
    def from_pid(cls, pid: int) -> Target:
        if pid <= 0:
            raise UserError(f"not a process id: {pid}")
        try:
            p = psutil.Process(pid)
            cmd = p.cmdline()
        except psutil.NoSuchProcess:
            raise UserError(f"no such process: {pid}") from None
        except psutil.AccessDenied:
            cmd = []
        except psutil.ZombieProcess:
            raise UserError(f"process {pid} has exited (zombie)") from None
        return cls(pid=pid, cmdline=cmd)

    def alive(self) -> bool:
        try:
            return psutil.Process(self.pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def pids(self) -> list[int]:
        """The root and every descendant still alive (children spawn and die: walked again
        when the last walk is older than PIDS_MAX_AGE_S)."""
        walked = self._walked
        now = time.monotonic()
        if walked is not None and now - walked[0] < self.PIDS_MAX_AGE_S:
            return list(walked[1])
        out = self._walk()
        self._walked = (now, out)
        return list(out)

    def _walk(self) -> list[int]:
        try:
            root = psutil.Process(self.pid)
            kids = root.children(recursive=True)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            return []
        except psutil.AccessDenied:
            return [self.pid]
        return [self.pid] + [k.pid for k in kids]

    def describe(self) -> dict:
        return {
            "pid": self.pid,
            "cmdline": " ".join(self.cmdline),
            "host": self.host,
            "uid": os.getuid(),
        }


def read_environ(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str]:
    """The environment a process was started with (/proc/PID/environ); raises OSError.

    Undecodable bytes are replaced, not fatal: an odd variable must not hide the others.
    """
    raw = (proc_root / str(pid) / "environ").read_bytes()
    env = {}
    for item in raw.split(b"\0"):
        k, sep, v = item.partition(b"=")
        if sep:
            env[k.decode(errors="replace")] = v.decode(errors="replace")
    return env
