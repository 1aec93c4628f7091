"""The scheduler source: every thread of the target's process tree, and every CPU, from /proc.

What it answers: is the thread that feeds the GPU getting a CPU when it wants one (run-queue
delay), which CPU is it on and which may it use (affinity), is it bouncing between CPUs
(migrations), and are the CPUs clocked down (frequency, busy %).

Per thread and poll (table `threads`):

- name: the `comm` in `/proc/<pid>/task/<tid>/stat` (field 2; threads rename themselves, so it
  is re-read each poll).
- cpu_pct: on-CPU time per wall second x 100. Taken from `schedstat` field 1 (the scheduler's
  own nanosecond counter) when the kernel keeps it, else from `stat` utime+stime (fields 14+15,
  clock ticks). Why not always utime+stime: at 4 Hz a 250 ms window holds 25 ticks, so a tick
  counter quantises CPU % to 4 points and jitters by as much; the ns counter is exact.
- cpu: the CPU it last ran on, `stat` field 39.
- allowed_cpus: its affinity mask as a cpulist (`"0-31,64-95"`). Read with the
  `sched_getaffinity(tid)` system call, which returns the same mask as `Cpus_allowed_list` in
  `status` (intersected with the active CPUs) at a tenth of the cost of generating `status`.
- runq_ms_per_s: `schedstat` field 2 (ns spent runnable but waiting for a CPU) per wall second,
  at most the part of the interval the thread was not on a CPU (`runq_rate`: the kernel adds
  a wait when it ends, so one poll can receive a wait that began polls before).
- vol_switches / invol_switches / migrations: cumulative counters from `sched`
  (`nr_voluntary_switches`, `nr_involuntary_switches`, `se.nr_migrations`). `sched` exists only
  on kernels built with CONFIG_SCHED_DEBUG; without it switches come from `status` and
  migrations are -1 (n/a).

Rates (cpu_pct, runq_ms_per_s) need two reads of the same thread: a thread's first row has NaN
there ("n/a"), so does every row of the first poll.

Per CPU and poll (table `cpu_freq`): the current and maximum clock from
`/sys/devices/system/cpu/cpuN/cpufreq/` (`scaling_cur_freq`, `cpuinfo_max_freq`), else from
`psutil.cpu_freq(percpu=True)` (which reads `/proc/cpuinfo`: current MHz only on most VMs, no
maximum, so the low-frequency finding cannot judge it), and busy % from `/proc/stat` deltas
(busy = everything but idle and iowait; steal counts as busy because the vCPU had work).

Cost: a thread that has not run since the last poll costs one small read (`schedstat`: its
counters did not move, so nothing else can have) plus one system call; one that ran costs three
reads (`stat`, `schedstat`, `sched`); every thread is read in full every `full_every` polls
anyway. Reads go through file descriptors kept open between polls (`pread` at offset 0 makes the
kernel regenerate the text, saving the path lookup and open/close of each read), within a budget
of half the process's open-file limit; threads beyond it are read with open/read/close. A kept
descriptor refers to the thread itself, not its number, so a recycled tid can never be mistaken
for the old thread: the read fails with ESRCH and the tid is re-opened. The process tree (a walk
over every process on the host in psutil) is refreshed once a second, not on every poll.
`bench/sched_cost.py` measures the whole.

Threads and processes that exit between reads are normal and never an error; a file that cannot
be read for lack of rights degrades the source's health with a line saying which and why.
"""

from __future__ import annotations

import math
import os
import resource
import threading
import time
from dataclasses import dataclass, field

import numpy as np
from kdash.collectors.base import OK, Health
from kdash.collectors.topology import format_cpulist, online_cpus

from kdash import schema
from kdash.schema import Batch
from kdash.target import Target

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_NAN = math.nan

# Errors that mean "this thread/process is gone" (or was never ours to read).
_GONE = (FileNotFoundError, ProcessLookupError)


