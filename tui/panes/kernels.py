"""Kernel timeline pane: per-(GPU, stream) lanes, NVTX lanes and the top-kernels table.

In continuous time the lanes share the clock pane's time axis (same window, same binning), so a
busy lane and a throttle band line up column for column; the app's `+`/`-`/`←`/`→`/`p`/`r` move
that window.
The strip itself is drawn by `kdash.tui.lanes` (NVTX lanes, "·" for time the agent did not
record, the one-pass binning that keeps a redraw of 100,000 kernels within a few ms); the
pane reuses the last drawn text while the window, the rows and the width are unchanged.

The window view: a duty-cycled agent records a few % of the time, and a minute of continuous
axis is then almost all "·". When less than a fifth of the shown range was recorded the strip
shows the last recorded windows side by side instead (`kdash.analyses.windows`), each slice
labelled with its start; `w` switches between it and continuous time, and zoom and pan still
choose the range whose windows are shown.

Kernel records come from the in-process agent (CUPTI); until a capture or a live agent brings
them, the pane is one line saying what will fill it and how.

The table lists every kernel name of the window (the first `TABLE_ROWS` after sorting and
filtering): `o` cycles the sort column, `/` opens a name filter (Enter applies a
case-insensitive substring match on the demangled name, Esc clears it), and the line under
the table shows the full demangled name of the row under the cursor. The name column takes
the width the other columns leave (`kdash.tui.columns`); columns that do not fit go out of
view to the right by priority, and `←`/`→` scroll the table to them while it has focus.
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from kdash.collectors.base import Health, as_health
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from kdash import schema
from kdash.analyses.cpu_ops import has_host_ranges
from kdash.analyses.gpu_time import Accounting, account, gpu_time_text
from kdash.analyses.kernel_findings import (
    ACTIONABLE,
    IDLE_INFO_SHARE,
    SHORT,
    feeder_state,
    gap_brief,
    idle_summaries,
    thread_names,
)
from kdash.analyses.kernels import (
    ACTIVITY_DOMAIN,
    ACTIVITY_NAME,
    launch_latency,
    top_kernels,
)
from kdash.analyses.windows import (
    PACK_BELOW,
    pack,
    recorded_share,
    window_rows,
    with_open_window,
)
from kdash.names import short_names

from ..columns import KERNEL_COLUMNS, PAD, Fit, fit_columns
from ..lanes import (  # noqa: F401  (re-exported: tests and bench/timeline_redraw.py use them)
    CUT,
    LABEL_W,
    MAX_LANES,
    MAX_NVTX_LANES,
    UNRECORDED,
    LaneStyles,
    cause_codes,
    coverage,
    idle_chars,
    lane_bins,
    lane_chars,
    render_lanes,
)
from .base import Pane, View

NO_KERNELS = (
    "Kernel timeline: no kernel data — needs the kdash agent in the target: start it with "
    "`kdash run -- CMD` (`?` shows why)"
)
# the agent tree's codes for an agent that is there but does not record (yet)
AGENT_FOUND_CODES = ("injecting", "agent_starting", "agent_degraded", "agent_unavailable")
# the codes of an agent tree that records kernels (healthy)
RECORDING_CODES = ("sampling", "continuous")
ANALYSIS_EVERY_S = 1.0
TABLE_ROWS = 50
NAME_MAX = 200  # the longest label the name column ever asks for
SCROLLBAR_W = 2  # the table's vertical scrollbar (50 rows rarely fit the pane)
NAME_MIN_START = 24  # the name column's width before the first fill
# (label, top_kernels column, ascending): `o` cycles through them in this order.
SORTS: list[tuple[str, str, bool]] = [
    ("total %", "total_ms", False),
    ("calls", "calls", False),
    ("mean", "mean_us", False),
    ("p99", "p99_us", False),
    ("name", "name", True),
]


def analysis_notes(
    kernels: pd.DataFrame,
    api: pd.DataFrame,
    markers: pd.DataFrame | None = None,
    threads: pd.DataFrame | None = None,
    accounting: Accounting | None = None,
    memcpy: pd.DataFrame | None = None,
) -> str:
    """Per GPU, busy and idle time (`kdash.analyses.gpu_time`) with its worst actionable gap,
    and launch-to-start latency, in one line ("" without kernels; `kdash report` spells the
    same findings out). `accounting`: the tables' `gpu_time.account`, when the caller has it.

    With a duty-cycled agent only its recording windows count as recorded time.
    """
    names = thread_names(threads)
    notes = []
    for d in idle_summaries(kernels, api, markers, accounting=accounting, memcpy=memcpy):
        line = gpu_time_text(d.time, with_copies=memcpy is not None)
        state = feeder_state(threads, d.feeder)
        if d.top in ACTIONABLE:
            ex = d.example
            line += f" · worst {d.top} gap {ex['gap_us'] / 1e3:.1f} ms: {gap_brief(ex, names)}"
        if d.top in (*ACTIONABLE, SHORT) and state is not None and d.share >= IDLE_INFO_SHARE:
            if state.problem == "runq":
                line += f" · its feeder waits {state.runq_ms_per_s:.0f} ms/s for a CPU"
            elif state.problem == "busy":
                line += f" · its feeder is on a CPU {state.cpu_pct:.0f}% of the time"
        notes.append(line)
    lat = launch_latency(kernels, api)
    if not lat.empty:
        p50, p99 = np.percentile(lat["latency_us"].to_numpy(dtype=float), [50, 99])
        notes.append(f"launch→start p50 {p50:.1f} µs, p99 {p99:.1f} µs")
    return " · ".join(notes)


def empty_line(agent_health: Health | str) -> str:
    """The pane's one line before any kernel arrived: the generic "needs the agent" advice,
    except under `attach --no-inject`, where the agent source's own reason ("no agent in pid
    N (injection off: --no-inject); ...") says the pane is empty by the user's choice, where
    the source says why no agent could be had (a failed injection's precondition), and where
    an agent records but has seen no kernel yet."""
    h = as_health(agent_health, "agent")
    # empty by choice (the user's --no-inject, or a graph process left alone by design): its
    # reason, never "yet"
    if h.code in ("no_inject", "graphs_off"):
        return "Kernel timeline: " + h.reason
    # why an agent is missing where kdash tried to put one (injection failed or a precondition
    # did not hold): say that, not the generic advice
    if h.code == "no_agent" and h.fields.get("note"):
        return f"Kernel timeline: no agent — {h.fields['note']}"
    # an agent is there but cannot record (no driver, CUPTI held by a profiler, busy): its
    # reason, not the advice to start one
    if h.code in AGENT_FOUND_CODES and "pid" in h.fields:
        return f"Kernel timeline: no kernels yet — agent {h.reason}"
    # an agent records, but the target has launched no kernel since (a server still loading
    # its model, or compiling its kernels): the advice to start an agent would be wrong
    if h.code in RECORDING_CODES:
        return f"Kernel timeline: no kernels yet — the agent is recording ({h.reason}), none seen"
    return NO_KERNELS


def top_summary(rows: pd.DataFrame, sort_label: str, n: int = 6) -> str:
    """The table squeezed into one line, for 80x24 where the pane has no room for rows: the
    leading names with their share, in the table's order (the table itself is one key away)."""
    if rows.empty:
        return "top: no kernel name matches the filter"
    head = rows.head(n)
    labels = short_names(head["name"].astype(str), 28)
    parts = [f"{labels[str(r.name)]} {r.pct:.1f}%" for r in head.itertuples()]
    return f"top by {sort_label} (1: table): " + " · ".join(parts)


def has_windows(markers: dict[str, np.ndarray]) -> bool:
    """Whether any "activity on" window row is in `markers` (the agent is duty-cycled)."""
    if not len(markers["start_ns"]):
        return False
    return bool(((markers["domain"] == ACTIVITY_DOMAIN) & (markers["name"] == ACTIVITY_NAME)).any())


def sort_top(top: pd.DataFrame, sort: int, needle: str) -> pd.DataFrame:
    """The table's rows: `top` filtered by a case-insensitive substring of the demangled
    name (`needle`, "" for all), sorted by `SORTS[sort]`, cut to `TABLE_ROWS`."""
    if top.empty:
        return top
    shown = top
    if needle:
        full = top["name"].astype(str).str.lower()
        shown = top[full.str.contains(needle.lower(), regex=False)]
    _, col, ascending = SORTS[sort]
    if col == "name":
        labels = short_names(top["name"].astype(str), 200)
        key = shown["name"].map(lambda n: labels[str(n)].lower())
        shown = shown.assign(_key=key).sort_values("_key", kind="stable").drop(columns="_key")
    else:
        shown = shown.sort_values(col, ascending=ascending, kind="stable")
    return shown.head(TABLE_ROWS)


def row_cells(r) -> list[str]:
    """One `top_kernels` row's cells in `KERNEL_COLUMNS` order (the name apart)."""
    return [
        f"{r.calls}",
        f"{r.total_ms:.2f}",
        f"{r.pct:.1f}",
        f"{r.mean_us:.1f}",
        f"{r.p50_us:.1f}",
        f"{r.p99_us:.1f}",
        str(r.grid),
        str(r.block),
        f"{r.registers}" if r.registers >= 0 else "n/a",
        f"{r.smem}" if r.smem >= 0 else "n/a",
    ]


def use_window_view(choice: bool | None, duty_cycled: bool, share: float) -> bool:
    """Whether the strip shows recorded windows side by side: the user's choice (`w`) when
    there is one, else when the agent duty-cycles and less than `PACK_BELOW` of the shown
    range was recorded."""
    if choice is not None:
        return choice and duty_cycled
    return duty_cycled and share < PACK_BELOW


class KernelTable(DataTable):
    """The top-kernels table: the name column stays put (fixed) while `←`/`→` scroll the
    others a column at a time. The app's `←`/`→` (pan the time window) give way to it while
    it has columns out of view (`takes_sideways_keys`)."""

    def on_resize(self) -> None:
        # the columns follow the table's width (the pane refits them once this layout is done)
        pane = next((n for n in self.ancestors if isinstance(n, KernelPane)), None)
        if pane is not None:
            self.call_after_refresh(pane.refit)

    def takes_sideways_keys(self) -> bool:
        return self.has_focus and self.display and self.max_scroll_x > 0

    def _column_edges(self) -> list[int]:
        """Scroll offsets at which each scrolled column starts (the fixed name excluded)."""
        edges, x = [0], 0
        for col in self.ordered_columns[self.fixed_columns :]:
            x += col.get_render_width(self)
            edges.append(x)
        return edges

    def action_cursor_right(self) -> None:
        at = round(self.scroll_x)
        nxt = next((e for e in self._column_edges() if e > at), at)
        self.scroll_to(x=min(nxt, self.max_scroll_x), animate=False)

    def action_cursor_left(self) -> None:
        at = round(self.scroll_x)
        prev = [e for e in self._column_edges() if e < at]
        self.scroll_to(x=prev[-1] if prev else 0, animate=False)


class NameFilter(Input):
    """The table's name filter. Its own `escape` binding: the app's `escape` (restore the
    layout) would otherwise take it."""

    BINDINGS = [Binding("escape", "clear", "clear the kernel name filter", show=False)]

    def action_clear(self) -> None:
        self.value = ""
        self.post_message(self.Submitted(self, ""))


class KernelPane(Pane):
    key = "1"
    title = "Kernels"
    COMPONENT_CLASSES = {
        "kernel-pane--lane",
        "kernel-pane--label",
        "kernel-pane--note",
        "kernel-pane--unrecorded",
        "kernel-pane--nvtx",
    }
    BINDINGS = [
        Binding("o", "cycle_sort", "kernel table: sort by total % / calls / mean / p99 / name"),
        Binding("slash", "filter", "kernel table: filter by name (enter applies, esc clears)"),
        Binding("w", "toggle_windows", "kernel timeline: windows side by side / continuous time"),
    ]
    waiting = NO_KERNELS

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._notes: str | None = None
        self._idle: dict | None = None  # the analysed window's explained gaps (idle lane)
        self._analysed_key: tuple = ()
        self._analysed_at = 0.0
        self._lanes_key: tuple = ()
        self._duty_key: tuple = ()
        self._duty = False
        self.window_choice: bool | None = None  # `w`: window view on/off; None: automatic
        self.packed = False  # whether the strip last drawn is the window view
        self._fit: Fit | None = None
        self._fit_key: tuple = ()
        self._top = pd.DataFrame()
        self.sort = 0  # index into SORTS
        self.name_filter = ""
        self.analyses_applied = 0  # results of the analysis worker shown (tests wait on it)
        self.lanes = Static("", classes="lanes", markup=False)
        self.table_line = Static("", classes="table-line", markup=False)
        self.filter_input = NameFilter(placeholder="kernel name contains…", classes="name-filter")
        self.table = KernelTable(
            cursor_type="row", zebra_stripes=False, fixed_columns=1, classes="top-kernels"
        )
        self.name_line = Static("", classes="kernel-name", markup=False)
        self.top_line = Static("", classes="top-line", markup=False)
        # Columns of explicit widths, set by `_fill_table` from the rows and the table's width:
        # auto-width would depend on whether the first fill landed before or after the first
        # layout, and the table would jump.
        self.table.add_column("kernel", key="kernel", width=NAME_MIN_START)
        for c in KERNEL_COLUMNS:
            self.table.add_column(c.label, key=c.key)

    def compose(self) -> ComposeResult:
        yield self.empty_line
        yield self.lanes
        yield self.table_line
        yield self.filter_input
        yield self.table
        yield self.top_line
        yield self.name_line

    def on_mount(self) -> None:
        self.filter_input.display = False
        self._show_table_line()

    def focus_target(self):
        # at 80x24 the table is folded into one line: the pane itself takes focus (o, /, w)
        return self.table if not self.has_class("-empty") and self.table.display else self

    def refit(self) -> None:
        """Lay the table's columns out again when its width changed."""
        if len(self._top) and self._table_width() != self._fit_key[:1]:
            self._fill_table()

    def _table_width(self) -> tuple[int]:
        return (max(0, self.table.size.width - SCROLLBAR_W),)

    def show(self, view: View) -> None:
        batch = view.store.get("kernels", view.since_ns, view.until_ns)
        if len(batch["start_ns"]) == 0:
            total = view.store.stats()["kernels"]["rows"]
            if total == 0:  # a trace without kernels (CPU-only torch.profiler) still has lanes
                all_markers = view.store.get("markers", None, view.until_ns)
                if has_host_ranges(all_markers):
                    self.set_empty(None)
                    open_ = all_markers["end_ns"] >= view.since_ns
                    markers = {c: v[open_] for c, v in all_markers.items()}
                    self._draw_lanes(view, batch, markers, all_markers)
                    return
            self.set_empty(
                empty_line(view.health_of("agent") or "")
                if total == 0
                else "Kernel timeline: no kernels in the shown window"
            )
            return
        self.set_empty(None)
        # Markers: every row up to the window's end that is still open at its start (recording
        # windows and NVTX ranges that began before the view reach into it).
        all_markers = view.store.get("markers", None, view.until_ns)
        markers = {c: v[all_markers["end_ns"] >= view.since_ns] for c, v in all_markers.items()}
        # The analyses (pandas: ~50-100 ms at 100k kernels) run in a thread worker, at most
        # once a second live and once per distinct window in a replay; their result is posted
        # back to the UI thread. The lanes (numpy, a few ms) are drawn on every redraw.
        key = (view.since_ns, view.until_ns, len(batch["start_ns"]))
        now = time.monotonic()
        due = view.mode == "replay" or now - self._analysed_at >= ANALYSIS_EVERY_S
        if self._analysed_key != key and due:
            self._analysed_key, self._analysed_at = key, now
            api = view.store.get("api", view.since_ns, view.until_ns)
            threads = view.store.get("threads", view.since_ns, view.until_ns)
            memcpy = view.store.get("memcpy", view.since_ns, view.until_ns)
            self._analyse(key, batch, api, markers, threads, memcpy)
        self._draw_lanes(view, batch, markers, all_markers)

    def _draw_lanes(self, view: View, batch: dict, markers: dict, all_markers: dict) -> None:
        """Redraw the strip unless nothing it depends on changed (the same text again would
        still cost the Static a re-render)."""
        duty_key = (len(all_markers["start_ns"]), int(all_markers["start_ns"][-1:].sum()))
        if duty_key != self._duty_key:
            self._duty_key, self._duty = duty_key, has_windows(all_markers)
        styles = LaneStyles(
            lane=self.get_component_rich_style("kernel-pane--lane"),
            label=self.get_component_rich_style("kernel-pane--label"),
            note=self.get_component_rich_style("kernel-pane--note"),
            unrecorded=self.get_component_rich_style("kernel-pane--unrecorded"),
            nvtx=self.get_component_rich_style("kernel-pane--nvtx"),
        )
        width = self.content_region.width or 60
        n = len(batch["start_ns"])
        packing = None
        if self._duty or self.window_choice:
            starts, ends = window_rows(markers)
            if view.mode == "live":
                starts, ends = with_open_window(
                    starts, ends, batch["start_ns"], batch["end_ns"], view.until_ns
                )
            share = recorded_share(starts, ends, view.since_ns, view.until_ns)
            if use_window_view(self.window_choice, self._duty, share):
                packing = pack(starts, ends, view.since_ns, view.until_ns, lane_bins(width))
        self.packed = packing is not None
        # 80x24 has four rows for the pane: no idle lane there (key 1 shows it)
        app = self.app
        idle = None if app.has_class("-compact") and not app.has_class("-maximized") else self._idle
        key = (
            view.since_ns, view.until_ns, view.mode, view.anchor_ns, n,
            int(batch["start_ns"][-1]) if n else 0, len(markers["start_ns"]), self._duty,
            width, self._notes, styles, id(idle), self.packed,
        )  # fmt: skip
        if key == self._lanes_key:
            return
        self._lanes_key = key
        self.lanes.update(
            render_lanes(
                batch,
                markers,
                view.since_ns,
                view.until_ns,
                width,
                view.axis,
                styles,
                self._notes,
                self._duty,
                idle,
                packing,
                lambda t: f"{view.rel(t):.1f}s",
            )  # fmt: skip
        )

    def action_toggle_windows(self) -> None:
        """`w`: the window view on or off (it is the default below a fifth recorded)."""
        if not self._duty:
            self.app.notify(
                "no recording windows here: the agent recorded continuously, every column "
                "of the timeline is recorded time",
                timeout=4,
            )
            return
        self.window_choice = not self.packed
        self._lanes_key = ()
        request = getattr(self.app, "request_redraw", None)
        if request is not None:
            request(now=True)

    @work(thread=True, exclusive=True, exit_on_error=False, group="kernel-analysis")
    def _analyse(
        self,
        key: tuple,
        batch: dict,
        api: dict,
        markers: dict,
        threads: dict | None = None,
        memcpy: dict | None = None,
    ) -> None:
        """Per-name summary of every kernel of the window (the table sorts and filters all of
        them), GPU busy and idle time by cause and launch-to-start latency, off the UI thread."""
        kernels = schema.to_frame("kernels", batch)
        top = top_kernels(kernels)
        api_f, markers_f = schema.to_frame("api", api), schema.to_frame("markers", markers)
        memcpy_f = schema.to_frame(
            "memcpy", memcpy if memcpy is not None else schema.empty("memcpy")
        )
        acc = account(kernels, memcpy_f, markers_f, api_f)
        gaps = acc.gaps
        notes = analysis_notes(
            kernels,
            api_f,
            markers_f,
            schema.to_frame("threads", threads) if threads is not None else None,
            accounting=acc,
            memcpy=memcpy_f,
        )
        # the lane is redrawn far more often than analysed: cause names become codes once here
        idle = {c: gaps[c].to_numpy() for c in ("device", "start_ns", "end_ns")}
        idle["code"] = cause_codes(gaps["cause"].to_numpy())
        self.app.call_from_thread(self._apply_analysis, key, top, notes, idle)

    def _apply_analysis(
        self, key: tuple, top: pd.DataFrame, notes: str, idle: dict | None = None
    ) -> None:
        if key != self._analysed_key:
            return  # a newer window's analysis is on its way
        self._notes = notes
        self._idle = idle
        self._top = top
        self._fill_table()
        self.analyses_applied += 1
        request = getattr(self.app, "request_redraw", None)
        if request is not None:
            request(now=True)  # the notes line sits under the lanes

    # -- table: sort, filter, full name ---------------------------------------------------------
    def action_cycle_sort(self) -> None:
        self.sort = (self.sort + 1) % len(SORTS)
        self._fill_table()

    def action_filter(self) -> None:
        self.filter_input.value = self.name_filter
        self.filter_input.display = True
        self.filter_input.focus()

    @on(Input.Submitted, ".name-filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.name_filter = event.value.strip()
        self.filter_input.display = False
        self.table.focus()
        self._fill_table()

    @on(DataTable.RowHighlighted, ".top-kernels")
    def _row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        name = event.row_key.value if event.row_key is not None else None
        self.name_line.update(name or "")

    @on(DataTable.HeaderSelected, ".top-kernels")
    def _header_selected(self, event: DataTable.HeaderSelected) -> None:
        """A click on a sortable column's header sorts by it (as `o` would, directly)."""
        label = {"%": "total %", "total ms": "total %", "mean µs": "mean", "p99 µs": "p99",
                 "kernel": "name", "calls": "calls"}.get(str(event.label))  # fmt: skip
        for i, (name, _, _) in enumerate(SORTS):
            if name == label:
                self.sort = i
                self._fill_table()

    def _show_table_line(self, shown: int = 0) -> None:
        hidden = len(self._fit.hidden) if self._fit is not None else 0
        more = f", ←→: {hidden} more" if hidden else ""
        what = f"top kernels by {SORTS[self.sort][0]} (o: sort, /: filter{more})"
        if self.name_filter:
            what += f" · filter {self.name_filter!r}: {shown} of {len(self._top)} names"
        self.table_line.update(what)
        # The title too: the compact layout hides the line, never the fact that rows are hidden.
        title = f"{self.key} {self.title}"
        self.border_title = f"{title} · filter {self.name_filter!r}" if self.name_filter else title

    def _fill_table(self) -> None:
        """Rows for the sort and filter; the columns re-laid out when the rows' widths or the
        table's width changed (the scroll position kept)."""
        keep = self.table.cursor_row
        rows = sort_top(self._top, self.sort, self.name_filter)
        names = self._top["name"].astype(str) if len(rows) else pd.Series([], dtype=str)
        cells = [row_cells(r) for r in rows.itertuples(index=False)]
        widths = [
            max([len(c.label)] + [len(row[i]) for row in cells])
            for i, c in enumerate(KERNEL_COLUMNS)
        ]
        full = short_names(names, NAME_MAX) if len(rows) else {}
        need = max([len("kernel")] + [len(full[str(r.name)]) for r in rows.itertuples()])
        (avail,) = self._table_width()
        fit = fit_columns(
            avail or NAME_MIN_START + PAD, need, widths, [c.priority for c in KERNEL_COLUMNS]
        )
        # Labels over every name of the window, so a row reads the same whatever the filter
        labels = short_names(names, fit.name_width) if len(rows) else {}
        fit_key = (avail, fit, tuple(widths))
        scroll_x = self.table.scroll_x
        if fit_key != self._fit_key:
            self._fit_key, self._fit = fit_key, fit
            self.table.clear(columns=True)
            self.table.add_column("kernel", key="kernel", width=fit.name_width)
            for i in fit.order:
                c = KERNEL_COLUMNS[i]
                self.table.add_column(c.label, key=c.key, width=widths[i])
        else:
            self.table.clear()
        for r, row in zip(rows.itertuples(index=False), cells, strict=True):
            self.table.add_row(labels[str(r.name)], *(row[i] for i in fit.order), key=str(r.name))
        if scroll_x:
            # after the new columns are laid out (the scroll range is theirs by then)
            self.table.call_after_refresh(self.table.scroll_to, x=scroll_x, animate=False)
        self._show_table_line(len(rows))
        self.top_line.update(top_summary(rows, SORTS[self.sort][0]))
        if self.table.row_count:
            self.table.move_cursor(row=min(max(keep, 0), self.table.row_count - 1), animate=False)
        else:
            self.name_line.update("no kernel name matches the filter" if self.name_filter else "")
