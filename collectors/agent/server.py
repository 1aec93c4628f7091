"""The agent: a listener inside the watched process that turns CUPTI activity into batches.

Started by `start_agent()` (from the `kdash run` sitecustomize hook, or by injection; both load
it through loader.py). Until a client connects it is one daemon thread blocked in `poll()` on
a Unix socket: no CUDA, no CUPTI, no numpy import, nothing the target could notice. Every
module it loads at start-up imports only the standard library at module level (numpy, cupti
and kdash's wire format are imported inside functions, once a client is there). Why each rule
below exists:

* Socket only in a folder that is ours and 0700, the socket 0600, and the peer's uid
  (SO_PEERCRED) must equal ours (security.py says where and why).
* A fixed message set (`wire.MsgType`); control bodies are JSON and only ever read as data.
  There is no way to make the agent run code, load a module or touch a file by name. Clients
  may send only small control frames (MAX_CLIENT_PAYLOAD), checked on the header before the
  payload is read; per-session state is bounded (activities, notes, the name table).
* One client at a time; a request made while one is attached gets STATUS "busy" and is closed.
  Connections are greeted and read by the accept loop without threads; one that sends no
  request within SPEAK_WAIT_S is closed, and at most MAX_PENDING_CONNS wait, so connections
  held open by a process of the same user cannot lock kdash out.
* CUPTI through the Activity API only (controller.py), switched on and off by the duty cycle
  (duty.py), and left as if never touched when the client goes (session.py).
* Nothing may raise into the target: every callback CUPTI calls catches its own errors and
  records them (`callback_errors`, `last_error` in STATS and STATUS); every agent thread ends
  in a handler that records why.
* When CUPTI cannot be had (cupti-python not importable, no driver, versions that do not
  match, CUPTI held by another client in this process) the agent answers STATUS
  "unavailable: <why> ; <what to do>" and stays idle.

Timestamps: CUPTI's clock is mapped onto `time.monotonic_ns()` by an offset measured at START
(the tightest of a few `get_timestamp`/`monotonic_ns` pairs) and re-measured every 10 s; the
offset in use is reported in STATS so captures can keep it.

The names other modules import from here (the agent's parts lived in this one file once) are
re-exported below.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import select
import socket
import sys
import threading
import time

from .buffers import LayoutMismatch, RawBuffers
from .constants import (
    ADMIT_WAIT_S,
    AGENT_VERSION,
    DEFAULT_ACTIVITIES,
    DUTY_ON_MS,
    DUTY_PERIOD_MS,
    ENV_FAKE_CUDA,
    ENV_FAKE_PCSAMPLING,
    ENV_FLAG,
    LISTEN_BACKLOG,
    MAX_CLIENT_PAYLOAD,
    MAX_NOTE_CHARS,
    MAX_NOTES,
    MAX_PENDING_CONNS,
    MIN_ON_MS,
    PC_ON_MS,
    PC_PERIOD_MS,
    PC_WINDOW_NAME,
    POLL_S,
    SEND_TIMEOUT_S,
    SPEAK_WAIT_S,
    WINDOW_DOMAIN,
    WINDOW_NAME,
)
from .controller import CuptiActivity, Unavailable, reader_name
from .duty import DutyCycle, PCConfig, parse_activities, sampling_text
from .fields import RECORD_DTYPES, ROW_COLUMNS
from .loader import ENV_PKGS, ensure_kdash, schema_module, wire_module
from .outbox import Outbox
from .pcrun import PCRunner
from .probes import (
    cuda_loaded,
    dist_version,
    driver_absent,
    driver_cuda_version,
    find_libcupti,
    install_hint,
    other_cupti_client,
    version_mismatch,
)
from .records import RecordConverter, ThreadIds, rows_to_batch
from .security import (
    check_peer,
    ensure_private_dir,
    fallback_dir,
    fallback_dirs,
    folder_problem,
    folder_problems,
    peer_credentials,
    socket_dirs,
    socket_path_for,
    sweep_stale,
)
from .session import Session

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

__all__ = [
    "DEFAULT_ACTIVITIES",
    "DUTY_ON_MS",
    "DUTY_PERIOD_MS",
    "ENV_FAKE_CUDA",
    "ENV_FAKE_PCSAMPLING",
    "ENV_FLAG",
    "ENV_PKGS",
    "MAX_NOTES",
    "MIN_ON_MS",
    "PC_ON_MS",
    "PC_PERIOD_MS",
    "PC_WINDOW_NAME",
    "RECORD_DTYPES",
    "ROW_COLUMNS",
    "SPEAK_WAIT_S",
    "WINDOW_DOMAIN",
    "WINDOW_NAME",
    "Agent",
    "CuptiActivity",
    "DutyCycle",
    "LayoutMismatch",
    "PCConfig",
    "RawBuffers",
    "RecordConverter",
    "ThreadIds",
    "Unavailable",
    "check_peer",
    "cuda_loaded",
    "current_agent",
    "driver_absent",
    "driver_cuda_version",
    "ensure_kdash",
    "ensure_private_dir",
    "fallback_dir",
    "fallback_dirs",
    "find_libcupti",
    "folder_problem",
    "folder_problems",
    "install_hint",
    "other_cupti_client",
    "parse_activities",
    "peer_credentials",
    "rows_to_batch",
    "sampling_text",
    "socket_dirs",
    "socket_path_for",
    "start_agent",
    "start_error",
    "sweep_stale",
    "version_mismatch",
]


def client_messages(wire: Any) -> frozenset:
    """Frames a client may send: control requests only. Data frames (NAMES, BATCH) would have
    the agent read and keep up to hundreds of megabytes a frame."""
    return wire.CONTROL_TYPES


_PENDING_SEQ = [0]


class _Pending:
    """An accepted connection that has been sent HELLO and not yet been given the session:
    the bytes of its first frame read so far, and the frame once it is whole."""

    __slots__ = (
        "buf",
        "conn",
        "deadline",
        "fd",
        "header",
        "msg",
        "need",
        "peer_pid",
        "seq",
        "spoke_at",
    )

    def __init__(self, conn: socket.socket, peer_pid: int, deadline: float, need: int) -> None:
        self.conn, self.fd, self.peer_pid, self.deadline = conn, conn.fileno(), peer_pid, deadline
        self.buf = bytearray()
        self.need = need  # bytes of the first frame to have: its header, then all of it
        self.header: Any = None
        self.msg: Any = None
        self.spoke_at = 0.0
        _PENDING_SEQ[0] += 1
        self.seq = _PENDING_SEQ[0]


def _eviction_victim(pending: dict[int, _Pending]) -> _Pending:
    """The waiting connection to close when too many wait: one that has not spoken, of the
    peer process holding the most, its oldest. A kdash client holds one connection and
    speaks at once, so another process's pile of idle connections cannot push it out."""
    quiet = [p for p in pending.values() if p.msg is None] or list(pending.values())
    counts: dict[int, int] = {}
    for p in quiet:
        counts[p.peer_pid] = counts.get(p.peer_pid, 0) + 1
    worst = max(counts, key=lambda pid: counts[pid])
    return min((p for p in quiet if p.peer_pid == worst), key=lambda p: p.seq)


