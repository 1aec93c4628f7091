"""Line tables for the kernels the agent's PC samples name, made in kdash's own process.

Why here and not in the agent: turning a cubin into a line table runs nvdisasm and reads the
source files, seconds of work that must not happen inside the user's server. The samples carry
each kernel's cubin CRC; Triton keeps every compiled cubin in its cache
(`$TRITON_CACHE_DIR`, else `~/.triton/cache` of the target's user), so the cubin that ran is
the cached one with that kernel name whose CRC (`cuptiGetCubinCrc`, no GPU needed) matches.
The resulting `source_lines` rows go into the store like any other table, so captures carry
them and the source pane needs nothing else.

Where the cubins are: the target's `TRITON_CACHE_DIR` (from its environment), its user's
`~/.triton/cache`, and torch.compile's: inductor compiles its generated Triton modules with
the cache under its own folder (`$TORCHINDUCTOR_CACHE_DIR`, else `/tmp/torchinductor_<user>`,
`triton/<device>/`), which the target's environment does not show because inductor sets it
inside the process. Each line table comes with the text of the files it points at
(`source_files` rows, read once per file and content), so a capture shows the code that ran
where that file is gone (inductor's modules live in /tmp) or has changed since.

Kernels that are not in Triton's cache (cuBLAS, ATen, CUDA extensions) get no line table here:
their cubins would have to come from CUPTI's module-load callback, which needs a callback
subscriber, and a subscriber blinds torch.profiler for the life of the process. The
pane then shows the kernel's name and says why there are no lines.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from kdash import cubin, schema
from kdash.target import read_environ

MAX_SOURCE_BYTES = 2 << 20  # a source file larger than this is not carried in the data


def inductor_cache_dir(env: dict[str, str], uid: int | None) -> Path:
    """torch.compile's cache folder for a process with environment `env` run by `uid`."""
    if env.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(env["TORCHINDUCTOR_CACHE_DIR"])
    import tempfile

    user = ""
    if uid is not None:
        import pwd

        try:
            user = pwd.getpwuid(uid).pw_name
        except KeyError:
            user = str(uid)
    # inductor's own rule: getpass.getuser() with path separators and spaces replaced
    user = "".join("_" if c in "/\\ :" else c for c in user)
    tmp = env.get("TMPDIR") or tempfile.gettempdir()
    return Path(tmp) / f"torchinductor_{user}"


def triton_cache_roots(pid: int) -> list[Path]:
    """Every folder where process `pid`'s Triton cubins may be, existing ones only, in the
    order they are searched: its TRITON_CACHE_DIR, its user's ~/.triton/cache, inductor's."""
    try:
        env = read_environ(pid)
    except OSError:
        env = {}
    try:
        uid: int | None = Path(f"/proc/{pid}").stat().st_uid
    except OSError:
        uid = None
    roots = [target_triton_cache(pid)]
    home = env.get("HOME")
    roots.append(Path(home) / ".triton" / "cache" if home else cubin.triton_cache_dir())
    roots.extend(sorted((inductor_cache_dir(env, uid) / "triton").glob("*")))
    out: list[Path] = []
    for r in roots:
        if r.is_dir() and r not in out:
            out.append(r)
    return out


def target_triton_cache(pid: int) -> Path:
    """The Triton cache folder of process `pid` (its environment; else this user's)."""
    try:
        env = read_environ(pid)
    except OSError:
        env = {}
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"])
    home = env.get("HOME")
    return Path(home) / ".triton" / "cache" if home else cubin.triton_cache_dir()


