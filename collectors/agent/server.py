"""The agent: a listener inside the watched process that turns CUPTI activity into batches.

Started by `start_agent()` (from the `kdash run` sitecustomize hook, or by injection). Until a
client connects it is one daemon thread blocked in `poll()` on a Unix socket: no CUDA, no
CUPTI, no numpy import, nothing the target could notice. Why each rule below exists:

* Socket only at `$XDG_RUNTIME_DIR/kdash/<pid>.sock`, else `/tmp/kdash-<uid>/<pid>.sock`, else
  (when someone else made that folder first) in a private `/tmp/kdash-<uid>-<random>` that the
  client finds by listing /tmp; every folder is 0700 and checked to be ours (a foreign one is
  never used, nor searched by the client), the socket 0600, and the peer's uid (SO_PEERCRED)
  must equal ours. Kernel names and API traces reveal what a process runs, so only its own
  user may see them.
* A fixed message set (`wire.MsgType`); control bodies are JSON and only ever read as data.
  There is no way to make the agent run code, load a module or touch a file by name. Clients
  may send only small control frames (MAX_CLIENT_PAYLOAD), checked on the header before the
  payload is read; per-session state is bounded (activities, notes, the name table).
* One client at a time; a request made while one is attached gets STATUS "busy" and is closed.
  Connections are greeted and read by the accept loop without threads; one that sends no
  request within SPEAK_WAIT_S is closed, and at most MAX_PENDING_CONNS wait, so connections
  held open by a process of the same user cannot lock kdash out.
* CUPTI through cupti-python's Activity API only (`activity_register_callbacks`,
  `activity_enable`, `activity_flush_all`). Never `cuptiSubscribe`: a callback subscriber
  blinds torch.profiler for the life of the process, and a profiler the user starts later must
  still work once kdash has detached.
* Duty cycle (agent version 2): after START, activity is on for `on_ms` of every `period_ms`
  (default 100 of 1000): at each window's end every kind is disabled and the buffers are
  force-flushed, at the next period's start they are enabled (and the API records narrowed)
  again. Why: continuous activity cost the H200 targets 12.7% (eager) and 59% (CUDA-graph
  replays of tiny kernels), against a 2% floor. Each window's [start, end] goes to the client
  as a markers row (domain "kdash", name "activity on"; start taken before the first enable,
  end after the last disable), so a timeline can tell "not recorded" from "GPU idle". START
  `continuous: true`, or SET at any time, switches to continuous (a row per period still marks
  the recorded span) and back.
* When the client says STOP, disconnects, or dies (SIGKILL closes its socket, which the agent
  sees as EOF or a send error within its 50 ms poll), every enabled activity kind is disabled
  and the buffers are flushed; then CUPTI is finalized at the exit of the target's next launch
  or synchronize call (detach.py), because CUPTI merely attached costs a graph-replaying
  process up to 17% for as long as it stays (`cupti_state` in STATS). Every enable and disable
  goes through a per-kind ledger (`kinds_on` in STATS: empty after a detach); kinds left on for
  another CUPTI client (torch.profiler, see step_aside) are switched off at the end of the
  session once that client has finished, and CUPTI is then left to that client.
* CUDA graphs: once kernel activity has been on while a process replays CUDA graphs, finalizing
  kills it, so CUPTI could never leave it again. START therefore first listens for graph
  launches (GRAPH_PROBE_S); a process that replays graphs gets no kernel activity, and CUPTI is
  finalized at that launch's exit, unless START says `graph_kernels` (`--graph-kernels`). A
  graph kernel that shows up later (graphs begun after START) stops kernel activity for good.
* Nothing may raise into the target: every callback CUPTI calls catches its own errors and
  records them (`callback_errors`, `last_error` in STATS and STATUS); every agent thread ends
  in a handler that records why.
* When CUPTI cannot be had (cupti-python not importable, no driver, versions that do not
  match, CUPTI held by another client in this process) the agent answers STATUS
  "unavailable: <why> ; <what to do>" and stays idle.

Timestamps: CUPTI's clock is mapped onto `time.monotonic_ns()` by an offset measured at START
(the tightest of a few `get_timestamp`/`monotonic_ns` pairs) and re-measured every 10 s; the
offset in use is reported in STATS so captures can keep it.

Test seam: with `KDASH_AGENT_FAKE_CUDA=<cuda version int, e.g. 13000>` in the target's
environment the driver probe reports that version and CUDA counts as loaded. The tests use it
with a stand-in `cupti` module to drive the whole START -> records -> STOP path on a machine
without a GPU; it changes nothing else.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import os
import select
import socket
import stat
import struct
import sys
import threading
import time

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

    Batch = dict[str, Any]  # column name -> numpy array (see kdash.schema)

AGENT_VERSION = 2  # 2: duty cycle (START period_ms/on_ms/continuous, SET), "activity on" rows
ENV_FLAG = "KDASH_AGENT"
ENV_FAKE_CUDA = "KDASH_AGENT_FAKE_CUDA"

POLL_S = 0.05  # how often the session looks at its socket and queue
FLUSH_EVERY_S = 0.2  # how often completed CUPTI buffers are asked for
OFFSET_EVERY_S = 10.0
MAX_PENDING_ROWS = 2_000_000  # agent-side queue bound; rows beyond it are counted as dropped
BUFFER_BYTES = 4 * 1024 * 1024
SEND_TIMEOUT_S = 5.0  # a client that reads nothing for this long is treated as gone
# Bounds on what a peer of our own user can make the agent hold (issue 11): connections that
# wait for the session, the first frame's size, and per-session state (see Agent._accept_loop).
SPEAK_WAIT_S = 5.0  # a connection that sends no request within this is closed
ADMIT_WAIT_S = 1.0  # how long a request waits for the previous session's teardown, then "busy"
LISTEN_BACKLOG = 64
MAX_PENDING_CONNS = 16  # accepted connections waiting to speak (or for a teardown), at most
MAX_CLIENT_PAYLOAD = 64 * 1024  # a client request (START, SET, STATS, STOP) is ~300 bytes
MAX_ACTIVITIES = 32  # names in a START's activities list
MAX_NOTES = 16  # STATUS/STATS notes kept; each cut to MAX_NOTE_CHARS
MAX_NOTE_CHARS = 400
# the session's string dictionary (kernel, API, NVTX names sent to the client)
MAX_SESSION_NAMES = 500_000
MAX_SESSION_NAME_BYTES = 128 * 1024 * 1024
MAX_NAME_CHARS = 16 * 1024
DETACH_WAIT_S = 1.0  # how long a detach waits for the target's next CUDA call (detach.py)
GRAPH_PROBE_S = 1.0  # how long START listens for CUDA-graph launches before enabling kernels

# Duty cycle (issue 3 item 4): CUPTI activity on for ON_MS of every PERIOD_MS by default, because
# continuous activity cost the H200 target 12.7% (eager) and 59% (CUDA-graph replays of tiny
# kernels), far above the 2% floor. A client asks for other values, or continuous, in START or SET.
DUTY_PERIOD_MS = 1000
DUTY_ON_MS = 100
MIN_ON_MS = 10  # below this the enable/flush/disable work of a window outweighs what it records
MAX_PERIOD_MS = 60_000
WINDOW_NAME = "activity on"  # markers rows (domain WINDOW_DOMAIN) that bound every on-window
WINDOW_DOMAIN = "kdash"
PC_WINDOW_NAME = "pc sampling"  # markers rows bounding every PC-sampling range

# PC sampling (issue 5): off until a client asks (START/SET "pc_sampling": true); then a range
# of PC_ON_MS every PC_PERIOD_MS, run by its own thread while kernel activity is off (CUPTI
# refuses both at once), its CUPTI calls made with the GIL held (pcsampling.SamplingRanges says
# why). Not yet run end to end on a GPU in this form: the first H200 run, with the GIL released,
# hung its target (bench/results/pcs-agent-h200-hang.json).
PC_ON_MS = 200
PC_PERIOD_MS = 2000
PC_MIN_ON_MS, PC_MAX_ON_MS = 20, 2000
ENV_FAKE_PCSAMPLING = "KDASH_AGENT_FAKE_PCSAMPLING"  # test seam: a stand-in libcupti+libcuda

# CUPTI's CUpti_ActivityFlag marker bits (cupti-python 13.0 lists START but not END by name).
MARKER_INSTANT = 1 << 0
MARKER_START = 1 << 1
MARKER_END = 1 << 2
MAX_OPEN_MARKERS = 100_000

DEFAULT_ACTIVITIES = (
    "kernels",
    "memcpy",
    "memset",
    "runtime",
    "driver",
    "synchronization",
    "markers",
)
# activity name -> cupti.ActivityKind member name
ACTIVITY_KINDS = {
    "kernels": "CONCURRENT_KERNEL",
    "memcpy": "MEMCPY",
    "memset": "MEMSET",
    "runtime": "RUNTIME",
    "driver": "DRIVER",
    "synchronization": "SYNCHRONIZATION",
    "markers": "MARKER",
}
REQUIRED_ACTIVITY = "kernels"  # without it there is nothing to show: unavailable
# API records kept (by cupti_runtime_cbid.h / cupti_driver_cbid.h name): launches, waits, copies
API_KEEP = r"Launch|Synchroniz|Memcpy|Memset|StreamWaitEvent|EventRecord"


# ---- where the socket lives ---------------------------------------------------------------------


TMP_ROOT = "/tmp"  # where the shared-folder candidates live (tests point it elsewhere)


def folder_problem(path: str, uid: int) -> str | None:
    """Why an existing `path` cannot be our socket folder (not a real folder, or another
    user's), or None when it is usable or absent. Loose modes of our own folder do not count:
    ensure_private_dir tightens them."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} exists and is not a folder (a symlink?)"
    if st.st_uid != uid:
        return f"{path} belongs to uid {st.st_uid} (another user made it first)"
    return None


def fallback_dirs(uid: int | None = None) -> list[str]:
    """Private folders `<TMP_ROOT>/kdash-<uid>-<suffix>` already made (by fallback_dir) for
    when `/tmp/kdash-<uid>` is taken: only real folders of ours with mode 0700, by name."""
    uid = os.getuid() if uid is None else uid
    prefix = f"kdash-{uid}-"
    try:
        names = sorted(n for n in os.listdir(TMP_ROOT) if n.startswith(prefix))
    except OSError:
        return []
    out = []
    for name in names:
        path = os.path.join(TMP_ROOT, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
            out.append(path)
    return out


def fallback_dir() -> str:
    """Make a new private folder `<TMP_ROOT>/kdash-<uid>-<random>` (0700, made by mkdir, so it
    cannot be someone else's) for an agent whose usual folders are taken; the client finds it
    with fallback_dirs()."""
    uid = os.getuid()
    for _ in range(8):
        path = os.path.join(TMP_ROOT, f"kdash-{uid}-{os.urandom(4).hex()}")
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue
    raise OSError(f"cannot make a private folder kdash-{uid}-* in {TMP_ROOT}")


def socket_dirs(uid: int | None = None) -> list[str]:
    """Candidate folders, best first: `$XDG_RUNTIME_DIR/kdash` (when that runtime dir is ours),
    `/tmp/kdash-<uid>`, then the private fallbacks of fallback_dirs(). A candidate that exists
    but is not a folder of ours is left out: it could be a folder someone else made first to
    plant a socket there. The client looks in the same places."""
    uid = os.getuid() if uid is None else uid
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        try:
            st = os.stat(xdg)
            if stat.S_ISDIR(st.st_mode) and st.st_uid == uid:
                out.append(os.path.join(xdg, "kdash"))
        except OSError:
            pass  # a stale XDG_RUNTIME_DIR (e.g. after su): fall back to /tmp below
    out.append(os.path.join(TMP_ROOT, f"kdash-{uid}"))
    usable = [d for d in out if folder_problem(d, uid) is None] + fallback_dirs(uid)
    # nothing usable: the taken folder stays first, so whatever uses it says why it failed
    return usable or out


def folder_problems(uid: int | None = None) -> list[str]:
    """Why the usual socket folders cannot be used, one phrase each (empty when they can)."""
    uid = os.getuid() if uid is None else uid
    out = []
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    cands = [os.path.join(xdg, "kdash")] if xdg else []
    for d in [*cands, os.path.join(TMP_ROOT, f"kdash-{uid}")]:
        why = folder_problem(d, uid)
        if why:
            out.append(why)
    return out


def ensure_private_dir(path: str) -> None:
    """Create `path` as 0700, or check that an existing one is a real folder of ours and 0700.

    A folder made first by someone else (or a symlink to one) could let them swap our socket
    for theirs, so it is refused with an OSError that says why.
    """
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise OSError(f"{path} exists and is not a folder (a symlink?); refusing to use it")
    if st.st_uid != os.getuid():
        raise OSError(f"{path} belongs to uid {st.st_uid}, not {os.getuid()}; refusing it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)  # ours but loosened (e.g. by a umask game): tighten it back


def sweep_stale(folder: str) -> int:
    """Remove sockets and notes of processes that are gone; how many were removed.

    A process killed with SIGKILL, or a forked child leaving by os._exit, cannot remove its
    socket; left alone, a later process that gets the same pid would look watched.
    """
    removed = 0
    try:
        names = os.listdir(folder)
    except OSError:
        return 0
    for name in names:
        stem, dot, ext = name.partition(".")
        if not dot or ext not in ("sock", "unavailable") or not stem.isdigit():
            continue
        if os.path.exists(f"/proc/{stem}"):
            continue
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(folder, name))
            removed += 1
    return removed


def socket_path_for(pid: int, uid: int | None = None) -> str:
    return os.path.join(socket_dirs(uid)[0], f"{pid}.sock")


# ---- peer check ---------------------------------------------------------------------------------

_UCRED = struct.Struct("3i")


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process on the other end of a Unix socket (SO_PEERCRED)."""
    raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    return _UCRED.unpack(raw)


def check_peer(conn: socket.socket, expected_uid: int | None = None) -> str | None:
    """None when the peer runs as `expected_uid` (default: our uid), else the reason to refuse.

    Same uid only, root included: a root kdash can reach a root target, and a root client
    talking to another user's process must use that user's account (or inject as root).
    """
    expected = os.getuid() if expected_uid is None else expected_uid
    try:
        pid, uid, _gid = peer_credentials(conn)
    except OSError as e:
        return f"cannot read the peer's credentials ({e})"
    if uid != expected:
        return f"peer pid {pid} runs as uid {uid}, the agent accepts only uid {expected}"
    return None


# ---- CUDA driver and version checks -------------------------------------------------------------


def driver_cuda_version() -> tuple[int | None, str]:
    """The CUDA version the installed driver supports (e.g. 13000), or None and why not.

    Uses cuDriverGetVersion through ctypes: it needs no cuInit, creates no context, and works
    whether or not cuda-bindings is installed.
    """
    fake = os.environ.get(ENV_FAKE_CUDA)
    if fake:
        return int(fake), ""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"no NVIDIA driver here (libcuda.so.1 not loadable: {e})"
    v = ctypes.c_int(0)
    rc = lib.cuDriverGetVersion(ctypes.byref(v))
    if rc != 0:
        return None, f"cuDriverGetVersion failed with CUDA error {rc}"
    return v.value, ""


def driver_absent() -> str | None:
    """Why there is no NVIDIA driver here, or None; without loading libcuda (see cuda_loaded)."""
    if os.environ.get(ENV_FAKE_CUDA):
        return None
    marks = ("/dev/nvidiactl", "/proc/driver/nvidia/version", "/dev/dxg")  # dxg: WSL
    if any(os.path.exists(m) for m in marks):
        return None
    return "no NVIDIA driver here (no /dev/nvidiactl, no /proc/driver/nvidia)"


def cuda_loaded() -> bool:
    """Has this process loaded libcuda? Until it has, enabling CUPTI would pull CUDA into a
    process that may never use it, so the agent waits instead."""
    if os.environ.get(ENV_FAKE_CUDA):
        return True
    try:
        with open("/proc/self/maps", "rb") as f:
            return b"libcuda.so" in f.read()
    except OSError:
        return True  # no /proc: cannot tell, do not wait forever


def _vtuple(v: str) -> tuple[int, int]:
    parts = (v.split(".") + ["0", "0"])[:2]
    try:
        return int(parts[0]), int("".join(ch for ch in parts[1] if ch.isdigit()) or 0)
    except ValueError:
        return 0, 0


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import PackageNotFoundError, version

        try:
            return version(name)
        except PackageNotFoundError:
            return None
    except Exception:  # noqa: BLE001 - metadata of a broken install must not stop the agent
        return None


def install_hint(driver_cuda: int | None) -> str:
    """What to pip install in the target's environment for this driver."""
    if driver_cuda is None:
        return "pip install 'cupti-python~=13.0.0' (matching your driver's CUDA version)"
    major, minor = driver_cuda // 1000, (driver_cuda % 1000) // 10
    return (
        f"pip install 'cupti-python~={major}.{minor}.0' 'nvidia-cuda-cupti~={major}.{minor}.0' "
        f"in the target's Python (the driver supports CUDA {major}.{minor})"
    )


def version_mismatch(driver_cuda: int, cupti_python: str | None, cupti_lib: str | None) -> str:
    """A one-line warning when cupti-python or libcupti is newer than the driver's CUDA, else "".

    Older CUPTI runs on newer drivers; a newer one may be refused by an older driver (seen:
    cupti-python 13.4 wants nvidia-cuda-cupti 13.4, which driver 580 / CUDA 13.0 may refuse).
    """
    drv = (driver_cuda // 1000, (driver_cuda % 1000) // 10)
    for what, v in (("cupti-python", cupti_python), ("nvidia-cuda-cupti", cupti_lib)):
        if v and _vtuple(v) > drv:
            return (
                f"{what} {v} is newer than the driver's CUDA {drv[0]}.{drv[1]}; "
                f"{install_hint(driver_cuda)}"
            )
    return ""


def other_cupti_client() -> str | None:
    """Why CUPTI is already taken in this process, or None when nothing says so.

    CUPTI serves one client per process: registering our buffers while torch.profiler (Kineto)
    or an injected tool (Nsight Systems, via CUDA_INJECTION64_PATH) is collecting would steal
    their records, so the agent must stay out of the way instead.
    """
    inj = os.environ.get("CUDA_INJECTION64_PATH")
    if inj:
        return f"an injected CUDA tool holds CUPTI in this process (CUDA_INJECTION64_PATH={inj})"
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            enabled = torch.autograd.profiler._is_profiler_enabled
        except AttributeError:
            enabled = False
        if not enabled:
            try:
                enabled = bool(torch._C._autograd._profiler_enabled())
            except Exception:  # noqa: BLE001 - older/newer torch: the flag above decides
                enabled = False
        if enabled:
            return "torch.profiler is running in this process and holds CUPTI"
    return None


# ---- CUPTI records -> columns -------------------------------------------------------------------

_COPY_KIND_NAMES = {
    "HTOD": "HtoD",
    "DTOH": "DtoH",
    "HTOA": "HtoA",
    "ATOH": "AtoH",
    "ATOA": "AtoA",
    "ATOD": "AtoD",
    "DTOA": "DtoA",
    "DTOD": "DtoD",
    "HTOH": "HtoH",
    "PTOP": "PtoP",
}


class RecordConverter:
    """Turns a list of cupti-python activity objects into per-table column lists.

    Runs inside CUPTI's buffer-completed callback, so it only copies the fields the schema
    wants into tuples (a few hundred ns per record); numpy arrays, the clock offset and string
    ids are made later on the agent's own thread. Kernel, copy, API and marker names come out
    as Python strings. NVTX ranges arrive as separate START and END marker records, which are
    paired here by id (the open ones are bounded, the overflow counted).
    """

    def __init__(self, cupti_mod: Any, pid: int) -> None:
        ak = cupti_mod.ActivityKind
        self.cupti = cupti_mod
        self.pid = pid
        self.k_kernel = {int(ak.CONCURRENT_KERNEL), int(ak.KERNEL)}
        self.k_memcpy = int(ak.MEMCPY)
        self.k_memset = int(ak.MEMSET)
        self.k_runtime = int(ak.RUNTIME)
        self.k_driver = int(ak.DRIVER)
        self.k_sync = int(ak.SYNCHRONIZATION)
        self.k_marker = int(ak.MARKER)
        self._api_names: dict[tuple[int, int], str] = {}
        self._copy_names: dict[int, str] = {}
        self._sync_names: dict[int, str] = {}
        self._open_markers: dict[int, tuple[int, str, str, int]] = {}
        self.markers_overflowed = 0
        self.other_records = 0
        self.fast_note = ""
        self._verified = False
        self.bad_time_records = 0  # kernel records dropped for impossible times (see batches_raw)
        self._kind_ints = {
            n: int(getattr(ak, n)) for n in RECORD_DTYPES if getattr(ak, n, None) is not None
        }
        try:
            self.reader: BufferReader | None = BufferReader(cupti_mod, self._kind_ints)
        except LayoutMismatch as e:
            self.reader = None
            self.fast_note = f"reading records attribute by attribute (slower): {e}"

    def _api_name(self, kind: int, cbid: int) -> str:
        key = (kind, cbid)
        name = self._api_names.get(key)
        if name is None:
            dom = self.cupti.CallbackDomain
            domain = dom.DRIVER_API if kind == self.k_driver else dom.RUNTIME_API
            try:
                name = str(self.cupti.get_callback_name(domain, cbid))
            except Exception as e:  # noqa: BLE001 - an unnamed API still gets a row
                name = f"cbid {cbid} ({type(e).__name__})"
            self._api_names[key] = name
        return name

    def _copy_name(self, copy_kind: int) -> str:
        name = self._copy_names.get(copy_kind)
        if name is None:
            try:
                raw = self.cupti.ActivityMemcpyKind(copy_kind).name
            except (ValueError, AttributeError):
                raw = f"kind{copy_kind}"
            name = _COPY_KIND_NAMES.get(raw, raw)
            self._copy_names[copy_kind] = name
        return name

    def _sync_name(self, t: int) -> str:
        name = self._sync_names.get(t)
        if name is None:
            try:
                name = "sync:" + self.cupti.ActivitySynchronizationType(t).name.lower()
            except (ValueError, AttributeError):
                name = f"sync:{t}"
            self._sync_names[t] = name
        return name

    def convert(self, activities: list[Any]) -> dict[str, list[tuple]]:
        """Rows per table as tuples in the order of `ROW_COLUMNS` (timestamps still CUPTI's)."""
        kernels: list[tuple] = []
        api: list[tuple] = []
        memcpy: list[tuple] = []
        markers: list[tuple] = []
        pid = self.pid
        for a in activities:
            k = a.kind
            if k in self.k_kernel:
                kernels.append(
                    (
                        a.start,
                        a.end,
                        a.name,
                        a.device_id,
                        a.stream_id,
                        a.grid_x,
                        a.grid_y,
                        a.grid_z,
                        a.block_x,
                        a.block_y,
                        a.block_z,
                        a.registers_per_thread,
                        a.static_shared_memory,
                        a.dynamic_shared_memory,
                        a.correlation_id,
                        a.graph_id or -1,  # CUPTI: 0 = not launched from a graph
                    )
                )
            elif k == self.k_runtime or k == self.k_driver:
                api.append(
                    (
                        a.start,
                        a.end,
                        self._api_name(k, a.cbid),
                        a.process_id or pid,
                        a.thread_id,
                        a.correlation_id,
                    )
                )
            elif k == self.k_memcpy:
                memcpy.append(
                    (
                        a.start,
                        a.end,
                        self._copy_name(a.copy_kind),
                        a.bytes,
                        a.device_id,
                        a.stream_id,
                        a.correlation_id,
                    )
                )
            elif k == self.k_memset:
                memcpy.append(
                    (a.start, a.end, "memset", a.bytes, a.device_id, a.stream_id, a.correlation_id)
                )
            elif k == self.k_sync:
                api.append((a.start, a.end, self._sync_name(a.type), pid, -1, a.correlation_id))
            elif k == self.k_marker:
                self._marker(a, markers)
            else:
                self.other_records += 1
        return {"kernels": kernels, "api": api, "memcpy": memcpy, "markers": markers}

    def batches(self, activities: list[Any]) -> dict[str, dict[str, Any]]:
        """Per-table column batches (CUPTI timestamps) of one buffer: fast path, else slow."""
        if not activities:
            return {}
        if self.reader is not None:
            try:
                out = self._fast(activities)
                if not self._verified and "kernels" in out:
                    self._verify(activities, out["kernels"])
                return out
            except LayoutMismatch as e:
                self.reader = None
                self.fast_note = f"reading records attribute by attribute (slower): {e}"
        rows = self.convert(activities)
        return {t: rows_to_batch(t, r, 0, self.pid) for t, r in rows.items() if r}

    def _verify(self, activities: list[Any], kernels: dict[str, Any]) -> None:
        """Compare the first gathered kernel rows with cupti-python's own attributes, once."""
        objs = [a for a in activities[:64] if int(a.kind) in self.k_kernel][:3]
        for i, a in enumerate(objs):
            want = (int(a.start), int(a.end), int(a.correlation_id), str(a.name), int(a.grid_x))
            got = (
                int(kernels["start_ns"][i]),
                int(kernels["end_ns"][i]),
                int(kernels["correlation_id"][i]),
                str(kernels["name"][i]),
                int(kernels["grid_x"][i]),
            )
            if want != got:
                raise LayoutMismatch(f"buffer read {got} but cupti-python says {want}")
        if objs:
            self._verified = True

    def _fast(self, activities: list[Any]) -> dict[str, dict[str, Any]]:
        r = self.reader
        assert r is not None
        views, kinds, offs, _span = r.walk(activities)
        return self._columns(views, kinds, offs, activities)

    def batches_raw(self, addr: int, valid: int) -> dict[str, dict[str, Any]]:
        """Per-table batches from a raw CUPTI buffer (our own buffer callback, see RawBuffers).

        Kernel rows with impossible times (end before start, or more than an hour from CUPTI's
        clock now) are dropped and counted in `bad_time_records`: CUPTI writes a few of them
        for kernels replayed from CUDA graphs (198 of 17,640 in a decode step on the H200), so
        they say nothing about the layout. A first buffer where most rows are impossible does:
        that raises LayoutMismatch. (Falling back to cupti-python's record objects on the
        strength of a few such rows once cost a graph-replayed decode loop 98% of its speed.)
        """
        r = self.reader
        if r is None:
            raise LayoutMismatch(self.fast_note or "no record layouts")
        views, kinds, offs, _span = r.walk_span(addr, valid)
        out = self._columns(views, kinds, offs, None)
        k = out.get("kernels")
        if k is not None:
            now = int(self.cupti.get_timestamp())
            hour = 3600 * 10**9
            sane = (k["end_ns"] >= k["start_ns"]) & (abs(k["start_ns"] - now) < hour)
            n_bad = int(sane.size - sane.sum())
            if not self._verified:
                if n_bad * 2 > sane.size:
                    raise LayoutMismatch(
                        f"{n_bad} of {sane.size} kernel records have impossible times"
                    )
                self._verified = True
            if n_bad:
                self.bad_time_records += n_bad
                out["kernels"] = {c: v[sane] for c, v in k.items()}
        return out

    def _columns(
        self, views: dict, kinds: Any, offs: Any, activities: list[Any] | None
    ) -> dict[str, dict[str, Any]]:
        r = self.reader
        assert r is not None
        np = r.np
        out: dict[str, dict[str, Any]] = {}
        pid = self.pid
        kin = self._kind_ints

        counts = np.bincount(kinds[(kinds >= 0) & (kinds < 256)], minlength=256)

        def pick(*names: str) -> Any:
            mask = None
            for n in names:
                k = kin.get(n)
                if k is None or not 0 <= k < 256 or not counts[k]:
                    continue
                mask = (kinds == k) if mask is None else (mask | (kinds == k))
            if mask is None:
                return None, offs[:0]
            return mask, offs[mask]

        mask, o = pick("CONCURRENT_KERNEL", "KERNEL")
        if o.size:
            dt = r.dtypes[kin["CONCURRENT_KERNEL"]]

            def f(name: str) -> Any:
                return r.field(views, o, dt, name)

            graph = f("graph_id").astype(np.int64)
            graph[graph == 0] = -1  # CUPTI: 0 = not launched from a graph
            out["kernels"] = {
                "start_ns": f("start").astype(np.int64),
                "end_ns": f("end").astype(np.int64),
                "name": _c_strings(f("name")),
                "device": f("device_id").astype(np.int16),
                "stream": f("stream_id").astype(np.int64),
                "pid": np.full(o.size, pid, dtype=np.int64),
                "grid_x": f("grid_x").astype(np.int32),
                "grid_y": f("grid_y").astype(np.int32),
                "grid_z": f("grid_z").astype(np.int32),
                "block_x": f("block_x").astype(np.int32),
                "block_y": f("block_y").astype(np.int32),
                "block_z": f("block_z").astype(np.int32),
                "registers": f("registers_per_thread").astype(np.int32),
                "static_smem": f("static_shared_memory").astype(np.int32),
                "dynamic_smem": f("dynamic_shared_memory").astype(np.int32),
                "correlation_id": f("correlation_id").astype(np.int64),
                "graph_id": graph,
            }
        api_parts = []
        for kname in ("RUNTIME", "DRIVER"):
            if kname not in kin:
                continue
            _m, o = pick(kname)
            if not o.size:
                continue
            dt = r.dtypes[kin[kname]]
            cbid = r.field(views, o, dt, "cbid")
            uniq, inv = np.unique(cbid, return_inverse=True)
            names = np.array([self._api_name(kin[kname], int(c)) for c in uniq], dtype=object)
            procs = r.field(views, o, dt, "process_id").astype(np.int64)
            procs[procs == 0] = pid
            api_parts.append(
                {
                    "start_ns": r.field(views, o, dt, "start").astype(np.int64),
                    "end_ns": r.field(views, o, dt, "end").astype(np.int64),
                    "name": names[inv],
                    "pid": procs,
                    "tid": r.field(views, o, dt, "thread_id").astype(np.int64),
                    "correlation_id": r.field(views, o, dt, "correlation_id").astype(np.int64),
                }
            )
        if "SYNCHRONIZATION" in kin:
            _m, o = pick("SYNCHRONIZATION")
            if o.size:
                dt = r.dtypes[kin["SYNCHRONIZATION"]]
                typ = r.field(views, o, dt, "type")
                uniq, inv = np.unique(typ, return_inverse=True)
                names = np.array([self._sync_name(int(t)) for t in uniq], dtype=object)
                api_parts.append(
                    {
                        "start_ns": r.field(views, o, dt, "start").astype(np.int64),
                        "end_ns": r.field(views, o, dt, "end").astype(np.int64),
                        "name": names[inv],
                        "pid": np.full(o.size, pid, dtype=np.int64),
                        "tid": np.full(o.size, -1, dtype=np.int64),
                        "correlation_id": r.field(views, o, dt, "correlation_id").astype(np.int64),
                    }
                )
        if api_parts:
            out["api"] = {c: np.concatenate([p[c] for p in api_parts]) for c in api_parts[0]}
        copy_parts = []
        for kname in ("MEMCPY", "MEMSET"):
            if kname not in kin:
                continue
            _m, o = pick(kname)
            if not o.size:
                continue
            dt = r.dtypes[kin[kname]]
            if kname == "MEMCPY":
                ck = r.field(views, o, dt, "copy_kind")
                uniq, inv = np.unique(ck, return_inverse=True)
                kinds_col = np.array([self._copy_name(int(c)) for c in uniq], dtype=object)[inv]
            else:
                kinds_col = np.full(o.size, "memset", dtype=object)
            copy_parts.append(
                {
                    "start_ns": r.field(views, o, dt, "start").astype(np.int64),
                    "end_ns": r.field(views, o, dt, "end").astype(np.int64),
                    "kind": kinds_col,
                    "bytes": r.field(views, o, dt, "bytes").astype(np.int64),
                    "device": r.field(views, o, dt, "device_id").astype(np.int16),
                    "stream": r.field(views, o, dt, "stream_id").astype(np.int64),
                    "pid": np.full(o.size, pid, dtype=np.int64),
                    "correlation_id": r.field(views, o, dt, "correlation_id").astype(np.int64),
                }
            )
        if copy_parts:
            out["memcpy"] = {c: np.concatenate([p[c] for p in copy_parts]) for c in copy_parts[0]}
        if "MARKER" in kin:
            idx = np.flatnonzero(kinds == kin["MARKER"])
            if idx.size:  # rare; START/END paired by id, one record at a time
                rows: list[tuple] = []
                if activities is not None:
                    for i in idx.tolist():
                        self._marker(activities[i], rows)
                else:
                    for rec in self._marker_records(views, offs[idx]):
                        self._marker(rec, rows)
                if rows:
                    out["markers"] = rows_to_batch("markers", rows, 0, pid)
        return out

    def _marker_records(self, views: dict, offs: Any) -> list[Any]:
        """Marker records read from a raw buffer, shaped like cupti-python's objects."""
        from types import SimpleNamespace

        r = self.reader
        assert r is not None
        dt = r.dtypes[self._kind_ints["MARKER"]]
        flags = r.field(views, offs, dt, "flags_").tolist()
        ts = r.field(views, offs, dt, "timestamp").tolist()
        ids = r.field(views, offs, dt, "id").tolist()
        names = _c_strings(r.field(views, offs, dt, "name")).tolist()
        if "domain" in (dt.names or ()):
            domains = _c_strings(r.field(views, offs, dt, "domain")).tolist()
        else:
            domains = [""] * len(names)
        tids = [-1] * len(ids)
        try:  # object_id is a union; .pt.thread_id sits 4 bytes in
            odt, ooff = dt.fields["object_id"][:2]
            toff = ooff + odt.fields["pt"][0].fields["thread_id"][1]
            tids = views[4][(offs + toff) // 4].tolist()
        except (KeyError, TypeError, AttributeError):
            pass  # this layout has no thread id: rows keep -1 (n/a)
        return [
            SimpleNamespace(flags_=f, timestamp=t, id=i, name=n, domain=d, object_id=_Tid(tid))
            for f, t, i, n, d, tid in zip(flags, ts, ids, names, domains, tids, strict=True)
        ]

    def _marker(self, a: Any, out: list[tuple]) -> None:
        flags = a.flags_
        ts = a.timestamp
        if flags & MARKER_END:
            opened = self._open_markers.pop(a.id, None)
            if opened is not None:
                start, name, domain, tid = opened
                out.append((start, ts, name, domain, tid))
            return
        try:
            tid = a.object_id.pt.thread_id
        except AttributeError:
            tid = -1
        name = a.name or ""
        domain = a.domain or ""
        if flags & MARKER_START:
            if len(self._open_markers) >= MAX_OPEN_MARKERS:
                self.markers_overflowed += 1
                return
            self._open_markers[a.id] = (ts, name, domain, tid)
        else:  # instantaneous
            out.append((ts, ts, name, domain, tid))


class ThreadIds:
    """CUPTI names the thread of an API or NVTX record by `pthread_self()` cut to 32 bits; the
    dashboard knows threads by OS tid (the scheduler collector's, the CPU pane's). Python knows
    both for its own threads (`threading.enumerate()`: `ident` and `native_id`), which are the
    ones that launch kernels in a Python server. Ids of threads Python never saw (a C++ worker)
    are left as they are: above 2^22, no OS tid can be mistaken for one.
    """

    MASK = 0xFFFFFFFF
    REFRESH_S = 1.0  # an unknown id looks the threads up again at most this often

    def __init__(self) -> None:
        self._map: dict[int, int] = {}
        self._looked = -1e9

    def _refresh(self) -> None:
        self._looked = time.monotonic()
        for t in threading.enumerate():
            if t.ident is not None and getattr(t, "native_id", None) is not None:
                self._map[t.ident & self.MASK] = int(t.native_id)

    def translate(self, tids: Any) -> Any:
        """The array with every known pthread id replaced by its OS tid (-1 stays -1)."""
        import numpy as np

        if not len(tids):
            return tids
        uniq, inv = np.unique(tids, return_inverse=True)
        if any(int(u) >= 0 and int(u) not in self._map for u in uniq) and (
            time.monotonic() - self._looked >= self.REFRESH_S
        ):
            self._refresh()
        mapped = np.array([self._map.get(int(u), int(u)) for u in uniq], dtype=np.int64)
        return mapped[inv]


# Tuple layouts made by RecordConverter.convert, per table; columns not listed get the pid or n/a.
ROW_COLUMNS: dict[str, tuple[str, ...]] = {
    "kernels": (
        "start_ns",
        "end_ns",
        "name",
        "device",
        "stream",
        "grid_x",
        "grid_y",
        "grid_z",
        "block_x",
        "block_y",
        "block_z",
        "registers",
        "static_smem",
        "dynamic_smem",
        "correlation_id",
        "graph_id",
    ),
    "api": ("start_ns", "end_ns", "name", "pid", "tid", "correlation_id"),
    "memcpy": ("start_ns", "end_ns", "kind", "bytes", "device", "stream", "correlation_id"),
    "markers": ("start_ns", "end_ns", "name", "domain", "tid"),
}


def rows_to_batch(table: str, rows: list[tuple], offset_ns: int, pid: int) -> dict[str, Any]:
    """Column arrays for the wire from converter tuples; CUPTI time + offset = monotonic ns."""
    import numpy as np

    schema = _schema()

    cols = ROW_COLUMNS[table]
    n = len(rows)
    transposed = list(zip(*rows, strict=True)) if n else [() for _ in cols]
    out: dict[str, Any] = {}
    types = dict(schema.TABLES[table])
    for c, vals in zip(cols, transposed, strict=True):
        code = types[c]
        if code == schema.STR:
            arr = np.empty(n, dtype=object)
            arr[:] = vals
            out[c] = arr
        elif c in ("start_ns", "end_ns"):
            out[c] = np.fromiter(vals, dtype=np.int64, count=n) + offset_ns
        else:
            out[c] = np.fromiter(vals, dtype=np.int64, count=n).astype(code)
    for c, code in schema.TABLES[table]:
        if c not in out:
            out[c] = np.full(n, pid if c == "pid" else -1, dtype=code)
    return out


class _Tid:
    """`object_id.pt.thread_id` for marker records read from a raw buffer."""

    __slots__ = ("pt",)

    def __init__(self, tid: int) -> None:
        from types import SimpleNamespace

        self.pt = SimpleNamespace(thread_id=tid)


class LayoutMismatch(Exception):
    """The CUPTI buffer does not look the way cupti-python's dtypes say: use the slow path."""


# cupti.ActivityKind member -> cupti-python dtype of that record (CUPTI 13 record versions)
RECORD_DTYPES = {
    "CONCURRENT_KERNEL": "activity_kernel10_dtype",
    "KERNEL": "activity_kernel10_dtype",
    "RUNTIME": "activity_api_dtype",
    "DRIVER": "activity_api_dtype",
    "MEMCPY": "activity_memcpy6_dtype",
    "MEMSET": "activity_memset4_dtype",
    "SYNCHRONIZATION": "activity_synchronization2_dtype",
    "MARKER": "activity_marker2_dtype",
}


STRETCH_EVERY = 16  # records walked one by one between two looks for a repeating period
MIN_STRETCH = 64  # fewest records a numpy stretch must cover (else the walk goes on)
MAX_PERIOD = 64  # longest period of record kinds looked for (a graph of up to ~60 kernels)


class BufferReader:
    """Reads the fields kdash needs straight out of a completed CUPTI buffer, with numpy.

    Why: each attribute read on a cupti-python record object goes through a one-row numpy
    record array and costs microseconds; a kernel row needs 17 of them. Records of one buffer
    lie back to back in CUPTI's memory, so the agent reads only the first and last record's
    address from cupti-python, walks the buffer by each record's `kind` and size (the sizes of
    cupti-python's own dtypes), and gathers every column with one fancy index per field.

    Trust but verify: the walk must visit exactly as many records as cupti-python delivered and
    end where the last one ends, and on the first buffer the gathered kernel fields are
    compared with the object attributes; any disagreement raises LayoutMismatch, and the agent
    switches to the attribute path for good (and says so in STATUS notes).
    """

    def __init__(self, cupti_mod: Any, kinds: dict[str, int]) -> None:
        import numpy as np

        self.np = np
        self.dtypes: dict[int, Any] = {}
        for kname, dname in RECORD_DTYPES.items():
            dt = getattr(cupti_mod, dname, None)
            if dt is None or kname not in kinds:
                raise LayoutMismatch(f"cupti-python has no {dname}")
            if dt.itemsize % 8:
                raise LayoutMismatch(f"{dname} is {dt.itemsize} bytes, not a multiple of 8")
            self.dtypes[kinds[kname]] = dt
        self.sizes = {k: dt.itemsize for k, dt in self.dtypes.items()}

    def walk(self, activities: list[Any]) -> tuple[Any, Any, Any, Any]:
        """(views by item size, record kinds, byte offsets, span) of the buffer that
        cupti-python's record objects point into; checked against their count."""
        first = int(activities[0].ptr)
        last_obj = activities[-1]
        last = int(last_obj.ptr)
        last_size = self.sizes.get(int(last_obj.kind))
        if last_size is None:
            raise LayoutMismatch(f"record kind {int(last_obj.kind)} has no known layout")
        out = self.walk_span(first, last + last_size - first)
        if len(out[2]) != len(activities):
            raise LayoutMismatch(
                f"walked {len(out[2])} records, cupti-python gave {len(activities)}"
            )
        return out

    def walk_span(self, first: int, span: int) -> tuple[Any, Any, Any, Any]:
        """Walk the records in [first, first + span): they must end exactly at the end.

        A Python step per record (about 0.1 us), except where the kinds repeat with a period of
        up to MAX_PERIOD records (a CUDA graph's kernels and its launch call; an eager loop's
        launch call + kernel): then numpy checks the following repetitions at once
        (`_periodic_stretch`).
        """
        import ctypes

        np = self.np
        # One buffer that we sized (BUFFER_BYTES): a span beyond it would mean the records
        # are not where we think, and reading there could fault in the target.
        if first % 8 or span <= 0 or span % 8 or span > BUFFER_BYTES:
            raise LayoutMismatch(f"records at {first:#x}+{span} are not one aligned buffer")
        mem = (ctypes.c_char * span).from_address(first)
        u8 = np.frombuffer(mem, dtype=np.uint8)
        i32np = u8.view("<i4")
        i32 = memoryview(mem).cast("B").cast("i")
        get = self.sizes.get
        chunks: list[Any] = []  # arrays of offsets: periodic stretches, and the steps between
        offs: list[int] = []
        seq: list[int] = []  # kinds walked one by one since the last numpy stretch
        append = offs.append
        remember = seq.append
        off = 0
        next_try = STRETCH_EVERY
        while off < span:  # every step advances >= 8 bytes, so this ends
            k = i32[off >> 2]
            sz = get(k)
            if sz is None:
                raise LayoutMismatch(f"unknown record kind {k} at byte {off}")
            append(off)
            remember(k)
            off += sz
            if len(seq) >= next_try:
                taken = self._periodic_stretch(seq, i32np, off, span)
                if taken is None:
                    next_try = len(seq) + STRETCH_EVERY
                    continue
                chunks.append(np.asarray(offs, dtype=np.int64))
                chunks.append(taken[0])
                off = taken[1]
                offs, seq = [], []
                append, remember = offs.append, seq.append
                next_try = STRETCH_EVERY
        if off != span:
            raise LayoutMismatch(f"records end at byte {off}, the buffer at {span}")
        chunks.append(np.asarray(offs, dtype=np.int64))
        offsets = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        kinds = i32np[offsets >> 2]
        views = {1: u8, 2: u8.view("<u2"), 4: u8.view("<u4"), 8: u8.view("<u8")}
        return views, kinds, offsets, span

    def _periodic_stretch(
        self, seq: list[int], i32np: Any, off: int, span: int
    ) -> tuple[Any, int] | None:
        """If the kinds walked last repeat with some period p <= MAX_PERIOD (seen twice in a
        row), take every following repetition of that period with numpy: (their offsets, the
        offset after them), or None.

        Every period whose last two repetitions match is a candidate; each is tried on a first
        block of 16 repetitions and the one covering the most records wins (so a graph's run
        of kernels plus its launch call is one period of 19, not a period of one kernel that
        breaks at the call). The winner's repetitions are then checked in blocks that grow 8x:
        a stretch that ends soon costs a small block, not a pass over the rest of the buffer
        (which once made a 19-record period cost 5 us per record).
        """
        np = self.np
        last = seq[-1]
        best: tuple | None = None  # (records covered, p, stride, phases, kinds, block full)
        for p in range(1, min(MAX_PERIOD, len(seq) // 2) + 1):
            if seq[-1 - p] != last or seq[-2 * p : -p] != seq[-p:]:
                continue
            kinds = seq[-p:]
            sizes = [self.sizes[k] for k in kinds]
            stride = sum(sizes)
            n_max = (span - off) // stride
            if n_max < 2:
                continue
            phases = np.cumsum([0, *sizes[:-1]])
            kinds_np = np.asarray(kinds, dtype=np.int32)
            m0 = min(n_max, max(16, -(-MIN_STRETCH // p)))
            n = self._repeats(i32np, off, stride, phases, kinds_np, 0, m0)
            if n and (best is None or n * p > best[0]):
                best = (n * p, p, stride, phases, kinds_np, n == m0)
                if n == m0:
                    break
        if best is None or best[0] < MIN_STRETCH and best[0] // best[1] < (span - off) // best[2]:
            return None  # too short to pay for itself: walk on, a longer period may show
        _, p, stride, phases, kinds_np, full = best
        n = best[0] // p
        n_max = (span - off) // stride
        block = 8 * n
        while full and n < n_max:  # the first block was full: grow until a repetition differs
            m = min(block, n_max - n)
            got = self._repeats(i32np, off, stride, phases, kinds_np, n, m)
            n += got
            if got < m:
                break
            block *= 8
        base = off + stride * np.arange(n, dtype=np.int64)
        taken = (base[:, None] + phases[None, :]).ravel()
        return taken, off + stride * n

    def _repeats(
        self, i32np: Any, off: int, stride: int, phases: Any, kinds: Any, n0: int, m: int
    ) -> int:
        """How many of repetitions n0 .. n0+m-1 of a period, counted from the first, match."""
        np = self.np
        base = off + stride * np.arange(n0, n0 + m, dtype=np.int64)
        ok = (i32np[(base[:, None] + phases[None, :]) >> 2] == kinds[None, :]).all(axis=1)
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else m

    def field(self, views: dict, offs: Any, dt: Any, name: str) -> Any:
        """Column `name` of the records at byte offsets `offs`, all of record dtype `dt`."""
        fdt, foff = dt.fields[name][:2]
        size = fdt.itemsize
        if foff % size:
            raise LayoutMismatch(f"{name} at offset {foff} is not {size}-byte aligned")
        return views[size][(offs + foff) // size].view(fdt.newbyteorder("<"))


def _c_strings(ptrs: Any) -> Any:
    """Object array of the C strings at `ptrs` (one ctypes read per distinct pointer)."""
    import ctypes

    import numpy as np

    uniq, inv = np.unique(ptrs, return_inverse=True)
    names = np.empty(len(uniq), dtype=object)
    for i, p in enumerate(uniq.tolist()):
        names[i] = ctypes.string_at(p).decode("utf-8", "replace") if p else ""
    return names[inv]


def find_libcupti() -> tuple[str | None, str]:
    """The one libcupti mapped into this process (cupti-python loaded it), or None and why."""
    try:
        with open("/proc/self/maps") as f:
            paths = {
                line.split(None, 5)[5].strip()
                for line in f
                if "libcupti.so" in line and len(line.split(None, 5)) == 6
            }
    except OSError as e:
        return None, f"cannot read /proc/self/maps ({e})"
    if len(paths) != 1:
        return None, f"{len(paths)} libcupti copies are mapped ({', '.join(sorted(paths))})"
    return paths.pop(), ""


class RawBuffers:
    """Our own CUPTI buffer callbacks, registered with libcupti through ctypes.

    Why not cupti-python's `activity_register_callbacks`: it hands the callback one Python
    object per record, each built around a one-row numpy record array; measured on the H200
    (bench/results/agent-h200.json, first run) that cost the target 73% of its iterations/s on
    an eager loop and 98% on CUDA-graph replays, because that work holds the GIL. Here CUPTI
    gets plain 8-byte-aligned buffers from us and hands them back as (address, valid bytes);
    `on_buffer` reads them with numpy (BufferReader.walk_span). Still the Activity API only
    (cuptiActivityRegisterCallbacks); enabling, flushing and disabling stay in cupti-python.

    Both callbacks catch everything: an error is counted, the buffer is given back, and the
    records in it are counted as lost (`bytes_lost`).
    """

    def __init__(self, lib_path: str, on_buffer: Callable[[int, int], None]) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(lib_path)
        self.on_buffer = on_buffer
        u8p = ctypes.POINTER(ctypes.c_uint8)
        req_t = ctypes.CFUNCTYPE(
            None,
            ctypes.POINTER(u8p),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        )
        done_t = ctypes.CFUNCTYPE(
            None, ctypes.c_void_p, ctypes.c_uint32, u8p, ctypes.c_size_t, ctypes.c_size_t
        )
        # kept referenced for the life of the process: CUPTI may call them at any time
        self._req = req_t(self._requested)
        self._done = done_t(self._completed)
        self._u8p = u8p
        self._live: dict[int, Any] = {}
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self.errors = 0
        self.last_error = ""
        self.bytes_lost = 0
        self.buffers = 0
        self.requested = 0  # buffers CUPTI asked for: after a detach this must stop growing

    def register(self) -> int:
        """cuptiActivityRegisterCallbacks(ours); the CUptiResult (0 = success)."""
        fn = self.lib.cuptiActivityRegisterCallbacks
        fn.restype = self.ctypes.c_int
        fn.argtypes = [self.ctypes.c_void_p, self.ctypes.c_void_p]
        return int(
            fn(
                self.ctypes.cast(self._req, self.ctypes.c_void_p),
                self.ctypes.cast(self._done, self.ctypes.c_void_p),
            )
        )

    def _requested(self, pbuf: Any, psize: Any, pmax: Any) -> None:
        ct = self.ctypes
        try:
            self.requested += 1
            with self._lock:
                arr = self._free.pop() if self._free else None
            if arr is None:
                arr = (ct.c_uint8 * (BUFFER_BYTES + 8))()
            addr = (ct.addressof(arr) + 7) & ~7
            with self._lock:
                self._live[addr] = arr
            pbuf[0] = ct.cast(addr, self._u8p)
            psize[0] = BUFFER_BYTES
            pmax[0] = 0
        except BaseException as e:  # noqa: BLE001 - CUPTI then drops records and counts them
            self.errors += 1
            self.last_error = f"buffer request: {type(e).__name__}: {e}"
            with contextlib.suppress(BaseException):
                pbuf[0] = ct.cast(None, self._u8p)
                psize[0] = 0

    def _completed(self, ctx: Any, stream: int, buf: Any, size: int, valid: int) -> None:
        addr = 0
        try:
            addr = self.ctypes.cast(buf, self.ctypes.c_void_p).value or 0
            self.buffers += 1
            if addr and valid:
                self.on_buffer(addr, int(valid))
        except BaseException as e:  # noqa: BLE001 - nothing may raise into CUPTI
            self.errors += 1
            self.bytes_lost += int(valid or 0)
            self.last_error = f"buffer completion: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                arr = self._live.pop(addr, None)
                if arr is not None and len(self._free) < 4:
                    self._free.append(arr)


# ---- the CUPTI controller -----------------------------------------------------------------------


class Unavailable(Exception):
    """CUPTI cannot be used here; the message is the STATUS line (why, and what to do).

    `retry` marks a passing reason (another CUPTI client that will finish) as opposed to a
    lasting one (no driver, no cupti-python).
    """

    def __init__(self, line: str, retry: bool = False) -> None:
        super().__init__(line)
        self.retry = retry


def _batch_rows(batch: Batch) -> int:
    for v in batch.values():
        return len(v)
    return 0


class CuptiActivity:
    """Owns everything the agent does with CUPTI: probe, enable, flush, disable, callbacks.

    Buffer callbacks are (re-)registered at every START (CUPTI keeps only the last
    registration); while no session is active the buffer callback only counts what it throws
    away.
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.cupti: Any = None
        self.converter: RecordConverter | None = None
        self.enabled: list[tuple[str, int]] = []
        self.last_enabled: list[tuple[str, int]] = []
        self.notes: list[str] = []
        self.offset_ns = 0
        self.offset_gap_ns = 0
        self.driver_cuda: int | None = None
        self.mismatch = ""  # cupti-python/libcupti newer than the driver: what to install
        self._registered = False
        self._lock = threading.Lock()
        self._sink: Callable[[dict[str, dict[str, Any]]], None] | None = None
        self.callback_errors = 0
        self.last_error = ""
        self.discarded_records = 0
        self.records_seen = 0
        self.callback_ns = 0  # wall time in our buffer callback (includes waits for the GIL)
        self.callback_cpu_ns = 0  # CPU time of the calling thread in our buffer callback
        self.flush_cpu_ns = 0  # CPU time of our periodic flushes: cupti-python's + ours
        self.dropped_by_cupti = 0
        # how records reach us: "raw" (RawBuffers, the default) or "objects" (cupti-python's)
        self.use_raw = os.environ.get("KDASH_AGENT_RECORDS", "raw") != "objects"
        self.mode = ""
        self.raw: RawBuffers | None = None
        self.raw_note = ""
        self.raw_failed = ""
        self.discarded_bytes = 0
        # duty cycle: the kinds switched off between windows, to switch on again in resume()
        self.paused: list[tuple[str, int]] = []
        # kind -> our enables minus our disables: every kind must be back at 0 after detach
        self.ledger: dict[int, int] = {}
        self.enabled_at_ns = 0  # monotonic ns just before the kinds were (re-)enabled
        self.disabled_at_ns = 0  # monotonic ns just after they were all disabled
        self.narrow_ns = 0  # agent-thread time re-narrowing API records at window starts
        self.resumes = 0
        # CUPTI out of the process again after a detach (detach.py says why and when it is
        # safe): the user may ask for kernels of graph replays anyway (START "graph_kernels")
        self.graph_kernels = False
        self.graphs_seen = False  # this process replays CUDA graphs (probe or a kernel record)
        self.graph_kernels_recorded = False  # kernel activity was on during graph replays
        self.hook: Any = None  # the detach.ExitHook of the last detach or probe
        self.cupti_detached = 0  # finalized after a detach or a probe
        self.detach_state = "never attached"
        self._lib: Any = None

    def note(self, text: str) -> None:
        """Add a STATUS note once: the duty cycle repeats enable/narrow every window, and the
        same complaint must not grow the list (and every STATUS frame) without bound; nor may
        many different ones (MAX_NOTES of MAX_NOTE_CHARS at most)."""
        text = text if len(text) <= MAX_NOTE_CHARS else text[: MAX_NOTE_CHARS - 3] + "..."
        if text not in self.notes and len(self.notes) < MAX_NOTES:
            self.notes.append(text)

    def _kind_on(self, kind: Any) -> None:
        self.cupti.activity_enable(kind)
        self.ledger[int(kind)] = self.ledger.get(int(kind), 0) + 1

    def _kind_off(self, kind: int) -> None:
        self.cupti.activity_disable(kind)
        self.ledger[int(kind)] = self.ledger.get(int(kind), 0) - 1

    def kinds_on(self) -> list[int]:
        """Kinds this agent has switched on and not off again (empty after every detach)."""
        return sorted(k for k, n in self.ledger.items() if n > 0)

    # probing
    def precheck(self) -> None:
        """Before the target has loaded CUDA: a driver must exist and cupti-python must be
        installed, judged without importing or loading either (Unavailable otherwise)."""
        import importlib.util

        no_driver = driver_absent()
        no_cupti = importlib.util.find_spec("cupti") is None
        if no_driver:
            also = f"; cupti-python is not installed in {sys.executable} either" if no_cupti else ""
            raise Unavailable(f"{no_driver}; kernel activity needs an NVIDIA GPU and driver{also}")
        if no_cupti:
            raise Unavailable(
                f"cupti-python is not installed in {sys.executable} (pid {self.pid}); "
                f"{install_hint(None)}"
            )

    def probe(self) -> None:
        """Import cupti-python and check driver and versions; raise Unavailable with the fix."""
        self.driver_cuda, why = driver_cuda_version()
        if self.driver_cuda is None:
            import importlib.util

            also = ""
            if importlib.util.find_spec("cupti") is None:
                also = f"; cupti-python is not installed in {sys.executable} either"
            raise Unavailable(f"{why}; kernel activity needs an NVIDIA GPU and driver{also}")
        hint = install_hint(self.driver_cuda)
        try:
            from cupti import cupti as cupti_mod
        except Exception as e:  # noqa: BLE001 - ImportError, or a broken cuda-bindings install
            raise Unavailable(
                f"cupti-python is not importable in pid {self.pid} "
                f"({type(e).__name__}: {e}); {hint}"
            ) from None
        self.cupti = cupti_mod
        self.converter = RecordConverter(cupti_mod, self.pid)
        mismatch = version_mismatch(
            self.driver_cuda,
            _dist_version("cupti-python"),
            _dist_version("nvidia-cuda-cupti") or _dist_version("nvidia-cuda-cupti-cu12"),
        )
        if mismatch:
            self.note("warning: " + mismatch)
        self.mismatch = mismatch
        held = other_cupti_client()
        if held:
            raise Unavailable(f"{held}; kdash waits until it ends", retry=True)

    def _describe_error(self, e: BaseException) -> str:
        status = getattr(e, "status", None)
        name = ""
        if status is not None and self.cupti is not None:
            try:
                name = self.cupti.Result(status).name
            except (ValueError, AttributeError):
                name = str(status)
        held = (
            "MULTIPLE_SUBSCRIBERS",
            "OLD_PROFILER_API_INITIALIZED",
            "HARDWARE_BUSY",
            "PROFILER_ALREADY_INITIALIZED",
        )
        if any(h in name for h in held):
            return (
                f"CUPTI is held by another client in this process ({name}: torch.profiler, "
                "Nsight or another tool); kdash stays idle"
            )
        if "INSUFFICIENT_PRIVILEGES" in name:
            return f"CUPTI refused ({name}): profiling is restricted to admins on this machine"
        text = f"{type(e).__name__}: {e}" if not name else f"CUPTI error {name} ({e})"
        return text

    def _with_hint(self, why: str) -> str:
        """A CUPTI failure, plus the version advice when the versions do not match."""
        return f"{why}; likely cause: {self.mismatch}" if self.mismatch else why

    def measure_offset(self) -> None:
        """monotonic_ns - CUPTI time, from the tightest of a few paired reads."""
        best_gap = None
        for _ in range(7):
            a = time.monotonic_ns()
            c = int(self.cupti.get_timestamp())
            b = time.monotonic_ns()
            gap = b - a
            if best_gap is None or gap < best_gap:
                best_gap = gap
                self.offset_ns = (a + b) // 2 - c
        self.offset_gap_ns = int(best_gap or 0)

    # enabling
    def enable(self, activities: list[str], sink: Callable[[dict[str, Batch]], None]) -> None:
        cu = self.cupti
        try:
            self.measure_offset()
        except Exception as e:  # noqa: BLE001
            raise Unavailable(
                f"{self._describe_error(e)}; {install_hint(self.driver_cuda)}"
            ) from None
        with self._lock:
            self._sink = sink
        self._register()
        self.enabled = []
        self.paused = []
        self.enabled_at_ns = time.monotonic_ns()
        for act in activities:
            kind_name = ACTIVITY_KINDS.get(act)
            if kind_name is None:
                self.note(f"unknown activity {act!r} ignored")
                continue
            kind = getattr(cu.ActivityKind, kind_name, None)
            if kind is None:
                self.note(f"{act}: this cupti-python has no {kind_name}")
                continue
            try:
                self._kind_on(kind)
            except Exception as e:  # noqa: BLE001
                if act == REQUIRED_ACTIVITY:
                    self.disable(flush=False)
                    raise Unavailable(self._with_hint(self._describe_error(e))) from None
                self.note(f"{act} not available: {self._describe_error(e)}")
                continue
            self.enabled.append((act, int(kind)))
        self._narrow_api_records(enable=True)
        # CUPTI's own flush period is left as it is: the session flushes every 200 ms.
        if "markers" in [a for a, _ in self.enabled] and not os.environ.get(
            "NVTX_INJECTION64_PATH"
        ):
            self.note(
                "NVTX ranges need `kdash run --nvtx` (NVTX_INJECTION64_PATH=<libcupti.so> "
                "set when the target starts)"
            )

    def _register(self) -> None:
        """Give CUPTI our buffer callbacks (raw buffers, else cupti-python's record objects).

        Done on every START: a profiler that ran in between (torch.profiler) has registered
        its own buffer callbacks and CUPTI keeps only the last registration; and after a
        cuptiFinalize (every detach, detach.py) CUPTI has forgotten ours.
        """
        cu = self.cupti
        self.mode = "objects"
        if self.use_raw and self.converter is not None and self.converter.reader is not None:
            try:
                if self.raw is None:
                    path, why = find_libcupti()
                    if path is None:
                        raise RuntimeError(why)
                    self.raw = RawBuffers(path, self._raw_buffer)
                rc = self.raw.register()
                if rc != 0:
                    raise RuntimeError(f"cuptiActivityRegisterCallbacks returned {rc}")
                self.mode = "raw"
                self._registered = True
            except Exception as e:  # noqa: BLE001 - cupti-python's callbacks still work
                self.use_raw = False
                self.raw_note = f"raw CUPTI buffers not used ({type(e).__name__}: {e})"
        if self.mode != "raw":
            try:
                cu.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
                self._registered = True
            except Exception as e:  # noqa: BLE001
                if not self._registered:
                    with self._lock:
                        self._sink = None
                    raise Unavailable(self._with_hint(self._describe_error(e))) from None
                self.note(f"re-registering buffer callbacks: {self._describe_error(e)}")

    def _narrow_api_records(self, enable: bool) -> None:
        """Keep only launch, synchronize, copy and set API records (enable=True), or put back
        CUPTI's default of every API (enable=False).

        Why: with RUNTIME and DRIVER on, CUPTI writes a record for every API call, and torch
        makes several bookkeeping calls (cudaGetDevice, ...) per op; those records cost the
        target time and say nothing kdash shows. The per-API switch is process-global CUPTI
        state, so it is restored on detach: a torch.profiler run afterwards sees every call.
        """
        import re

        cu = self.cupti
        acts = {a for a, _ in (self.enabled if enable else self.last_enabled)}
        plan = (
            ("runtime", "runtime_api_trace_cbid", "activity_enable_runtime_api"),
            ("driver", "driver_api_trace_cbid", "activity_enable_driver_api"),
        )
        keep = re.compile(API_KEEP)
        for act, enum_name, fn_name in plan:
            if act not in acts:
                continue
            members = getattr(getattr(cu, enum_name, None), "__members__", None)
            fn = getattr(cu, fn_name, None)
            if not members or fn is None:
                if enable:
                    self.note(f"{act} API records not narrowed: no {fn_name}")
                continue
            skipped = 0
            for name, cbid in members.items():
                if name in ("INVALID", "SIZE", "FORCE_INT") or keep.search(name):
                    continue
                try:
                    fn(int(cbid), 0 if enable else 1)
                except Exception as e:  # noqa: BLE001 - some cbids are not switchable
                    skipped += 1
                    if skipped == 1 and enable:
                        self.note(f"{act} API records partly narrowed: {self._describe_error(e)}")

    def pause(self) -> str:
        """End a duty-cycle window: switch every enabled kind off and force-flush, keeping the
        sink (the flushed records still arrive) and the kinds for `resume`; "" or what failed.

        The per-API narrowing is left as it is: switching a kind on again resets CUPTI's
        per-function choices anyway (so `resume` narrows again), and with the kind off they
        record nothing (both seen on a card with CUDA 13.0's CUPTI).
        """
        errors = []
        kinds = list(self.enabled)
        for act, kind in kinds:
            try:
                self._kind_off(kind)
            except Exception as e:  # noqa: BLE001
                errors.append(f"disable {act}: {self._describe_error(e)}")
        self.paused, self.enabled = kinds, []
        self.disabled_at_ns = time.monotonic_ns()  # the window's end: before the flush's work
        try:
            self.cupti.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
        except Exception as e:  # noqa: BLE001
            errors.append(f"flush: {self._describe_error(e)}")
        if errors:
            self.last_error = "; ".join(errors)
        return "; ".join(errors)

    def resume(self) -> str:
        """Start a duty-cycle window: the kinds `pause` switched off go on again, narrowed."""
        errors = []
        kinds, self.paused = self.paused, []
        self.enabled_at_ns = time.monotonic_ns()
        for act, kind in kinds:
            try:
                self._kind_on(kind)
            except Exception as e:  # noqa: BLE001
                errors.append(f"enable {act}: {self._describe_error(e)}")
                continue
            self.enabled.append((act, kind))
        t0 = time.perf_counter_ns()
        self._narrow_api_records(enable=True)  # one call per API id: measured, as it repeats
        self.narrow_ns += time.perf_counter_ns() - t0
        self.resumes += 1
        if errors:
            self.last_error = "; ".join(errors)
        return "; ".join(errors)

    def disable(self, flush: bool = True) -> str:
        """Disable every enabled kind, then force-flush; "" or what went wrong.

        Between duty-cycle windows nothing is enabled (`pause` did it); the flush and the
        sink's release still happen, and `last_enabled` remembers what a resume after another
        CUPTI client should switch on again.
        """
        errors = []
        cu = self.cupti
        if self.paused and not self.enabled:
            self.last_enabled, self.paused = list(self.paused), []
        if self.enabled:
            self.last_enabled = list(self.enabled)
            try:
                self._narrow_api_records(enable=False)
            except Exception as e:  # noqa: BLE001
                errors.append(f"restoring API record defaults: {self._describe_error(e)}")
        was_on = bool(self.enabled)
        for act, kind in self.enabled:
            try:
                self._kind_off(kind)
            except Exception as e:  # noqa: BLE001
                errors.append(f"disable {act}: {self._describe_error(e)}")
        self.enabled = []
        if was_on:
            self.disabled_at_ns = time.monotonic_ns()
        if flush and cu is not None:
            try:
                cu.activity_flush_all(1)  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED
            except Exception as e:  # noqa: BLE001
                errors.append(f"flush: {self._describe_error(e)}")
        self.read_dropped()
        with self._lock:
            self._sink = None
        if errors:
            self.last_error = "; ".join(errors)
        return "; ".join(errors)

    def step_aside(self) -> None:
        """Stop taking records without touching CUPTI's global state.

        Used when another client (torch.profiler) started while we were on: it has registered
        its own callbacks and enabled the kinds it needs; disabling "our" kinds now would switch
        off its collection too. Its run may still miss records (CUPTI serves one client at a
        time); the STATUS line says so. We re-register and re-enable when it has ended.
        """
        if self.paused and not self.enabled:
            self.last_enabled, self.paused = list(self.paused), []
        if self.enabled:
            self.last_enabled = list(self.enabled)
            try:  # give the other client CUPTI's default of every API record back
                self._narrow_api_records(enable=False)
            except Exception as e:  # noqa: BLE001
                self.last_error = f"restoring API record defaults: {self._describe_error(e)}"
        self.enabled = []
        with self._lock:
            self._sink = None

    def release_left_behind(self) -> str:
        """Switch off the kinds `step_aside` left on, once the other client has gone.

        While it ran they were its kinds as well; once it has ended, a kind it did not use
        itself (synchronization, markers) would otherwise stay on for the life of the process
        and cost the target on every launch. "" or what failed.
        """
        errors = []
        for kind in self.kinds_on():
            for _ in range(self.ledger.get(kind, 0)):
                try:
                    self._kind_off(kind)
                except Exception as e:  # noqa: BLE001
                    errors.append(f"disable kind {kind}: {self._describe_error(e)}")
                    break
        return "; ".join(errors)

    def flush(self) -> None:
        c0 = time.thread_time_ns()
        try:
            self.cupti.activity_flush_all(0)
        except Exception as e:  # noqa: BLE001
            self.last_error = f"flush: {self._describe_error(e)}"
        self.flush_cpu_ns += time.thread_time_ns() - c0

    def read_dropped(self) -> int:
        if self.cupti is None:
            return self.dropped_by_cupti
        import ctypes

        try:
            d = ctypes.c_size_t(0)
            self.cupti.activity_get_num_dropped_records(0, 0, ctypes.addressof(d))
            self.dropped_by_cupti += int(d.value)
        except Exception as e:  # noqa: BLE001
            self.last_error = f"dropped-record count: {self._describe_error(e)}"
        return self.dropped_by_cupti

    # the callbacks CUPTI calls (on its own thread or the flushing one): never raise
    def _raw_buffer(self, addr: int, valid: int) -> None:
        """RawBuffers' completion: read one CUPTI buffer with numpy (never raises)."""
        try:
            t0 = time.perf_counter_ns()
            c0 = time.thread_time_ns()
            with self._lock:
                sink = self._sink
            if sink is None or self.converter is None or self.raw_failed:
                self.discarded_bytes += valid
                return
            try:
                batches = self.converter.batches_raw(addr, valid)
            except LayoutMismatch as e:
                # cannot read this buffer; the session switches to cupti-python's objects
                self.raw_failed = f"raw CUPTI buffer unreadable: {e}"
                self.discarded_bytes += valid
                return
            self.records_seen += sum(_batch_rows(b) for b in batches.values())
            self._note_graphs(batches)
            sink(batches)
            self.callback_cpu_ns += time.thread_time_ns() - c0
            self.callback_ns += time.perf_counter_ns() - t0
        except BaseException as e:  # noqa: BLE001 - nothing may raise into CUPTI or the target
            self.callback_errors += 1
            self.last_error = f"raw buffer callback: {type(e).__name__}: {e}"

    def _note_graphs(self, batches: dict[str, Batch]) -> None:
        """A kernel record with a graph id: kernel activity has now been on during a graph
        replay, after which finalizing kills the process (detach.py)."""
        k = batches.get("kernels")
        if k is not None and len(k.get("graph_id", ())) and bool((k["graph_id"] > 0).any()):
            self.graphs_seen = self.graph_kernels_recorded = True

    # taking CUPTI out again (detach.py)
    def libcupti(self) -> Any:
        """The libcupti that cupti-python loaded, through ctypes (None where none is mapped)."""
        if self._lib is None:
            if self.raw is not None:
                self._lib = self.raw.lib
            else:
                import ctypes

                path, _why = find_libcupti()
                self._lib = ctypes.CDLL(path) if path else None
        return self._lib

    def cancel_hook(self) -> None:
        """A START while a detach still waits for the target's next call: CUPTI stays."""
        if self.hook is not None and self.hook.cancel():
            self.detach_state = "attached (the pending finalize was cancelled by a new client)"

    def probe_graphs(self, seconds: float) -> bool:
        """True when the target launches a CUDA graph within `seconds` (CUPTI is then
        finalized at that launch's exit, so the probe leaves nothing behind)."""
        from . import detach

        lib = self.libcupti()
        if lib is None or self.cupti is None:
            return False
        hook = detach.probe_graphs(lib, self.cupti, seconds)
        self.hook = hook
        if hook.state.startswith("failed"):
            self.note(f"CUDA-graph probe: {hook.state}")
        if hook.state == "finalized":
            self.cupti_detached += 1
            self.detach_state = "detached (finalized at a graph launch)"
        self.graphs_seen = self.graphs_seen or hook.graph_seen
        return hook.graph_seen

    def detach_cupti(self, wait_s: float) -> str:
        """After every kind is off: finalize CUPTI at the target's next launch or synchronize
        call, unless kernels of graph replays were recorded (then CUPTI must stay). "" or why
        CUPTI stays attached."""
        from . import detach

        if self.cupti is None:
            return ""
        if self.graph_kernels_recorded:
            self.detach_state = "attached for good (kernels of CUDA-graph replays were recorded)"
            return "CUPTI stays attached: kernels of CUDA-graph replays were recorded"
        if self.kinds_on():
            self.detach_state = "attached (kinds still on)"
            return "CUPTI stays attached: activity kinds still on"
        lib = self.libcupti()
        if lib is None:
            self.detach_state = "attached (no libcupti handle)"
            return "CUPTI stays attached: libcupti not found in this process"
        hook = detach.finalize_at_next_call(lib, self.cupti, wait_s)
        self.hook = hook
        if hook.state == "finalized":
            self.cupti_detached += 1
            self.detach_state = "detached"
        elif hook.state == "armed":
            self.detach_state = "detaching at the target's next CUDA call"
        else:
            self.detach_state = f"attached ({hook.state})"
            return f"CUPTI stays attached: {hook.state}"
        return ""

    def _buffer_requested(self) -> tuple[int, int]:
        return BUFFER_BYTES, 0

    def _buffer_completed(self, activities: list[Any]) -> None:
        try:
            t0 = time.perf_counter_ns()
            c0 = time.thread_time_ns()
            n = len(activities)
            with self._lock:
                sink = self._sink
            if sink is None or self.converter is None:
                self.discarded_records += n
                return
            batches = self.converter.batches(activities)
            self.records_seen += n
            self._note_graphs(batches)
            sink(batches)
            self.callback_cpu_ns += time.thread_time_ns() - c0
            self.callback_ns += time.perf_counter_ns() - t0
        except BaseException as e:  # noqa: BLE001 - nothing may raise into CUPTI or the target
            self.callback_errors += 1
            self.last_error = f"buffer callback: {type(e).__name__}: {e}"


# ---- the agent ----------------------------------------------------------------------------------


def _client_messages(wire: Any) -> frozenset:
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
    """The listener and its one session at a time. See the module docstring for the rules."""

    def __init__(self, path: str) -> None:
        self.pid = os.getpid()
        self.path = path
        self.state = "idle"  # idle | active | waiting | unavailable | error
        self.line = "idle: no client"
        self.sessions = 0
        self.last_error = ""
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._session_lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._live = False  # a session has a client (set by the accept loop, cleared at its end)
        self._hello: bytes | None = None
        self._strings: Any = None  # the session's wire.StringEncoder
        self._act_note = ""  # the last START's unknown activities, if any
        self._closing = False
        self._cupti: CuptiActivity | None = None
        self._pending: list[dict[str, dict[str, Any]]] = []
        self._thread_ids = ThreadIds()  # CUPTI's pthread ids -> OS tids, for api/markers rows
        self._pending_rows = 0
        self._pending_lock = threading.Lock()
        self.dropped_rows = 0
        self.discarded_rows = 0
        self._next_try = 0.0
        self.sent_rows: dict[str, int] = {}
        self._windows: list[tuple[int, int]] = []  # on-windows not yet sent (monotonic ns)
        self._duty = DutyCycle()
        self.on_ns = 0  # total time CUPTI activity was on, over all sessions
        self.windows_sent = 0
        self.last_disconnect = ""
        # PC sampling: its own thread per range; `_pc_busy` is set while a range runs, and the
        # duty cycle does not switch activity on meanwhile
        self._pc: Any = None  # pcsampling.SamplingRanges, made at the first range
        self._pc_thread: threading.Thread | None = None
        self._pc_busy = threading.Event()
        self._pc_cut = threading.Event()
        self._pc_windows: list[tuple[int, int]] = []
        self.pc_state = "off"  # off | ok | unavailable: <why>
        self.pc_ranges = 0
        self.pc_rows = 0
        self.pc_last: dict = {}
        self.pc_device_hint: int | None = None
        self._graph_kernels = False  # START "graph_kernels" of the current session

    # lifecycle
    def listen(self) -> None:
        folder = os.path.dirname(self.path)
        ensure_private_dir(folder)
        sweep_stale(folder)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a stale socket of an earlier process with our pid
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(self.path)
            os.chmod(self.path, 0o600)
            s.listen(LISTEN_BACKLOG)
            s.setblocking(False)  # the accept loop drains the backlog and never waits in accept
        except BaseException:
            s.close()
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
        if self._cupti is not None:  # no finalize waiting for a call during interpreter exit
            with contextlib.suppress(Exception):
                self._cupti.cancel_hook()
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
        wire = _wire()
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
                    if self._closing or not self._accept_some(wire, pending, poller):
                        return
                elif fd in pending:
                    self._read_first(wire, pending[fd], pending, poller)
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
                wire.check_header(p.header, _client_messages(wire), MAX_CLIENT_PAYLOAD)
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
                    "schema_version": _schema_version(),
                    "pid": self.pid,
                    "python": sys.version.split()[0],
                    "capabilities": list(DEFAULT_ACTIVITIES),
                    "cupti_python": _dist_version("cupti-python"),
                    "duty_cycle": True,
                    "pc_sampling": True,
                },
            )
        return self._hello

    # one client
    def _notes(self) -> list[str]:
        c = self._cupti
        notes = [self._act_note] if self._act_note else []
        if c is None:
            return notes
        notes += c.notes
        if c.converter is not None and c.converter.fast_note:
            notes.append(c.converter.fast_note)
        for extra in (c.raw_note, c.raw_failed):
            if extra:
                notes.append(extra[:MAX_NOTE_CHARS])
        return notes

    def _status(self, state: str, line: str) -> dict:
        self.state, self.line = state, line
        return {
            "state": state,
            "line": line,
            "notes": self._notes(),
            "sampling": self._duty.describe(),
        }

    def _stats(self) -> dict:
        c = self._cupti
        if c is not None and c.enabled:
            c.read_dropped()
        return {
            "pid": self.pid,
            "state": self.state,
            "line": self.line,
            "sessions": self.sessions,
            "sent_rows": dict(self.sent_rows),
            "dropped_agent": self.dropped_rows,
            "dropped_cupti": c.dropped_by_cupti if c else 0,
            "discarded_records": c.discarded_records if c else 0,
            "discarded_rows": self.discarded_rows,
            "records_seen": c.records_seen if c else 0,
            "callback_ns": c.callback_ns if c else 0,
            "callback_cpu_ns": c.callback_cpu_ns if c else 0,
            "flush_cpu_ns": c.flush_cpu_ns if c else 0,
            "callback_errors": c.callback_errors if c else 0,
            "last_error": (c.last_error if c and c.last_error else self.last_error),
            "offset_ns": c.offset_ns if c else 0,
            "offset_gap_ns": c.offset_gap_ns if c else 0,
            "enabled": [a for a, _ in c.enabled] if c else [],
            "notes": self._notes(),
            "record_reader": _reader_name(c),
            "discarded_bytes": c.discarded_bytes if c else 0,
            "bad_time_records": c.converter.bad_time_records if c and c.converter else 0,
            "raw_buffers": c.raw.buffers if c and c.raw else 0,
            "raw_errors": c.raw.errors if c and c.raw else 0,
            "raw_bytes_lost": c.raw.bytes_lost if c and c.raw else 0,
            "markers_overflowed": c.converter.markers_overflowed if c and c.converter else 0,
            "sampling": self._duty.describe(),
            "windows_sent": self.windows_sent,
            "on_ns": self.on_ns,
            "kinds_on": c.kinds_on() if c else [],
            "buffers_requested": c.raw.requested if c and c.raw else 0,
            "cupti_detached": c.cupti_detached if c else 0,
            "cupti_state": c.detach_state if c else "never attached",
            "graphs_seen": c.graphs_seen if c else False,
            "graph_kernels_recorded": c.graph_kernels_recorded if c else False,
            # the agent's own threads now: after a detach only the accept loop (blocked in
            # accept, never waking) and the session answering this request
            "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("kdash")),
            "narrow_us_per_window": round(c.narrow_ns / c.resumes / 1e3, 1)
            if c and c.resumes
            else None,
            "last_disconnect": self.last_disconnect,
            "names_overflowed": self._strings.overflowed if self._strings is not None else 0,
            "pc_state": self.pc_state,
            "pc_ranges": self.pc_ranges,
            "pc_rows": self.pc_rows,
            "pc_last": dict(self.pc_last),
            "pc_cpu_ms_per_range": round(self._pc.cpu_ms_total / self._pc.ranges, 2)
            if self._pc is not None and self._pc.ranges
            else None,
        }

    # ---- PC sampling ----------------------------------------------------------------------
    def _pc_start_range(self, on_s: float) -> None:
        """Run one PC-sampling range on a thread of its own (activity is off meanwhile)."""
        self._pc_busy.set()
        self._pc_cut.clear()
        t = threading.Thread(target=self._pc_range, args=(on_s,), name="kdash-pcs", daemon=True)
        self._pc_thread = t
        t.start()

    def _pc_range(self, on_s: float) -> None:
        """The range's thread: its rows and window go to the pending queue, its costs to
        STATS; a failure makes PC sampling "unavailable: <why>" for the rest of the session
        (the source pane shows that line). Never raises."""
        try:
            from . import pcsampling

            if self._pc is None:
                fake = os.environ.get(ENV_FAKE_PCSAMPLING)
                if fake:
                    self._pc = pcsampling.SamplingRanges(fake, libcuda=fake)
                else:
                    path, why = find_libcupti()
                    if path is None:
                        raise RuntimeError(f"libcupti not found in this process ({why})")
                    self._pc = pcsampling.SamplingRanges(path, device=self.pc_device_hint)
            t0 = time.monotonic_ns()
            cols, stats = self._pc.run(on_s, self._pc_cut)
            t1 = time.monotonic_ns()
            import numpy as np

            n = len(cols["count"])
            cols["t_ns"] = np.full(n, t1, dtype=np.int64)
            with self._pending_lock:
                if n:
                    self._pending.append({"pc_samples": cols})
                    self._pending_rows += n
                self._pc_windows.append((t0, t1))
            self.pc_ranges += 1
            self.pc_rows += n
            self.pc_last = stats
            self.pc_state = "ok"
        except BaseException as e:  # noqa: BLE001 - never into the target; say why in the pane
            why = str(e) or type(e).__name__
            if "NOT_COMPATIBLE" in why or "MULTIPLE_SUBSCRIBERS" in why:
                why += " (another profiler holds the counters, or kernel activity is on)"
            self.pc_state = f"unavailable: {why}"
        finally:
            self._pc_busy.clear()

    def _pc_stop(self, timeout_s: float = 5.0) -> None:
        """Cut a running range short and wait for its thread (detach, STOP, SET off)."""
        t = self._pc_thread
        if t is not None and t.is_alive():
            self._pc_cut.set()
            t.join(timeout_s)

    def _sink(self, rows: dict[str, Batch]) -> None:
        n = sum(_batch_rows(b) for b in rows.values())
        with self._pending_lock:
            if self._pending_rows + n > MAX_PENDING_ROWS:
                self.dropped_rows += n
                return
            self._pending.append(rows)
            self._pending_rows += n

    def _take_pending(self) -> list[dict[str, dict[str, Any]]]:
        with self._pending_lock:
            out, self._pending, self._pending_rows = self._pending, [], 0
        return out

    def _add_window(self, start_ns: int, end_ns: int) -> None:
        """Queue one on-window [start_ns, end_ns] (monotonic) for the client as a markers row."""
        if end_ns <= start_ns:
            return
        with self._pending_lock:
            self._windows.append((start_ns, end_ns))
        self.on_ns += end_ns - start_ns

    def _session(self, conn: socket.socket, first: Any) -> None:
        """One client, whose HELLO the accept loop sent and whose first request is `first`."""
        wire = _wire()

        self._conn = conn
        self.sessions += 1
        active = False
        waiting: list[str] | None = None  # START received, CUPTI not on yet (or paused)
        last_sent: tuple[str, str] | None = None
        self._duty = DutyCycle()
        pc_cfg = PCConfig()
        next_pc = 0.0  # when the next PC-sampling range may start
        pc_paused_activity = False  # a range paused continuous activity: resume after it
        # the duty cycle while active: is the current window on, since when, and the next edge
        phase_on = False
        win_start_ns = 0
        period_start = next_edge = 0.0
        try:
            conn.settimeout(SEND_TIMEOUT_S)
            strings = wire.StringEncoder(MAX_SESSION_NAMES, MAX_SESSION_NAME_BYTES, MAX_NAME_CHARS)
            self._strings = strings
            accept = _client_messages(wire)
            # poll, not select: select() cannot watch a descriptor numbered 1024 or more, and
            # a target holding that many files gives its connections such numbers
            poller = select.poll()
            poller.register(conn.fileno(), select.POLLIN)
            decoder = wire.Decoder()

            def send(frame: bytes) -> None:
                conn.sendall(frame, socket.MSG_NOSIGNAL)

            def status(state: str, line: str, force: bool = False) -> None:
                nonlocal last_sent
                self.state, self.line = state, line
                if force or last_sent != (state, line):  # retries do not repeat themselves
                    last_sent = (state, line)
                    send(wire.encode_control(wire.MsgType.STATUS, self._status(state, line)))

            def begin_windows(now: float) -> None:
                """CUPTI has just been switched on: the first window starts."""
                nonlocal phase_on, win_start_ns, period_start, next_edge
                phase_on = True
                win_start_ns = self._cupti.enabled_at_ns if self._cupti else time.monotonic_ns()
                period_start = now
                d = self._duty
                next_edge = now + (d.period_s if d.continuous else d.on_s)

            def end_window(off_ns: int) -> None:
                """Activity was switched off for good at `off_ns` (STOP, another client)."""
                nonlocal phase_on
                if phase_on:
                    self._add_window(win_start_ns, off_ns)
                phase_on = False

            def edge(now: float) -> None:
                """The duty cycle's clock: close or open a window when its time has come."""
                nonlocal phase_on, win_start_ns, period_start, next_edge
                c = self._cupti
                d = self._duty
                if c is None:
                    return
                if not phase_on and self._pc_busy.is_set():
                    next_edge = now + POLL_S  # CUPTI refuses activity during a PC range
                    return
                if d.continuous:
                    if not phase_on:  # SET continuous arrived between windows
                        c.resume()
                        begin_windows(now)
                        return
                    # one row per period, so the timeline sees activity while it lasts
                    t = time.monotonic_ns()
                    self._add_window(win_start_ns, t)
                    win_start_ns, next_edge = t, now + d.period_s
                elif phase_on:
                    c.pause()
                    self._add_window(win_start_ns, c.disabled_at_ns)
                    phase_on = False
                    next_edge = period_start + d.period_s
                    if next_edge <= now:  # this thread was held up: no catching up in bursts
                        next_edge = now + d.period_s - d.on_s
                else:
                    c.resume()
                    begin_windows(now)

            last_flush = last_offset = last_held_check = time.monotonic()
            while not self._closing:
                timeout = POLL_S
                if active:
                    timeout = max(0.0, min(POLL_S, next_edge - time.monotonic()))
                msg = first
                first = None
                if msg is None and poller.poll(timeout * 1000):
                    msg = wire.recv_message(conn, decoder, accept, MAX_CLIENT_PAYLOAD)
                    if msg is None:
                        break  # the client closed or died
                if msg is not None:
                    if msg.type == wire.MsgType.START:
                        if active or waiting is not None:
                            status(self.state, self.line, force=True)
                            continue
                        acts, act_note = parse_activities(msg.body.get("activities"))
                        if acts is None:
                            status("error", f"error: START {act_note}")
                            continue
                        duty, why = DutyCycle.parse(msg.body, DutyCycle())
                        if duty is None:
                            status("error", f"error: START {why}")
                            continue
                        pcc, why = PCConfig.parse(msg.body, PCConfig())
                        if pcc is None:
                            status("error", f"error: START {why}")
                            continue
                        pc_cfg = pcc
                        self.pc_state = "starting" if pcc.on else "off"
                        self._duty = duty
                        self._graph_kernels = msg.body.get("graph_kernels") is True
                        waiting = acts
                        self._next_try = 0.0
                        self._act_note = act_note
                        if self._cupti is not None:
                            self._cupti.notes = []
                    elif msg.type == wire.MsgType.SET:
                        duty, why = DutyCycle.parse(msg.body, self._duty)
                        if duty is None:
                            status("error", f"error: SET {why}")
                            continue
                        pcc, why = PCConfig.parse(msg.body, pc_cfg)
                        if pcc is None:
                            status("error", f"error: SET {why}")
                            continue
                        if pcc.on and not pc_cfg.on:
                            next_pc = 0.0
                            if not self.pc_state.startswith("unavailable"):
                                self.pc_state = "starting"
                        elif not pcc.on and pc_cfg.on:
                            self._pc_stop()
                            if not self.pc_state.startswith("unavailable"):
                                self.pc_state = "off"
                        pc_cfg = pcc
                        self._duty = duty
                        if active:
                            now = time.monotonic()
                            if duty.continuous and phase_on:
                                next_edge = now + duty.period_s
                            elif duty.continuous or not phase_on:
                                next_edge = now  # switch on at once
                            else:  # this window becomes the first of the new cycle
                                period_start, next_edge = now, now + duty.on_s
                            names = ", ".join(a for a, _ in (self._cupti.enabled or []))
                            names = names or ", ".join(a for a, _ in self._cupti.paused)
                            status("active", self._active_line(names), force=True)
                        else:
                            status(self.state, self.line, force=True)
                    elif msg.type == wire.MsgType.STOP:
                        waiting = None
                        self._pc_stop()
                        pc_cfg = PCConfig()
                        if active:
                            active = False
                            err = self._cupti.disable() if self._cupti else ""
                            end_window(self._cupti.disabled_at_ns if self._cupti else 0)
                            if self._cupti is not None and not err:
                                err = self._cupti.detach_cupti(DETACH_WAIT_S)
                            self._send_pending(send, strings)
                            status("idle", "idle: stopped" + (f" ({err})" if err else ""))
                        else:
                            status("idle", "idle: stopped")
                    elif msg.type == wire.MsgType.STATS:
                        send(wire.encode_control(wire.MsgType.STATS, self._stats()))
                    else:
                        status("error", f"error: {msg.type.name} is not a client message")
                if waiting is not None:
                    outcome = self._try_start(waiting, status)
                    if outcome == "active":
                        active, waiting = True, None
                        begin_windows(time.monotonic())
                    elif outcome == "gave_up":
                        waiting = None
                now = time.monotonic()
                if active and self._cupti is not None:
                    if now - last_held_check >= 1.0 or (not phase_on and now >= next_edge):
                        last_held_check = now
                        held = other_cupti_client()
                        if held:  # e.g. the user started torch.profiler: step aside at once
                            active = False
                            end_window(time.monotonic_ns())  # its kinds stay on for it
                            self._cupti.step_aside()
                            self._send_pending(send, strings)
                            status(
                                "unavailable",
                                f"unavailable: {held} (started while kdash was attached; "
                                "CUPTI serves one client, so its trace may miss kernels); "
                                "kdash paused and resumes when it ends",
                            )
                            waiting = [a for a, _ in self._cupti.last_enabled]
                            self._next_try = now + 1.0
                            continue
                    if self._cupti.graph_kernels_recorded and not self._cupti.graph_kernels:
                        active = False
                        self._cupti.disable()
                        end_window(self._cupti.disabled_at_ns)
                        self._cupti.detach_state = "attached for good (graph kernels recorded)"
                        self._send_pending(send, strings)
                        status("unavailable", f"unavailable: {self._tainted_line()}")
                        continue
                    if self._cupti.raw_failed and self._cupti.mode == "raw" and phase_on:
                        # a buffer we could not read: go on with cupti-python's record objects
                        acts_now = [a for a, _ in self._cupti.enabled]
                        self._cupti.use_raw = False
                        self._cupti.disable(flush=False)
                        try:
                            self._cupti.enable(acts_now, self._sink)
                            status("active", self._active_line(", ".join(acts_now)))
                        except Exception as e:  # noqa: BLE001 - say so, stay idle
                            active = False
                            end_window(self._cupti.disabled_at_ns)
                            status("unavailable", f"unavailable: re-enabling CUPTI failed: {e}")
                            continue
                    if now >= next_edge:
                        edge(now)
                    if (
                        pc_cfg.on
                        and now >= next_pc
                        and not self._pc_busy.is_set()
                        and not self.pc_state.startswith("unavailable")
                        and (not phase_on or self._duty.continuous)
                    ):
                        if phase_on:  # continuous: activity must be off during the range
                            self._cupti.pause()
                            self._add_window(win_start_ns, self._cupti.disabled_at_ns)
                            phase_on = False
                            pc_paused_activity = True
                        self._pc_start_range(pc_cfg.on_ms / 1000)
                        next_pc = now + pc_cfg.period_ms / 1000
                    if pc_paused_activity and not self._pc_busy.is_set():
                        pc_paused_activity = False
                        next_edge = now  # continuous: switch activity back on now
                    if phase_on and now - last_flush >= FLUSH_EVERY_S:
                        self._cupti.flush()
                        last_flush = now
                    if now - last_offset >= OFFSET_EVERY_S:
                        try:
                            self._cupti.measure_offset()
                        except Exception as e:  # noqa: BLE001 - keep the previous offset
                            self._cupti.last_error = f"offset: {type(e).__name__}: {e}"
                        last_offset = now
                self._send_pending(send, strings)
        except (BrokenPipeError, ConnectionResetError) as e:
            # the client went away (closed after STOP, or was killed): a normal end, not an error
            self.last_disconnect = f"client left ({type(e).__name__})"
        except (OSError, wire.WireError) as e:
            self.last_error = f"client connection: {type(e).__name__}: {e}"
        except BaseException as e:  # noqa: BLE001 - never into the target
            self.last_error = f"session: {type(e).__name__}: {e}"
        finally:
            self._live = False  # newcomers wait for the teardown below, then get the session
            self._end_session(active, phase_on, win_start_ns)
            self._conn = None
            with contextlib.suppress(OSError):
                conn.close()
            self._session_lock.release()

    def _end_session(self, active: bool, phase_on: bool, win_start_ns: int) -> None:
        """Whatever way the session ended, leave CUPTI as if it had never been touched."""
        self._pc_stop()
        if self.pc_state == "ok" or self.pc_state == "starting":
            self.pc_state = "off"
        try:
            c = self._cupti
            if active and c is not None:
                err = c.disable()
                if phase_on:
                    self._add_window(win_start_ns, c.disabled_at_ns)
                if not err and not self._closing:  # at exit there is no "afterwards" to spare
                    err = c.detach_cupti(DETACH_WAIT_S)
                if err:
                    self.last_error = err
            elif c is not None and c.kinds_on() and other_cupti_client() is None:
                # left on by step_aside for a client (torch.profiler) that has ended since
                err = c.release_left_behind()
                if err:
                    self.last_error = err
        except BaseException as e:  # noqa: BLE001 - never into the target
            self.last_error = f"detach: {type(e).__name__}: {e}"
        # rows that were on their way to a client that has gone: counted for the next one
        self.discarded_rows += sum(
            _batch_rows(b) for ch in self._take_pending() for b in ch.values()
        )
        with self._pending_lock:
            self._windows = []
        self.state, self.line = "idle", "idle: no client"

    def _graphs_line(self) -> str:
        return (
            f"kernel activity off: pid {self.pid} replays CUDA graphs, and once CUPTI has "
            "recorded their kernels it cannot be taken out of the process again on this "
            "driver (it would stay 8-25% slower until it restarts); CUPTI was detached. "
            "`--graph-kernels` records them anyway"
        )

    def _tainted_line(self) -> str:
        return (
            f"kernel activity stopped: pid {self.pid} began replaying CUDA graphs; with their "
            "kernels recorded CUPTI cannot be taken out of it again on this driver, so it "
            "stays attached, idle, until the process exits. `--graph-kernels` keeps recording"
        )

    def _active_line(self, names: str) -> str:
        return f"ok: CUPTI activity on, {sampling_text(self._duty.describe())} ({names})"

    def _try_start(self, acts: list[str], status: Callable[..., None]) -> str:
        """One step of START: probe CUPTI, wait for CUDA, enable.

        Returns "active" once enabled, "retry" while waiting (for CUDA to be loaded, or for
        another CUPTI client to finish: checked again every second), "gave_up" when CUPTI
        cannot be had in this process at all (the STATUS line says why and what to do).
        """
        now = time.monotonic()
        if now < self._next_try:
            return "retry"
        if self._cupti is None:
            self._cupti = CuptiActivity(self.pid)
        c = self._cupti
        try:
            if c.cupti is None:
                # Nothing may load libcuda or cupti before the target has loaded CUDA itself:
                # until then only what can be seen from outside is checked.
                if not cuda_loaded():
                    c.precheck()
                    self._next_try = now + 0.5  # /proc/self/maps of a torch process is ~1 MB
                    status("waiting", f"waiting: pid {self.pid} has not loaded CUDA yet")
                    return "retry"
                c.probe()
            else:
                held = other_cupti_client()
                if held:
                    raise Unavailable(f"{held}; kdash waits until it ends", retry=True)
            c.cancel_hook()
            c.graph_kernels = self._graph_kernels
            if not c.graph_kernels and (c.graphs_seen or c.probe_graphs(GRAPH_PROBE_S)):
                raise Unavailable(self._graphs_line())
            c.enable(acts, self._sink)
        except Unavailable as e:
            status("unavailable", f"unavailable: {e}")
            if e.retry:
                self._next_try = now + 1.0
                return "retry"
            return "gave_up"
        except Exception as e:  # noqa: BLE001
            if c.enabled:
                c.disable(flush=False)
            status("unavailable", f"unavailable: enabling CUPTI failed: {type(e).__name__}: {e}")
            return "gave_up"
        names = ", ".join(a for a, _ in c.enabled)
        status("active", self._active_line(names))
        return "active"

    def _send_pending(self, send: Callable[[bytes], None], strings: Any) -> None:
        wire = _wire()

        chunks = self._take_pending()
        with self._pending_lock:
            windows, self._windows = self._windows, []
            pc_windows, self._pc_windows = self._pc_windows, []
        if windows:
            self._send_windows(send, strings, windows)
        if pc_windows:
            self._send_windows(send, strings, pc_windows, PC_WINDOW_NAME)
        if not chunks:
            return
        import numpy as np

        offset = self._cupti.offset_ns if self._cupti else 0
        for table in ROW_COLUMNS:
            parts = [ch[table] for ch in chunks if table in ch]
            if not parts:
                continue
            cols = {c: np.concatenate([p[c] for p in parts]) for c in parts[0]}
            cols["start_ns"] = cols["start_ns"] + offset
            cols["end_ns"] = cols["end_ns"] + offset
            if "tid" in cols:
                cols["tid"] = self._thread_ids.translate(cols["tid"])
            n = len(cols["start_ns"])
            for i in range(0, n, 200_000):
                part = {c: v[i : i + 200_000] for c, v in cols.items()}
                send(wire.encode_batch(table, part, strings))
            self.sent_rows[table] = self.sent_rows.get(table, 0) + n
        pcs = [ch["pc_samples"] for ch in chunks if "pc_samples" in ch]
        if pcs:  # already on the monotonic clock (t_ns taken at the range's end)
            cols = {c: np.concatenate([p[c] for p in pcs]) for c in pcs[0]}
            n = len(cols["t_ns"])
            for i in range(0, n, 200_000):
                part = {c: v[i : i + 200_000] for c, v in cols.items()}
                send(wire.encode_batch("pc_samples", part, strings))
            self.sent_rows["pc_samples"] = self.sent_rows.get("pc_samples", 0) + n

    def _send_windows(
        self,
        send: Callable[[bytes], None],
        strings: Any,
        windows: list[tuple[int, int]],
        name: str = WINDOW_NAME,
    ) -> None:
        """On-windows as markers rows (domain "kdash", name "activity on", tid -1): the
        timeline marks the gaps between them as "not recorded", not as "GPU idle"."""
        import numpy as np

        wire = _wire()
        n = len(windows)
        starts = np.array([w[0] for w in windows], dtype=np.int64)
        ends = np.array([w[1] for w in windows], dtype=np.int64)
        batch = {
            "start_ns": starts,
            "end_ns": ends,
            "name": np.full(n, name, dtype=object),
            "domain": np.full(n, WINDOW_DOMAIN, dtype=object),
            "pid": np.full(n, self.pid, dtype=np.int64),
            "tid": np.full(n, -1, dtype=np.int64),
        }
        send(wire.encode_batch("markers", batch, strings))
        if name == WINDOW_NAME:
            self.windows_sent += n
        self.sent_rows["markers"] = self.sent_rows.get("markers", 0) + n


def parse_activities(value: Any) -> tuple[list[str] | None, str]:
    """The activities a START asks for (None or empty: the defaults) and a note naming the
    unknown ones, which are ignored; or None and why the list is refused. At most
    MAX_ACTIVITIES names: each is one CUPTI kind, and a list of thousands must cost the
    agent neither a long loop nor a note per name."""
    if not value:
        return list(DEFAULT_ACTIVITIES), ""
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        return None, "activities must be a list of names"
    if len(value) > MAX_ACTIVITIES:
        return None, f"activities: {len(value)} names, at most {MAX_ACTIVITIES}"
    known = [a for a in value if a in ACTIVITY_KINDS]
    unknown = [a for a in value if a not in ACTIVITY_KINDS]
    if not known:
        return None, f"activities: none known (known: {', '.join(ACTIVITY_KINDS)})"
    why = ""
    if unknown:
        shown = ", ".join(repr(a[:40]) for a in unknown[:4])
        more = f" and {len(unknown) - 4} more" if len(unknown) > 4 else ""
        why = f"unknown activities ignored: {shown}{more}"
    return list(dict.fromkeys(known)), why


def sampling_text(sampling: dict | None) -> str:
    """ "sampling 10% (100 ms/s)" or "continuous" for a STATUS/STATS "sampling" field."""
    if not sampling:
        return ""
    if sampling.get("continuous"):
        return "continuous"
    period, on = int(sampling.get("period_ms", 0)), int(sampling.get("on_ms", 0))
    if period <= 0:
        return ""
    per = "s" if period == 1000 else f"{period / 1000:g} s"
    return f"sampling {100 * on / period:.0f}% ({on} ms/{per})"


class DutyCycle:
    """How much of the time CUPTI activity is on: `on_ms` of every `period_ms`, or always.

    Continuous activity cost the H200 targets far more than the 2% floor (the numbers are at
    DUTY_PERIOD_MS), so the default is 100 ms of every second; kernels
    that run between windows are not recorded, and the windows are sent so that the timeline
    can tell "not recorded" from "GPU idle". In continuous mode a window row is still sent
    every period, so a live timeline sees the recorded span grow.
    """

    def __init__(
        self, continuous: bool = False, period_ms: int = DUTY_PERIOD_MS, on_ms: int = DUTY_ON_MS
    ) -> None:
        self.continuous = continuous or on_ms >= period_ms
        self.period_ms = period_ms
        self.on_ms = min(on_ms, period_ms)

    @property
    def period_s(self) -> float:
        return self.period_ms / 1000

    @property
    def on_s(self) -> float:
        return self.on_ms / 1000

    def describe(self) -> dict:
        return {"continuous": self.continuous, "period_ms": self.period_ms, "on_ms": self.on_ms}

    @classmethod
    def parse(cls, body: dict, base: DutyCycle) -> tuple[DutyCycle | None, str]:
        """The cycle a START or SET body asks for (fields it leaves out keep `base`'s), or
        None and what is wrong with it. Only plain JSON values are read."""
        cont = body.get("continuous", base.continuous)
        period = body.get("period_ms", base.period_ms)
        on = body.get("on_ms", base.on_ms)
        if not isinstance(cont, bool):
            return None, "continuous must be true or false"
        for name, v in (("period_ms", period), ("on_ms", on)):
            if isinstance(v, bool) or not isinstance(v, int):
                return None, f"{name} must be an integer"
        if not MIN_ON_MS <= on <= period <= MAX_PERIOD_MS:
            return None, (
                f"duty cycle must satisfy {MIN_ON_MS} <= on_ms <= period_ms <= {MAX_PERIOD_MS} "
                f"(got on_ms={on}, period_ms={period})"
            )
        return cls(cont, period, on), ""


class PCConfig:
    """Whether PC sampling is asked for, and its range length and period (START/SET fields
    `pc_sampling`, `pc_on_ms`, `pc_period_ms`; fields left out keep the current values)."""

    def __init__(self, on: bool = False, on_ms: int = PC_ON_MS, period_ms: int = PC_PERIOD_MS):
        self.on, self.on_ms, self.period_ms = on, on_ms, period_ms

    def describe(self) -> dict:
        return {"on": self.on, "on_ms": self.on_ms, "period_ms": self.period_ms}

    @classmethod
    def parse(cls, body: dict, base: PCConfig) -> tuple[PCConfig | None, str]:
        on = body.get("pc_sampling", base.on)
        on_ms = body.get("pc_on_ms", base.on_ms)
        period = body.get("pc_period_ms", base.period_ms)
        if not isinstance(on, bool):
            return None, "pc_sampling must be true or false"
        for name, v in (("pc_on_ms", on_ms), ("pc_period_ms", period)):
            if isinstance(v, bool) or not isinstance(v, int):
                return None, f"{name} must be an integer"
        if not PC_MIN_ON_MS <= on_ms <= PC_MAX_ON_MS or not 2 * on_ms <= period <= MAX_PERIOD_MS:
            return None, (
                f"PC sampling must satisfy {PC_MIN_ON_MS} <= pc_on_ms <= {PC_MAX_ON_MS} and "
                f"2 * pc_on_ms <= pc_period_ms <= {MAX_PERIOD_MS} "
                f"(got pc_on_ms={on_ms}, pc_period_ms={period})"
            )
        return cls(on, on_ms, period), ""


def _reader_name(c: CuptiActivity | None) -> str:
    """How records are read: "raw buffers", "buffer" (cupti-python objects' memory, numpy),
    or "attributes" (one attribute at a time)."""
    if c is None or c.converter is None:
        return ""
    if c.mode == "raw":
        return "raw buffers"
    return "buffer" if c.converter.reader is not None else "attributes"


def _schema_version() -> int:
    return _schema().SCHEMA_VERSION


ENV_PKGS = "KDASH_AGENT_PKGS"


def _ensure_kdash() -> None:
    """Make `kdash.schema` and `kdash.collectors.agent.wire` importable, importing them late.

    They pull in numpy, so they are imported when the first client connects, never at start-up.
    When the target's interpreter has no kdash installed (`kdash run -- /other/python ...`), the
    three package folders that `kdash run` put in KDASH_AGENT_PKGS are mounted as bare packages
    (their `__init__` is not run) so the two modules load from kdash's own files.
    """
    try:
        import kdash.collectors.agent.wire

        import kdash.schema

        return
    except ImportError as first:
        dirs = os.environ.get(ENV_PKGS, "").split(os.pathsep)
        if len(dirs) != 3 or not all(os.path.isdir(d) for d in dirs):
            raise ImportError(
                f"kdash is not importable by {sys.executable} ({first}) and {ENV_PKGS} "
                "does not name its folders"
            ) from None
    import types

    names = ("kdash", "kdash.collectors", "kdash.collectors.agent")
    for name, d in zip(names, dirs, strict=True):
        mod = types.ModuleType(name)
        mod.__path__ = [d]
        mod.__package__ = name
        sys.modules[name] = mod
    import kdash.collectors.agent.wire

    import kdash.schema  # noqa: F401


def _wire() -> Any:
    _ensure_kdash()
    return sys.modules["kdash.collectors.agent.wire"]


def _schema() -> Any:
    _ensure_kdash()
    return sys.modules["kdash.schema"]


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
