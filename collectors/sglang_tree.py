"""What an SGLang server is made of: its process tree, each process's role and ranks, each
scheduler's GPU.

Why it is built this way:

- **Titles, not names.** SGLang renames its child processes with `setproctitle`:
  `sglang::scheduler` plus rank tokens (`_DP{d}`, `_PP{p}`, `_ATTN_CP{c}`, `_MOE_DP{m}`,
  `_TP{n}`, `_EP{e}`, `_NP{node}`; 0.5.10's `configure_scheduler` writes them in that order),
  `sglang::detokenizer`, `sglang::data_parallel_controller`. The kernel's `comm` (psutil's
  `name()`) is cut at 15 characters (`sglang::schedul`), so the title is read from `cmdline()`.
  The order of the rank tokens changed between SGLang versions (`_DP0_TP1`, `_TP1_DP0`,
  `_DP0_PP1_TP2_EP0`) and the TP token is left out when `tp_size == 1`, so tokens are read in
  any order and a missing TP means rank 0. A token is a whole `_`-separated word, so
  `_MOE_DP1` is never read as `DP1`.
- **Not supported**, said rather than misread: SGLang's diffusion server (`sgl_diffusion::`
  titles), `--grpc-mode` (no HTTP API) and `--use-ray` (schedulers are Ray actors, not
  children of the server).
- **The root** is the process that runs `python -m sglang.launch_server` or `sglang serve`
  (HTTP server and tokenizer); it keeps its real command line.
- **GPU of a scheduler**, best source first:
  1. NVML's process list (`nvml_pids`: GPU index -> pids holding a context there, already
     translated to this /proc's pid namespace — the NVML collector's `PidMap` does that);
  2. SGLang's own rule, `gpu_id = base_gpu_id + dp * tp_size * pp_size * gpu_id_step +
     pp_rank * tp_per_node + tp_rank * gpu_id_step` (the DP offset only without DP attention;
     checked by running 0.5.10's `DataParallelController` launch code on a CPU), taken through
     `CUDA_VISIBLE_DEVICES` read from `/proc/PID/environ` when set;
  3. the same rule without `CUDA_VISIBLE_DEVICES` (says "rank" as its source).
  `base_gpu_id`, `gpu_id_step`, `tp_size`, `pp_size`, `dp_size` and `enable_dp_attention`
  come from `/get_server_info` when given; without it the sizes are inferred from the ranks seen.
- **From a URL**: the pid that listens on the URL's port on this machine (psutil, else
  `/proc/net/tcp{,6}` and the socket inodes under `/proc/PID/fd`), then up to the root.
- **From a pid**: up through the parents while they are SGLang processes, then the root's
  descendants.

Nothing here needs privileges beyond reading /proc of the same user; what cannot be read is
said in `GpuAssignment.note`, never raised.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil

from kdash.errors import UserError

TITLE_PREFIX = "sglang::"
DEFAULT_PORT = 30000

ROLE_ROOT = "root"
ROLE_SCHEDULER = "scheduler"
ROLE_DETOKENIZER = "detokenizer"
ROLE_DP_CONTROLLER = "dp_controller"
ROLE_TOKENIZER = "tokenizer"
ROLE_OTHER = "other"
ROLE_UNSUPPORTED = "unsupported"

DIFFUSION_PREFIX = "sgl_diffusion::"
_RANK_TOKEN = re.compile(r"(?:^|_)(ATTN_CP|MOE_DP|TP|DP|PP|EP|NP)(\d+)(?=_|$)")
_RANK_FIELDS = {"TP": "tp", "DP": "dp", "PP": "pp", "EP": "ep", "NP": "node"}
_RANK_FIELDS.update({"ATTN_CP": "attn_cp", "MOE_DP": "moe_dp"})
# Launch flags whose servers kdash cannot watch as SGLang servers, and why.
UNSUPPORTED_FLAGS = {
    "--grpc-mode": "gRPC mode (no HTTP API to read)",
    "--use-ray": "Ray mode (the schedulers are Ray actors, not the server's children)",
}
_ROOT_MODULES = ("sglang.launch_server", "sglang.srt.server", "sglang.launch")


class UnsupportedServer(UserError):
    """An SGLang server of a kind kdash does not read (diffusion, gRPC, Ray)."""


@dataclass(frozen=True)
class Ranks:
    """A scheduler's parallel ranks; None where the title did not carry that rank."""

    tp: int = 0
    dp: int | None = None
    pp: int | None = None
    ep: int | None = None
    node: int | None = None
    attn_cp: int | None = None
    moe_dp: int | None = None

    def label(self) -> str:
        """Short label for a narrow column, e.g. `TP3`, `DP1 TP0`, `PP1 TP2`, `MOE_DP1 TP2`."""
        parts = []
        if self.dp is not None:
            parts.append(f"DP{self.dp}")
        if self.pp is not None:
            parts.append(f"PP{self.pp}")
        if self.attn_cp is not None:
            parts.append(f"CP{self.attn_cp}")
        if self.moe_dp is not None:
            parts.append(f"MOE_DP{self.moe_dp}")
        parts.append(f"TP{self.tp}")
        if self.ep is not None:
            parts.append(f"EP{self.ep}")
        return " ".join(parts)

    def sort_key(self) -> tuple[int, int, int, int]:
        return (self.node or 0, self.dp or 0, self.pp or 0, self.tp)


