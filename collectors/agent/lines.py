"""Line tables for the kernels the agent's PC samples name, made in kdash's own process.

Why here and not in the agent: turning a cubin into a line table runs nvdisasm and reads the
source files, seconds of work that must not happen inside the user's server. The samples carry
each kernel's cubin CRC; Triton keeps every compiled cubin in its cache
(`$TRITON_CACHE_DIR`, else `~/.triton/cache` of the target's user), so the cubin that ran is
the cached one with that kernel name whose CRC (`cuptiGetCubinCrc`, no GPU needed) matches.
The resulting `source_lines` rows go into the store like any other table, so captures carry
them and the source pane needs nothing else.

Kernels that are not in Triton's cache (cuBLAS, ATen, CUDA extensions) get no line table here:
their cubins would have to come from CUPTI's module-load callback, which needs a callback
subscriber, and a subscriber blinds torch.profiler for the life of the process (issue 3). The
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
        with self._lock:
            out, self._ready = self._ready, []
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
        root = self.cache_dir or target_triton_cache(self.pid)
        want = int(np.int64(crc_i8).view(np.uint64)) if crc_i8 != -1 else None
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
            rows = cubin.to_rows(lt, t_ns=time.monotonic_ns())
            batch = schema.make_batch("source_lines", **{k: np.asarray(v) for k, v in rows.items()})
            return "ok", batch
        return f"not in the Triton cache at {root}", None
