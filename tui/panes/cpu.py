"""CPU affinity pane: what is wrong with the CPU threads that feed the GPU, then the evidence.

Findings come first (severity, what, which thread, evidence, what to do), because they are the
answer; the thread table below is the evidence, sorted by CPU %. Live, the findings are the
recorder's (refreshed each second on the poll thread, read here); in a replay, the capture's
findings table (judged over the whole capture, so kept when the view pans), the latest of each
(kind, subject).

Thread columns: cpu% and runq ms/s are the latest sample (both are already rates); sw/s and
mig/s are rates over the shown window (the table keeps cumulative counters).
"""

from __future__ import annotations

import time

import numpy as np
import pandas as pd
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import DataTable, Static

from kdash.analyses.finding import SEVERITY_ORDER, Finding, findings_of

from ..widgets.spark import fmt
from .base import Pane, View

SEVERITY_TAG = {"critical": "CRIT", "warning": "WARN", "info": "info"}


def current_findings(view: View) -> list[Finding]:
    """The findings to show for this view, most severe first, one per (kind, subject).

    Records, not pandas: there are a handful, and a DataFrame round trip per redraw cost more
    than the rest of the pane.
    """
    if view.mode == "live" and view.findings is not None:
        rows = findings_of(view.findings)
    else:
        # A capture's findings were judged over its whole window (their evidence says so),
        # so panning or zooming a replay keeps them all rather than hiding them by time stamp.
        rows = findings_of(view.store.get("findings"))
    rows.sort(key=lambda f: f.t_ns)
    latest = {(f.kind, f.subject): f for f in rows}
    return sorted(latest.values(), key=lambda f: (f.rank, f.kind))


THREAD_COLUMNS = [
    "pid", "tid", "name", "cpu_pct", "cpu", "allowed_cpus", "runq_ms_per_s", "sw_s", "mig_s",
]  # fmt: skip


def thread_rows(threads: dict[str, np.ndarray]) -> pd.DataFrame:
    """One row per (pid, tid): latest values plus window rates of the cumulative counters.

    Works on the store's numpy batch (not a DataFrame): at 2 Hz with hundreds of threads a
    pandas groupby cost tens of ms per redraw; this is a sort and two index picks.
    """
    t = threads["t_ns"]
    if len(t) == 0:
        return pd.DataFrame(columns=THREAD_COLUMNS)
    pid, tid = threads["pid"], threads["tid"]
    order = np.lexsort((t, tid, pid))  # by pid, tid, then time
    p_s, t_s = pid[order], tid[order]
    new_group = np.ones(len(order), dtype=bool)
    new_group[1:] = (p_s[1:] != p_s[:-1]) | (t_s[1:] != t_s[:-1])
    first = order[new_group]
    last = order[np.r_[np.nonzero(new_group)[0][1:] - 1, len(order) - 1]]
    dt = (t[last] - t[first]).astype(np.float64) / 1e9
    sw = (threads["vol_switches"] + threads["invol_switches"]).astype(np.float64)
    mig = threads["migrations"].astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        sw_s = np.where(
            (dt > 0) & (threads["vol_switches"][first] >= 0), (sw[last] - sw[first]) / dt, np.nan
        )
        mig_s = np.where((dt > 0) & (mig[first] >= 0), (mig[last] - mig[first]) / dt, np.nan)
    out = pd.DataFrame(
        {
            "pid": pid[last],
            "tid": tid[last],
            "name": threads["name"][last],
            "cpu_pct": threads["cpu_pct"][last],
            "cpu": threads["cpu"][last],
            "allowed_cpus": threads["allowed_cpus"][last],
            "runq_ms_per_s": threads["runq_ms_per_s"][last],
            "sw_s": sw_s,
            "mig_s": mig_s,
        }
    )
    key = np.nan_to_num(out["cpu_pct"].to_numpy(dtype=np.float64), nan=-1.0)
    return out.iloc[np.lexsort((out["tid"].to_numpy(), -key))].reset_index(drop=True)


# Live, the thread table and findings are refilled at most this often while the view only
# follows the clock (top refreshes every 3 s): a repaint of the table was the largest part of
# kdash's own CPU at 120x40 (bench/self_cpu.py). A zoom, pan or replay redraws at once.
TABLE_EVERY_S = 2.0


