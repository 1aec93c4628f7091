"""The recorder: polls sources into the store on one clock and cuts capture windows.

Used the same way by the dashboard (which runs it in a worker thread and reads the store) and by
`--headless` (which runs it for a duration and writes one capture). The poll loop is
self-clocking: each source has its own due time, polls never overlap, and the loop measures its
own cost so the status bar can show it.

A capture is "the `pre` seconds before the key and the `post` seconds after": the ring always
holds the pre-trigger seconds, sources poll faster until the window closes, then the window is
cut from the store and written on a separate thread so polling never stalls on disk.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path

from kdash import clock, schema
from kdash.capture import write_capture
from kdash.collectors.base import (
    CostEstimating,
    DescribesGpus,
    ExtraHealth,
    Health,
    Paced,
    Source,
    as_health,
    safe_call,
    safe_poll,
)
from kdash.config import Thresholds
from kdash.errors import UserError
from kdash.store import Store
from kdash.target import Target
from kdash.topology import Topology

log = logging.getLogger("kdash.session")


@dataclass
class CaptureState:
    phase: str = "idle"  # idle | recording | writing | saved | failed
    trigger_ns: int = 0
    start_ns: int = 0
    end_ns: int = 0
    path: Path | None = None
    error: str = ""
    seq: int = 0  # increments per capture, so the UI can tell a new result from an old one

    def remaining_s(self, now_ns: int) -> float:
        if self.phase != "recording":
            return 0.0
        return max(0.0, (self.end_ns - now_ns) / 1e9)


@dataclass
class RecorderOptions:
    interval_s: float = 0.25  # 4 Hz
    fast_interval_s: float = 0.1  # inside a capture window
    pre_s: float = 10.0
    post_s: float = 5.0
    capture_dir: Path = field(default_factory=lambda: Path.cwd())
    findings_every_s: float = 1.0
    findings_window_s: float = 10.0
    thresholds: Thresholds = field(default_factory=Thresholds)


class Recorder:
    def __init__(
        self,
        sources: list[Source],
        store: Store,
        target: Target | None = None,
        options: RecorderOptions | None = None,
        on_event: Callable[[str, object], None] | None = None,
    ) -> None:
        self.sources = sources
        self.store = store
        self.target = target
        self.opt = options or RecorderOptions()
        self.on_event = on_event
        self.capture = CaptureState()
        self.poll_cost_ms = 0.0
        self.findings = schema.to_frame("findings", schema.empty("findings"))
        self.started_ns = clock.now_ns()
        self.wall_offset_ns = clock.wall_offset_ns()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._next_findings = 0
        self._target_gone_reported = False
        self._topo: Topology | None = None
        self._topo_no_gpu: tuple[float, Topology] | None = None  # (monotonic s, topo), no GPUs

    # -- life cycle ---------------------------------------------------------------------
    def start(self) -> None:
        """Poll on a thread of our own (headless callers); the dashboard uses `run_forever`."""
        self._thread = threading.Thread(target=self.run_forever, name="kdash-recorder", daemon=True)
        self._thread.start()

    def run_forever(self) -> None:
        """Start the sources and poll until `stop()`; meant for a Textual thread worker."""
        for s in self.sources:
            safe_call(s, "start")
        try:
            self._loop()
        finally:
            for s in self.sources:
                safe_call(s, "stop")

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def run_for(self, seconds: float, progress: Callable[[float], None] | None = None) -> None:
        """Poll for `seconds` on the calling thread (headless mode); progress gets elapsed s."""
        for s in self.sources:
            safe_call(s, "start")
        t0 = time.monotonic()
        last_tick = -1
        while True:
            elapsed = time.monotonic() - t0
            if elapsed >= seconds or self._stop.is_set():
                break
            self._tick()
            if progress and int(elapsed) != last_tick:
                last_tick = int(elapsed)
                progress(elapsed)
            self._stop.wait(self._sleep_s())
        self._tick()
        for s in self.sources:
            safe_call(s, "stop")

    # -- polling --------------------------------------------------------------------------
    def _interval(self, s: Source) -> float:
        base = s.interval_s if isinstance(s, Paced) else self.opt.interval_s
        if self.capture.phase == "recording":
            return min(base, self.opt.fast_interval_s)
        return base

    def _sleep_s(self) -> float:
        return min(self._interval(s) for s in self.sources) if self.sources else 0.25

    def _loop(self) -> None:
        due = {id(s): 0.0 for s in self.sources}
        while not self._stop.is_set():
            now = time.monotonic()
            for s in self.sources:
                if now >= due[id(s)]:
                    self._poll_one(s)
                    due[id(s)] = now + self._interval(s)
            self._after_poll()
            nxt = min(due.values()) if due else now + 0.25
            self._stop.wait(max(0.005, nxt - time.monotonic()))

    def _tick(self) -> None:
        for s in self.sources:
            self._poll_one(s)
        self._after_poll()

    def _poll_one(self, s: Source) -> None:
        t0 = time.perf_counter()
        batches = safe_poll(s, clock.now_ns())
        self.store.extend(batches)
        cost = (time.perf_counter() - t0) * 1e3
        self.poll_cost_ms = 0.8 * self.poll_cost_ms + 0.2 * cost

    def _after_poll(self) -> None:
        now = clock.now_ns()
        if now >= self._next_findings:
            self._next_findings = now + int(self.opt.findings_every_s * 1e9)
            self.findings = self.compute_findings(now - int(self.opt.findings_window_s * 1e9), now)
        if self.target is not None and not self._target_gone_reported and not self.target.alive():
            self._target_gone_reported = True
            self._emit("target-exited", self.target.pid)
        cap = self.capture
        if cap.phase == "recording" and now >= cap.end_ns:
            with self._lock:
                cap.phase = "writing"
            threading.Thread(target=self._write_capture, name="kdash-capture", daemon=True).start()

    # -- analyses -------------------------------------------------------------------------
    def topology(self) -> Topology:
        """The machine as the findings take it; cached, since GPUs and CPUs do not move under
        us."""
        kept = self._topo_no_gpu
        if self._topo is None and kept is not None and time.monotonic() - kept[0] < 30.0:
            return kept[1]
        if self._topo is None:
            from kdash.collectors.topology import build_topo

            gpus = self.gpus()
            try:
                topo = build_topo(
                    {g["index"]: g["pci_bus_id"] for g in gpus if g.get("pci_bus_id")}
                )
            except (OSError, ValueError) as e:
                log.warning("topology: %s", e)
                topo = Topology(gpu_local_cpus={}, cpu_count=os.cpu_count() or 0)
            local = dict(topo.gpu_local_cpus or {})
            for g in gpus:  # NVML's view (affinity) where sysfs had nothing
                if g.get("local_cpus") and not local.get(g["index"]):
                    local[g["index"]] = g["local_cpus"]
            topo = replace(topo, gpu_local_cpus=local)
            if not gpus:
                # NVML may come up later: keep this view only a while, since rebuilding it
                # reads sysfs for every CPU at each findings pass
                self._topo_no_gpu = (time.monotonic(), topo)
                return topo
            self._topo = topo
        return self._topo

    def gpus(self) -> list[dict]:
        for s in self.sources:
            if isinstance(s, DescribesGpus):
                try:
                    return list(s.describe())
                except Exception as e:  # noqa: BLE001 - metadata must not stop a capture
                    log.warning("describe() failed on %s: %s", s.name, e)
        return []

    def compute_findings(self, since_ns: int, until_ns: int):
        try:
            from kdash.analyses.findings import find_all
        except ImportError:
            return self.findings
        tables = {
            t: self.store.frame(t, since_ns, until_ns)
            for t in ("threads", "cpu_freq", "gpu_samples", "gpu_procs")
        }
        try:
            return find_all(tables, self.topology(), self.opt.thresholds, now_ns=until_ns)
        except Exception:
            log.exception("findings failed")
            return self.findings

    # -- captures -------------------------------------------------------------------------
    def trigger_capture(self, pre_s: float | None = None, post_s: float | None = None) -> bool:
        """Start a capture window; False when one is already being recorded or written."""
        with self._lock:
            if self.capture.phase in ("recording", "writing"):
                return False
            now = clock.now_ns()
            pre = self.opt.pre_s if pre_s is None else pre_s
            post = self.opt.post_s if post_s is None else post_s
            self.capture = CaptureState(
                phase="recording",
                trigger_ns=now,
                start_ns=max(self.started_ns, now - int(pre * 1e9)),
                end_ns=now + int(post * 1e9),
                seq=self.capture.seq + 1,
            )
        self._emit("capture-started", self.capture)
        return True

    def capture_path(self, trigger_ns: int) -> Path:
        wall = (trigger_ns + self.wall_offset_ns) / 1e9
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(wall))
        pid = self.target.pid if self.target else "none"
        base = Path(self.opt.capture_dir) / f"kdash-{pid}-{stamp}.kdash"
        n = 1
        path = base
        while path.exists():
            n += 1
            path = base.with_name(f"{base.stem}-{n}.kdash")
        return path

    def _before_write(self, cap: CaptureState) -> None:
        """Hook: work that must finish before the window is cut (e.g. a server's profile)."""

    def _extra_failure(self, cap: CaptureState) -> str:
        """Hook: a one-line failure of that extra work ("" when none); the window is kept."""
        return ""

    def _write_capture(self) -> None:
        cap = self.capture
        self._before_write(cap)
        try:
            path = self.write_window(
                cap.start_ns, cap.end_ns, self.capture_path(cap.trigger_ns), cap.trigger_ns
            )
        except Exception as e:
            log.exception("capture failed")
            with self._lock:
                cap.phase = "failed"
                cap.error = (
                    str(e) if isinstance(e, OSError | UserError) else f"{type(e).__name__}: {e}"
                )
            self._emit("capture-failed", cap)
            return
        failure = self._extra_failure(cap)
        with self._lock:
            cap.path = path
            if failure:
                cap.phase = "failed"
                cap.error = f"{failure} (host-only window saved: {path})"
            else:
                cap.phase = "saved"
        self._emit("capture-failed" if failure else "capture-saved", cap)

    def write_window(
        self,
        start_ns: int,
        end_ns: int,
        path: Path,
        trigger_ns: int | None = None,
        extra_meta: dict | None = None,
    ) -> Path:
        """Write the window [start_ns, end_ns] as a capture at `path` (never replacing a
        file); `extra_meta` keys are added to its metadata."""
        tables = {
            t: self.store.get(t)
            if t in schema.STATIC_TABLES
            else self.store.get(t, start_ns, end_ns)
            for t in schema.TABLES
            if t != "findings"
        }
        findings = self.compute_findings(start_ns, end_ns)
        tables["findings"] = schema.from_frame("findings", findings)
        meta = self.build_meta(start_ns, end_ns, trigger_ns)
        meta.update(extra_meta or {})
        return write_capture(path, meta, tables)

    def build_meta(self, start_ns: int, end_ns: int, trigger_ns: int | None = None) -> dict:
        return build_meta(
            target=self.target,
            gpus=self.gpus(),
            sources=source_healths(self.sources),
            start_ns=start_ns,
            end_ns=end_ns,
            trigger_ns=trigger_ns,
            wall_offset_ns=self.wall_offset_ns,
            overflowed=self.store.overflowed(),
            extra={
                "interval_s": self.opt.interval_s,
                "topology": self.topology(),
                "agent_cost": agent_cost(self.sources),
            },
        )

    def _emit(self, event: str, payload: object) -> None:
        if self.on_event is not None:
            try:
                self.on_event(event, payload)
            except Exception:
                log.exception("event callback failed for %s", event)


def source_healths(sources) -> dict[str, Health]:
    """Each source's health by name, plus the healths a source reports for parts of itself
    (`extra_health()`: the agents' PC sampling, which the source pane explains)."""
    out = {s.name: s.health for s in sources}
    for s in sources:
        if not isinstance(s, ExtraHealth):
            continue
        try:  # a bug here must not cost a capture or a redraw: it is shown instead
            out.update({str(k): as_health(v, str(k)) for k, v in s.extra_health().items()})
        except Exception as e:  # noqa: BLE001
            out[f"{s.name} (detail)"] = Health.degraded(
                f"extra_health failed: {type(e).__name__}: {e}", "extra_health_failed"
            )
    return out


def agent_cost(sources) -> dict | None:
    """What watching cost the target when the window was written: the estimate (a fraction)
    and the agents' counters behind it, so a capture can be read against a measured cost;
    None when no source estimates it."""
    for s in sources:
        if not isinstance(s, CostEstimating):
            continue
        try:  # a bug here must not cost a capture
            return {"estimate": s.cost_estimate(), "agents": s.cost_detail()}
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}
    return None


