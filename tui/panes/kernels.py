"""Kernel timeline pane: per-(GPU, stream) lanes, NVTX lanes and the top-kernels table.

The lanes share the clock pane's time axis (same window, same binning), so a busy lane and a
throttle band line up column for column; the app's `+`/`-`/`←`/`→`/`p`/`r` move that window.
Three things make the strip honest about what it shows:

* NVTX ranges (markers rows of any domain but the agent's own "kdash") get a lane per domain,
  so "which phase of the step was this" sits above the kernels it launched.
* Time the agent did not record (its duty cycle keeps CUPTI activity on ~10% of the time and
  says when with "activity on" markers rows) is drawn as a dim "·", never as a blank: a blank
  would read as "GPU idle". Busy shades are then the share of the *recorded* part of a bin.
  With no window rows at all (continuous activity, older captures) everything counts as
  recorded.
* The redraw has to stay under 20 ms with 100,000 kernels in the window (bench/
  timeline_redraw.py measures `render_lanes`): all lanes are binned in one pass of
  `np.bincount` over the rows (no boolean mask and sort per lane), and the last drawn text is
  reused while the window, the rows and the width are unchanged.

Kernel records come from the in-process agent (CUPTI); until a capture or a live agent brings
them, the pane is one line saying what will fill it and how.

The table lists every kernel name of the window (the first `TABLE_ROWS` after sorting and
filtering): `o` cycles the sort column, `/` opens a name filter (Enter applies a
case-insensitive substring match on the demangled name, Esc clears it), and the line under
the table shows the full demangled name of the row under the cursor, which the 40-column
name cell has to cut.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pandas as pd
from rich.style import Style
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import DataTable, Input, Static

from kdash import schema
from kdash.analyses.gpu_time import Accounting, account, gpu_time_text
from kdash.analyses.kernel_findings import (
    ACTIONABLE,
    CAUSES,
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
from kdash.names import short_names

from ..widgets.spark import SHADES
from .base import Pane, View

NO_KERNELS = (
    "Kernel timeline: no kernel data — needs the kdash agent in the target: start it with "
    "`kdash run -- CMD` (`?` shows why)"
)
NO_INJECT_MARK = "--no-inject"  # in the agent source's reason under `attach --no-inject`
MAX_LANES = 8
MAX_NVTX_LANES = 3  # NVTX domains drawn as lanes; more are counted on one line
LABEL_W = 12
UNRECORDED = "·"
ANALYSIS_EVERY_S = 1.0
TABLE_ROWS = 50
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


def empty_line(agent_health: str) -> str:
    """The pane's one line before any kernel arrived: the generic "needs the agent" advice,
    except under `attach --no-inject`, where the agent source's own reason ("no agent in pid
    N (injection off: --no-inject); ...") says the pane is empty by the user's choice, and
    where the source says why no agent could be had (a failed injection's precondition)."""
    if NO_INJECT_MARK in agent_health:
        return "Kernel timeline: " + agent_health.split(": ", 1)[-1]
    # why an agent is missing where kdash tried to put one (injection failed or a precondition
    # did not hold): say that, not the generic advice
    if "or its children: " in agent_health:
        return "Kernel timeline: no agent — " + agent_health.split("or its children: ", 1)[1]
    # an agent is there but cannot record (no driver, CUPTI held by a profiler, busy): its
    # reason, not the advice to start one
    m = re.match(r"(unavailable|degraded|starting): (.*)", agent_health)
    if m and re.search(r"\bpid \d+", m.group(2)) and "no kdash agent" not in m.group(2):
        return f"Kernel timeline: no kernels yet — agent {m.group(2)}"
    return NO_KERNELS


# -- lanes (pure functions: the pane and bench/timeline_redraw.py call the same code) ---------


@dataclass(frozen=True)
class LaneStyles:
    """The Rich styles of the strip (from the pane's component classes; plain in the bench)."""

    lane: Style = Style()
    label: Style = Style()
    note: Style = Style()
    unrecorded: Style = Style(dim=True)
    nvtx: Style = Style()


def coverage(
    codes: np.ndarray,
    n_lanes: int,
    starts: np.ndarray,
    ends: np.ndarray,
    since_ns: int,
    until_ns: int,
    bins: int,
) -> np.ndarray:
    """Covered share (0..1) of each of `bins` bins, per lane: an (n_lanes, bins) array.

    `codes[i]` is row i's lane (0..n_lanes-1). One pass over all rows, whatever the number of
    lanes: the covered length up to a bin edge g is the sum over intervals of
    clamp(g - start, 0, end - start) = g·#(start < g) − Σ(start < g) − (the same for ends),
    and the counts and sums by bin come from four `np.bincount` calls on (lane, bin) keys.
    Overlapping intervals on one lane count once per bin up to 1.0 (the result is clipped).
    """
    out = np.zeros((n_lanes, bins))
    if bins <= 0 or n_lanes == 0 or len(starts) == 0:
        return out
    scale = bins / max(1, until_ns - since_ns)
    ps = (np.clip(starts, since_ns, until_ns) - since_ns) * scale  # float64, bin units
    pe = (np.clip(ends, since_ns, until_ns) - since_ns) * scale
    pe = np.maximum(pe, ps)
    stride = bins + 2
    base = codes.astype(np.int64) * stride
    size = n_lanes * stride
    grid = np.arange(bins + 1, dtype=np.float64)
    covered = np.zeros((n_lanes, bins + 1))
    for pos, sign in ((ps, 1.0), (pe, -1.0)):
        # Key floor(pos)+1: an exclusive cumulative sum then counts the positions < g exactly.
        key = base + np.minimum(pos.astype(np.int64), bins) + 1
        n = np.bincount(key, minlength=size).reshape(n_lanes, stride).cumsum(axis=1)
        s = np.bincount(key, weights=pos, minlength=size).reshape(n_lanes, stride).cumsum(axis=1)
        covered += sign * (grid * n[:, : bins + 1] - s[:, : bins + 1])
    out = np.clip(np.diff(covered, axis=1), 0.0, 1.0)
    return out


def lane_chars(frac: np.ndarray, unrecorded: np.ndarray | None) -> str:
    """Busy share per bin as shade characters (vectorised `spark.shade`); "·" where the bin
    was not recorded at all."""
    top = len(SHADES) - 1
    idx = np.where(frac > 0, np.clip(np.ceil(frac * top), 1, top), 0).astype(np.int64)
    chars = np.array(list(SHADES))[idx]
    if unrecorded is not None:
        chars[unrecorded] = UNRECORDED
    return "".join(chars.tolist())


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of True in `mask`."""
    if not mask.any():
        return []
    d = np.diff(np.concatenate([[0], mask.astype(np.int8), [0]]))
    return list(zip(np.flatnonzero(d == 1).tolist(), np.flatnonzero(d == -1).tolist(), strict=True))


def _factorize(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(codes, sorted unique keys) in O(n): np.unique's sort was the slow part of a redraw.

    Integer keys of a small range (device and stream ids are small) go through a bincount
    lookup table; anything else through pandas' hash table.
    """
    if keys.dtype.kind == "i" and len(keys):
        lo, hi = int(keys.min()), int(keys.max())
        if hi - lo < 1 << 16:
            present = np.bincount(keys - lo, minlength=hi - lo + 1) > 0
            table = np.cumsum(present) - 1
            return table[keys - lo], np.flatnonzero(present) + lo
    codes, uniques = pd.factorize(keys, sort=True)
    return np.asarray(codes, dtype=np.int64), np.asarray(uniques)


def render_lanes(
    kernels: dict[str, np.ndarray],
    markers: dict[str, np.ndarray] | None,
    since_ns: int,
    until_ns: int,
    width: int,
    axis: Callable[[int], str],
    styles: LaneStyles | None = None,
    notes: str | None = None,
    duty_cycled: bool | None = None,
    idle: dict[str, np.ndarray] | None = None,
) -> Text:
    """The strip: NVTX lanes, kernel lanes (one per GPU and stream), an idle lane per GPU
    (`idle`: its explained gaps, each bin lettered by the cause that idled it most: h host,
    s sync, q quiet, g gpu, u unknown), the axis, the notes.

    `kernels` and `markers` are store batches (column -> array); `markers` may hold rows that
    start before `since_ns` (a window or range reaching into the view). `axis(bins)` draws
    the time axis line. `duty_cycled`: whether the agent wrote recording windows anywhere in
    the data (None: whether `markers` holds any) — a view zoomed into the gap between two
    windows holds none of them, yet nothing in it was recorded.
    """
    st = styles or LaneStyles()
    bins = max(1, max(10, width) - LABEL_W)
    out = Text(no_wrap=True, overflow="ellipsis")
    rows: list[tuple[str, str, Style, list[tuple[int, int]]]] = []

    # Recorded time: the agent's "activity on" windows. None: no windows, all recorded.
    recorded = None
    nvtx_rows = None
    if markers is not None and len(markers["start_ns"]):
        domain, name = markers["domain"], markers["name"]
        own = domain == ACTIVITY_DOMAIN
        win = own & (name == ACTIVITY_NAME)
        if duty_cycled is None:
            duty_cycled = bool(win.any())
        if duty_cycled:
            recorded = coverage(
                np.zeros(int(win.sum()), dtype=np.int64), 1,
                markers["start_ns"][win], markers["end_ns"][win], since_ns, until_ns, bins,
            )[0]  # fmt: skip
        nvtx_rows = ~own
    elif duty_cycled:
        recorded = np.zeros(bins)

    # NVTX lanes: one per domain (most rows first), shaded where any range covers the bin.
    extra_note = ""
    if nvtx_rows is not None and nvtx_rows.any():
        doms = markers["domain"][nvtx_rows].astype(str)
        codes, uniq = _factorize(doms)
        order = np.argsort(-np.bincount(codes, minlength=len(uniq)), kind="stable")
        keep = order[:MAX_NVTX_LANES]
        remap = np.full(len(uniq), -1, dtype=np.int64)
        remap[keep] = np.arange(len(keep))
        lane = remap[codes]
        sel = lane >= 0
        s = markers["start_ns"][nvtx_rows][sel].astype(np.int64)
        e = markers["end_ns"][nvtx_rows][sel].astype(np.int64)
        e = np.maximum(e, s + 1)  # an instant marker still marks its bin
        frac = coverage(lane[sel], len(keep), s, e, since_ns, until_ns, bins)
        for i, d in enumerate(uniq[keep]):
            rows.append((f"nvtx {d}", lane_chars(frac[i], None), st.nvtx, []))
        if len(uniq) > MAX_NVTX_LANES:
            extra_note = f"… {len(uniq) - MAX_NVTX_LANES} more NVTX domains"

    # Kernel lanes. One int64 key per (device, stream); stream + 1 keeps -1 (n/a) >= 0.
    dev = kernels["device"].astype(np.int64)
    stream = kernels["stream"].astype(np.int64, copy=False)
    # Dense keys when the stream ids are a small range (the usual case): the O(n) table path.
    s_lo = int(stream.min()) if len(stream) else 0
    s_span = (int(stream.max()) - s_lo + 1) if len(stream) else 1
    dense = (
        s_span * (int(dev.max()) + 1 if len(dev) else 1) < 1 << 16 and int(dev.min(initial=0)) >= 0
    )
    codes, keys = _factorize(
        dev * s_span + (stream - s_lo) if dense else (dev << 40) + (stream + 1)
    )
    if dense:
        keys = (keys // s_span << 40) + (keys % s_span + s_lo + 1)
    n_pairs = len(keys)
    shown = min(n_pairs, MAX_LANES)
    starts = kernels["start_ns"].astype(np.int64, copy=False)
    ends = kernels["end_ns"].astype(np.int64, copy=False)
    if n_pairs > shown:
        sel = codes < shown
        codes, starts, ends = codes[sel], starts[sel], ends[sel]
    busy = coverage(codes, shown, starts, ends, since_ns, until_ns, bins)
    unrec_runs: list[tuple[int, int]] = []
    unrecorded = None
    if recorded is not None:
        # A bin with a kernel was recorded whatever the windows say (the live tail: a window's
        # row is sent when it closes, its kernels may come first).
        unrecorded = (recorded <= 0) & (busy.sum(axis=0) <= 0)
        unrec_runs = _runs(unrecorded)
        with np.errstate(divide="ignore", invalid="ignore"):
            busy = np.where(recorded > 0, np.minimum(1.0, busy / recorded), busy)
    for n in range(shown):
        k = int(keys[n])
        label = f"GPU{k >> 40} s{k - ((k >> 40) << 40) - 1}"
        rows.append((label, lane_chars(busy[n], unrecorded), st.lane, unrec_runs))
    if idle is not None and len(idle["start_ns"]):
        for d in sorted({int(k) >> 40 for k in keys[:shown]}):
            chars = idle_chars(idle, d, since_ns, until_ns, bins)
            if chars.strip():
                rows.append((f"GPU{d} idle", chars, st.note, []))

    for i, (label, chars, style, runs) in enumerate(rows):
        if i:
            out.append("\n")
        out.append(label.ljust(LABEL_W)[:LABEL_W], st.label)
        at = len(out)
        out.append(chars, style)
        for a, b in runs:
            out.stylize(st.unrecorded, at + a, at + b)
    if n_pairs > MAX_LANES:
        out.append(f"\n… {n_pairs - MAX_LANES} more streams", st.note)
    if extra_note:
        out.append("\n" + extra_note, st.note)
    out.append("\n" + " " * LABEL_W + axis(bins), st.note)
    line = []
    if recorded is not None:
        share = float(np.clip(recorded, 0, 1).mean())
        line.append(f"{UNRECORDED} not recorded (agent duty cycle: {100 * share:.0f}% recorded)")
    if notes:
        line.append(notes)
    if line:
        out.append("\n" + " · ".join(line), st.note)
    return out


IDLE_MARK_SHARE = 0.05  # a bin gets a cause letter when that cause idled >= 5% of it
CAUSE_LETTERS = np.array([c[0] for c in CAUSES])


def cause_codes(causes: np.ndarray) -> np.ndarray:
    """Cause names as indexes into CAUSES (an unknown name counts as the last, "unknown")."""
    index = {c: i for i, c in enumerate(CAUSES)}
    return np.array([index.get(str(c), len(CAUSES) - 1) for c in causes], dtype=np.int64)


def idle_chars(
    idle: dict[str, np.ndarray], device: int, since_ns: int, until_ns: int, bins: int
) -> str:
    """One GPU's idle lane: per bin, the first letter of the cause that idled it most.

    `idle`: device, start_ns, end_ns and either "code" (`cause_codes`, what the pane passes)
    or "cause" names."""
    m = idle["device"] == device
    if not m.any():
        return " " * bins
    codes = idle["code"][m] if "code" in idle else cause_codes(idle["cause"][m])
    frac = coverage(
        codes, len(CAUSES), idle["start_ns"][m], idle["end_ns"][m], since_ns, until_ns, bins
    )
    marked = frac.max(axis=0) >= IDLE_MARK_SHARE
    return "".join(np.where(marked, CAUSE_LETTERS[frac.argmax(axis=0)], " "))


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
        self._top = pd.DataFrame()
        self.sort = 0  # index into SORTS
        self.name_filter = ""
        self.analyses_applied = 0  # results of the analysis worker shown (tests wait on it)
        self.lanes = Static("", classes="lanes", markup=False)
        self.table_line = Static("", classes="table-line", markup=False)
        self.filter_input = NameFilter(placeholder="kernel name contains…", classes="name-filter")
        self.table = DataTable(cursor_type="row", zebra_stripes=False, classes="top-kernels")
        self.name_line = Static("", classes="kernel-name", markup=False)
        self.top_line = Static("", classes="top-line", markup=False)
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
        yield self.table_line
        yield self.filter_input
        yield self.table
        yield self.top_line
        yield self.name_line

    def on_mount(self) -> None:
        self.filter_input.display = False
        self._show_table_line()

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
        # 80x24 has four rows for the pane: no idle lane there (key 1 shows it)
        app = self.app
        idle = None if app.has_class("-compact") and not app.has_class("-maximized") else self._idle
        key = (
            view.since_ns, view.until_ns, view.mode, view.anchor_ns, n,
            int(batch["start_ns"][-1]) if n else 0, len(markers["start_ns"]), self._duty,
            width, self._notes, styles, id(idle),
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
            )  # fmt: skip
        )

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
        what = f"top kernels by {SORTS[self.sort][0]} (o: sort, /: filter)"
        if self.name_filter:
            what += f" · filter {self.name_filter!r}: {shown} of {len(self._top)} names"
        self.table_line.update(what)
        # The title too: the compact layout hides the line, never the fact that rows are hidden.
        title = f"{self.key} {self.title}"
        self.border_title = f"{title} · filter {self.name_filter!r}" if self.name_filter else title

    def _fill_table(self) -> None:
        keep = self.table.cursor_row
        self.table.clear()
        rows = sort_top(self._top, self.sort, self.name_filter)
        # Labels over every name of the window, so a row reads the same whatever the filter
        labels = short_names(self._top["name"].astype(str), 40) if len(rows) else {}
        for r in rows.itertuples(index=False):
            self.table.add_row(
                labels[str(r.name)],
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
                key=str(r.name),
            )
        self._show_table_line(len(rows))
        self.top_line.update(top_summary(rows, SORTS[self.sort][0]))
        if self.table.row_count:
            self.table.move_cursor(row=min(max(keep, 0), self.table.row_count - 1), animate=False)
        else:
            self.name_line.update("no kernel name matches the filter" if self.name_filter else "")