@dataclass(frozen=True)
class GpuAssignment:
    """Which GPU a scheduler runs on and how we know. `gpu` is the physical NVML index when
    known (None if not); `visible_device` is the raw CUDA_VISIBLE_DEVICES entry (may be a UUID)."""

    gpu: int | None
    source: str  # "nvml" | "env" | "rank" | ""
    visible_device: str | None = None
    note: str = ""


@dataclass
class SglangProcess:
    pid: int
    ppid: int
    role: str
    title: str
    ranks: Ranks | None = None
    gpu: GpuAssignment | None = None

    def label(self) -> str:
        if self.role == ROLE_SCHEDULER and self.ranks is not None:
            return self.ranks.label()
        return self.role


@dataclass
class SglangTree:
    """One SGLang server as seen from this machine."""

    root: SglangProcess | None
    schedulers: list[SglangProcess] = field(default_factory=list)
    detokenizer: SglangProcess | None = None
    dp_controller: SglangProcess | None = None
    others: list[SglangProcess] = field(default_factory=list)
    # False when the root is only "the pid we were given" (a wrapper), not a launch_server.
    root_recognized: bool = True
    # Set when this is an SGLang server kdash cannot watch (diffusion, gRPC, Ray): why.
    unsupported: str = ""

    def processes(self) -> list[SglangProcess]:
        out = [self.root] if self.root else []
        out += self.schedulers
        out += [p for p in (self.dp_controller, self.detokenizer) if p is not None]
        return out + self.others

    def pids(self) -> list[int]:
        return [p.pid for p in self.processes()]

    def scheduler_by_pid(self) -> dict[int, SglangProcess]:
        return {p.pid: p for p in self.schedulers}

    def tp_size(self) -> int:
        return len({p.ranks.tp for p in self.schedulers if p.ranks}) or 0

    def describe(self) -> dict:
        """JSON-ready summary for capture metadata and the status bar."""
        return {
            "root": self.root.pid if self.root else None,
            "schedulers": [
                {
                    "pid": p.pid,
                    "title": p.title,
                    "ranks": p.ranks.label() if p.ranks else "",
                    "gpu": p.gpu.gpu if p.gpu else None,
                    "gpu_source": p.gpu.source if p.gpu else "",
                }
                for p in self.schedulers
            ],
            "detokenizer": self.detokenizer.pid if self.detokenizer else None,
            "dp_controller": self.dp_controller.pid if self.dp_controller else None,
        }


