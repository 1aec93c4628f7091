"""`kdash report`: a capture's summary as one dict (for --json) and as rich tables.

Built from the same analyses the panes use, so the report and the dashboard never disagree.
The dict is the `--json` document, described by kdash/data/report.schema.json and versioned by
its own `REPORT_SCHEMA_VERSION` (the capture's `schema_version` is the capture format's):
raise it when a field changes meaning or goes; adding a field keeps it.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from kdash import gpu_reasons, schema
from kdash.analyses.cost import cost_text
from kdash.analyses.cpu_ops import cpu_op_threads, top_cpu_ops
from kdash.analyses.finding import findings_of
from kdash.analyses.gpu_time import account, gpu_time_text
from kdash.analyses.kernel_findings import idle_findings, latency_findings
from kdash.analyses.kernels import top_kernels
from kdash.capture import Capture
from kdash.cubin import hot_lines_by_kernel
from kdash.names import demangle, short_names, symbols_of

REPORT_SCHEMA_VERSION = 1
DEFAULT_TOP = 20


def schema_path() -> Path:
    """The JSON Schema of the `--json` document (shipped as package data)."""
    return Path(__file__).resolve().parent / "data" / "report.schema.json"


def _num(v, nd: int = 1):
    if v is None:
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    if math.isnan(f):
        return None
    return round(f, nd)


def gpu_summary(gs: pd.DataFrame) -> list[dict]:
    """Per GPU over the window: clocks, power, temperature, utilisation and throttle reasons."""
    out = []
    if gs.empty:
        return out
    for gpu, g in gs.groupby("gpu"):
        bits = 0
        for b in g["throttle_reasons"].to_numpy():
            if b > 0:
                bits |= int(b)
        busy = g[g["util_gpu_pct"] >= 50]
        out.append(
            {
                "gpu": int(gpu),
                "samples": len(g),
                "sm_clock_mhz_mean": _num(g["sm_clock_mhz"].mean()),
                "sm_clock_mhz_max_seen": _num(g["sm_clock_mhz"].max()),
                "sm_clock_max_mhz": _num(g["sm_clock_max_mhz"].max()),
                "mem_clock_mhz_mean": _num(g["mem_clock_mhz"].mean()),
                "temp_c_max": _num(g["temp_c"].max()),
                "power_w_mean": _num(g["power_w"].mean()),
                "power_w_max": _num(g["power_w"].max()),
                "power_limit_w": _num(g["power_limit_w"].max()),
                "util_gpu_pct_mean": _num(g["util_gpu_pct"].mean()),
                "busy_fraction": _num(len(busy) / len(g), 3),
                "mem_used_mib_max": _num(g["mem_used_mib"].max(), 0),
                "throttle_reasons_seen": gpu_reasons.decode(bits),
            }
        )
    return out


def thread_summary(th: pd.DataFrame, limit: int = 10) -> list[dict]:
    if th.empty:
        return []
    rows = []
    for (pid, tid), g in th.groupby(["pid", "tid"]):
        last = g.iloc[-1]
        cpus = g["cpu"].to_numpy()
        rows.append(
            {
                "pid": int(pid),
                "tid": int(tid),
                "name": str(last["name"]),
                "cpu_pct_mean": _num(g["cpu_pct"].mean()),
                "runq_ms_per_s_mean": _num(
                    g["runq_ms_per_s"].clip(upper=schema.RUNQ_MAX_MS_PER_S).mean(), 2
                ),
                "cpus_seen": sorted({int(c) for c in cpus if c >= 0}),
                "allowed_cpus": str(last["allowed_cpus"]),
                "invol_switches": int(g["invol_switches"].max() - g["invol_switches"].min()),
            }
        )
    rows.sort(key=lambda r: -(r["cpu_pct_mean"] or 0))
    return rows[:limit]


def summarize(cap: Capture, top: int = DEFAULT_TOP) -> dict:
    """The report as one JSON-ready dict; `top` cuts each list (kernels, threads, hot lines)."""
    meta = cap.meta
    t = cap.tables
    target = meta.get("target") or {}
    window = meta.get("window") or {}
    tk = top_kernels(t["kernels"], limit=top)
    acc = account(t["kernels"], t.get("memcpy"), t.get("markers"), t.get("api"))
    return {
        "report_schema_version": REPORT_SCHEMA_VERSION,
        "schema_version": meta.get("schema_version"),
        "kdash_version": meta.get("kdash_version"),
        "title": meta.get("title"),
        "target": {
            "pid": target.get("pid"),
            "cmdline": target.get("cmdline", ""),
            "host": target.get("host") or (meta.get("host") or {}).get("hostname"),
        },
        "window": {
            "start_ns": window.get("start_ns"),
            "end_ns": window.get("end_ns"),
            "seconds": window.get("seconds"),
        },
        "gpus": meta.get("gpus") or [],
        "driver": meta.get("driver"),
        "sources": meta.get("sources") or {},
        "watch_cost": watch_cost(meta),
        "tables": {name: int(len(df)) for name, df in t.items()},
        "gpu_summary": gpu_summary(t["gpu_samples"]),
        "gpu_time": [g.to_json() for g in acc.gpus],
        "threads_top": thread_summary(t["threads"], limit=top),
        "findings": _findings(t, acc),
        "top_kernels": _top_kernel_rows(
            tk, symbols_of(t["kernel_symbols"]), _readable_kernels(t.get("source_lines"))
        ),
        "top_cpu_ops": _rows(top_cpu_ops(t.get("markers"), limit=top), CPU_OP_DIGITS),
        "cpu_op_threads": _rows(cpu_op_threads(t.get("markers")).head(top), CPU_OP_DIGITS),
        "hot_lines": hot_lines_by_kernel(t["pc_samples"], t.get("source_lines"))[:top],
    }


def watch_cost(meta: dict) -> dict | None:
    """The estimate of what watching cost the target, and the agents' counters behind it, as
    the capture kept them (`agent_cost`); None for a capture without one."""
    cost = meta.get("agent_cost")
    if not isinstance(cost, dict) or "estimate" not in cost:
        return None
    est = cost.get("estimate")
    agents = cost.get("agents")
    return {
        "estimate": float(est) if isinstance(est, (int, float)) else None,
        "agents": agents if isinstance(agents, dict) else {},
    }


# rounding of the CPU-op lists' times: 1 ns in ms and us, shares to 0.001 %
CPU_OP_DIGITS = {"self_ms": 6, "total_ms": 6, "busy_ms": 6, "top_op_self_ms": 6,
                 "mean_us": 3, "max_us": 3, "self_pct": 3}  # fmt: skip


def _rows(df: pd.DataFrame, digits: dict[str, int]) -> list[dict]:
    """A frame as JSON rows: numpy scalars made plain, the named float columns rounded."""
    out = []
    for row in df.to_dict("records"):
        r = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()}
        for k, nd in digits.items():
            if k in r:
                r[k] = round(float(r[k]), nd)
        out.append(r)
    return out


def _readable_kernels(source_lines: pd.DataFrame | None) -> set[str]:
    """Kernel names the data holds a line table with source lines for."""
    if source_lines is None or source_lines.empty:
        return set()
    has = source_lines[source_lines["file"].astype(str) != ""]
    return set(has["kernel"].astype(str)) | set(has["function"].astype(str))


def _top_kernel_rows(
    tk: pd.DataFrame, symbols: dict[str, str], readable: set[str] | None = None
) -> list[dict]:
    """The top kernels as JSON rows: `name` demangled, `mangled` the symbol as recorded (null
    when the name was never mangled), `label` what the tables show (kdash.names), `has_source`
    whether the data maps it to source lines (a line table of its cubin)."""
    labels = short_names(tk["name"].astype(str), 48) if len(tk) else {}
    readable = readable or set()
    rows = []
    for row in tk.to_dict("records"):
        r = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in row.items()}
        r["mangled"] = symbols.get(str(r["name"]))
        r["label"] = labels[str(r["name"])]
        r["has_source"] = str(r["name"]) in readable or (r["mangled"] or "") in readable
        rows.append(r)
    return rows


def _findings(tables: dict[str, pd.DataFrame], acc) -> list[dict]:
    """The capture's findings (the CPU/GPU-state ones made while recording; their numbers are in
    the prose only, as stored) and the kernel ones judged here over the whole window (idle time
    by class, launch latency; their numbers also in `data`), most severe first."""
    stored = findings_of(tables["findings"])
    kernels = tables["kernels"]
    judged = []
    if not kernels.empty:
        api = tables.get("api")
        if api is None:
            api = schema.to_frame("api", schema.empty("api"))
        memcpy = tables.get("memcpy")
        judged = idle_findings(
            kernels, api, tables.get("markers"), tables.get("threads"), memcpy=memcpy,
            accounting=acc,
        ) + latency_findings(kernels, api, memcpy, tables.get("threads"))  # fmt: skip
    found = sorted(stored + judged, key=lambda f: f.rank)
    return [{**f.to_dict(), "data": _plain(f.data)} for f in found]


def _plain(v):
    """numpy scalars and NaN made JSON-plain (NaN -> null), recursively."""
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_plain(x) for x in v]
    if isinstance(v, np.generic):
        v = v.item()
    if isinstance(v, float) and math.isnan(v):
        return None
    return v


def render(summary: dict, console) -> None:
    """Print the summary as rich tables (plain text when the output is not a terminal)."""
    _render_head(summary, console)
    _render_table_rows(summary, console)
    _render_gpus(summary, console)
    for g in summary.get("gpu_time") or []:
        console.print("  " + _gpu_time_line(g))
    _render_findings(summary, console)
    _render_threads(summary, console)
    _render_kernels(summary, console)
    _render_cpu_ops(summary, console)
    _render_hot_lines(summary, console)


def _render_head(summary: dict, console) -> None:
    """The capture's title line, its target, window, versions, GPUs and sources."""
    tgt = summary["target"]
    win = summary["window"]
    head = f"[b]{summary.get('title') or 'kdash capture'}[/b]  pid {tgt['pid']} on {tgt['host']}"
    console.print(head)
    if tgt.get("cmdline"):
        console.print(f"  {tgt['cmdline'][:200]}")
    console.print(
        f"  window {win.get('seconds')} s · kdash {summary.get('kdash_version')} · "
        f"schema {summary.get('schema_version')} · driver {summary.get('driver') or 'n/a'}"
    )
    for g in summary["gpus"]:
        console.print(
            f"  GPU {g.get('index')}: {g.get('name', '?')} "
            f"(local CPUs {g.get('local_cpus') or 'n/a'})"
        )
    console.print("  sources: " + ", ".join(f"{k} {v}" for k, v in summary["sources"].items()))
    cost = summary.get("watch_cost") or {}
    if cost.get("estimate") is not None:
        console.print(f"  {cost_text(cost['estimate'])} while recording (kdash's estimate)")