def source_health(sources) -> dict[str, str]:
    """`source_healths` as the lines users read."""
    return {k: str(h) for k, h in source_healths(sources).items()}


def capture_healths(meta: dict) -> dict[str, Health]:
    """The sources' health a capture recorded: from `sources_health` where the capture has
    it, else from the lines of `sources` (older captures) through `health_from_text`."""
    lines = meta.get("sources") or {}
    data = meta.get("sources_health") or {}
    out: dict[str, Health] = {}
    for k, v in lines.items():
        d = data.get(k)
        out[str(k)] = Health.from_dict(d) if isinstance(d, dict) else as_health(str(v), str(k))
    return out


def build_meta(
    *,
    target: Target | None,
    gpus: list[dict],
    sources: Mapping[str, Health | str],
    start_ns: int,
    end_ns: int,
    trigger_ns: int | None,
    wall_offset_ns: int,
    overflowed: int = 0,
    extra: dict | None = None,
) -> dict:
    """A recorded window's metadata, as the JSON object of `kdash.json` (kdash.meta builds it:
    the one builder of captures' metadata)."""
    from kdash.meta import ClockInfo, Window
    from kdash.meta import build_meta as new_meta

    meta = new_meta(
        created_wall_ns=time.time_ns(),
        target=target.describe() if target else None,
        gpus=gpus,
        clock=ClockInfo(wall_offset_ns=wall_offset_ns),
        window=Window.of(start_ns, end_ns, trigger_ns),
        sources={k: str(v) for k, v in sources.items()},
        sources_health={k: as_health(v, k).to_dict() for k, v in sources.items()},
        overflowed_rows=overflowed,
    )
    return meta.merged(extra).to_dict()