# -- titles -------------------------------------------------------------------------------
def _title_text(cmdline: Iterable[str]) -> str:
    """The process title as one string: setproctitle may leave padding or split on spaces."""
    return " ".join(s for s in cmdline if s).strip()


def parse_ranks(suffix: str) -> Ranks:
    """Rank tokens in any order: `_DP0_PP1_MOE_DP1_TP2_EP0`, `_TP3`, `` (tp_size 1: rank 0)."""
    found: dict[str, int] = {}
    for kind, num in _RANK_TOKEN.findall(suffix.lstrip("_")):
        found.setdefault(_RANK_FIELDS[kind], int(num))
    return Ranks(tp=found.pop("tp", 0), **found)


def unsupported_launch(cmdline: list[str]) -> str:
    """Why a launch command's server cannot be watched ("" when it can)."""
    for arg in cmdline:
        why = UNSUPPORTED_FLAGS.get(arg.split("=", 1)[0])
        if why:
            return why
    return ""


def is_root_cmdline(cmdline: list[str]) -> bool:
    """`python -m sglang.launch_server ...`, `sglang serve ...`, `.../sglang/launch_server.py`."""
    for i, arg in enumerate(cmdline):
        nxt = cmdline[i + 1] if i + 1 < len(cmdline) else ""
        if arg == "-m" and nxt in _ROOT_MODULES:
            return True
        if os.path.basename(arg) == "sglang" and nxt == "serve":
            return True
        if arg.replace(os.sep, "/").endswith("sglang/launch_server.py"):
            return True
    return False


def classify_cmdline(cmdline: list[str]) -> tuple[str, str, Ranks | None] | None:
    """(role, title, ranks) for one process's cmdline; None when it is not an SGLang process."""
    text = _title_text(cmdline)
    if text.startswith(DIFFUSION_PREFIX):
        return ROLE_UNSUPPORTED, text.split()[0], None
    if text.startswith(TITLE_PREFIX):
        title = text.split()[0]
        rest = title[len(TITLE_PREFIX) :]
        if rest.startswith("scheduler"):
            return ROLE_SCHEDULER, title, parse_ranks(rest[len("scheduler") :])
        if rest.startswith("detokenizer"):
            return ROLE_DETOKENIZER, title, None
        if rest.startswith("data_parallel_controller"):
            return ROLE_DP_CONTROLLER, title, None
        if "tokenizer" in rest or rest.startswith("http_server"):
            return ROLE_TOKENIZER, title, None
        return ROLE_OTHER, title, None
    if is_root_cmdline(cmdline):
        return ROLE_ROOT, text, None
    return None


def _proc_info(p: psutil.Process) -> tuple[int, list[str]] | None:
    try:
        with p.oneshot():
            return p.ppid(), p.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return p.ppid(), []


def classify_tree(root_pid: int) -> SglangTree:
    """Classify `root_pid` and all its descendants. UserError if the pid is gone."""
    try:
        root = psutil.Process(root_pid)
        kids = root.children(recursive=True)
    except psutil.NoSuchProcess:
        raise UserError(f"no such process: {root_pid}") from None
    except psutil.AccessDenied:
        raise UserError(f"cannot read process {root_pid}: permission denied") from None
    tree = SglangTree(root=None)
    for p in [root, *kids]:
        info = _proc_info(p)
        if info is None:
            continue
        ppid, cmd = info
        cls = classify_cmdline(cmd)
        if cls is None:
            if p.pid == root_pid:
                # The pid we were given is the root even if it does not look like one
                # (a wrapper script, `kdash run -- python my_launcher.py`).
                tree.root = SglangProcess(p.pid, ppid, ROLE_ROOT, _title_text(cmd))
                tree.root_recognized = False
            continue
        role, title, ranks = cls
        proc = SglangProcess(p.pid, ppid, role, title, ranks)
        if role == ROLE_UNSUPPORTED:
            tree.unsupported = tree.unsupported or (
                f"SGLang's diffusion server ({title}) is not supported"
            )
        elif role == ROLE_ROOT and unsupported_launch(cmd):
            tree.unsupported = f"SGLang in {unsupported_launch(cmd)} is not supported"
        if role == ROLE_ROOT and tree.root is None:
            tree.root = proc
        elif role == ROLE_SCHEDULER:
            tree.schedulers.append(proc)
        elif role == ROLE_DETOKENIZER and tree.detokenizer is None:
            tree.detokenizer = proc
        elif role == ROLE_DP_CONTROLLER and tree.dp_controller is None:
            tree.dp_controller = proc
        else:
            tree.others.append(proc)
    tree.schedulers.sort(key=lambda s: (s.ranks or Ranks()).sort_key())
    return tree


