"""SGLang server pane: what the server says about its load, and its process tree as one view of
a multi-GPU server. Mounted only when the target is an SGLang server (`meta["sglang"]`).

Top: running and queued requests, token usage, generation throughput, TTFT and inter-token
latency. Each row is the latest value and a sparkline binned over the shown window with the
same width and binning as the clock pane (`kdash.tui.widgets.spark`), so column i is the same
second here and there. The TTFT/ITL p50/p99 figures are over the whole shown window: the
metrics source stores each scrape's histogram bucket deltas (`ttft_le:<bound>` rows), and
their sum over the window is that window's histogram (`window_buckets`); the sparkline is each
scrape interval's p99. With `--enable-metrics` off the server only has `/get_load`, and the
pane says so in one line and shows what that gives (requests, tokens).

Bottom: one line per scheduler (TP/DP/PP/EP ranks), its pid, its GPU and that GPU's latest
SM clock, utilisation and power from `gpu_samples` — compact enough that TP=8 fits an 80x24
terminal with the pane maximised (`5`). The GPU of a scheduler comes from NVML's process list
when kdash has seen one, else from the server's args and CUDA_VISIBLE_DEVICES (see
`collectors.sglang_tree`); a mapping not from NVML is marked `~`.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from kdash import schema
from kdash.gpu_reasons import THROTTLE_MASK
from kdash.histogram import BUCKET_TAG, bucket_quantile, window_buckets

from ..widgets.spark import bin_mean, fmt, spark
from .base import Pane, View

LABEL_W = 24  # "TTFT p50/p99 0.15/0.52 s" and a space
METRICS_OFF = "metrics off: start the server with --enable-metrics; showing /get_load"


def _latest(groups: dict[str, pd.DataFrame], name: str) -> float:
    g = groups.get(name)
    return float(g["value"].iloc[-1]) if g is not None and len(g) else math.nan


def _pair(p50: float, p99: float) -> str:
    """p50/p99 in one unit, the one that reads best for the larger: `186/759 ms`, `0.2/1.4 s`."""
    ok = [v for v in (p50, p99) if np.isfinite(v) and v >= 0]
    if not ok:
        return "n/a"
    ms = max(ok) < 1.0

    def one(v: float) -> str:
        if not np.isfinite(v) or v < 0:
            return "n/a"
        if ms:
            return f"{v * 1e3:.1f}" if v * 1e3 < 9.95 else f"{v * 1e3:.0f}"
        return f"{v:.1f}" if v < 100 else f"{v:.0f}"

    return f"{one(p50)}/{one(p99)} {'ms' if ms else 's'}"


def _count(v: float) -> str:
    if not np.isfinite(v) or v < 0:
        return "n/a"
    if v >= 10_000:
        return f"{v / 1000:.1f}k"
    return f"{v:.0f}"


def health_line(view: View) -> str | None:
    """One line about the metrics source when it is not plainly ok; None when it is."""
    h = view.health_of("sglang")
    if h is None or h.ok:
        return None
    if h.code == "metrics_off":
        return METRICS_OFF
    if h.state == "starting":
        return "server: waiting for the first /metrics answer"
    return f"server {h}"


class ServerPane(Pane):
    key = "5"
    title = "SGLang server"
    waiting = "SGLang server: waiting for data"
    COMPONENT_CLASSES = {
        "server-pane--head",
        "server-pane--label",
        "server-pane--spark",
        "server-pane--bad",
        "server-pane--note",
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.body = Static("", markup=False, classes="server-body")

    def compose(self) -> ComposeResult:
        yield self.empty_line
        with VerticalScroll(classes="server-scroll"):
            yield self.body

    def focus_target(self):
        return self if self.has_class("-empty") else self.query_one(".server-scroll")

    def show(self, view: View) -> None:
        batch = view.store.get("server", view.since_ns, view.until_ns)
        if not view.sglang and len(batch["t_ns"]) == 0:
            self.set_empty(f"SGLang server: no data — {health_line(view) or 'no server rows'}")
            return
        self.set_empty(None)
        scroller = self.query_one(".server-scroll")
        avail = scroller.scrollable_content_region.width or self.content_region.width or 80
        self.body.update(self.render_server(view, batch, max(LABEL_W + 10, avail - 1)))

    def render_server(self, view: View, batch: dict, width: int) -> Text:
        st = {c: self.get_component_rich_style(f"server-pane--{c}") for c in (
            "head", "label", "spark", "bad", "note")}  # fmt: skip
        sg = view.sglang or {}
        bins = width - LABEL_W
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append(self._head(sg), st["head"])
        out.append("\n")
        note = health_line(view)
        if note:
            out.append(note + "\n", st["bad"])
        df = schema.to_frame("server", batch) if len(batch["t_ns"]) else None
        if df is not None:
            df = df.sort_values("t_ns", kind="stable")
            groups = {str(m): g for m, g in df.groupby("metric", sort=False)}
            self._metrics(out, st, view, groups, bins)
        elif not note:
            out.append("no server metrics in this window\n", st["note"])
        self._ranks(out, st, view, sg)
        return out

    @staticmethod
    def _head(sg: dict) -> str:
        srv = sg.get("server") or {}
        bits = [f"SGLang {sg.get('url') or ''}".rstrip()]
        sizes = [f"{k.upper()[:2]} {srv[k + '_size']}" for k in ("tp", "dp", "pp", "ep")
                 if isinstance(srv.get(k + "_size"), int) and srv[k + "_size"] > 1]  # fmt: skip
        bits.append(" ".join(sizes) or "TP 1" if srv else "")
        if srv.get("attention_backend"):
            bits.append(str(srv["attention_backend"]))
        if "disable_cuda_graph" in srv:
            bits.append("cuda graph off" if srv["disable_cuda_graph"] else "cuda graph on")
        if "enable_metrics" in srv:
            bits.append("metrics on" if srv["enable_metrics"] else "metrics off")
        return " · ".join(b for b in bits if b)

    def _metrics(
        self, out: Text, st: dict, view: View, groups: dict[str, pd.DataFrame], bins: int
    ) -> None:
        def series(name: str) -> np.ndarray | None:
            g = groups.get(name)
            if g is None or not len(g):
                return None
            return bin_mean(
                g["t_ns"].to_numpy(), g["value"].to_numpy(), view.since_ns, view.until_ns, bins
            )

        def row(label: str, sp: np.ndarray | None, lo: float = 0.0, hi: float | None = None):
            out.append(f"{label[: LABEL_W - 1]:<{LABEL_W}}", st["label"])
            if sp is not None:
                top = hi if hi is not None else float(np.nanmax(sp)) if np.isfinite(sp).any() else 1
                out.append(spark(sp, lo, max(top, 1e-9)), st["spark"])
            out.append("\n")

        row(
            f"running {_count(_latest(groups, 'num_running_reqs')):>15}", series("num_running_reqs")
        )
        row(f"queued {_count(_latest(groups, 'num_queue_reqs')):>16}", series("num_queue_reqs"))
        usage = _latest(groups, "token_usage")
        if np.isfinite(usage):
            row(f"token usage {fmt(usage * 100, '.0f', '%'):>11}", series("token_usage"), 0, 1)
        elif "num_used_tokens" in groups:
            row(
                f"tokens used {_count(_latest(groups, 'num_used_tokens')):>11}",
                series("num_used_tokens"),
            )
        if "gen_throughput" in groups:
            row(
                f"gen tok/s {_count(_latest(groups, 'gen_throughput')):>13}",
                series("gen_throughput"),
            )
        metric_names = set(groups)
        for short, label in (("ttft", "TTFT"), ("itl", "ITL")):
            if not any(m.startswith(short + "_") for m in metric_names):
                continue
            parts = [g for m, g in groups.items() if m.startswith(short + BUCKET_TAG)]
            sub = pd.concat(parts) if parts else None
            buckets = (
                window_buckets(sub["metric"].astype(str), sub["value"].to_numpy(), short)
                if sub is not None
                else {}
            )
            p50 = bucket_quantile(0.5, buckets) if buckets else math.nan
            p99 = bucket_quantile(0.99, buckets) if buckets else math.nan
            head = f"{label} p50/p99"
            row(f"{head} {_pair(p50, p99):>{LABEL_W - 2 - len(head)}}", series(f"{short}_p99_s"))
        out.append(" " * LABEL_W + view.axis(bins) + "\n", st["note"])
        if any(m.startswith(("ttft_", "itl_")) for m in metric_names):
            out.append(
                " " * LABEL_W + "p50/p99 over the window; sparklines: p99 per scrape\n", st["note"]
            )

    def _ranks(self, out: Text, st: dict, view: View, sg: dict) -> None:
        scheds = sg.get("schedulers") or []
        if not scheds:
            out.append("no scheduler process seen (sglang::scheduler*)", st["note"])
            return
        last = self._last_gpu_samples(view)
        others = [
            f"{r['role']} {r['pid']}"
            for r in sg.get("roles") or []
            if r.get("role") not in ("scheduler",)
        ]
        out.append(
            f"{'rank':<8}{'pid':>8} {'GPU':<5}{'SM MHz':>11}{'util':>6}{'power W':>10}\n",
            st["head"],
        )
        for s in scheds:
            gpu = s.get("gpu")
            mark = "" if s.get("gpu_source") == "nvml" else "~"
            gtxt = f"{mark}{gpu}" if gpu is not None else "?"
            line = f"{(s.get('ranks') or 'TP0')[:7]:<8}{s.get('pid', ''):>8} {gtxt:<5}"
            g = last.get(gpu) if gpu is not None else None
            if g is None:
                out.append(line, st["label"])
                out.append("no NVML sample\n", st["note"])
                continue
            sm = f"{fmt(g['sm_clock_mhz'])}/{fmt(g['sm_clock_max_mhz'])}"
            pw = f"{fmt(g['power_w'])}/{fmt(g['power_limit_w'])}"
            bits = int(g["throttle_reasons"])
            held = bits >= 0 and bool(bits & THROTTLE_MASK)
            out.append(
                line + f"{sm:>11}{fmt(g['util_gpu_pct'], '.0f', '%'):>6}{pw:>10}", st["label"]
            )
            if held:
                out.append(" held", st["bad"])
            out.append("\n")
        if others:
            out.append(" · ".join(others), st["note"])
        if any(s.get("gpu_source") != "nvml" for s in scheds):
            out.append(
                ("\n" if others else "") + "~ GPU from server args/CUDA_VISIBLE_DEVICES, not NVML",
                st["note"],
            )

    @staticmethod
    def _last_gpu_samples(view: View) -> dict[int, pd.Series]:
        b = view.store.get("gpu_samples", view.since_ns, view.until_ns)
        if not len(b["t_ns"]):
            return {}
        df = schema.to_frame("gpu_samples", b).sort_values("t_ns", kind="stable")
        return {int(gpu): g.iloc[-1] for gpu, g in df.groupby("gpu", sort=True)}