def _sched_field(buf: bytes, key: bytes) -> int:
    """The integer after `key ... :` in a /proc/<tid>/sched text; -1 when absent."""
    i = buf.find(key)
    if i < 0:
        return -1
    j = buf.find(b":", i)
    k = buf.find(b"\n", j)
    try:
        return int(float(buf[j + 1 : k if k >= 0 else None]))
    except ValueError:
        return -1


def _status_field(buf: bytes, key: bytes) -> int:
    """The integer after `key:` in a /proc/<tid>/status text; -1 when absent."""
    i = buf.find(key)
    if i < 0:
        return -1
    j = buf.find(b"\n", i)
    try:
        return int(buf[i + len(key) : j if j >= 0 else None])
    except ValueError:
        return -1


@dataclass
class _Thread:
    """What is kept between polls for one thread: open descriptors and the previous counters."""

    pid: int
    tid: int
    fds: dict[str, int] = field(default_factory=dict)
    prev_t_ns: int = -1
    prev_exec_ns: int = -1  # schedstat field 1, or utime+stime converted to ns
    prev_wait_ns: int = -1  # schedstat field 2
    seen: int = 0  # poll generation in which it was last listed
    last: tuple[str, int, int, int, int] | None = None  # name, cpu, vol, invol, migrations


class SchedSource:
    """Scheduler source for a target's process tree (see the module docstring for the fields).

    `interval_s` is the poll period the app should use (the source does not time itself: the
    app's poll worker calls `poll`, so polls never overlap). `poll(now_ns)` stamps every row
    with `now_ns` (the caller's clock) and measures rates on the host monotonic clock.
    """

    name = "sched"

    def __init__(
        self,
        target: Target,
        interval_s: float = 0.25,
        *,
        tree_interval_s: float = 1.0,
        full_every: int = 8,
        proc: str = "/proc",
        sysfs: str = "/sys",
        fd_budget: int | None = None,
    ) -> None:
        self.target = target
        self.interval_s = interval_s
        self.tree_interval_s = tree_interval_s
        self.full_every = max(1, full_every)
        self.health: Health = Health("starting")
        self._proc = proc
        self._sysfs = sysfs
        self._fd_budget = self._default_fd_budget() if fd_budget is None else fd_budget
        self._fds_open = 0
        self._lock = threading.Lock()
        self._threads: dict[int, _Thread] = {}
        self._pids: list[int] = []
        self._tree_t_ns = -1
        self._gen = 0
        self._affinity_cache: dict[frozenset[int], str] = {}
        # What the kernel offers; learned on the first reads, said in `health`.
        self._schedstat_ok: bool | None = None  # None until a thread with CPU time was seen
        self._sched_file = True  # /proc/<tid>/sched exists and is readable
        self._notes: dict[str, str] = {}  # lasting degraded reasons, keyed so each is said once
        self._poll_notes: dict[str, str] = {}  # reasons that hold for the latest poll only
        # CPUs
        self._cpus: list[int] = []
        self._cur_paths: dict[int, str] = {}
        self._max_mhz: dict[int, float] = {}
        self._freq_mode = "none"  # "sysfs" | "psutil" | "none"
        self._prev_cpu_times: dict[int, tuple[int, int]] = {}
        self._psutil_cache: list = []
        self._psutil_t = -1e9
        self._started = False

    # ------------------------------------------------------------------ protocol

    def start(self) -> None:
        """Learn the CPUs and the frequency interface; read the tree once. Never raises."""
        with self._lock:
            self._cpus = sorted(online_cpus(self._sysfs))
            self._probe_freq()
            self._refresh_tree(time.monotonic_ns())
            self._started = True
            self._update_health()

    def poll(self, now_ns: int) -> dict[str, Batch]:
        """One reading of every thread of the tree and every CPU: {"threads", "cpu_freq"}."""
        with self._lock:
            if not self._started:
                self._cpus = sorted(online_cpus(self._sysfs))
                self._probe_freq()
                self._started = True
            self._poll_notes.clear()
            t_ns = time.monotonic_ns()
            if self._tree_t_ns < 0 or t_ns - self._tree_t_ns >= self.tree_interval_s * 1e9:
                self._refresh_tree(t_ns)
            threads = self._poll_threads(now_ns)
            cpus = self._poll_cpus(now_ns)
            self._update_health()
            return {"threads": threads, "cpu_freq": cpus}

    def stop(self) -> None:
        with self._lock:
            for th in self._threads.values():
                self._close(th)
            self._threads.clear()
            self._started = False

    # ------------------------------------------------------------------ threads

    @staticmethod
    def _default_fd_budget() -> int:
        """Half of the soft open-file limit (minus headroom), so kdash never starves the app."""
        try:
            soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        except (OSError, ValueError):
            return 0
        if soft == resource.RLIM_INFINITY:
            soft = 65536
        return max(0, min(soft // 2 - 64, 8192))

    def _refresh_tree(self, t_ns: int) -> None:
        """Re-read the process tree; on a psutil error keep the last one and say so."""
        import psutil

        try:
            self._pids = self.target.pids()
        except (psutil.Error, OSError) as e:
            self._poll_notes["tree"] = f"process tree not re-read: {type(e).__name__}: {e}"
        self._tree_t_ns = t_ns

    def _close(self, th: _Thread) -> None:
        for fd in th.fds.values():
            try:
                os.close(fd)
            except OSError as e:  # an fd we own failing to close is a bug worth seeing
                self._poll_notes["close"] = f"close failed: {e}"
        self._fds_open -= len(th.fds)
        th.fds.clear()

    def _read(self, th: _Thread, name: str, size: int = 4096) -> bytes:
        """Read /proc/<pid>/task/<tid>/<name>, through a kept descriptor when the budget allows.

        Raises the _GONE errors (thread exited) and PermissionError; the caller decides.
        """
        fd = th.fds.get(name)
        if fd is not None:
            return os.pread(fd, size, 0)
        path = f"{self._proc}/{th.pid}/task/{th.tid}/{name}"
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        keep = self._fds_open < self._fd_budget
        try:
            data = os.read(fd, size)
        except BaseException:
            os.close(fd)
            raise
        if keep:
            th.fds[name] = fd
            self._fds_open += 1
        else:
            os.close(fd)
        return data

    def _affinity(self, tid: int) -> str:
        cpus = frozenset(os.sched_getaffinity(tid))
        s = self._affinity_cache.get(cpus)
        if s is None:
            if len(self._affinity_cache) > 256:
                self._affinity_cache.clear()
            s = format_cpulist(cpus)
            self._affinity_cache[cpus] = s
        return s

    def _list_tids(self, pid: int) -> list[int]:
        try:
            return [int(t) for t in os.listdir(f"{self._proc}/{pid}/task")]
        except _GONE:
            return []
        except NotADirectoryError:
            return []
        except PermissionError:
            self._poll_notes["perm-task"] = f"cannot list threads of pid {pid} (permission denied)"
            return []

    def _poll_threads(self, now_ns: int) -> Batch:
        self._gen += 1
        gen = self._gen
        c_pid: list[int] = []
        c_tid: list[int] = []
        c_name: list[str] = []
        c_cpu_pct: list[float] = []
        c_cpu: list[int] = []
        c_allowed: list[str] = []
        c_runq: list[float] = []
        c_vol: list[int] = []
        c_invol: list[int] = []
        c_mig: list[int] = []
        for pid in self._pids:
            for tid in self._list_tids(pid):
                th = self._threads.get(tid)
                if th is None or th.pid != pid:
                    if th is not None:
                        self._close(th)
                    th = _Thread(pid, tid)
                    self._threads[tid] = th
                th.seen = gen
                row = self._read_thread(th)
                if row is None:
                    # Exited between listing and reading, or its kept descriptor points at a
                    # previous thread of the same number: forget it, try once afresh.
                    self._close(th)
                    th = _Thread(pid, tid, seen=gen)
                    self._threads[tid] = th
                    row = self._read_thread(th)
                    if row is None:
                        self._close(th)
                        del self._threads[tid]
                        continue
                name, cpu_pct, cpu, allowed, runq, vol, invol, mig = row
                c_pid.append(pid)
                c_tid.append(tid)
                c_name.append(name)
                c_cpu_pct.append(cpu_pct)
                c_cpu.append(cpu)
                c_allowed.append(allowed)
                c_runq.append(runq)
                c_vol.append(vol)
                c_invol.append(invol)
                c_mig.append(mig)
        for tid in [t for t, th in self._threads.items() if th.seen != gen]:
            self._close(self._threads.pop(tid))
        n = len(c_tid)
        return schema.make_batch(
            "threads",
            t_ns=np.full(n, now_ns, dtype=np.int64),
            pid=c_pid,
            tid=c_tid,
            name=c_name,
            cpu_pct=c_cpu_pct,
            cpu=c_cpu,
            allowed_cpus=c_allowed,
            runq_ms_per_s=c_runq,
            vol_switches=c_vol,
            invol_switches=c_invol,
            migrations=c_mig,
        )

    def _read_full(
        self, th: _Thread, exec_ns: int, wait_ns: int, slices: int
    ) -> tuple[str, int, int, int, int, int, int]:
        """`stat` and `sched` (or `status`): name, CPU, counters. Raises as `_read` does."""
        stat = self._read(th, "stat", 1024)
        if not stat:
            raise ProcessLookupError(th.tid)
        rp = stat.rfind(b")")
        name = stat[stat.find(b"(") + 1 : rp].decode("utf-8", "replace")
        f = stat[rp + 2 :].split()
        # f[0] is field 3 (state): field N is f[N - 3].
        ticks = int(f[11]) + int(f[12])
        cpu = int(f[36]) if len(f) > 36 else -1
        if self._schedstat_ok is None and ticks > 0 and exec_ns >= 0:
            # "0 0 0" for a thread that has run: the kernel keeps no sched_info.
            self._schedstat_ok = not (exec_ns == 0 and slices == 0)
        if self._schedstat_ok is False:
            exec_ns = wait_ns = -1
        if exec_ns < 0:
            exec_ns = ticks * (1_000_000_000 // _CLK_TCK)
        vol = invol = mig = -1
        if self._sched_file:
            try:
                sc = self._read(th, "sched", 8192)
                vol = _sched_field(sc, b"nr_voluntary_switches")
                invol = _sched_field(sc, b"nr_involuntary_switches")
                mig = _sched_field(sc, b"se.nr_migrations")
            except FileNotFoundError:
                # Either the thread left, or the kernel has no CONFIG_SCHED_DEBUG: the
                # stat read just worked, so look at whether the file exists at all.
                if not os.path.exists(f"{self._proc}/{th.pid}/task/{th.tid}"):
                    raise
                self._sched_file = False
                self._notes["sched"] = (
                    "no /proc/<tid>/sched (kernel without CONFIG_SCHED_DEBUG): migrations n/a"
                )
            except PermissionError:
                self._sched_file = False
                self._notes["sched"] = "/proc/<tid>/sched not readable: migrations n/a"
        if vol < 0:
            st = self._read(th, "status", 4096)
            vol = _status_field(st, b"voluntary_ctxt_switches:")
            invol = _status_field(st, b"nonvoluntary_ctxt_switches:")
        return name, cpu, exec_ns, wait_ns, vol, invol, mig

    def _read_thread(self, th: _Thread) -> tuple | None:
        """One thread's row, or None when it has gone (any read failing with ESRCH/ENOENT).

        `schedstat` is read first: when neither its on-CPU nor its wait counter moved since
        the last poll, the thread has not been on a CPU, so its switch and migration counters
        and its CPU cannot have moved either (a migration of a queued thread shows at its next
        run): the `stat` and `sched` reads are skipped and the last values reused. Most threads
        of a server sleep, so this cuts the cost per poll about threefold. Every
        `full_every`-th poll (staggered by tid) reads everything regardless, so a name changed
        from outside shows within seconds.
        """
        try:
            exec_ns = wait_ns = slices = -1
            if self._schedstat_ok is not False:
                try:
                    ss = self._read(th, "schedstat", 256).split()
                    exec_ns, wait_ns, slices = int(ss[0]), int(ss[1]), int(ss[2])
                except (IndexError, ValueError):
                    exec_ns = wait_ns = -1
            # Stamp each thread's own reading: under GIL contention a poll's reads can spread
            # over tens of ms, and one stamp per poll would turn that into bogus CPU %.
            t_ns = time.monotonic_ns()
            if (
                self._schedstat_ok
                and th.last is not None
                and exec_ns == th.prev_exec_ns
                and wait_ns == th.prev_wait_ns
                and (th.tid + self._gen) % self.full_every
            ):
                name, cpu, vol, invol, mig = th.last
            else:
                name, cpu, exec_ns, wait_ns, vol, invol, mig = self._read_full(
                    th, exec_ns, wait_ns, slices
                )
                th.last = (name, cpu, vol, invol, mig)
            allowed = self._affinity(th.tid)
        except _GONE:
            return None
        except PermissionError:
            self._poll_notes["perm"] = f"cannot read threads of pid {th.pid} (permission denied)"
            return None
        except OSError as e:
            # Anything else (EIO from a dying task, a /proc oddity): skip the thread this poll
            # and say so, rather than lose the whole poll.
            self._poll_notes["oserror"] = f"reading tid {th.tid}: {e.strerror or e}"
            return None
        cpu_pct = runq = _NAN
        if th.prev_t_ns >= 0 and t_ns > th.prev_t_ns:
            dt = t_ns - th.prev_t_ns
            ran = max(0, exec_ns - th.prev_exec_ns)
            cpu_pct = ran * 100.0 / dt
            if wait_ns >= 0 and th.prev_wait_ns >= 0:
                runq = runq_rate(wait_ns - th.prev_wait_ns, ran, dt)
        th.prev_t_ns = t_ns
        th.prev_exec_ns = exec_ns
        th.prev_wait_ns = wait_ns
        return name, cpu_pct, cpu, allowed, runq, vol, invol, mig

    # ------------------------------------------------------------------ CPUs

    def _probe_freq(self) -> None:
        """Choose sysfs cpufreq, else psutil, else nothing; read the (static) maxima once."""
        self._cur_paths.clear()
        self._max_mhz.clear()
        for cpu in self._cpus:
            base = f"{self._sysfs}/devices/system/cpu/cpu{cpu}/cpufreq"
            cur = f"{base}/scaling_cur_freq"
            if os.path.exists(cur):
                self._cur_paths[cpu] = cur
                for mx in ("cpuinfo_max_freq", "scaling_max_freq"):
                    khz = _read_int(f"{base}/{mx}")
                    if khz > 0:
                        self._max_mhz[cpu] = khz / 1000.0
                        break
        if self._cur_paths:
            self._freq_mode = "sysfs"
            self._notes.pop("freq", None)
            return
        if self._psutil_freq():
            self._freq_mode = "psutil"
            self._notes["freq"] = (
                "no cpufreq in sysfs: MHz from /proc/cpuinfo, maximum unknown "
                "(low-frequency finding off)"
            )
        else:
            self._freq_mode = "none"
            self._notes["freq"] = "no cpufreq: CPU frequency n/a"

    @staticmethod
    def _psutil_freq() -> list:
        import psutil

        try:
            return list(psutil.cpu_freq(percpu=True) or [])
        except (OSError, NotImplementedError, RuntimeError, AttributeError):
            return []

    def _read_proc_stat(self) -> dict[int, tuple[int, int]]:
        """CPU -> (busy jiffies, total jiffies) from /proc/stat."""
        out: dict[int, tuple[int, int]] = {}
        try:
            with open(f"{self._proc}/stat", "rb") as fh:
                data = fh.read()
        except OSError as e:
            self._poll_notes["stat"] = f"/proc/stat unreadable: {e.strerror}"
            return out
        for line in data.split(b"\n"):
            if not (line.startswith(b"cpu") and line[3:4].isdigit()):
                if out:
                    break  # the per-CPU lines are contiguous, right after the "cpu " total
                continue
            parts = line.split()
            try:
                cpu = int(parts[0][3:])
                vals = [int(v) for v in parts[1:9]]
            except (ValueError, IndexError):
                continue
            total = sum(vals)
            idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
            out[cpu] = (total - idle, total)
        return out

    def _poll_cpus(self, now_ns: int) -> Batch:
        times = self._read_proc_stat()
        cpus = sorted(set(self._cpus) | set(times))
        busy: dict[int, float] = {}
        for cpu, (b, tot) in times.items():
            prev = self._prev_cpu_times.get(cpu)
            if prev is not None and tot > prev[1]:
                busy[cpu] = 100.0 * (b - prev[0]) / (tot - prev[1])
        self._prev_cpu_times = times
        mhz: dict[int, float] = {}
        maxes: dict[int, float] = dict(self._max_mhz)
        if self._freq_mode == "sysfs":
            for cpu, path in self._cur_paths.items():
                khz = _read_int(path)
                if khz > 0:
                    mhz[cpu] = khz / 1000.0
        elif self._freq_mode == "psutil":
            # psutil parses all of /proc/cpuinfo (hundreds of KB on a big VM, whose MHz is
            # mostly static anyway): once a second is enough.
            mono = time.monotonic()
            if mono - self._psutil_t >= 1.0:
                self._psutil_cache = self._psutil_freq()
                self._psutil_t = mono
            for cpu, fr in enumerate(self._psutil_cache):
                if fr.current and fr.current > 0:
                    mhz[cpu] = float(fr.current)
                if fr.max and fr.max > 0:
                    maxes[cpu] = float(fr.max)
        n = len(cpus)
        return schema.make_batch(
            "cpu_freq",
            t_ns=np.full(n, now_ns, dtype=np.int64),
            cpu=cpus,
            mhz=[mhz.get(c, _NAN) for c in cpus],
            max_mhz=[maxes.get(c, _NAN) for c in cpus],
            busy_pct=[busy.get(c, _NAN) for c in cpus],
        )

    # ------------------------------------------------------------------ health

    def _update_health(self) -> None:
        if not self._pids:
            self.health = Health.unavailable(
                f"target pid {self.target.pid} has exited", "target_exited", pid=self.target.pid
            )
            return
        notes = {**self._notes, **self._poll_notes}
        if self._schedstat_ok is False:
            notes["schedstat"] = (
                "kernel keeps no schedstat (CONFIG_SCHEDSTATS off or delayacct off): "
                "run-queue delay n/a"
            )
        self.health = Health.degraded("; ".join(notes.values())) if notes else OK


def runq_rate(waited_ns: int, ran_ns: int, dt_ns: int) -> float:
    """Run-queue wait in ms per wall second over one poll interval, from schedstat deltas.

    The kernel adds a wait to `run_delay` when it ends (the thread gets a CPU), not while it
    lasts: a thread kept runnable for 1.5 s (a throttled cgroup, a crowded CPU) reads 0 for
    the polls it waited through and then 1.5 s in one 250 ms poll, which is 6000 ms/s. Within
    one interval it can have waited only the time it did not run, so the rate is capped there
    (at most 1000 ms/s); the part cut off happened in the earlier intervals.
    """
    if dt_ns <= 0:
        return _NAN
    waited = min(max(0, waited_ns), max(0, dt_ns - max(0, ran_ns)))
    return waited * 1000.0 / dt_ns


def _read_int(path: str) -> int:
    """An integer sysfs attribute, -1 when missing or unreadable."""
    try:
        with open(path, "rb") as fh:
            return int(fh.read().strip() or b"-1")
    except (OSError, ValueError):
        return -1