def find_root(pid: int) -> int:
    """The SGLang root above `pid` (or `pid` itself): walk up while parents are SGLang's."""
    try:
        proc = psutil.Process(pid)
    except psutil.NoSuchProcess:
        raise UserError(f"no such process: {pid}") from None
    best = pid
    found_sglang = False
    cur: psutil.Process | None = proc
    while cur is not None and cur.pid > 1:
        info = _proc_info(cur)
        if info is None:
            break
        cls = classify_cmdline(info[1])
        if cls is not None:
            found_sglang = True
            best = cur.pid
            if cls[0] == ROLE_ROOT:
                return cur.pid
        elif found_sglang:
            break  # left the SGLang part of the tree
        try:
            cur = cur.parent()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            break
    return best


def tree_from_pid(pid: int) -> SglangTree:
    """The whole server around `pid`; UserError when no SGLang process is there."""
    root = find_root(pid)
    tree = classify_tree(root)
    if tree.unsupported:
        raise UnsupportedServer(f"{tree.unsupported}: kdash reads SGLang's HTTP server only")
    if not tree.schedulers and not tree.root_recognized:
        raise UserError(
            f"process {pid} is not part of an SGLang server (no sglang::scheduler process "
            "in its tree)"
        )
    return tree


# -- URL -> pid ----------------------------------------------------------------------------
def parse_url(url: str) -> tuple[str, int]:
    """(host, port) of an SGLang URL; `host:port` without a scheme is accepted."""
    text = url.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as e:
        raise UserError(f"not a URL: {url!r} ({e})") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"not an http URL: {url!r} (e.g. http://127.0.0.1:30000)")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    return parts.hostname, port


def _local_addresses() -> set[str]:
    addrs = {"0.0.0.0", "::", "127.0.0.1", "::1"}
    try:
        for entries in psutil.net_if_addrs().values():
            for a in entries:
                if a.family in (socket.AF_INET, socket.AF_INET6):
                    addrs.add(a.address.split("%")[0])
    except OSError:
        pass
    return addrs


