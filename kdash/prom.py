"""What kdash sees, for a fleet: a Prometheus `/metrics` endpoint and a JSON-lines stream.

`--prometheus [HOST:]PORT` on `attach` and `run` (with or without the dashboard) serves
`kdash_`-prefixed series through prometheus-client, bound to 127.0.0.1 unless a host is given
(what a process sees of another's GPU and threads is not for the network by default).
`--jsonl PATH|-` writes the same sample as one JSON object per line, once a second.

One sample is computed from the recorder's store on each scrape (`sample`): the last NVML row
per GPU, GPU time over the last WINDOW_S seconds from the same accounting the kernel pane uses
(`kdash.analyses.gpu_time.account`), the top kernels' shares, the findings of that window by
kind and severity, and kdash's own cost estimate and CPU time. The kernel label set is bounded
(TOP_KERNELS names, cut to 120 characters) so a server with many kernel names cannot blow up a
Prometheus's series count.
"""

from __future__ import annotations

import json
import os
import sys
import threading
from typing import Any

from kdash.collectors.base import CostEstimating
from kdash.errors import UserError

WINDOW_S = 10.0
TOP_KERNELS = 10
LABEL_MAX = 120
GPU_FIELDS = (
    ("sm_clock_mhz", "SM clock, MHz"),
    ("mem_clock_mhz", "memory clock, MHz"),
    ("sm_clock_max_mhz", "SM clock maximum, MHz"),
    ("temp_c", "GPU temperature, degrees C"),
    ("power_w", "board power, W"),
    ("power_limit_w", "board power limit, W"),
    ("util_gpu_pct", "NVML utilisation: share of time a kernel ran, %"),
    ("mem_used_mib", "GPU memory used, MiB"),
)


def parse_listen(text: str) -> tuple[str, int]:
    """`PORT` or `HOST:PORT` (IPv6 as `[::1]:PORT`) -> (host, port); UserError otherwise."""
    host, _, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise UserError(f"--prometheus {text}: give PORT or HOST:PORT (port 0-65535; 0: any)")
    return host, int(port)


def sample(store: Any, sources: list, now_ns: int | None = None) -> dict:
    """One JSON-ready sample of the last WINDOW_S seconds of `store`."""
    from kdash import clock
    from kdash.analyses.gpu_time import account
    from kdash.analyses.kernels import top_kernels
    from kdash.gpu_reasons import decode

    now = clock.now_ns() if now_ns is None else now_ns
    since = now - int(WINDOW_S * 1e9)
    out: dict[str, Any] = {"t_ns": now, "window_s": WINDOW_S, "gpus": [], "kernels": []}
    gs = store.frame("gpu_samples", since_ns=since)
    if len(gs):
        for gpu, rows in gs.sort_values("t_ns").groupby("gpu"):
            last = rows.iloc[-1]
            g: dict[str, Any] = {"gpu": int(gpu)}
            for name, _ in GPU_FIELDS:
                v = float(last[name])
                g[name] = None if v != v or v < 0 else v  # NaN and -1 are n/a
            g["throttle_reasons"] = decode(int(last["throttle_reasons"]))
            out["gpus"].append(g)
    kernels = store.frame("kernels", since_ns=since)
    if len(kernels):
        acc = account(
            kernels,
            store.frame("memcpy", since_ns=since),
            store.frame("markers", since_ns=since),
            store.frame("api", since_ns=since),
        )
        by_gpu = {g["gpu"]: g for g in out["gpus"]}
        for t in acc.gpus:
            rec = t.recorded_ns or 1
            share = {
                "busy": t.busy_ns / rec,
                "kernels": t.kernel_ns / rec,
                "copies": t.copy_ns / rec,
                "idle_short_gaps": t.short_gap_idle_ns / rec,
            }
            for cause, ns in t.idle_by_cause_ns.items():
                share[f"idle_{cause}"] = ns / rec
            by_gpu.setdefault(t.gpu, {"gpu": t.gpu})["time_share"] = share
        out["gpus"] = sorted(by_gpu.values(), key=lambda g: g["gpu"])
        tk = top_kernels(kernels, limit=TOP_KERNELS)
        for _, row in tk.iterrows():
            out["kernels"].append(
                {"kernel": str(row["name"])[:LABEL_MAX], "share": float(row["pct"]) / 100}
            )
    fd = store.frame("findings", since_ns=since)
    counts: dict[tuple[str, str], int] = {}
    for kind, sev in zip(fd.get("kind", []), fd.get("severity", []), strict=False):
        counts[(str(kind), str(sev))] = counts.get((str(kind), str(sev)), 0) + 1
    out["findings"] = [{"kind": k, "severity": s, "count": n} for (k, s), n in counts.items()]
    cost = None
    for s in sources:
        if isinstance(s, CostEstimating):
            cost = s.cost_estimate()
    out["kdash_cost_estimate"] = cost
    t = os.times()
    out["kdash_cpu_seconds"] = t.user + t.system
    return out


