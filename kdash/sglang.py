"""Watching a live SGLang server: finding it, describing it, and capturing through its profiler.

`kdash attach --sglang URL` (or `--pid` of any process of an SGLang server) lands here:

- **Finding it.** `discover_from_url` finds the process tree behind the URL (the listening
  root, its schedulers; `collectors.sglang_tree`) and asks `/get_server_info`, so a port that is
  not SGLang's, or a server that wants a key, is refused before any UI starts, in one line.
  `discover_from_pid` does the same from a pid and returns None when the pid's tree has no
  SGLang process (then it is a plain `attach --pid`); its URL is the root's listening TCP port.
- **Describing it.** `SglangRecorder.sglang_meta()` is what the server pane draws and what
  every capture's `meta["sglang"]` holds: URL, roles and titles, each scheduler's ranks and GPU
  (re-mapped from NVML's process list as soon as the store has one — NVML's pids beat the
  environment and the rank rule), and the server args a person checks first.
- **Capturing through the server.** With no kdash agent holding CUPTI in the schedulers, `c`
  also asks the server's own torch.profiler for a bounded number of forward steps
  (`/start_profile`, GPU activity, kdash's own folder and prefix), waits for every rank's
  trace (through /proc/PID/root when the server is in a container), reads it onto kdash's
  clock (`kdash.kineto`) and merges its kernels, API calls, copies and markers into the
  capture window the recorder writes. The blocking part (`run_server_job`) runs in the app's
  thread worker, or on the capture-writer thread when nobody ran it — never on the UI thread
  or the poll loop. Every failure the server can give (401, a profile already running, no
  forward step because no request came, no kernel because another CUPTI client held it) ends
  as the one-line capture failure; the host-side window is still saved, and the line says so.
  Asked to capture through the server while kdash's agents are connected (`C`), the agents are
  switched off first (so torch.profiler can have CUPTI) and back on after.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from kdash import schema
from kdash.collectors.base import ActiveAgents, PausableAgents
from kdash.collectors.sglang_http import (
    ServerCapture,
    SglangClient,
    SglangError,
    SglangMetricsSource,
    capture_via_server,
    new_prefix,
)
from kdash.collectors.sglang_tree import (
    SglangTree,
    UnsupportedServer,
    assign_gpus,
    classify_tree,
    path_in_process,
    tree_from_pid,
    tree_from_url,
)
from kdash.errors import UserError
from kdash.session import CaptureState, Recorder, RecorderOptions
from kdash.store import Store
from kdash.target import Target

log = logging.getLogger("kdash.sglang")

# Server args kept in meta["sglang"]["server"]: what tells two servers' captures apart.
SERVER_KEYS = (
    "version",
    "model_path",
    "served_model_name",
    "tp_size",
    "dp_size",
    "pp_size",
    "ep_size",
    "nnodes",
    "attention_backend",
    "prefill_attention_backend",
    "decode_attention_backend",
    "attn_cp_size",
    "moe_dp_size",
    "disaggregation_mode",
    "enable_metrics_for_all_schedulers",
    "disable_cuda_graph",
    "cuda_graph_max_bs",
    "enable_dp_attention",
    "enable_metrics",
    "chunked_prefill_size",
    "mem_fraction_static",
    "base_gpu_id",
    "gpu_id_step",
    "host",
    "port",
)
IMPORTED_TABLES = ("kernels", "api", "memcpy", "markers")
TREE_EVERY_S = 10.0  # how often the server's process tree is re-read


@dataclass
class SglangServer:
    """One server as found at start: its tree, URL (None when it has no HTTP port we can
    see), key, what `/get_server_info` said, and why not when it could not be asked."""

    tree: SglangTree
    url: str | None
    api_key: str | None = None
    server_info: dict[str, Any] = field(default_factory=dict)
    info_error: str = ""
    admin_api_key: str | None = None
    # SGLANG_PROFILE_V2 in the server's environment: True/False, None when unreadable.
    profile_v2: bool | None = None

    def client(self, timeout_s: float = 5.0) -> SglangClient | None:
        if not self.url:
            return None
        return SglangClient(self.url, self.api_key, timeout_s, admin_api_key=self.admin_api_key)


def server_summary(info: dict[str, Any]) -> dict[str, Any]:
    return {k: info[k] for k in SERVER_KEYS if k in info}


_TRUE = ("1", "true", "yes", "on")


def profile_v2_of(tree: SglangTree) -> bool | None:
    """Whether the server runs SGLang's V2 profiler (SGLANG_PROFILE_V2 in its root's
    environment; the schedulers inherit it). None when no environment could be read."""
    from kdash.collectors.sglang_tree import read_environ

    pids = [p.pid for p in ([tree.root] if tree.root else []) + tree.others if p.role == "root"]
    for pid in pids:
        env = read_environ(pid)
        if env:
            return env.get("SGLANG_PROFILE_V2", "").strip().lower() in _TRUE
    return None


def discover_from_url(
    url: str, api_key: str | None = None, admin_api_key: str | None = None
) -> SglangServer:
    """The tree behind `url` and its server info; one-line UserError when it is not an SGLang
    server. A server that wants a key for /server_info but answers /health (which never
    wants one) is watched without its info: /metrics needs no key either."""
    tree = tree_from_url(url)
    client = SglangClient(url, api_key=api_key, timeout_s=5.0, admin_api_key=admin_api_key)
    info: dict[str, Any] = {}
    info_error = ""
    try:
        info = client.get_server_info()
    except SglangError as e:
        if e.kind == "not_found":
            raise UserError(
                f"{client.base} has no /server_info: is this an SGLang server's HTTP port?"
            ) from None
        if e.kind != "unauthorized" or client.health() != 200:
            raise
        info_error = str(e)
    assign_gpus(tree, info)
    return SglangServer(
        tree=tree,
        url=client.base,
        api_key=api_key,
        server_info=info,
        info_error=info_error,
        admin_api_key=admin_api_key,
        profile_v2=profile_v2_of(tree),
    )


def listening_urls(pid: int, cmdline: list[str] | None = None) -> list[str]:
    """http URLs of the TCP ports `pid` listens on, the one named by `--port` first."""
    try:
        conns = psutil.Process(pid).net_connections(kind="tcp")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    wanted: int | None = None
    cmd = cmdline or []
    for i, a in enumerate(cmd):
        if a == "--port" and i + 1 < len(cmd) and cmd[i + 1].isdigit():
            wanted = int(cmd[i + 1])
        elif a.startswith("--port=") and a[7:].isdigit():
            wanted = int(a[7:])
    found: list[tuple[bool, int, str]] = []
    for c in conns:
        if c.status != psutil.CONN_LISTEN or not c.laddr:
            continue
        ip = c.laddr.ip
        host = "127.0.0.1" if ip in ("0.0.0.0", "::", "") else ip
        if ":" in host:
            host = "[::1]" if host in ("::", "::1") else f"[{host}]"
        found.append((c.laddr.port != wanted, c.laddr.port, f"http://{host}:{c.laddr.port}"))
    return [u for _, _, u in sorted(set(found))]


def discover_from_pid(
    pid: int, api_key: str | None = None, admin_api_key: str | None = None
) -> SglangServer | None:
    """The SGLang server `pid` belongs to, or None when its tree has no SGLang process."""
    try:
        tree = tree_from_pid(pid)
    except UnsupportedServer:
        raise
    except UserError:
        return None
    if tree.root is None:
        return None
    root_cmd: list[str] = []
    try:
        root_cmd = psutil.Process(tree.root.pid).cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied) as e:
        log.info("cannot read the command line of pid %s (no --port hint): %s", tree.root.pid, e)
    server = SglangServer(
        tree=tree,
        url=None,
        api_key=api_key,
        admin_api_key=admin_api_key,
        profile_v2=profile_v2_of(tree),
    )
    errors = []
    # A wrapper (a shell script, `kdash run`) above the server is the tree's root; the HTTP
    # port is then held by the real launch_server process below it.
    urls = listening_urls(tree.root.pid, root_cmd)
    for p in tree.others:
        if p.role == "root":
            urls += listening_urls(p.pid, p.title.split())
    for url in urls:
        client = SglangClient(url, api_key=api_key, timeout_s=3.0, admin_api_key=admin_api_key)
        try:
            server.server_info = client.get_server_info()
        except SglangError as e:
            errors.append(str(e))
            if e.kind in ("unauthorized", "timeout"):
                server.url = client.base  # it is the server; metrics will say what is wrong
            continue
        server.url = client.base
        break
    if server.url is None:
        server.info_error = (
            errors[0]
            if errors
            else (f"the server's root (pid {tree.root.pid}) listens on no TCP port kdash can see")
        )
    elif not server.server_info and errors:
        server.info_error = errors[0]
    assign_gpus(tree, server.server_info)
    return server


def starting_server(pid: int, cmd: list[str]) -> SglangServer | None:
    """The server `kdash run` just started, when `cmd` is an SGLang launch; None otherwise.

    Nothing is asked yet (the server needs seconds to minutes to load its model): the URL is
    taken from `--host`/`--port` (SGLang's defaults 127.0.0.1:30000), the metrics source
    retries until the server answers and then reads `/server_info`, and the recorder's
    tree re-read finds the schedulers once they are spawned.
    """
    from kdash.collectors.sglang_tree import (
        DEFAULT_PORT,
        ROLE_ROOT,
        SglangProcess,
        is_root_cmdline,
    )

    if not is_root_cmdline(cmd):
        return None
    port, host = DEFAULT_PORT, "127.0.0.1"
    for i, a in enumerate(cmd[:-1]):
        if a == "--port" and cmd[i + 1].isdigit():
            port = int(cmd[i + 1])
        elif a == "--host" and cmd[i + 1] not in ("0.0.0.0", "::", ""):
            host = cmd[i + 1]
    for a in cmd:
        if a.startswith("--port=") and a[7:].isdigit():
            port = int(a[7:])
    tree = SglangTree(root=SglangProcess(pid, os.getpid(), ROLE_ROOT, " ".join(cmd)))
    host = f"[{host}]" if ":" in host else host
    v2 = os.environ.get("SGLANG_PROFILE_V2", "").strip().lower() in _TRUE  # it inherits ours
    return SglangServer(tree=tree, url=f"http://{host}:{port}", profile_v2=v2)


@dataclass
class ServerCaptureOptions:
    """How `c` profiles through the server. `server_dir` is the folder as the server names it
    (inside its container, if any); by default `/tmp/kdash-sglang-UID` with the uid the
    server's scheduler runs as: the server creates it (SGLang's profiler makes its output
    folder), so it is the server's own and two users never share one."""

    num_steps: int = 20
    # CPU too: the step annotations (markers) come from CPU activity; stacks and shapes,
    # the costly part, are off.
    activities: tuple[str, ...] = ("CPU", "GPU")
    server_dir: str | None = None
    timeout_s: float = 60.0
    stable_s: float = 1.0
    keep_traces: bool = False  # the capture holds their rows; the .gz files are removed