def is_local_host(host: str) -> bool:
    """True when `host` names this machine (loopback, one of its addresses, its hostname)."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    local = _local_addresses()
    for info in infos:
        addr = info[4][0].split("%")[0]
        try:
            if ipaddress.ip_address(addr).is_loopback:
                return True
        except ValueError:
            continue
        if addr in local:
            return True
    return False


def _listen_inodes(port: int, proc_root: Path) -> set[int]:
    """Socket inodes in LISTEN state on `port`, from /proc/net/tcp and tcp6."""
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_root / "net" / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            cols = line.split()
            if len(cols) < 10 or cols[3] != "0A":  # 0A = TCP_LISTEN
                continue
            try:
                if int(cols[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(int(cols[9]))
            except (ValueError, IndexError):
                continue
    return inodes


def _pids_with_inodes(inodes: set[int], proc_root: Path) -> list[int]:
    targets = {f"socket:[{i}]" for i in inodes}
    out = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(fd) in targets:
                    out.append(int(entry.name))
                    break
            except OSError:
                continue
    return sorted(out)


def listening_pids(port: int, proc_root: Path = Path("/proc")) -> list[int]:
    """Pids of the processes that listen on TCP `port` here (ours, or all when root)."""
    pids: set[int] = set()
    try:
        for c in psutil.net_connections(kind="tcp"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                pids.add(c.pid)
    except (psutil.AccessDenied, OSError):
        pass
    if pids:
        return sorted(pids)
    inodes = _listen_inodes(port, proc_root)
    return _pids_with_inodes(inodes, proc_root) if inodes else []


def tree_from_url(url: str, proc_root: Path = Path("/proc")) -> SglangTree:
    """The server behind `url`, which must be on this machine (kdash runs where the GPUs are)."""
    host, port = parse_url(url)
    if not is_local_host(host):
        raise UserError(
            f"{host} is not this machine: run kdash on the server's host (over SSH) "
            f"and give --sglang http://127.0.0.1:{port}"
        )
    pids = listening_pids(port, proc_root)
    if not pids:
        if _listen_inodes(port, proc_root):
            raise UserError(
                f"port {port} is listened on by a process kdash cannot see (another user's): "
                "run kdash as that user, or as root"
            )
        raise UserError(
            f"no process here listens on port {port} (is the server up? if it runs in a "
            "container with its own network, give --pid of its root process)"
        )
    for pid in pids:
        try:
            return tree_from_pid(pid)
        except UnsupportedServer:
            raise
        except UserError:
            continue
    raise UserError(f"the process listening on port {port} (pid {pids[0]}) is not an SGLang server")


# -- GPUs ----------------------------------------------------------------------------------
def read_environ(pid: int, proc_root: Path = Path("/proc")) -> dict[str, str] | None:
    """A process's environment, or None when /proc/PID/environ cannot be read."""
    from kdash.target import read_environ as _read

    try:
        return _read(pid, proc_root)
    except OSError:
        return None