class CpuPane(Pane):
    key = "3"
    title = "CPU affinity"
    waiting = "CPU affinity: waiting for data"
    COMPONENT_CLASSES = {
        "cpu-pane--critical",
        "cpu-pane--warning",
        "cpu-pane--info",
        "cpu-pane--advice",
        "cpu-pane--ok",
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.findings = Static("", markup=False, classes="findings")
        self.table = DataTable(cursor_type="row", classes="threads")
        self._columns = self.table.add_columns(
            "pid", "tid", "name", "cpu%", "cpu", "allowed", "runq ms/s", "sw/s", "mig/s"
        )
        self._findings_key: object = None
        self._rows_shown: list[tuple[str, ...]] | None = None
        self._shown_at = 0.0  # monotonic s of the last refill of the table
        self._shown_span: tuple[int, int] | None = None  # (window length, end) drawn then

    def compose(self) -> ComposeResult:
        yield self.empty_line
        with VerticalScroll(classes="findings-scroll"):
            yield self.findings
        yield self.table

    def focus_target(self):
        return self.table if not self.has_class("-empty") else self

    def _following(self, view: View) -> bool:
        """A live view that only moved on with time since the last fill (no zoom, pan or
        jump): the thread table may then wait for TABLE_EVERY_S."""
        last = self._shown_span
        span = (view.until_ns - view.since_ns, view.until_ns)
        return (
            view.mode == "live" and last is not None and span[0] == last[0] and span[1] >= last[1]
        )

    def show(self, view: View) -> None:
        now = time.monotonic()
        if self._following(view) and now - self._shown_at < TABLE_EVERY_S:
            return
        self._shown_at, self._shown_span = now, (view.until_ns - view.since_ns, view.until_ns)
        threads = view.store.get("threads", view.since_ns, view.until_ns)
        findings = current_findings(view)
        if len(threads["t_ns"]) == 0 and not findings:
            health = view.health_of("sched")
            why = (
                f"sched {health}"
                if health is not None and str(health) and health.state not in ("ok", "starting")
                else "no thread samples in the shown window"
            )
            self.set_empty(f"CPU affinity: no thread data — {why}")
            return
        self.set_empty(None)
        # Set again only when changed: each update costs Textual a layout pass and a repaint,
        # which at the redraw rate was most of kdash's own CPU.
        key = (
            [(f.severity, f.kind, f.subject, f.evidence, f.advice) for f in findings],
            self.app.has_class("-compact"),
            self.app.theme,
        )
        if key != self._findings_key:
            self._findings_key = key
            self.findings.update(self._findings_text(findings))
        self._fill_table(thread_rows(threads))

    def _findings_text(self, f: list[Finding]) -> Text | Table:
        out = Text()
        if not f:
            out.append("No findings in this window ", self.get_component_rich_style("cpu-pane--ok"))
            out.append(
                "(thresholds: [thresholds] in config.toml)",
                self.get_component_rich_style("cpu-pane--advice"),
            )
            return out
        advice_style = self.get_component_rich_style("cpu-pane--advice")
        if self.app.has_class("-compact"):
            return self._findings_compact(f, advice_style)
        grid = Table.grid(padding=(0, 1), expand=True)
        grid.add_column(width=4, no_wrap=True)
        grid.add_column(ratio=1)
        for r in f:
            sev = r.severity
            style = self.get_component_rich_style(
                f"cpu-pane--{sev}" if sev in SEVERITY_ORDER else "cpu-pane--info"
            )
            body = Text(f"{r.kind} · {r.subject}: ", style)
            body.append(r.evidence)
            if r.advice:
                body.append(f"\n→ {r.advice}", advice_style)
            grid.add_row(Text(SEVERITY_TAG.get(sev, sev)[:4], style), body)
        return grid

    def _findings_compact(self, f: list[Finding], advice_style) -> Text:
        """80 columns: each finding on one line and its advice on the next, cut with '…'."""
        lines: list[Text] = []
        for r in f:
            sev = r.severity
            style = self.get_component_rich_style(
                f"cpu-pane--{sev}" if sev in SEVERITY_ORDER else "cpu-pane--info"
            )
            head = Text(f"{SEVERITY_TAG.get(sev, sev)[:4]:<4} {r.kind} · {r.subject}: ", style)
            head.append(r.evidence)
            lines.append(head)
            if r.advice:
                lines.append(Text(f"  → {r.advice}", advice_style))
        out = Text("\n").join(lines)
        out.no_wrap = True
        out.overflow = "ellipsis"
        return out

    def _update_in_place(self, cells: list[tuple[str, ...]]) -> bool:
        """The same threads in the same order, every new value fitting its column: change
        only the cells that differ. A refill (clear, add_row) makes Textual measure the table
        and lay the screen out again, once a second; this is a repaint of the table alone.
        False when a refill is needed."""
        shown = self._rows_shown
        if shown is None or len(shown) != len(cells) or not cells:
            return False
        if any(a[:2] != b[:2] for a, b in zip(shown, cells, strict=True)):
            return False
        cols = self.table.columns
        widths = [cols[k].content_width for k in self._columns]
        changed = []
        for old, new in zip(shown, cells, strict=True):
            for i, (a, b) in enumerate(zip(old, new, strict=True)):
                if a != b:
                    if len(b) > widths[i]:
                        return False
                    changed.append((f"{new[0]}/{new[1]}", self._columns[i], b))
        for row_key, col_key, value in changed:
            self.table.update_cell(row_key, col_key, value)
        return True

    def _fill_table(self, rows: pd.DataFrame) -> None:
        """Refill the table; the cursor stays on the same thread (pid/tid) as rows re-sort."""
        cells = [
            (
                str(r.pid),
                str(r.tid),
                str(r.name)[:16],
                fmt(r.cpu_pct, ".0f"),
                str(r.cpu) if r.cpu >= 0 else "n/a",
                str(r.allowed_cpus) or "n/a",
                fmt(r.runq_ms_per_s, ".1f"),
                fmt(r.sw_s, ".0f"),
                fmt(r.mig_s, ".1f"),
            )
            for r in rows.itertuples(index=False)
        ]
        if cells == self._rows_shown:
            return  # the same text: a refill would only cost a repaint
        if self._update_in_place(cells):
            self._rows_shown = cells
            return
        self._rows_shown = cells
        keep_row = self.table.cursor_row
        keep_key = None
        if self.table.row_count:
            keep_key = self.table.coordinate_to_cell_key((keep_row, 0)).row_key.value
        self.table.clear()
        for c in cells:
            self.table.add_row(*c, key=f"{c[0]}/{c[1]}")
        if not self.table.row_count:
            return
        if keep_key is not None and keep_key in self.table.rows:
            row = self.table.get_row_index(keep_key)
        else:
            row = min(keep_row, self.table.row_count - 1)
        self.table.move_cursor(row=row, animate=False)
