"""CPU affinity pane: what is wrong with the CPU threads that feed the GPU, then the evidence.

Findings come first (severity, what, which thread, evidence, what to do), because they are the
answer; the thread table below is the evidence, sorted by CPU %. Live, the findings are the
recorder's (refreshed each second on the poll thread, read here); in a replay, the capture's
findings table for the shown window, the latest of each (kind, subject).

Thread columns: cpu% and runq ms/s are the latest sample (both are already rates); sw/s and
mig/s are rates over the shown window (the table keeps cumulative counters).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import DataTable, Static

from ..widgets.spark import fmt
from .base import Pane, View

SEVERITY_ORDER = {"critical": 0, "warning": 1, "info": 2}
SEVERITY_TAG = {"critical": "CRIT", "warning": "WARN", "info": "info"}


def current_findings(view: View) -> pd.DataFrame:
    """The findings to show for this view, most severe first, one per (kind, subject)."""
    if view.mode == "live" and view.findings is not None:
        f = view.findings
    else:
        f = view.store.frame("findings", view.since_ns, view.until_ns)
    if f is None or f.empty:
        return pd.DataFrame(columns=["severity", "kind", "subject", "evidence", "advice"])
    if "t_ns" in f.columns:
        f = f.sort_values("t_ns")
    f = f.drop_duplicates(subset=["kind", "subject"], keep="last")
    rank = f["severity"].map(lambda s: SEVERITY_ORDER.get(str(s), 3))
    return f.assign(_rank=rank).sort_values(["_rank", "kind"], kind="stable").drop(columns="_rank")


def thread_rows(threads: pd.DataFrame) -> pd.DataFrame:
    """One row per (pid, tid): latest values plus window rates of the cumulative counters."""
    cols = [
        "pid",
        "tid",
        "name",
        "cpu_pct",
        "cpu",
        "allowed_cpus",
        "runq_ms_per_s",
        "sw_s",
        "mig_s",
    ]
    if threads.empty:
        return pd.DataFrame(columns=cols)
    t = threads.sort_values("t_ns")
    g = t.groupby(["pid", "tid"], sort=False)
    last = g.tail(1).set_index(["pid", "tid"])
    first = g.head(1).set_index(["pid", "tid"]).reindex(last.index)
    dt = (last["t_ns"] - first["t_ns"]).to_numpy(dtype=np.float64) / 1e9
    sw_last = last["vol_switches"] + last["invol_switches"]
    sw_first = first["vol_switches"] + first["invol_switches"]
    with np.errstate(invalid="ignore", divide="ignore"):
        sw = np.where(
            (dt > 0) & (first["vol_switches"].to_numpy() >= 0),
            (sw_last - sw_first).to_numpy(dtype=np.float64) / dt,
            np.nan,
        )
        mig = np.where(
            (dt > 0) & (first["migrations"].to_numpy() >= 0),
            (last["migrations"] - first["migrations"]).to_numpy(dtype=np.float64) / dt,
            np.nan,
        )
    out = last.reset_index()[
        ["pid", "tid", "name", "cpu_pct", "cpu", "allowed_cpus", "runq_ms_per_s"]
    ].assign(sw_s=sw, mig_s=mig)
    key = out["cpu_pct"].fillna(-1.0)
    return out.assign(_k=key).sort_values(["_k", "tid"], ascending=[False, True]).drop(columns="_k")


class CpuPane(Pane):
    key = "3"
    title = "CPU affinity"
    COMPONENT_CLASSES = {
        "cpu-pane--critical",
        "cpu-pane--warning",
        "cpu-pane--info",
        "cpu-pane--advice",
        "cpu-pane--ok",
    }

    def compose(self) -> ComposeResult:
        yield self.empty_line
        self.findings = Static("", markup=False, classes="findings")
        self.table = DataTable(cursor_type="row", classes="threads")
        yield self.findings
        yield self.table

    def on_mount(self) -> None:
        self.table.add_columns(
            "pid", "tid", "name", "cpu%", "cpu", "allowed", "runq ms/s", "sw/s", "mig/s"
        )
        self.set_empty("CPU affinity: waiting for data")

    def focus_target(self):
        return self.table if not self.has_class("-empty") else self

    def show(self, view: View) -> None:
        threads = view.store.frame("threads", view.since_ns, view.until_ns)
        findings = current_findings(view)
        if threads.empty and findings.empty:
            health = view.health.get("sched")
            why = (
                f"sched {health}"
                if health and not health.startswith(("ok", "starting"))
                else "no thread samples in the shown window"
            )
            self.set_empty(f"CPU affinity: no thread data — {why}")
            return
        self.set_empty(None)
        self.findings.update(self._findings_text(findings))
        self._fill_table(thread_rows(threads))

    def _findings_text(self, f: pd.DataFrame) -> Text | Table:
        out = Text()
        if f.empty:
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
        for r in f.itertuples(index=False):
            sev = str(r.severity)
            style = self.get_component_rich_style(
                f"cpu-pane--{sev}" if sev in SEVERITY_ORDER else "cpu-pane--info"
            )
            body = Text(f"{r.kind} · {r.subject}: ", style)
            body.append(str(r.evidence))
            if str(r.advice):
                body.append(f"\n→ {r.advice}", advice_style)
            grid.add_row(Text(SEVERITY_TAG.get(sev, sev)[:4], style), body)
        return grid

    def _findings_compact(self, f: pd.DataFrame, advice_style) -> Text:
        """80 columns: each finding on one line and its advice on the next, cut with '…'."""
        width = max(20, self.content_region.width or 78)
        lines: list[Text] = []
        for r in f.itertuples(index=False):
            sev = str(r.severity)
            style = self.get_component_rich_style(
                f"cpu-pane--{sev}" if sev in SEVERITY_ORDER else "cpu-pane--info"
            )
            head = Text(f"{SEVERITY_TAG.get(sev, sev)[:4]:<4} {r.kind} · {r.subject}: ", style)
            head.append(str(r.evidence))
            head.truncate(width, overflow="ellipsis")
            lines.append(head)
            if str(r.advice):
                adv = Text(f"  → {r.advice}", advice_style)
                adv.truncate(width, overflow="ellipsis")
                lines.append(adv)
        return Text("\n").join(lines)

    def _fill_table(self, rows: pd.DataFrame) -> None:
        keep = self.table.cursor_row
        self.table.clear()
        for r in rows.itertuples(index=False):
            self.table.add_row(
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
        if self.table.row_count:
            self.table.move_cursor(row=min(keep, self.table.row_count - 1), animate=False)