class Agent:
    """The listener and its one session at a time. See the module docstring for the rules.

    What outlives a session is here: the CUPTI controller (`make_controller(pid)` makes it at
    the first START; the tests hand in a fake), the outbox, the PC-sampling runner, counters.
    """

    def __init__(self, path: str, make_controller: Callable[[int], Any] = CuptiActivity) -> None:
        self.pid = os.getpid()
        self.path = path
        self.make_controller = make_controller
        self.controller: Any = None  # CuptiActivity, made at the first START
        self.state = "idle"  # idle | active | waiting | unavailable | error
        self.line = "idle: no client"
        self.sessions = 0
        self.last_error = ""
        self.last_disconnect = ""
        self.outbox = Outbox(self.pid)
        self.pc = PCRunner(self.outbox)
        self.next_try = 0.0  # when a waiting START may ask for CUPTI again
        self.act_note = ""  # the last START's unknown activities, if any
        self.graph_kernels = False  # START "graph_kernels" of the current session
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._session_lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._live = False  # a session has a client (set by the accept loop, cleared at its end)
        self._hello: bytes | None = None
        self._strings: Any = None  # the session's wire.StringEncoder
        self._closing = False

    # lifecycle
    def listen(self) -> None:
        folder = os.path.dirname(self.path)
        ensure_private_dir(folder)
        sweep_stale(folder)
        # Bound under a name no client looks for, and moved into place once it listens: a
        # client that found `<pid>.sock` between bind and listen would be refused and take it
        # for a stale socket. The move also replaces a stale one of an earlier pid holder.
        binding = os.path.join(folder, f".{self.pid}.binding")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(binding)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(binding)
            os.chmod(binding, 0o600)
            s.listen(LISTEN_BACKLOG)
            s.setblocking(False)  # the accept loop drains the backlog and never waits in accept
            os.replace(binding, self.path)
        except BaseException:
            s.close()
            with contextlib.suppress(OSError):
                os.unlink(binding)
            raise
        self._listener = s
        self._thread = threading.Thread(target=self._serve, name="kdash-agent", daemon=True)
        self._thread.start()

    def close(self, unlink: bool = True) -> None:
        """Stop listening; disable CUPTI if a session is on (atexit and tests)."""
        self._closing = True
        conn = self._conn
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        # wait (bounded) for a running session to disable CUPTI before the process goes on
        if self._session_lock.acquire(timeout=2.0):
            self._session_lock.release()
        if self.controller is not None:  # no finalize waiting for a call during interpreter exit
            with contextlib.suppress(Exception):
                self.controller.cancel_hook()
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept loop's poll
            with contextlib.suppress(OSError):
                self._listener.close()
        if unlink:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            folder = os.path.dirname(self.path)
            if os.path.basename(folder).startswith(f"kdash-{os.getuid()}-"):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)  # a fallback folder of ours, if nobody else uses it

    # the accept loop
    def _serve(self) -> None:
        pending: dict[int, _Pending] = {}
        try:
            self._accept_loop(pending)
        except BaseException as e:  # noqa: BLE001 - the target must never see this
            if not self._closing:
                self.state, self.last_error = "error", f"accept loop: {type(e).__name__}: {e}"
        finally:
            for p in pending.values():
                with contextlib.suppress(OSError):
                    p.conn.close()

    def _accept_loop(self, pending: dict[int, _Pending]) -> None:
        """Accept, greet, and hand a connection to a session once it has spoken.

        Why not one thread per connection, or a session per accepted connection: a process of
        our own user holding many connections open (or opening them in a loop) must not lock
        kdash out, nor cost the target threads or file descriptors. So: HELLO goes out at
        accept; the connection then has SPEAK_WAIT_S to send its first request, read here
        without blocking; at most MAX_PENDING_CONNS wait, and a new one beyond that closes a
        waiting one of the peer process that holds the most; a request made while a client is
        attached gets STATUS "busy" (after ADMIT_WAIT_S, in case that client has just left),
        and the connection is closed. The loop sleeps in poll() with no
        timeout while nothing is waiting: no wake-ups in an idle target.
        """
        wire: Any = None  # wire.py (and numpy with it) once a first connection comes
        lst = self._listener
        assert lst is not None
        lfd = lst.fileno()
        poller = select.poll()
        poller.register(lfd, select.POLLIN)
        while not self._closing:
            timeout_ms: float | None = None
            if pending:
                nearest = min(p.deadline for p in pending.values())
                if any(p.msg is not None for p in pending.values()):
                    nearest = min(nearest, time.monotonic() + POLL_S)  # a teardown to await
                timeout_ms = max(0.0, (nearest - time.monotonic()) * 1000)
            for fd, _ev in poller.poll(timeout_ms):
                if fd == lfd:
                    if self._closing:
                        return
                    wire = wire or wire_module()
                    if not self._accept_some(wire, pending, poller):
                        return
                elif fd in pending:
                    self._read_first(wire, pending[fd], pending, poller)
            if pending:
                self._admit_ready(wire, pending, poller)
            now = time.monotonic()
            for p in [p for p in pending.values() if p.deadline <= now]:
                if p.msg is not None:  # spoke, but the last session's teardown took too long
                    self._send_busy(wire, p.conn)
                self._drop(p, pending, poller)

    def _accept_some(self, wire: Any, pending: dict[int, _Pending], poller: Any) -> bool:
        """Accept what the backlog holds (a bounded number per call); False to stop serving."""
        lst = self._listener
        assert lst is not None
        for _ in range(64):
            try:
                conn, _ = lst.accept()
            except BlockingIOError:
                return True
            except OSError as e:
                if self._closing:
                    return False
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self.last_error = f"accept failed: {e}"
                    time.sleep(0.1)  # the target is out of descriptors: do not spin on it
                    return True
                self.state, self.last_error = "error", f"accept failed: {e}"
                return False
            try:
                self._greet(wire, conn, pending, poller)
            except BaseException as e:  # noqa: BLE001 - the target must never see this
                self.last_error = f"session setup: {type(e).__name__}: {e}"
                pending.pop(conn.fileno(), None)
                with contextlib.suppress(OSError, KeyError, ValueError):
                    poller.unregister(conn)
                with contextlib.suppress(OSError):
                    conn.close()
        return True

    def _greet(self, wire: Any, conn: socket.socket, pending: dict[int, _Pending], poller: Any):
        refusal = check_peer(conn)
        if refusal is not None:
            self.last_error = f"refused a client: {refusal}"
            conn.close()  # a stranger learns nothing, not even why
            return
        try:
            peer_pid = peer_credentials(conn)[0]
            conn.send(self._hello_frame(wire), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
        except OSError:
            conn.close()
            return
        p = _Pending(conn, peer_pid, time.monotonic() + SPEAK_WAIT_S, wire.HEADER.size)
        pending[conn.fileno()] = p
        poller.register(conn.fileno(), select.POLLIN)
        if len(pending) > MAX_PENDING_CONNS:
            self._drop(_eviction_victim(pending), pending, poller)

    def _read_first(
        self, wire: Any, p: _Pending, pending: dict[int, _Pending], poller: Any
    ) -> None:
        """Read what has arrived of a waiting connection's first frame, never past it: the
        session reads the rest. A frame that is not a small control request closes it."""
        try:
            data = p.conn.recv(p.need - len(p.buf), socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._drop(p, pending, poller)
            return
        p.buf += data
        if len(p.buf) < p.need:
            return
        try:
            if p.header is None:
                p.header = wire.decode_header(p.buf)
                wire.check_header(p.header, client_messages(wire), MAX_CLIENT_PAYLOAD)
                p.need += p.header.payload_len
                if len(p.buf) < p.need:
                    return
            p.msg = wire.Decoder().decode_payload(p.header, memoryview(p.buf)[wire.HEADER.size :])
            p.spoke_at = time.monotonic()
        except wire.WireError as e:
            self.last_error = f"refused a client: {e}"
            self._drop(p, pending, poller)
            return
        with contextlib.suppress(KeyError, ValueError):
            poller.unregister(p.conn)  # it has spoken: the session reads the rest

    def _admit_ready(self, wire: Any, pending: dict[int, _Pending], poller: Any) -> None:
        """Give the session to the first connection that has spoken, once the last session has
        torn down (disable, the last flush, finalize); others that spoke are told busy."""
        ready = sorted((p for p in pending.values() if p.msg is not None), key=lambda p: p.seq)
        if not ready:
            return
        if self._live:  # a client is attached, or has just left and its session not seen it
            now = time.monotonic()
            ready = [p for p in ready if now - p.spoke_at >= ADMIT_WAIT_S]
        else:
            if not self._session_lock.acquire(blocking=False):
                return  # still tearing down: wait (until the connection's deadline)
            first = ready.pop(0)
            self._drop(first, pending, poller, close=False)
            self._live = True
            try:
                t = threading.Thread(
                    target=self._session, args=(first.conn, first.msg), name="kdash-agent-session"
                )
                t.daemon = True
                t.start()
            except BaseException:
                self._live = False
                self._session_lock.release()
                with contextlib.suppress(OSError):
                    first.conn.close()
                raise
        for p in ready:
            self._send_busy(wire, p.conn)
            self._drop(p, pending, poller)

    def _drop(
        self, p: _Pending, pending: dict[int, _Pending], poller: Any, close: bool = True
    ) -> None:
        pending.pop(p.fd, None)
        with contextlib.suppress(KeyError, ValueError):
            poller.unregister(p.fd)
        if close:
            with contextlib.suppress(OSError):
                p.conn.close()

    def _send_busy(self, wire: Any, conn: socket.socket) -> None:
        busy = {"state": "busy", "line": f"busy: another kdash client is attached to {self.pid}"}
        with contextlib.suppress(OSError):
            conn.send(
                wire.encode_control(wire.MsgType.STATUS, busy),
                socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL,
            )

    def _hello_frame(self, wire: Any) -> bytes:
        if self._hello is None:
            self._hello = wire.encode_control(
                wire.MsgType.HELLO,
                {
                    "agent_version": AGENT_VERSION,
                    "wire_version": wire.VERSION,
                    "schema_version": schema_module().SCHEMA_VERSION,
                    "pid": self.pid,
                    "python": sys.version.split()[0],
                    "capabilities": list(DEFAULT_ACTIVITIES),
                    "cupti_python": dist_version("cupti-python"),
                    "duty_cycle": True,
                    "pc_sampling": True,
                },
            )
        return self._hello

    # one client
    def _notes(self) -> list[str]:
        c = self.controller
        notes = [self.act_note] if self.act_note else []
        if c is None:
            return notes
        notes += c.notes
        if c.converter is not None and c.converter.fast_note:
            notes.append(c.converter.fast_note)
        for extra in (c.raw_note, c.raw_failed):
            if extra:
                notes.append(extra[:MAX_NOTE_CHARS])
        return notes

    def status_body(self, state: str, line: str, duty: DutyCycle) -> dict:
        return {"state": state, "line": line, "notes": self._notes(), "sampling": duty.describe()}

    def stats(self, duty: DutyCycle) -> dict:
        """The STATS body: the agent's counters and the controller's."""
        c = self.controller
        if c is not None and c.enabled:
            c.read_dropped()
        pc = self.pc
        out = self.outbox
        return {
            "pid": self.pid,
            "state": self.state,
            "line": self.line,
            "sessions": self.sessions,
            "sent_rows": dict(out.sent_rows),
            "dropped_agent": out.dropped_rows,
            # GPU records a window's switch-off falsified (trim.py): ends cut back, rows dropped
            "trimmed_rows": out.trimmed_rows,
            "dropped_off_rows": out.dropped_off_rows,
            "discarded_rows": out.discarded_rows,
            **controller_stats(c),
            "last_error": (c.last_error if c and c.last_error else self.last_error),
            "notes": self._notes(),
            "sampling": duty.describe(),
            "windows_sent": out.windows_sent,
            "on_ns": out.on_ns,
            # the agent's own threads now: after a detach only the accept loop (blocked in
            # accept, never waking) and the session answering this request
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kdash")),
            "last_disconnect": self.last_disconnect,
            "names_overflowed": self._strings.overflowed if self._strings is not None else 0,
            "pc_state": pc.text(),
            "pc_ranges": pc.ranges,
            "pc_rows": pc.rows,
            "pc_last": dict(pc.last),
            "pc_cpu_ms_per_range": pc.cpu_ms_per_range(),
            "pc_held_ms_per_range": pc.held_ms_per_range(),
            "pc_non_user_share": pc.non_user_share,
            "pc_refreshes": getattr(c, "pc_refreshes", 0),
            "pc_refresh_note": pc.refresh_note,
            # CUPTI finalized after each window (controller.release_between_windows)
            "cupti_releases": getattr(c, "releases", 0),
            "cupti_released": bool(getattr(c, "released", False)),
            "cupti_release_note": getattr(c, "release_note", ""),
            # the target's time in those releases' cuptiFinalize calls and the windows'
            # registrations after them (part of what the cost estimate counts)
            "cupti_release_finalize_ns": getattr(c, "release_finalize_ns", 0),
            "cupti_reregister_ns": getattr(c, "reregister_ns", 0),
            # the windows' edges (kinds on and narrowed, kinds off): counted like the releases
            "cupti_switch_ns": getattr(c, "switch_ns", 0),
        }

    def _session(self, conn: socket.socket, first: Any) -> None:
        """One client, whose HELLO the accept loop sent and whose first request is `first`:
        its messages go to a Session until it stops, leaves or dies."""
        wire = wire_module()
        self._conn = conn
        self.sessions += 1
        s: Session | None = None
        try:
            conn.settimeout(SEND_TIMEOUT_S)

            def send(frame: bytes) -> None:
                conn.sendall(frame, socket.MSG_NOSIGNAL)

            s = Session(self, send, wire)
            self._strings = s.strings
            accept = client_messages(wire)
            # poll, not select: select() cannot watch a descriptor numbered 1024 or more, and
            # a target holding that many files gives its connections such numbers
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            decoder = wire.Decoder()
            msg = first
            while not self._closing:
                if msg is None and poller.poll(s.timeout() * 1000):
                    msg = wire.recv_message(conn, decoder, accept, MAX_CLIENT_PAYLOAD)
                    if msg is None:
                        break  # the client closed or died
                s.step(msg)
                msg = None
        except (BrokenPipeError, ConnectionResetError) as e:
            # the client went away (closed after STOP, or was killed): a normal end, not an error
            self.last_disconnect = f"client left ({type(e).__name__})"
        except (OSError, wire.WireError) as e:
            self.last_error = f"client connection: {type(e).__name__}: {e}"
        except BaseException as e:  # noqa: BLE001 - never into the target
            self.last_error = f"session: {type(e).__name__}: {e}"
        finally:
            self._live = False  # newcomers wait for the teardown below, then get the session
            if s is not None:
                s.end(self._closing)
            self.outbox.discard()
            self.state, self.line = "idle", "idle: no client"
            self._conn = None
            with contextlib.suppress(OSError):
                conn.close()
            self._session_lock.release()


def controller_stats(c: CuptiActivity | None) -> dict:
    """The controller's part of STATS (zeros before the first START)."""
    conv = c.converter if c is not None else None
    raw = c.raw if c is not None else None
    out = {
        "record_reader": reader_name(c),
        "bad_time_records": conv.bad_time_records if conv else 0,
        "markers_overflowed": conv.markers_overflowed if conv else 0,
        "raw_buffers": raw.buffers if raw else 0,
        "raw_errors": raw.errors if raw else 0,
        "raw_bytes_lost": raw.bytes_lost if raw else 0,
        "buffers_requested": raw.requested if raw else 0,
    }
    if c is None:
        return {
            **out,
            **dict.fromkeys(CONTROLLER_COUNTERS, 0),
            "enabled": [],
            "kinds_on": [],
            "cupti_state": "never attached",
            "graphs_seen": False,
            "graph_kernels_recorded": False,
            "narrow_us_per_window": None,
            "switch_us_per_window": None,
        }
    return {
        **out,
        **{k: getattr(c, attr) for k, attr in CONTROLLER_COUNTERS.items()},
        "enabled": [a for a, _ in c.enabled],
        "kinds_on": c.kinds_on(),
        "cupti_state": c.detach_state,
        "graphs_seen": c.graphs_seen,
        "graph_kernels_recorded": c.graph_kernels_recorded,
        "narrow_us_per_window": round(c.narrow_ns / c.resumes / 1e3, 1) if c.resumes else None,
        "switch_us_per_window": round(c.switch_ns / c.resumes / 1e3, 1) if c.resumes else None,
    }


# STATS key -> CuptiActivity counter
CONTROLLER_COUNTERS = {
    "dropped_cupti": "dropped_by_cupti",
    "discarded_records": "discarded_records",
    "records_seen": "records_seen",
    "callback_ns": "callback_ns",
    "callback_cpu_ns": "callback_cpu_ns",
    "flush_cpu_ns": "flush_cpu_ns",
    "callback_errors": "callback_errors",
    "offset_ns": "offset_ns",
    "offset_gap_ns": "offset_gap_ns",
    "discarded_bytes": "discarded_bytes",
    "cupti_detached": "cupti_detached",
}

# ---- process-wide entry points ------------------------------------------------------------------

_AGENT: Agent | None = None
_START_LOCK = threading.Lock()
_FORK_HOOKED = False
_LAST_START_ERROR = ""


def start_agent() -> Agent | None:
    """Start the agent in this process once; later calls return the same agent.

    Returns quickly (a mkdir, a bind and a thread start) and never raises: if the socket cannot
    be made, the reason is kept in `start_error()` and None is returned, and the target goes on.
    """
    global _AGENT, _FORK_HOOKED, _LAST_START_ERROR
    try:
        with _START_LOCK:
            if _AGENT is not None and _AGENT.pid == os.getpid():
                return _AGENT
            errors = folder_problems()
            for d in [*socket_dirs(), ""]:
                try:
                    if not d:  # every usual folder is taken: a private one of our own
                        d = fallback_dir()
                    agent = Agent(os.path.join(d, f"{os.getpid()}.sock"))
                    agent.listen()
                except OSError as e:
                    why = f"{d}: {e}" if d else str(e)
                    if why not in errors:
                        errors.append(why)
                    continue
                _AGENT = agent
                atexit.register(_at_exit, agent)
                if not _FORK_HOOKED:
                    os.register_at_fork(after_in_child=_after_fork_in_child)
                    _FORK_HOOKED = True
                return agent
            _LAST_START_ERROR = f"no usable socket folder ({'; '.join(errors)})"
            return None
    except BaseException as e:  # noqa: BLE001 - the target must start regardless
        _LAST_START_ERROR = f"{type(e).__name__}: {e}"
        return None


def start_error() -> str:
    return _LAST_START_ERROR


def current_agent() -> Agent | None:
    return _AGENT


def _at_exit(agent: Agent) -> None:
    try:
        if agent.pid == os.getpid():
            agent.close()
    except BaseException as e:  # noqa: BLE001 - exiting anyway: say it once on stderr
        with contextlib.suppress(Exception):
            sys.stderr.write(f"kdash agent: cleanup at exit failed: {type(e).__name__}: {e}\n")


def _after_fork_in_child() -> None:
    """A forked child is a new pid: drop the parent's listener (without unlinking the parent's
    socket) and listen on its own, if kdash run armed this process tree."""
    global _AGENT, _START_LOCK
    old = _AGENT
    _AGENT = None
    _START_LOCK = threading.Lock()  # the parent's lock may have been held at fork time
    if old is not None and old._listener is not None:
        with contextlib.suppress(OSError):
            old._listener.close()
    if os.environ.get(ENV_FLAG) == "1":
        start_agent()