@dataclass
class ServerJob:
    """One capture through the server, for the capture window with sequence number `seq`."""

    seq: int
    prefix: str
    phase: str = "pending"  # pending | pausing agents | profiling | done | failed
    result: ServerCapture | None = None
    error: str = ""
    paused_agents: list[int] = field(default_factory=list)
    server_dir: str = ""
    done: threading.Event = field(default_factory=threading.Event)
    _claim: threading.Lock = field(default_factory=threading.Lock)
    _claimed: bool = False

    def claim(self) -> bool:
        """True for the one caller that gets to run the job (the app's worker or the writer)."""
        with self._claim:
            if self._claimed:
                return False
            self._claimed = True
            return True

    def failure(self) -> str:
        """The one-line reason the server gave no kernels; "" when it did."""
        if self.error:
            return self.error
        if self.result is not None and self.result.note:
            return self.result.note
        if not self.done.is_set():
            return "the server's profile did not finish in time"
        return ""

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "via": "server /start_profile",
            "prefix": self.prefix,
            "phase": self.phase,
            "agents_paused": self.paused_agents,
            "server_dir": self.server_dir,
        }
        if self.error:
            out["error"] = self.error
        if self.result is not None:
            out["files"] = [str(f) for f in self.result.files]
            out["kernels"] = int(schema.batch_len(self.result.tables["kernels"]))
            if self.result.note:
                out["note"] = self.result.note
            if self.result.missing:
                out["missing_ranks"] = self.result.missing
                out["partial"] = self.result.partial
        return out