def _render_table_rows(summary: dict, console) -> None:
    """Rows per table (the non-empty ones)."""
    from rich.table import Table

    tables = Table(title="Tables", show_header=True)
    tables.add_column("table")
    tables.add_column("rows", justify="right")
    for name, n in summary["tables"].items():
        if n:
            tables.add_row(name, str(n))
    console.print(tables)


def _render_gpus(summary: dict, console) -> None:
    """Clocks, temperature, power, utilisation and throttle reasons per GPU."""
    from rich.table import Table

    if summary["gpu_summary"]:
        gt = Table(title="GPUs over the window")
        for c in (
            "gpu",
            "SM MHz mean/max",
            "mem MHz",
            "temp max",
            "power mean/max/limit W",
            "util %",
            "busy",
            "throttle reasons",
        ):
            gt.add_column(c)
        for g in summary["gpu_summary"]:
            gt.add_row(
                str(g["gpu"]),
                f"{_fmt(g['sm_clock_mhz_mean'])}/{_fmt(g['sm_clock_max_mhz'])}",
                _fmt(g["mem_clock_mhz_mean"]),
                _fmt(g["temp_c_max"]),
                f"{_fmt(g['power_w_mean'])}/{_fmt(g['power_w_max'])}/{_fmt(g['power_limit_w'])}",
                _fmt(g["util_gpu_pct_mean"]),
                f"{_fmt((g['busy_fraction'] or 0) * 100)}%",
                ", ".join(g["throttle_reasons_seen"]) or "none",
            )
        console.print(gt)
        console.print("  (util % = share of time a kernel was running, not SM occupancy)")