def local_gpu_id(ranks: Ranks, info: Mapping[str, object]) -> int:
    """SGLang's own rank -> device-ordinal rule for one node (see module docstring)."""

    def num(key: str, default: int) -> int:
        v = info.get(key, default)
        try:
            return int(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            return default

    tp_size = max(num("tp_size", 1), 1)
    pp_size = max(num("pp_size", 1), 1)
    nnodes = max(num("nnodes", 1), 1)
    tp_per_node = max(tp_size // max(nnodes // pp_size, 1), 1)
    pp_per_node = max(pp_size // nnodes, 1)
    gid = num("base_gpu_id", 0)
    if ranks.dp is not None and num("dp_size", 1) > 1 and not info.get("enable_dp_attention"):
        gid += ranks.dp * tp_size * pp_size * num("gpu_id_step", 1)
    gid += ((ranks.pp or 0) % pp_per_node) * tp_per_node
    gid += (ranks.tp % tp_per_node) * num("gpu_id_step", 1)
    return gid


def assign_gpus(
    tree: SglangTree,
    server_info: Mapping[str, object] | None = None,
    nvml_pids: Mapping[int, Collection[int]] | None = None,
    proc_root: Path = Path("/proc"),
) -> SglangTree:
    """Fill `gpu` of every scheduler in place (and return the tree); never raises."""
    info: dict[str, object] = dict(server_info or {})
    ranks = [s.ranks for s in tree.schedulers if s.ranks]
    if "tp_size" not in info and ranks:
        info["tp_size"] = max(r.tp for r in ranks) + 1
    if "pp_size" not in info and ranks:
        info["pp_size"] = max((r.pp or 0) for r in ranks) + 1
    if "dp_size" not in info and ranks:
        info["dp_size"] = max((r.dp or 0) for r in ranks) + 1
    by_pid: dict[int, list[int]] = {}
    for gpu, pids in (nvml_pids or {}).items():
        for pid in pids:
            by_pid.setdefault(int(pid), []).append(int(gpu))
    procs = {p.pid: p for p in tree.processes()}
    for s in tree.schedulers:
        chain = []
        cur = procs.get(s.ppid)
        while cur is not None and cur.pid not in chain:
            chain.append(cur.pid)
            cur = procs.get(cur.ppid) if cur is not tree.root else None
        s.gpu = _assign_one(s, info, by_pid, proc_root, chain)
    return tree


def _assign_one(
    s: SglangProcess,
    info: Mapping[str, object],
    by_pid: dict[int, list[int]],
    proc_root: Path,
    fallback_pids: list[int],
) -> GpuAssignment:
    local = local_gpu_id(s.ranks or Ranks(), info)
    env, note = _scheduler_environ(s.pid, fallback_pids, proc_root)
    visible: list[str] | None = None
    if env is not None and env.get("CUDA_VISIBLE_DEVICES", "").strip():
        visible = [v.strip() for v in env["CUDA_VISIBLE_DEVICES"].split(",") if v.strip()]
    from_env: int | None = None
    vis_entry: str | None = None
    if visible is not None:
        if local < len(visible):
            vis_entry = visible[local]
            from_env = int(vis_entry) if vis_entry.isdigit() else None
            if from_env is None:
                note = f"CUDA_VISIBLE_DEVICES entry {vis_entry!r} is not an index"
        else:
            note = f"device {local} is outside CUDA_VISIBLE_DEVICES={','.join(visible)}"
    gpus = sorted(set(by_pid.get(s.pid, [])))
    if gpus:
        if len(gpus) == 1:
            return GpuAssignment(gpus[0], "nvml", vis_entry, note)
        pick = from_env if from_env in gpus else gpus[0]
        return GpuAssignment(
            pick, "nvml", vis_entry, f"holds contexts on GPUs {gpus}; main one taken as {pick}"
        )
    if visible is not None:
        return GpuAssignment(from_env, "env" if from_env is not None else "", vis_entry, note)
    return GpuAssignment(local, "rank", None, note)


def _scheduler_environ(
    pid: int, fallback_pids: list[int], proc_root: Path
) -> tuple[dict[str, str] | None, str]:
    """The environment that holds the scheduler's CUDA_VISIBLE_DEVICES.

    `setproctitle` grows the title over the memory that /proc/PID/environ shows, so a retitled
    scheduler's environ reads as empty or cut short (seen with setproctitle 1.3 on Linux).
    SGLang does not set CUDA_VISIBLE_DEVICES per scheduler (it calls
    `torch.cuda.set_device(gpu_id)`), so the variable is inherited from the root: when the
    scheduler's own environ lacks it, the nearest ancestor that has it is read. (SGLang's
    one-visible-device-per-process mode sets it per scheduler; there only NVML's pids are right.)
    """
    own = read_environ(pid, proc_root)
    if own and "CUDA_VISIBLE_DEVICES" in own:
        return own, ""
    for other in fallback_pids:
        env = read_environ(other, proc_root)
        if env and "CUDA_VISIBLE_DEVICES" in env:
            why = "unreadable" if own is None else "without it (setproctitle clears it)"
            return env, f"CUDA_VISIBLE_DEVICES of pid {other} used (pid {pid}'s environ is {why})"
    if own is None:
        return None, f"cannot read /proc/{pid}/environ (another user's process?)"
    return own, ""


def path_in_process(pid: int, path: str | os.PathLike, proc_root: Path = Path("/proc")) -> Path:
    """A path as the process `pid` names it, readable from here.

    A server in a container writes its traces under its own root; /proc/PID/root reaches them
    (same user or root needed). When the process shares our root, the path is used as is.
    """
    p = Path(path)
    root = proc_root / str(pid) / "root"
    try:
        theirs = os.stat(root)
        ours = os.stat("/")
    except OSError:
        return p
    if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino):
        return p
    return root / str(p).lstrip("/")
