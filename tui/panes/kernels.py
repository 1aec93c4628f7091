"""Kernel pane: the top-kernels table and a per-device/stream lane strip over the window.

Kernel records come from the in-process agent (CUPTI), which is a later issue; until a capture
or a live agent brings them, the pane is one line saying what will fill it and how. The full
zoomable line-API timeline replaces the lane strip in a later issue; this strip already shares
the clock pane's time axis (same window, same binning), so a busy lane and a throttle band line
up column for column.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from rich.text import Text
from textual import work
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from kdash import schema
from kdash.analyses.kernels import (
    idle_gaps,
    launch_latency,
    recorded_windows,
    short_name,
    top_kernels,
)

from ..widgets.spark import busy_fraction, shade
from .base import Pane, View

NO_KERNELS = (
    "Kernel timeline: no kernel data — needs the kdash agent in the target: start it with "
    "`kdash run -- CMD` (`?` shows why)"
)
NO_INJECT_MARK = "--no-inject"  # in the agent source's reason under `attach --no-inject`
MAX_LANES = 8
ANALYSIS_EVERY_S = 1.0


def analysis_notes(
    kernels: pd.DataFrame, api: pd.DataFrame, markers: pd.DataFrame | None = None
) -> str:
    """GPU idle gaps and launch-to-start latency, in one line ("" when neither applies).

    With a duty-cycled agent only gaps inside its recording windows count as idle.
    """
    windows = recorded_windows(markers) if markers is not None else None
    gaps = idle_gaps(kernels, windows=windows)
    lat = launch_latency(kernels, api)
    notes = []
    if not gaps.empty:
        notes.append(
            f"GPU idle gaps ≥100 µs: {len(gaps)}, longest {gaps['gap_us'].max() / 1e3:.2f} ms"
        )
    if not lat.empty:
        p50, p99 = np.percentile(lat["latency_us"].to_numpy(dtype=float), [50, 99])
        notes.append(f"launch→start p50 {p50:.1f} µs, p99 {p99:.1f} µs")
    return " · ".join(notes)


def empty_line(agent_health: str) -> str:
    """The pane's one line before any kernel arrived: the generic "needs the agent" advice,
    except under `attach --no-inject`, where the agent source's own reason ("no agent in pid
    N (injection off: --no-inject); ...") says the pane is empty by the user's choice."""
    if NO_INJECT_MARK in agent_health:
        return "Kernel timeline: " + agent_health.split(": ", 1)[-1]
    return NO_KERNELS