def _render_findings(summary: dict, console) -> None:
    """The findings: a table when wide, a block each when narrow."""
    from rich.table import Table

    if summary["findings"] and console.width < 120:
        # A five-column table at 80 wide folds every cell into a narrow strip: a block each.
        from rich.markup import escape

        console.print("[b]Findings[/b]")
        for f in summary["findings"]:
            console.print(
                f"[b]{f['severity'].upper()}[/b] {escape(f['kind'])} · {escape(f['subject'])}"
            )
            console.print(f"  {escape(f['evidence'])}")
            console.print(f"  → {escape(f['advice'])}")
    elif summary["findings"]:
        ft = Table(title="Findings")
        for c in ("severity", "what", "subject", "evidence", "advice"):
            ft.add_column(c, overflow="fold")
        for f in summary["findings"]:
            ft.add_row(f["severity"], f["kind"], f["subject"], f["evidence"], f["advice"])
        console.print(ft)
    else:
        console.print("Findings: none over this window")


def _render_threads(summary: dict, console) -> None:
    """The busiest threads."""
    from rich.table import Table

    if summary["threads_top"]:
        tt = Table(title="Busiest threads")
        for c in ("pid", "tid", "name", "cpu %", "runq ms/s", "CPUs seen", "allowed", "invol sw"):
            tt.add_column(c)
        for r in summary["threads_top"]:
            tt.add_row(
                str(r["pid"]),
                str(r["tid"]),
                r["name"],
                _fmt(r["cpu_pct_mean"]),
                _fmt(r["runq_ms_per_s_mean"], 2),
                _cpus(r["cpus_seen"]),
                r["allowed_cpus"],
                str(r["invol_switches"]),
            )
        console.print(tt)


