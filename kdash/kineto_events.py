"""One Kineto event into the row lists of its table: which category becomes which table, and
which of the event's fields fill which column (the mapping is listed in `kdash.kineto`).

A CPU op is a host range on one thread, as an NVTX range is: it goes into the markers table
with domain `CPU_OP_DOMAIN`. Python frames, other flows and the rest are counted per category
(`EventReader.skipped`) and not stored.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from kdash.kineto_columns import MAX_TIME_US, RowTable, dim3, json_int
from kdash.kineto_flows import LAUNCH_FLOW, LaunchFlows

MAX_SKIP_KEYS = 1_000  # distinct skipped categories counted by name; the rest as "(other)"


STORED_CATS = {
    "kernel",
    "cuda_runtime",
    "cuda_driver",
    "gpu_memcpy",
    "gpu_memset",
    "user_annotation",
    "gpu_user_annotation",
    "cpu_op",
}
CPU_OP_DOMAIN = "cpu_op"  # markers rows that are CPU ops
HOST_CATS = {"cpu_op", "user_annotation", "cuda_runtime", "cuda_driver", "python_function"}


def memcpy_kind(name: str, cat: str) -> str:
    if cat == "gpu_memset" or name.startswith("Memset"):
        return "memset"
    parts = name.split()
    if len(parts) >= 2 and parts[0] == "Memcpy":
        return parts[1]
    return name


class EventReader:
    """One trace's events into the tables' row lists: one method per kind of event, and the
    state a pass carries (the host pid once seen, the flows, what was skipped, the counts)."""

    def __init__(self, tables: dict[str, RowTable], base_ns: int, offset: int, chunk: int) -> None:
        self.kern, self.api, self.mem, self.mark = (
            tables[k] for k in ("kernels", "api", "memcpy", "markers")
        )
        self.base_ns = base_ns
        self.offset = offset
        self.chunk = chunk
        self.interned: dict[str, str] = {}
        self.skipped: Counter[str] = Counter()
        self.host_pid: int | None = None
        self.flows = LaunchFlows()
        self.cpu_ops = 0
        self.n = 0
        self._by_cat = {
            "kernel": self._kernel,
            "cuda_runtime": self._api,
            "cuda_driver": self._api,
            "gpu_memcpy": self._memcpy,
            "gpu_memset": self._memcpy,
            "user_annotation": self._marker,
            "gpu_user_annotation": self._marker,
            "cpu_op": self._marker,
        }

    def _skip(self, key: str) -> None:
        if key not in self.skipped and len(self.skipped) >= MAX_SKIP_KEYS:
            key = "(other)"
        self.skipped[key] += 1

    def _cols(self, t: RowTable) -> dict[str, list]:
        """The table's row lists, flushed first when a chunk is full."""
        if t.n >= self.chunk:
            t.flush(self.base_ns, self.offset, self.host_pid)
        return t.cols

    def add(self, ev: Any) -> None:
        self.n += 1
        if not isinstance(ev, dict):
            return
        ph = ev.get("ph")
        if ph != "X":
            if ph in ("s", "t", "f"):  # a flow's start, step, end
                self._flow(ev, ph)
            return
        cat = ev.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        if cat in STORED_CATS:
            ts = ev.get("ts")
            if not isinstance(ts, int | float) or isinstance(ts, bool):
                self.skipped[f"{cat} without ts"] += 1
                return
            if not -MAX_TIME_US < ts < MAX_TIME_US:  # NaN fails too
                self.skipped[f"{cat} with a ts that is not a time"] += 1
                return
        name = ev.get("name")
        name = self.interned.setdefault(name, name) if isinstance(name, str) else ""
        args = ev.get("args")
        if not isinstance(args, dict):
            args = {}
        handler = self._by_cat.get(cat)
        if handler is None:
            self._other(ev, cat)
        else:
            handler(ev, cat, name, args)

    def _flow(self, ev: dict[str, Any], ph: str) -> None:
        cat = ev.get("cat")
        cat = cat.lower() if isinstance(cat, str) else ""
        if cat != LAUNCH_FLOW or ph == "t" or not self.flows.add(ev):
            self._skip(f"{cat or '(none)'} flow")

    def _kernel(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        kc = self._cols(self.kern)
        g = args.get("grid")
        b = args.get("block")
        gx, gy, gz = g if type(g) is list and len(g) == 3 else dim3(g)
        bx, by, bz = b if type(b) is list and len(b) == 3 else dim3(b)
        kc["ts"].append(ev["ts"])
        kc["dur"].append(ev.get("dur", 0.0))
        kc["name"].append(name)
        kc["device"].append(args.get("device", ev.get("pid")))
        kc["stream"].append(args.get("stream", ev.get("tid")))
        kc["pid"].append(None)
        kc["grid_x"].append(gx)
        kc["grid_y"].append(gy)
        kc["grid_z"].append(gz)
        kc["block_x"].append(bx)
        kc["block_y"].append(by)
        kc["block_z"].append(bz)
        kc["registers"].append(args.get("registers per thread", -1))
        kc["dynamic_smem"].append(args.get("shared memory", -1))
        kc["correlation_id"].append(args.get("correlation", -1))
        kc["graph_id"].append(args.get("graph id", args.get("graph_id", -1)))
        self.kern.n += 1

    def _api(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        ac = self._cols(self.api)
        pid = ev.get("pid")
        if self.host_pid is None and json_int(pid) >= 0:
            self.host_pid = json_int(pid)
        ac["ts"].append(ev["ts"])
        ac["dur"].append(ev.get("dur", 0.0))
        ac["name"].append(name)
        ac["pid"].append(pid)
        ac["tid"].append(ev.get("tid", -1))
        ac["correlation_id"].append(args.get("correlation", -1))
        self.api.n += 1

    def _memcpy(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        mc = self._cols(self.mem)
        mc["ts"].append(ev["ts"])
        mc["dur"].append(ev.get("dur", 0.0))
        kind = memcpy_kind(name, cat)
        mc["kind"].append(self.interned.setdefault(kind, kind))
        mc["bytes"].append(args.get("bytes", -1))
        mc["device"].append(args.get("device", ev.get("pid")))
        mc["stream"].append(args.get("stream", ev.get("tid")))
        mc["pid"].append(None)
        mc["correlation_id"].append(args.get("correlation", -1))
        self.mem.n += 1

    def _marker(self, ev: dict[str, Any], cat: str, name: str, args: dict[str, Any]) -> None:
        rc = self._cols(self.mark)
        # raw pid and tid, made integers per chunk (CPU ops are most events)
        if cat == "cpu_op":
            self.cpu_ops += 1
            pid = ev.get("pid")
        elif cat == "gpu_user_annotation":
            pid = None
        else:
            pid = ev.get("pid")
        if self.host_pid is None and pid is not None and json_int(pid) >= 0:
            self.host_pid = json_int(pid)
        rc["ts"].append(ev["ts"])
        rc["dur"].append(ev.get("dur", 0.0))
        rc["name"].append(name)
        rc["domain"].append(cat)
        rc["pid"].append(pid)
        rc["tid"].append(ev.get("tid"))
        self.mark.n += 1

    def _other(self, ev: dict[str, Any], cat: str) -> None:
        if self.host_pid is None and cat in HOST_CATS:
            p = json_int(ev.get("pid"))
            self.host_pid = p if p >= 0 else None
        self._skip(cat or "(none)")
