"""The client side of the agent: a Source that streams a target's CUPTI activity into the Store.

`AgentSource(pid)` finds the agent's socket, handshakes, sends START, and reads frames on a
background thread into a bounded queue that `poll()` drains; a full queue drops whole batches
and counts their rows (`stats["dropped_client"]`), never silently. The agent's own counters
(CUPTI's dropped records, rows the agent could not queue, callback errors, the clock offset)
arrive in STATS replies, requested once a second from `poll()`, and are merged into `stats`.

Health follows the agent's STATUS lines: "ok: sampling 10% (100 ms/s)" while activity is on
with the default duty cycle (see `duty.DutyCycle`), "ok: continuous" after
`set_continuous(True)`; "unavailable: ..." with the
agent's reason (no cupti-python, no driver, CUPTI held by torch.profiler, ...), or "no kdash
agent in pid N (start it with `kdash run -- CMD`)" when there is no socket; "starting:
waiting ..." until the target has loaded CUDA.
"""

from __future__ import annotations

import contextlib
import os
import queue
import socket
import stat
import threading
import time
from typing import Any

from kdash.collectors.agent import constants, security, wire
from kdash.collectors.agent.duty import sampling_text
from kdash.collectors.base import OK, Health

from kdash import schema, target_python
from kdash.schema import Batch

TABLES = ("kernels", "api", "memcpy", "markers")
STATS_EVERY_S = 1.0


def find_agent_socket(pid: int) -> str | None:
    """The agent socket of `pid` in the folders the agent uses for our uid, or None."""
    for d in _our_dirs():
        path = os.path.join(d, f"{pid}.sock")
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
        except OSError:
            continue
    return None


def agent_failure_note(pid: int) -> str | None:
    """Why `pid` has no agent, if anything says so: the note the start-up hook wrote when the
    agent could not start, else, for a process that `kdash run` armed, what keeps it from
    having one (not Python; the socket folders), so the advice is not to use `kdash run`,
    which it already did."""
    note = unavailable_note(pid)
    if note is not None or not _armed(pid):
        return note
    tp = target_python.target_python(pid)
    if tp.is_python:
        return (
            f"pid {pid} ({tp.label()}) was started by `kdash run` but its agent has no socket "
            f"({socket_problems()})"
        )
    name = os.path.basename(tp.argv[0]) if tp.argv else (tp.exe or "?")
    also = "; also: " + "; ".join(security.folder_problems()) if security.folder_problems() else ""
    return (
        f"pid {pid} ({name}) was started by `kdash run` but is not Python, and kdash's agent "
        f"starts only in Python processes{also}"
    )


def unavailable_note(pid: int) -> str | None:
    """The note the start-up hook of `pid` wrote when its agent could not start, with its
    install advice run through the interpreter the target really runs."""
    for d in _our_dirs():
        try:
            with open(os.path.join(d, f"{pid}.unavailable")) as f:
                note = f.read().strip()
        except OSError:
            continue
        return target_python.for_target(note, target_python.target_python(pid)) or None
    return None


def socket_problems() -> str:
    """What the socket folders say when an armed process has no socket."""
    problems = security.folder_problems()
    return "; ".join(problems) if problems else "no socket in " + ", ".join(security.socket_dirs())


def _our_dirs() -> list[str]:
    """security.socket_dirs() without folders someone else made: a socket or note planted there
    is not our agent's."""
    return [d for d in security.socket_dirs() if security.folder_problem(d, os.getuid()) is None]


def _armed(pid: int) -> bool:
    """Does `pid`'s environment say `kdash run` armed it (KDASH_AGENT=1)?"""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"{constants.ENV_FLAG}=1".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _connect(s: socket.socket, path: str, timeout_s: float) -> None:
    """connect(), retried while the agent's listen backlog is full: a Unix socket with a
    timeout fails at once with EAGAIN then, and the agent drains its backlog quickly."""
    end = time.monotonic() + timeout_s
    while True:
        try:
            s.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= end:
                raise
            time.sleep(0.02)