def _render_kernels(summary: dict, console) -> None:
    """The top kernels by GPU time, or why there are none."""
    from rich.table import Table

    if summary["top_kernels"]:
        kt = Table(title="Top kernels (by GPU time)")
        # The name is what the table is for: it keeps 28 columns at 80 wide; the launch shape
        # columns go first when there is no room (`--json` has them all).
        kt.add_column("kernel", min_width=28, no_wrap=True)
        narrow = console.width < 120
        for c in (
            "calls",
            "total ms",
            "%",
            "mean us",
            "p50 us",
            "p99 us",
            *(() if narrow else ("grid", "block", "regs", "smem")),
        ):
            kt.add_column(c, justify="right" if c not in ("grid", "block") else "left")
        labels = short_names([k["name"] for k in summary["top_kernels"]], 28 if narrow else 48)
        for k in summary["top_kernels"]:
            cells = [
                labels[k["name"]],
                str(k["calls"]),
                _fmt(k["total_ms"], 2),
                _fmt(k["pct"]),
                _fmt(k["mean_us"], 2),
                _fmt(k["p50_us"], 2),
                _fmt(k["p99_us"], 2),
            ]
            if not narrow:
                cells += [k["grid"], k["block"], str(k["registers"]), str(k["smem"])]
            kt.add_row(*cells)
        console.print(kt)
    else:
        console.print(
            "Top kernels: no kernel records in this capture (needs the in-process agent, or a "
            "torch.profiler trace recorded with CUDA activity)"
        )