class SglangRecorder(Recorder):
    """The Recorder for an SGLang target: `meta["sglang"]` in every capture, and `c` through
    the server's profiler (see the module docstring)."""

    def __init__(
        self,
        sources: list,
        store: Store,
        target: Target | None,
        options: RecorderOptions | None,
        server: SglangServer,
        capture_options: ServerCaptureOptions | None = None,
        on_event: Callable[[str, object], None] | None = None,
    ) -> None:
        super().__init__(sources, store, target, options, on_event)
        self.server = server
        self.capture_opts = capture_options or ServerCaptureOptions()
        self.metrics: SglangMetricsSource | None = next(
            (s for s in sources if isinstance(s, SglangMetricsSource)), None
        )
        self.agents = next((s for s in sources if s.name == "agent"), None)
        self.server_job: ServerJob | None = None
        self._meta_cache: tuple[float, dict[str, Any]] | None = None
        self._tree_at = time.monotonic()
        self.tree_every_s = TREE_EVERY_S
        self._meta_lock = threading.Lock()

    # -- the server's description -----------------------------------------------------------
    def sglang_meta(self, max_age_s: float = 2.0) -> dict[str, Any]:
        """The server as the pane and captures show it (cached `max_age_s`: the pane asks on
        every redraw, and a fresh one reads /proc of every scheduler)."""
        with self._meta_lock:
            now = time.monotonic()
            if self._meta_cache is not None and now - self._meta_cache[0] < max_age_s:
                return self._meta_cache[1]
            info = dict(self.server.server_info)
            if self.metrics is not None and self.metrics.server_info:
                info.update(self.metrics.server_info)
            self._refresh_tree(now)
            tree = assign_gpus(self.server.tree, info, self._nvml_pids())
            meta = describe(self.server, tree, info)
            if self.metrics is not None:
                meta["metrics"] = self.metrics.mode or self.metrics.last_mode or "not read yet"
                if self.metrics.info_error and not info:
                    meta["server_error"] = self.metrics.info_error
            self._meta_cache = (now, meta)
            return meta

    def _refresh_tree(self, now: float) -> None:
        """Re-read the tree every `tree_every_s`: schedulers come up after the root on a
        starting server, and a crashed one is replaced with a new pid."""
        root = self.server.tree.root
        every = self.tree_every_s if self.server.tree.schedulers else min(2.0, self.tree_every_s)
        if root is None or now - self._tree_at < every:
            return
        self._tree_at = now
        try:
            fresh = classify_tree(root.pid)
        except UserError as e:  # the root is gone: keep the last tree, the status bar says so
            log.info("server tree not re-read: %s", e)
            return
        if fresh.schedulers or not self.server.tree.schedulers:
            fresh.root_recognized = self.server.tree.root_recognized
            self.server.tree = fresh

    def _nvml_pids(self) -> dict[int, list[int]]:
        """GPU -> pids holding a context there, from the newest gpu_procs rows."""
        procs = self.store.get("gpu_procs")
        if schema.batch_len(procs) == 0:
            return {}
        newest = int(procs["t_ns"].max())
        recent = procs["t_ns"] >= newest - int(5e9)
        out: dict[int, set[int]] = {}
        for g, p in zip(procs["gpu"][recent], procs["pid"][recent], strict=True):
            out.setdefault(int(g), set()).add(int(p))
        return {g: sorted(p) for g, p in out.items()}

    def build_meta(self, start_ns: int, end_ns: int, trigger_ns: int | None = None) -> dict:
        meta = super().build_meta(start_ns, end_ns, trigger_ns)
        meta["sglang"] = dict(self.sglang_meta(max_age_s=0.0))
        job = self._job_for(self.capture.seq)
        if job is not None and trigger_ns is not None:
            meta["sglang"]["capture"] = job.summary()
            if job.result is not None:
                from kdash.kineto import build_meta as kineto_meta

                meta["traces"] = kineto_meta(job.result.traces, self.wall_offset_ns)["traces"]
        return meta

    # -- capture through the server ---------------------------------------------------------
    def agents_active(self) -> list[int]:
        agents = self.agents
        return list(agents.active_pids()) if isinstance(agents, ActiveAgents) else []

    def trigger_capture(
        self,
        pre_s: float | None = None,
        post_s: float | None = None,
        via_server: bool | None = None,
    ) -> bool:
        """A capture window; through the server too when `via_server`, or (None) when the
        server has a URL and no kdash agent is active in its processes."""
        if not super().trigger_capture(pre_s, post_s):
            return False
        if via_server is None:
            via_server = self.server.url is not None and not self.agents_active()
        if via_server and self.server.url is None:
            self.server_job = ServerJob(seq=self.capture.seq, prefix="")
            self.server_job.error = f"no HTTP port of the server found ({self.server.info_error})"
            self.server_job.phase = "failed"
            self.server_job.claim()
            self.server_job.done.set()
        elif via_server:
            self.server_job = ServerJob(seq=self.capture.seq, prefix=new_prefix())
        return True

    def _job_for(self, seq: int) -> ServerJob | None:
        job = self.server_job
        return job if job is not None and job.seq == seq else None

    def capture_detail(self) -> str:
        """What the status bar adds to the capture state while the server profiles."""
        job = self._job_for(self.capture.seq)
        if job is not None and self.capture.phase == "saved" and job.result is not None:
            return job.result.partial  # which ranks had no step, or ""
        if job is None or self.capture.phase not in ("recording", "writing"):
            return ""
        if job.phase in ("pending", "profiling"):
            n = len(self.server.tree.schedulers) or 1
            return f"server profiling {self.capture_opts.num_steps} steps, {n} rank(s)"
        if job.phase == "pausing agents":
            return "pausing kdash's agents for the server's profiler"
        return ""

    def run_server_job(self, job: ServerJob) -> None:
        """Blocking: /start_profile, wait for every rank's trace, read it. Never raises; the
        outcome is in `job`. Call from a worker thread (the app's) or the writer thread."""
        if not job.claim():
            job.done.wait(self.capture_opts.timeout_s + 30)
            return
        paused: list[int] = []
        agents = self.agents
        try:
            if isinstance(agents, PausableAgents) and agents.agents:
                job.phase = "pausing agents"
                paused = agents.pause()
                job.paused_agents = paused
                time.sleep(0.3)  # each agent turns CUPTI off when its client goes
            job.phase = "profiling"
            client = self.server.client(timeout_s=10.0)
            if client is None:
                raise UserError("no HTTP port of the server found")
            scheds = self.server.tree.schedulers
            where = scheds[0].pid if scheds else (self.target.pid if self.target else 0)
            opts = self.capture_opts
            server_dir = opts.server_dir or f"/tmp/kdash-sglang-{_uid_of(where)}"
            # Not created here: made by kdash it could belong to another user than the
            # server's (kdash as root), and the server could not write its traces into it.
            local = path_in_process(where, server_dir) if where else Path(server_dir)
            job.server_dir = server_dir
            expect = [(s.ranks.dp, s.ranks.tp, s.ranks.pp) for s in scheds if s.ranks is not None]
            job.result = capture_via_server(
                client,
                ranks=max(1, len(scheds)),
                server_dir=server_dir,
                local_dir=str(local),
                wall_offset_ns=self.wall_offset_ns,
                num_steps=opts.num_steps,
                activities=opts.activities,
                timeout_s=opts.timeout_s,
                stable_s=opts.stable_s,
                prefix=job.prefix,
                profile_v2=self.server.profile_v2,
                expect=expect,
            )
            job.phase = "done"
        except UserError as e:
            job.error = str(e)
            job.phase = "failed"
        except Exception as e:
            log.exception("capture through the server failed")
            job.error = f"{type(e).__name__}: {e}"
            job.phase = "failed"
        finally:
            if paused and isinstance(agents, PausableAgents):
                agents.resume()
            job.done.set()

    def write_window(
        self,
        start_ns: int,
        end_ns: int,
        path: Path,
        trigger_ns: int | None = None,
        extra_meta: dict | None = None,
    ) -> Path:
        job = self._job_for(self.capture.seq) if trigger_ns is not None else None
        if job is None or job.result is None:
            return super().write_window(start_ns, end_ns, path, trigger_ns, extra_meta)
        from kdash.capture import write_capture

        imported = job.result.tables
        # The profiled steps may end after the window: widen it to hold every imported row.
        for t in IMPORTED_TABLES:
            b = imported[t]
            if schema.batch_len(b):
                start_ns = min(start_ns, int(b["start_ns"].min()))
                end_ns = max(end_ns, int(b["end_ns"].max()))
        tables = {t: self.store.get(t, start_ns, end_ns) for t in schema.TABLES if t != "findings"}
        for t in IMPORTED_TABLES:
            tables[t] = schema.concat(t, [tables[t], imported[t]])
        tables["findings"] = schema.from_frame("findings", self.compute_findings(start_ns, end_ns))
        meta = self.build_meta(start_ns, end_ns, trigger_ns)
        meta.update(extra_meta or {})
        written = write_capture(path, meta, tables)
        if not self.capture_opts.keep_traces:
            for f in job.result.files:
                try:
                    Path(f).unlink()
                except OSError as e:
                    log.info("could not remove %s: %s", f, e)
        return written

    def _before_write(self, cap: CaptureState) -> None:
        """Wait for the server's traces (if this capture asked for them) before the window
        is cut; a server-side failure then makes the capture "failed" with its one line,
        the host window still saved (see `_extra_failure`)."""
        job = self._job_for(cap.seq)
        if job is not None:
            self.run_server_job(job)  # a no-op wait when the app's worker has it already
            job.done.wait(self.capture_opts.timeout_s + 30)

    def _extra_failure(self, cap: CaptureState) -> str:
        job = self._job_for(cap.seq)
        return job.failure() if job is not None else ""


def _uid_of(pid: int) -> int:
    """The real uid `pid` runs as (ours when it cannot be read)."""
    try:
        return psutil.Process(pid).uids().real
    except (psutil.Error, ValueError):
        return os.getuid()


def describe(server: SglangServer, tree: SglangTree, info: dict[str, Any]) -> dict[str, Any]:
    """JSON-ready description of the server for meta["sglang"] and the server pane."""
    d = tree.describe()
    d["url"] = server.url
    d["roles"] = [
        {"pid": p.pid, "role": p.role, "title": p.title[:120], "label": p.label()}
        for p in tree.processes()
    ]
    for s, row in zip(tree.schedulers, d["schedulers"], strict=True):
        if s.gpu is not None and s.gpu.note:
            row["gpu_note"] = s.gpu.note
    d["server"] = server_summary(info)
    if server.info_error:
        d["server_error"] = server.info_error
    return d