class _Collector:
    """prometheus-client's custom-collector protocol: `collect()` yields metric families."""

    def __init__(self, store: Any, sources: list) -> None:
        self.store = store
        self.sources = sources

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        s = sample(self.store, self.sources)
        for name, doc in GPU_FIELDS:
            fam = GaugeMetricFamily(f"kdash_gpu_{name}", doc, labels=["gpu"])
            for g in s["gpus"]:
                if g.get(name) is not None:
                    fam.add_metric([str(g["gpu"])], g[name])
            yield fam
        thr = GaugeMetricFamily(
            "kdash_gpu_throttle",
            "1 for each clock-event reason NVML reports",
            labels=["gpu", "reason"],
        )
        share = GaugeMetricFamily(
            "kdash_gpu_time_share",
            f"share of the recorded time of the last {WINDOW_S:g} s, by class",
            labels=["gpu", "class"],
        )
        for g in s["gpus"]:
            for reason in g.get("throttle_reasons", []):
                thr.add_metric([str(g["gpu"]), reason], 1.0)
            for cls, v in (g.get("time_share") or {}).items():
                share.add_metric([str(g["gpu"]), cls], v)
        yield thr
        yield share
        k = GaugeMetricFamily(
            "kdash_kernel_time_share",
            f"share of kernel time of the last {WINDOW_S:g} s (top {TOP_KERNELS})",
            labels=["kernel"],
        )
        for row in s["kernels"]:
            k.add_metric([row["kernel"]], row["share"])
        yield k
        f = GaugeMetricFamily(
            "kdash_findings",
            f"findings of the last {WINDOW_S:g} s",
            labels=["kind", "severity"],
        )
        for row in s["findings"]:
            f.add_metric([row["kind"], row["severity"]], row["count"])
        yield f
        if s["kdash_cost_estimate"] is not None:
            yield GaugeMetricFamily(
                "kdash_cost_estimate_ratio",
                "kdash's estimated slowdown of the target (0.01 = 1%)",
                value=s["kdash_cost_estimate"],
            )
        yield CounterMetricFamily(
            "kdash_cpu_seconds", "kdash's own CPU time", value=s["kdash_cpu_seconds"]
        )


class Exporter:
    """Serves `/metrics` and/or writes JSON lines while a recording runs; `stop()` ends both."""

    def __init__(
        self, store: Any, sources: list, listen: str | None = None, jsonl: str | None = None
    ) -> None:
        self.store = store
        self.sources = sources
        self.listen = parse_listen(listen) if listen else None
        self.jsonl = jsonl
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._out: Any = None
        self.address: tuple[str, int] | None = None

    def start(self) -> None:
        if self.listen is not None:
            from prometheus_client import CollectorRegistry
            from prometheus_client.exposition import start_http_server

            registry = CollectorRegistry(auto_describe=False)
            registry.register(_Collector(self.store, self.sources))
            host, port = self.listen
            try:
                self._server, _t = start_http_server(port, addr=host, registry=registry)
            except OSError as e:
                raise UserError(f"--prometheus {host}:{port}: {e.strerror or e}") from None
            self.address = (host, self._server.server_port)
        if self.jsonl is not None:
            try:
                self._out = sys.stdout if self.jsonl == "-" else open(self.jsonl, "x")  # noqa: SIM115
            except FileExistsError:
                raise UserError(f"--jsonl {self.jsonl} exists (kdash never overwrites)") from None
            except OSError as e:
                raise UserError(f"--jsonl {self.jsonl}: {e.strerror or e}") from None
            self._thread = threading.Thread(target=self._lines, name="kdash-jsonl", daemon=True)
            self._thread.start()

    def _lines(self) -> None:
        while not self._stop.wait(1.0):
            try:
                line = json.dumps(sample(self.store, self.sources), default=str)
                self._out.write(line + "\n")
                self._out.flush()
            except (OSError, ValueError):  # the reader left (a closed pipe): stop writing
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(3)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._out is not None and self._out is not sys.stdout:
            self._out.close()

    def __enter__(self) -> Exporter:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