def _render_cpu_ops(summary: dict, console) -> None:
    """The top CPU ops by self time and the threads that ran them."""
    from rich.table import Table

    if summary.get("top_cpu_ops"):
        from rich.markup import escape

        ct = Table(title="Top CPU ops (by self time: in the op, not in the ops it called)")
        # as the kernels' table: the name keeps 28 columns at 80 wide, the rest go first
        narrow = console.width < 120
        width = 28 if narrow else 48
        ct.add_column("op", min_width=width, max_width=width, no_wrap=True)
        cols = ("calls", "self ms", "%", "mean us") + (
            () if narrow else ("total ms", "max us", "threads")
        )
        for c in cols:
            ct.add_column(c, justify="right")
        for r in summary["top_cpu_ops"]:
            cells = [
                escape(_cut(r["name"], width)),
                str(r["calls"]),
                _fmt(r["self_ms"], 3),
                _fmt(r["self_pct"], 1),
                _fmt(r["mean_us"], 1),
            ]
            if not narrow:
                cells += [_fmt(r["total_ms"], 3), _fmt(r["max_us"], 1), str(r["threads"])]
            ct.add_row(*cells)
        console.print(ct)
        for r in summary.get("cpu_op_threads") or []:
            console.print(
                f"  thread {r['tid']} (pid {r['pid']}): {r['ops']} CPU ops, "
                f"{_fmt(r['busy_ms'], 3)} ms in ops, most self time in "
                f"{escape(_cut(r['top_op'], 48))} ({_fmt(r['top_op_self_ms'], 3)} ms)"
            )


def _render_hot_lines(summary: dict, console) -> None:
    """The hot source lines from PC sampling, or why there are none."""
    from rich.table import Table

    if summary.get("hot_lines"):
        ht = Table(title="Hot source lines (PC sampling)")
        for c in ("kernel", "file:line", "samples", "%", "top stalls"):
            ht.add_column(c, overflow="fold")
        hot = short_names([demangle(h["kernel"]) for h in summary["hot_lines"]], 32)
        for h in summary["hot_lines"]:
            if h["file"]:
                where = f"{Path(h['file']).name}:{h['line']}"
            elif h.get("pc_offset", -1) >= 0:
                where = f"+0x{h['pc_offset']:x} (no line table)"
            else:
                where = h["note"] or "no line"
            ht.add_row(
                hot[demangle(h["kernel"])],
                where,
                str(h["samples"]),
                _fmt(h["share"] * 100, 1),
                h["top_stalls"],
            )
        console.print(ht)
    else:
        console.print("Hot source lines: no PC samples in this capture (PC sampling was off)")


def _gpu_time_line(g: dict) -> str:
    """A `gpu_time` object back in the kernel pane's words (the same text function)."""
    from kdash.analyses.gpu_time import GpuTime

    ns = 1e9
    t = GpuTime(
        gpu=g["gpu"],
        recorded_ns=round(g["recorded_s"] * ns),
        busy_ns=round(g["busy_s"] * ns),
        kernel_ns=round(g["kernel_s"] * ns),
        copy_ns=round(g["copy_s"] * ns),
        short_gaps=g["short_gaps"],
        short_gap_idle_ns=round(g["short_gap_idle_s"] * ns),
        short_gap_median_us=g["short_gap_median_us"] or math.nan,
        long_gaps=g["long_gaps"],
        idle_by_cause_ns={c: round(v * ns) for c, v in g["idle_by_cause_s"].items()},
    )
    how = ", the agent's recording windows" if g["duty_cycled"] else ""
    return f"{gpu_time_text(t)} (of {g['recorded_s']:.2f} s recorded{how})"


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _fmt(v, nd: int = 0) -> str:
    if v is None:
        return "n/a"
    return f"{v:.{nd}f}"


def _cpus(cpus: list[int]) -> str:
    from kdash.cpulist import format_cpulist

    return format_cpulist(set(cpus)) if cpus else "n/a"