def _health_from_status(body: dict[str, Any]) -> Health:
    state = str(body.get("state", ""))
    line = str(body.get("line", ""))
    why = line.split(": ", 1)[1] if ": " in line else line
    if state == "active":
        sampling = sampling_text(body.get("sampling"))
        code = "continuous" if sampling == "continuous" else "sampling"
        return Health("ok", sampling, code) if sampling else OK
    if state in ("unavailable", "busy"):
        return Health.unavailable(why, "agent_busy" if state == "busy" else "")
    if state == "off":  # kernel activity off by design (the target replays CUDA graphs)
        return Health("off", why, "graphs_off")
    if state == "waiting":
        return Health("starting", line, "agent_waiting")
    if state == "error":
        return Health.degraded(why)
    return Health("starting", line or state)


class AgentSource:
    """A Source (`name` "agent") fed by the kdash agent inside process `pid`."""

    name = "agent"

    def __init__(
        self,
        pid: int,
        socket_path: str | None = None,
        activities: list[str] | None = None,
        max_queued_batches: int = 1024,
        connect_timeout_s: float = 2.0,
        continuous: bool = False,
        period_ms: int = constants.DUTY_PERIOD_MS,
        on_ms: int = constants.DUTY_ON_MS,
        pc_sampling: bool = False,
        pc_on_ms: int = constants.PC_ON_MS,
        pc_period_ms: int = constants.PC_PERIOD_MS,
        graph_kernels: bool = False,
    ) -> None:
        self.pid = pid
        self.socket_path = socket_path
        self.activities = list(activities or constants.DEFAULT_ACTIVITIES)
        # duty cycle asked of the agent (see duty.DutyCycle): the default samples, because
        # continuous activity costs graph-replayed decode far more than the 2% floor
        self.continuous = continuous
        self.period_ms = period_ms
        self.on_ms = on_ms
        self.graph_kernels = graph_kernels  # START "graph_kernels": see controller.CuptiActivity
        # PC sampling: off unless asked; ranges of pc_on_ms every pc_period_ms
        self.pc_sampling = pc_sampling
        self.pc_on_ms = pc_on_ms
        self.pc_period_ms = pc_period_ms
        self.lines: Any = None  # lines.LineTableFeeder, made when the first samples arrive
        self._gone = False  # the reader saw the agent close: later send errors say nothing new
        self.health: Health = Health(
            "starting", f"connecting to the agent in pid {pid}", "connecting", {"pid": pid}
        )
        self.hello: dict[str, Any] = {}
        self.stats: dict[str, Any] = {"dropped_client": 0, "received_rows": 0}
        self.status_line = ""
        self._connect_timeout = connect_timeout_s
        self._queue: queue.Queue[tuple[str, Batch]] = queue.Queue(maxsize=max_queued_batches)
        self._sock: socket.socket | None = None
        self._send_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._last_stats_req = 0.0
        self._lock = threading.Lock()
        self._python: target_python.TargetPython | None = None

    # Source protocol
    def start(self) -> None:
        path = self.socket_path or find_agent_socket(self.pid)
        if path is None:
            note = agent_failure_note(self.pid)
            if note:
                self.health = Health.unavailable(
                    f"no kdash agent in pid {self.pid}: {note}", "no_socket", note=note
                )
            else:
                self.health = Health.unavailable(
                    f"no kdash agent in pid {self.pid} (start it with `kdash run -- CMD`)",
                    "no_socket",
                )
            return
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self._connect_timeout)
        try:
            _connect(s, path, self._connect_timeout)
        except ConnectionRefusedError:
            s.close()
            # nobody listens: the socket of an earlier process that had this pid, or of this
            # one's agent that could not survive (e.g. a fork). Remove it; say there is none.
            with contextlib.suppress(OSError):
                os.unlink(path)
            self.health = Health.unavailable(
                f"no kdash agent in pid {self.pid} (start it with `kdash run -- CMD`; "
                "a stale socket was removed)",
                "no_socket",
            )
            return
        except OSError as e:
            s.close()
            self.health = Health.unavailable(
                f"cannot connect to the kdash agent of pid {self.pid} at {path} ({e}); "
                "is the process still running, and as your user?"
            )
            return
        s.settimeout(None)
        self._sock = s
        self._thread = threading.Thread(
            target=self._reader, name=f"kdash-agent-client-{self.pid}", daemon=True
        )
        self._thread.start()

    def poll(self, now_ns: int) -> dict[str, Batch]:
        now = time.monotonic()
        if self._sock is not None and now - self._last_stats_req >= STATS_EVERY_S:
            self._last_stats_req = now
            self._send(wire.encode_control(wire.MsgType.STATS, {}))
        parts: dict[str, list[Batch]] = {}
        while True:
            try:
                table, batch = self._queue.get_nowait()
            except queue.Empty:
                break
            parts.setdefault(table, []).append(batch)
        out = {t: schema.concat(t, bs) for t, bs in parts.items()}
        if "pc_samples" in out:
            if self.lines is None:
                from .lines import LineTableFeeder

                self.lines = LineTableFeeder(self.pid)
            self.lines.offer(out["pc_samples"])
        if self.lines is not None:
            made = self.lines.take()
            if made:
                out["source_lines"] = schema.concat("source_lines", made)
            files = self.lines.take_files()
            if files:
                out["source_files"] = schema.concat("source_files", files)
        return out

    def stop(self) -> None:
        self._stopping = True
        if self._sock is not None:
            self._send(wire.encode_control(wire.MsgType.STOP, {}))
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def set_continuous(self, on: bool) -> None:
        """Ask the agent for continuous activity (True) or its duty cycle (False).

        Before the connection is up this only changes what START will ask for; an agent older
        than version 2 cannot switch, which its health then says (it keeps its own mode).
        """
        self.continuous = on
        if self._sock is None or not self.hello:
            return
        if int(self.hello.get("agent_version", 1)) < 2:
            self.health = Health.degraded(
                f"the agent in pid {self.pid} is too old to switch between sampling and "
                "continuous; restart the target with this kdash"
            )
            return
        self._send(wire.encode_control(wire.MsgType.SET, self._duty_fields()))

    def set_duty(self, period_ms: int, on_ms: int) -> None:
        """Ask for another duty cycle (the tree source's cost budget); sent at once when
        sampling, else kept for the next switch back from continuous."""
        self.period_ms, self.on_ms = int(period_ms), int(on_ms)
        if self._sock is None or not self.hello or self.continuous:
            return
        if int(self.hello.get("agent_version", 1)) < 2:
            return  # an old agent keeps its own cycle; its health already says it is old
        self._send(wire.encode_control(wire.MsgType.SET, self._duty_fields()))

    def sampling(self) -> str:
        """ "sampling 10% (100 ms/s)", "continuous", or "" before the agent has said."""
        with self._lock:
            return sampling_text(self.stats.get("sampling"))

    def set_pc_sampling(self, on: bool) -> None:
        """Ask the agent to start (True) or stop PC-sampling ranges; before the connection is
        up this only changes what START asks for."""
        self.pc_sampling = on
        if self._sock is None or not self.hello or not self.hello.get("pc_sampling"):
            return
        self._send(wire.encode_control(wire.MsgType.SET, self._duty_fields()))

    def set_pc_period(self, period_ms: int) -> None:
        """Space the PC ranges `period_ms` apart (the tree source's PC budget); sent at once
        when connected, else kept for START."""
        self.pc_period_ms = int(period_ms)
        if self._sock is None or not self.hello or not self.hello.get("pc_sampling"):
            return
        self._send(wire.encode_control(wire.MsgType.SET, self._duty_fields()))

    def pc_status(self) -> str:
        """The agent's PC-sampling state: "off", "starting", "ok", "unavailable: <why>", or
        "" when this agent cannot sample (too old) or has not said yet."""
        with self._lock:
            state = self.stats.get("agent_pc_state")
        if not self.hello.get("pc_sampling"):
            return "unavailable: the agent in this process has no PC sampling (older kdash)"
        if state == "ok":
            with self._lock:
                ranges = self.stats.get("agent_pc_ranges")
                cpu_ms = self.stats.get("agent_pc_cpu_ms_per_range")
                held_ms = self.stats.get("agent_pc_held_ms_per_range")
            every = f", one every {self.pc_period_ms / 1000:g} s"
            if ranges and held_ms:
                # every CUPTI call of a range holds the target's GIL: wall time, not CPU
                return f"ok: {ranges} ranges, each holds the target {held_ms:.0f} ms{every}"
            if ranges and cpu_ms is not None:  # an older agent: only Stop's CPU is known
                return f"ok: {ranges} ranges, {cpu_ms:.0f} ms of the target's CPU each{every}"
        return str(state or ("starting" if self.pc_sampling else "off"))

    def _duty_fields(self) -> dict[str, Any]:
        f: dict[str, Any] = {
            "continuous": self.continuous,
            "period_ms": self.period_ms,
            "on_ms": self.on_ms,
        }
        if self.hello.get("pc_sampling"):
            f.update(
                pc_sampling=self.pc_sampling,
                pc_on_ms=self.pc_on_ms,
                pc_period_ms=self.pc_period_ms,
            )
        return f

    # internals
    def _send(self, frame: bytes) -> bool:
        sock = self._sock
        if sock is None:
            return False
        try:
            with self._send_lock:
                sock.sendall(frame, socket.MSG_NOSIGNAL)
            return True
        except OSError as e:
            if not self._stopping and not self._gone:
                if os.path.exists(f"/proc/{self.pid}"):
                    self.health = Health.unavailable(f"lost the agent of pid {self.pid}: {e}")
                else:  # the write raced the reader's EOF: say what happened, not the errno
                    self._gone = True
                    self.health = Health.unavailable(
                        f"the agent of pid {self.pid} went away (process exited)"
                    )
            return False

    def _reader(self) -> None:
        sock = self._sock
        assert sock is not None
        decoder = wire.Decoder()
        try:
            hello = wire.recv_message(sock, decoder)
            if hello is None or hello.type != wire.MsgType.HELLO:
                if hello is not None and hello.type == wire.MsgType.STATUS:
                    self._on_status(hello.body)
                else:
                    self.health = Health.unavailable(
                        f"the agent of pid {self.pid} closed the connection before HELLO "
                        "(another user's process, or a refused peer?)"
                    )
                return
            self.hello = hello.body
            if hello.body.get("schema_version") != schema.SCHEMA_VERSION:
                self.health = Health.unavailable(
                    f"the agent in pid {self.pid} speaks record schema "
                    f"{hello.body.get('schema_version')}, this kdash {schema.SCHEMA_VERSION}: "
                    "run the same kdash version in both"
                )
                return
            start = {"activities": self.activities, **self._duty_fields()}
            if self.graph_kernels:
                start["graph_kernels"] = True
            if int(hello.body.get("agent_version", 1)) < 2:
                start = {"activities": self.activities}  # an old agent: always continuous
            self._send(wire.encode_control(wire.MsgType.START, start))
            while True:
                msg = wire.recv_message(sock, decoder)
                if msg is None:
                    self._gone = True
                    if not self._stopping and not self.status_line.startswith("busy"):
                        self.health = Health.unavailable(
                            f"the agent of pid {self.pid} went away (process exited?)"
                        )
                    return
                if msg.type == wire.MsgType.BATCH:
                    self._on_batch(msg.table or "", msg.body)
                elif msg.type == wire.MsgType.STATUS:
                    self._on_status(msg.body)
                elif msg.type == wire.MsgType.STATS:
                    with self._lock:
                        self.stats.update({f"agent_{k}": v for k, v in msg.body.items()})
        except (OSError, wire.WireError) as e:
            if not self._stopping:
                self.health = Health.unavailable(
                    f"connection to the agent of pid {self.pid} failed: {type(e).__name__}: {e}"
                )
        except Exception as e:  # noqa: BLE001 - a reader bug shows as health, not a crash
            self.health = Health.degraded(f"agent reader failed: {type(e).__name__}: {e}")

    def _on_batch(self, table: str, batch: Batch) -> None:
        n = schema.batch_len(batch)
        try:
            self._queue.put_nowait((table, batch))
        except queue.Full:
            with self._lock:
                self.stats["dropped_client"] += n
            return
        with self._lock:
            self.stats["received_rows"] += n

    def _on_status(self, body: dict[str, Any]) -> None:
        self.status_line = str(body.get("line", ""))
        notes = [self._for_target(str(n)) for n in body.get("notes") or []]
        with self._lock:
            self.stats["notes"] = notes
            if "sampling" in body:
                self.stats["sampling"] = body["sampling"]
        health = _health_from_status(body)
        if "pip install" in health.reason:
            health = Health(health.state, self._for_target(health.reason), health.code)
        self.health = health

    def _for_target(self, text: str) -> str:
        """The agent's advice, with its `pip install` run through the target's interpreter
        (read once: a process does not change its interpreter)."""
        if "pip install" not in text:
            return text
        if self._python is None:
            self._python = target_python.target_python(self.pid)
        return target_python.for_target(text, self._python)

    def dropped(self) -> int:
        """Every row lost between CUPTI and this source, from all three places it can happen."""
        with self._lock:
            return int(
                self.stats.get("dropped_client", 0)
                + self.stats.get("agent_dropped_agent", 0)
                + self.stats.get("agent_dropped_cupti", 0)
            )