class KernelPane(Pane):
    key = "1"
    title = "Kernels"
    COMPONENT_CLASSES = {"kernel-pane--lane", "kernel-pane--label", "kernel-pane--note"}
    waiting = NO_KERNELS

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._notes: str | None = None
        self._analysed_key: tuple = ()
        self._analysed_at = 0.0
        self.analyses_applied = 0  # results of the analysis worker shown (tests wait on it)
        self.lanes = Static("", classes="lanes", markup=False)
        self.table = DataTable(cursor_type="row", zebra_stripes=False, classes="top-kernels")
        # A fixed name column (short names are cut to 40): auto-width would depend on whether
        # the first fill landed before or after the first layout, and the table would jump.
        self.table.add_column("kernel", width=40)
        self.table.add_columns(
            "calls", "total ms", "%", "mean µs", "p50 µs", "p99 µs", "grid", "block", "regs",
            "smem",
        )  # fmt: skip

    def compose(self) -> ComposeResult:
        yield self.empty_line
        yield self.lanes
        yield self.table

    def focus_target(self):
        return self.table if not self.has_class("-empty") else self

    def show(self, view: View) -> None:
        batch = view.store.get("kernels", view.since_ns, view.until_ns)
        if len(batch["start_ns"]) == 0:
            total = view.store.stats()["kernels"]["rows"]
            self.set_empty(
                empty_line(view.health.get("agent", ""))
                if total == 0
                else "Kernel timeline: no kernels in the shown window"
            )
            return
        self.set_empty(None)
        # The analyses (pandas: ~50-100 ms at 100k kernels) run in a thread worker, at most
        # once a second live and once per distinct window in a replay; their result is posted
        # back to the UI thread. The lanes (numpy, a few ms) are drawn on every redraw.
        key = (view.since_ns, view.until_ns, len(batch["start_ns"]))
        now = time.monotonic()
        due = view.mode == "replay" or now - self._analysed_at >= ANALYSIS_EVERY_S
        if self._analysed_key != key and due:
            self._analysed_key, self._analysed_at = key, now
            api = view.store.get("api", view.since_ns, view.until_ns)
            markers = view.store.get("markers", view.since_ns, view.until_ns)
            self._analyse(key, batch, api, markers)
        self.lanes.update(self._lanes(view, batch))

    @work(thread=True, exclusive=True, exit_on_error=False, group="kernel-analysis")
    def _analyse(self, key: tuple, batch: dict, api: dict, markers: dict) -> None:
        """Top kernels, GPU idle gaps and launch-to-start latency, off the UI thread."""
        kernels = schema.to_frame("kernels", batch)
        top = top_kernels(kernels, limit=50)
        notes = analysis_notes(
            kernels, schema.to_frame("api", api), schema.to_frame("markers", markers)
        )
        self.app.call_from_thread(self._apply_analysis, key, top, notes)

    def _apply_analysis(self, key: tuple, top: pd.DataFrame, notes: str) -> None:
        if key != self._analysed_key:
            return  # a newer window's analysis is on its way
        self._notes = notes
        self._fill_table(top)
        self.analyses_applied += 1
        request = getattr(self.app, "request_redraw", None)
        if request is not None:
            request(now=True)  # the notes line sits under the lanes

    def _lanes(self, view: View, batch: dict[str, np.ndarray]) -> Text:
        width = max(10, self.content_region.width or 60)
        label_w = 12
        bins = max(1, width - label_w)
        lane_style = self.get_component_rich_style("kernel-pane--lane")
        label_style = self.get_component_rich_style("kernel-pane--label")
        note_style = self.get_component_rich_style("kernel-pane--note")
        out = Text(no_wrap=True, overflow="ellipsis")
        # One int64 key per (device, stream): np.unique on rows (axis=0) is ~20x slower.
        dev, stream = batch["device"].astype(np.int64), batch["stream"].astype(np.int64)
        # stream + 1 keeps the low part non-negative for an n/a stream (-1).
        keys, inverse = np.unique((dev << 40) + (stream + 1), return_inverse=True)
        inverse = inverse.reshape(-1)
        pairs = [(int(k) >> 40, int(k) - ((int(k) >> 40) << 40) - 1) for k in keys]
        shown = min(len(pairs), MAX_LANES)
        for n in range(shown):
            sel = inverse == n
            frac = busy_fraction(
                batch["start_ns"][sel], batch["end_ns"][sel], view.since_ns, view.until_ns, bins
            )
            out.append(f"GPU{pairs[n][0]} s{pairs[n][1]}".ljust(label_w)[:label_w], label_style)
            out.append(shade(frac), lane_style)
            if n < shown - 1:
                out.append("\n")
        if len(pairs) > MAX_LANES:
            out.append(f"\n… {len(pairs) - MAX_LANES} more streams", note_style)
        out.append("\n" + " " * label_w + view.axis(bins), note_style)
        if self._notes:
            out.append("\n" + self._notes, note_style)
        return out

    def _fill_table(self, top: pd.DataFrame) -> None:
        keep = self.table.cursor_row
        self.table.clear()
        for r in top.itertuples(index=False):
            self.table.add_row(
                short_name(str(r.name), 40),
                f"{r.calls}",
                f"{r.total_ms:.2f}",
                f"{r.pct:.1f}",
                f"{r.mean_us:.1f}",
                f"{r.p50_us:.1f}",
                f"{r.p99_us:.1f}",
                r.grid,
                r.block,
                f"{r.registers}" if r.registers >= 0 else "n/a",
                f"{r.smem}" if r.smem >= 0 else "n/a",
            )
        if self.table.row_count:
            self.table.move_cursor(row=min(keep, self.table.row_count - 1), animate=False)