class LineTableFeeder:
    """Watches pc_samples batches; for each new (kernel, CRC) makes the line table on a
    background thread and hands back `source_lines` batches on the next `take()`.

    Each (kernel, CRC) is looked at once; the outcome ("ok", or why not) is kept in
    `outcomes` for the pane and tests.
    """

    def __init__(self, pid: int, cache_dir: Path | None = None) -> None:
        self.pid = pid
        self.cache_dir = cache_dir
        self.outcomes: dict[tuple[str, int], str] = {}
        self._todo: list[tuple[str, int]] = []
        self._ready: list[Any] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._crc_of_path: dict[str, int | None] = {}
        self._files_sent: set[tuple[str, str]] = set()  # (file, sha256) carried already
        self._files_ready: list[Any] = []

    def offer(self, batch: Any) -> None:
        """Note the (kernel, CRC) pairs of a pc_samples batch not seen before."""
        if not len(batch["kernel"]):
            return
        pairs = set(zip(batch["kernel"].tolist(), batch["cubin_crc"].tolist(), strict=True))
        with self._lock:
            new = [p for p in pairs if p not in self.outcomes]
            for p in new:
                self.outcomes[p] = "pending"
            self._todo.extend(new)
            if new and (self._thread is None or not self._thread.is_alive()):
                self._thread = threading.Thread(target=self._work, name="kdash-lines", daemon=True)
                self._thread.start()

    def take(self) -> list[Any]:
        """The `source_lines` batches made since the last call."""
        with self._lock:
            out, self._ready = self._ready, []
        return out

    def take_files(self) -> list[Any]:
        """The `source_files` batches (the text of the files those tables point at)."""
        with self._lock:
            out, self._files_ready = self._files_ready, []
        return out

    def wait_idle(self, timeout: float = 30.0) -> bool:
        """For tests and headless runs: until the background work is done."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            with self._lock:
                busy = bool(self._todo) or (self._thread is not None and self._thread.is_alive())
            if not busy:
                return True
            time.sleep(0.02)
        return False

    def _work(self) -> None:
        while True:
            with self._lock:
                if not self._todo:
                    return
                kernel, crc_i8 = self._todo.pop()
            try:
                outcome, batch = self._one(kernel, crc_i8)
            except Exception as e:  # noqa: BLE001 - say why in the outcome, keep going
                outcome, batch = f"failed: {type(e).__name__}: {e}", None
            with self._lock:
                self.outcomes[(kernel, crc_i8)] = outcome
                if batch is not None:
                    self._ready.append(batch)

    def _one(self, kernel: str, crc_i8: int) -> tuple[str, Any]:
        roots = [self.cache_dir] if self.cache_dir else triton_cache_roots(self.pid)
        want = int(np.int64(crc_i8).view(np.uint64)) if crc_i8 != -1 else None
        for root in roots:
            for c in cubin.triton_cached_cubins({kernel}, root):
                data = Path(c.path).read_bytes()
                if want is not None:
                    if c.path not in self._crc_of_path:
                        self._crc_of_path[c.path] = cubin.cubin_crc(data)[0]
                    if self._crc_of_path[c.path] != want:
                        continue
                lt = cubin.line_table(data, compiled_ns=c.mtime_ns)
                if lt.why:
                    return f"no line table: {lt.why}", None
                t_ns = time.monotonic_ns()
                rows = cubin.to_rows(lt, t_ns=t_ns)
                batch = schema.make_batch(
                    "source_lines", **{k: np.asarray(v) for k, v in rows.items()}
                )
                self._carry_files(lt.files, t_ns)
                return "ok", batch
        where = ", ".join(str(r) for r in roots) or "no Triton cache folder of the target"
        return f"not in the Triton cache at {where}", None

    def _carry_files(self, files: list[str], t_ns: int) -> None:
        """`source_files` rows for the files not carried yet (this content)."""
        import hashlib

        rows: dict[str, list] = {"t_ns": [], "file": [], "sha256": [], "text": []}
        for f in files:
            try:
                raw = Path(f).read_bytes()
            except OSError:
                continue  # the pane says the file is not readable
            if len(raw) > MAX_SOURCE_BYTES:
                continue
            sha = hashlib.sha256(raw).hexdigest()
            if (f, sha) in self._files_sent:
                continue
            self._files_sent.add((f, sha))
            rows["t_ns"].append(t_ns)
            rows["file"].append(f)
            rows["sha256"].append(sha)
            rows["text"].append(raw.decode("utf-8", "replace"))
        if rows["file"]:
            batch = schema.make_batch(
                "source_files",
                t_ns=np.asarray(rows["t_ns"], dtype=np.int64),
                file=np.asarray(rows["file"], dtype=object),
                sha256=np.asarray(rows["sha256"], dtype=object),
                text=np.asarray(rows["text"], dtype=object),
            )
            with self._lock:
                self._files_ready.append(batch)
