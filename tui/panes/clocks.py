"""Clock & thermal pane: per GPU, where the clocks, temperature and power are against their
limits over the shown window, and why the GPU held its clocks back (the throttle band).

Every sparkline and the band are binned over the same window and width (see
`kdash.tui.widgets.spark`), so a dip in the SM clock sits right above the `P` of a power cap.
"util" is NVML's utilisation: the share of the sample period in which *a kernel ran*, not SM
occupancy — attention kernels read ~100% while using a fraction of the SMs; the pane says so.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from kdash import schema
from kdash.gpu_reasons import REASONS, THROTTLE_MASK

from ..widgets.spark import bin_mean, bin_or, fmt, spark
from .base import Pane, View

# Band letters, most important first: one character per bin shows the strongest reason.
BAND: list[tuple[int, str]] = [
    (0x40, "T"),  # hw-thermal
    (0x20, "T"),  # sw-thermal
    (0x8, "H"),  # hw-slowdown
    (0x80, "B"),  # power-brake
    (0x4, "P"),  # sw-power
    (0x2, "A"),  # app-clocks
    (0x10, "S"),  # sync-boost
    (0x100, "D"),  # display-clocks
    (0x1, "·"),  # idle: not a throttle, but says why clocks are low
]
LEGEND = {
    "T": "thermal",
    "H": "hw slowdown",
    "B": "power brake",
    "P": "power cap",
    "A": "app clocks",
    "S": "sync boost",
    "D": "display",
    "·": "idle",
}
LABEL_W = 22  # "power  650/700 W    " etc.
FULL_LINES = 11  # lines of one GPU in the full view; more GPUs than fit -> the dense view


def band_char(bits: int) -> str:
    if bits < 0:
        return " "
    for bit, ch in BAND:
        if bits & bit:
            return ch
    return "─"  # sampled, no reason set: running free


def throttle_band(view: View, g: pd.DataFrame, bins: int) -> tuple[str, str, bool]:
    """One GPU's band over the window, its latest reasons in words, and whether they hold
    the clocks back (a throttle, not just idle)."""
    t = g["t_ns"].to_numpy()
    bits = bin_or(t, g["throttle_reasons"].to_numpy(), view.since_ns, view.until_ns, bins)
    band = "".join(band_char(int(b)) for b in bits)
    now_bits = int(g["throttle_reasons"].iloc[-1])
    held = now_bits >= 0 and bool(now_bits & THROTTLE_MASK)
    if now_bits < 0:
        reason_now = "n/a"
    else:
        names_now = [REASONS[b][0] for b in REASONS if now_bits & b and b != 0x1]
        reason_now = ",".join(names_now) or ("idle" if now_bits & 0x1 else "none")
    return band, reason_now, held


def no_gpu_line(view: View) -> str:
    """Why there is no GPU data, from the NVML source's health (live) or the capture (replay)."""
    health = view.health_of("nvml")
    if health is None:
        why = "no NVML source" if view.mode == "live" else "the capture has no GPU samples"
    elif health.state in ("ok", "starting"):
        why = "waiting for the first NVML sample" if view.mode == "live" else "no GPU samples"
    else:
        why = f"nvml {health}"
    return f"Clocks & thermal: no GPU data — {why}"


class ClockPane(Pane):
    key = "2"
    title = "Clocks & thermal"
    waiting = "Clocks & thermal: waiting for data"
    COMPONENT_CLASSES = {
        "clock-pane--gpu",
        "clock-pane--label",
        "clock-pane--spark",
        "clock-pane--hot",
        "clock-pane--band",
        "clock-pane--throttle",
        "clock-pane--note",
    }

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.body = Static("", markup=False, classes="clock-body")
        self.full_detail = False  # `g`: every GPU in full, even when they do not all fit
        self.dense = False  # what the last redraw drew

    def compose(self) -> ComposeResult:
        yield self.empty_line
        with VerticalScroll(classes="clock-scroll"):
            yield self.body

    def focus_target(self):
        """The scroller, so ↑/↓ scroll through the GPUs when the pane has focus."""
        return self if self.has_class("-empty") else self.query_one(".clock-scroll")

    def show(self, view: View) -> None:
        batch = view.store.get("gpu_samples", view.since_ns, view.until_ns)
        df = schema.to_frame("gpu_samples", batch) if len(batch["t_ns"]) else None
        if df is None:
            self.set_empty(no_gpu_line(view))
            return
        self.set_empty(None)
        scroller = self.query_one(".clock-scroll")
        avail = scroller.scrollable_content_region.width or self.content_region.width or 80
        width = max(LABEL_W + 10, avail - 1)
        height = scroller.scrollable_content_region.height or self.content_region.height or 24
        n_gpus = int(df["gpu"].nunique())
        self.dense = not self.full_detail and n_gpus > 1 and n_gpus * FULL_LINES > height
        if self.dense:
            self.body.update(self.render_dense(view, df, width))
        else:
            self.body.update(self.render_gpus(view, df, width))

    def render_dense(self, view: View, df: pd.DataFrame, width: int) -> Text:
        """Many GPUs (an 8-GPU server) in little room: three lines each — the latest values,
        the SM clock sparkline, the throttle band — on the same time axis as the full view."""
        st = {c: self.get_component_rich_style(f"clock-pane--{c}") for c in (
            "gpu", "label", "spark", "hot", "band", "throttle", "note")}  # fmt: skip
        bins = width - LABEL_W
        out = Text(no_wrap=True, overflow="ellipsis")
        out.append("util = a kernel ran, not occupancy · g: full detail per GPU\n", st["note"])
        seen: set[str] = set()
        for gpu, g in df.groupby("gpu", sort=True):
            g = g.sort_values("t_ns")
            last = g.iloc[-1]
            pstate = int(last["pstate"])
            out.append(f"GPU{gpu}", st["gpu"])
            out.append(
                f" P{pstate if pstate >= 0 else ' n/a'}"
                f"  SM {fmt(last['sm_clock_mhz'])}/{fmt(last['sm_clock_max_mhz'])} MHz"
                f"  mem {fmt(last['mem_clock_mhz'])}/{fmt(last['mem_clock_max_mhz'])}"
                f"  {fmt(last['temp_c'])} °C  {fmt(last['power_w'])}/{fmt(last['power_limit_w'])} W"
                f"  util {fmt(last['util_gpu_pct'], '.0f', '%')}\n",
                st["label"],
            )
            sm = bin_mean(
                g["t_ns"].to_numpy(), g["sm_clock_mhz"].to_numpy(), view.since_ns, view.until_ns,
                bins,
            )  # fmt: skip
            out.append(f"{'  SM clock':<{LABEL_W}}", st["label"])
            out.append(
                spark(sm, 0, _hi(g["sm_clock_max_mhz"], g["sm_clock_mhz"])) + "\n", st["spark"]
            )
            band, reason_now, held = throttle_band(view, g, bins)
            seen |= set(band) - {" ", "─"}
            out.append(
                f"  {'thrtl':<6}{reason_now[:13]:>13} ", st["throttle"] if held else st["label"]
            )
            for ch in band:
                out.append(ch, st["throttle"] if ch in "THBP" else st["band"])
            out.append("\n")
        out.append(" " * LABEL_W + view.axis(bins), st["note"])
        if seen:
            legend = "  ".join(f"{ch} {LEGEND[ch]}" for ch in LEGEND if ch in seen)
            out.append("\n" + " " * LABEL_W + legend + "  ─ no reason", st["note"])
        return out

    def render_gpus(self, view: View, df: pd.DataFrame, width: int) -> Text:
        st = {c: self.get_component_rich_style(f"clock-pane--{c}") for c in (
            "gpu", "label", "spark", "hot", "band", "throttle", "note")}  # fmt: skip
        bins = width - LABEL_W
        names = {int(g.get("index", -1)): str(g.get("name", "")) for g in view.gpus}
        out = Text(no_wrap=True, overflow="ellipsis")
        seen_letters: set[str] = set()
        pb = view.store.get("gpu_procs", view.since_ns, view.until_ns)
        procs = schema.to_frame("gpu_procs", pb) if len(pb["t_ns"]) else None
        for n, (gpu, g) in enumerate(df.groupby("gpu", sort=True)):
            g = g.sort_values("t_ns")
            last = g.iloc[-1]
            t = g["t_ns"].to_numpy()

            def series(col: str, g=g, t=t) -> np.ndarray:
                return bin_mean(t, g[col].to_numpy(), view.since_ns, view.until_ns, bins)

            if n:
                out.append("\n")
            pstate = int(last["pstate"])
            util = fmt(last["util_gpu_pct"], ".0f", "%")
            head = f"GPU{gpu} {names.get(int(gpu), '')}".rstrip()
            out.append(head, st["gpu"])
            out.append(f"  P{pstate}" if pstate >= 0 else "  P n/a", st["label"])
            out.append(f"  util {util}", st["label"])
            out.append("  (util = a kernel ran, not occupancy)\n", st["note"])

            def row(label: str, value: str, sp: str, hot: bool = False) -> None:
                out.append(f"{label:<6}{value:>15} ", st["label"])
                out.append(sp, st["hot"] if hot else st["spark"])
                out.append("\n")

            sm, sm_max = last["sm_clock_mhz"], last["sm_clock_max_mhz"]
            sm_hi = _hi(g["sm_clock_max_mhz"], g["sm_clock_mhz"])
            row("SM", f"{fmt(sm)}/{fmt(sm_max)} MHz", spark(series("sm_clock_mhz"), 0, sm_hi))
            mem, mem_max = last["mem_clock_mhz"], last["mem_clock_max_mhz"]
            mem_hi = _hi(g["mem_clock_max_mhz"], g["mem_clock_mhz"])
            row("mem", f"{fmt(mem)}/{fmt(mem_max)} MHz", spark(series("mem_clock_mhz"), 0, mem_hi))
            temp = last["temp_c"]
            row("temp", f"{fmt(temp)} °C", spark(series("temp_c"), 20, 100), hot=_gt(temp, 85))
            pw, lim = last["power_w"], last["power_limit_w"]
            pw_hi = _hi(g["power_limit_w"], g["power_w"])
            row(
                "power",
                f"{fmt(pw)}/{fmt(lim)} W",
                spark(series("power_w"), 0, pw_hi),
                hot=_gt(pw, 0.97 * float(lim)) if np.isfinite(lim) and lim > 0 else False,
            )
            row("util", f"{util}", spark(series("util_gpu_pct"), 0, 100))
            band, reason_now, held = throttle_band(view, g, bins)
            seen_letters |= set(band) - {" ", "─"}
            out.append(
                f"{'thrtl':<6}{reason_now[:15]:>15} ", st["throttle"] if held else st["label"]
            )
            for ch in band:
                out.append(ch, st["throttle"] if ch in "THBP" else st["band"])
            out.append("\n")
            used, total = last["mem_used_mib"], last["mem_total_mib"]
            row(
                "vram",
                f"{fmt(used / 1024, '.1f')}/{fmt(total / 1024, '.0f')} GiB",
                spark(series("mem_used_mib"), 0, _hi(g["mem_total_mib"], g["mem_used_mib"])),
            )
            pcie = g["pcie_tx_kbs"].to_numpy(dtype=np.float64) + g["pcie_rx_kbs"].to_numpy(
                dtype=np.float64
            )
            pcie_bins = bin_mean(t, pcie, view.since_ns, view.until_ns, bins)
            row(
                "pcie",
                f"↑{_mbs(last['pcie_tx_kbs'])} ↓{_mbs(last['pcie_rx_kbs'])}",
                spark(
                    pcie_bins,
                    0,
                    float(np.nanmax(pcie_bins)) if np.isfinite(pcie_bins).any() else 1.0,
                ),
            )
            out.append(" " * LABEL_W + view.axis(bins), st["note"])
            if procs is not None:
                out.append(self._procs_line(procs, int(gpu)), st["note"])
        if seen_letters:
            legend = "  ".join(f"{ch} {LEGEND[ch]}" for ch in LEGEND if ch in seen_letters)
            out.append("\n" + " " * LABEL_W + legend + "  ─ no reason", st["note"])
        return out

    @staticmethod
    def _procs_line(procs: pd.DataFrame, gpu: int) -> str:
        """The target's processes on this GPU at their latest sample: memory and SM util."""
        p = procs[procs["gpu"] == gpu]
        if p.empty:
            return ""
        p = p.sort_values("t_ns").groupby("pid", sort=False).tail(1)
        p = p.sort_values("mem_used_mib", ascending=False)
        parts = [
            f"pid {int(r.pid)} {fmt(r.mem_used_mib / 1024, '.1f')} GiB"
            f" sm {fmt(r.sm_util_pct, '.0f', '%')}"
            for r in p.head(4).itertuples(index=False)
        ]
        more = f" +{len(p) - 4} more" if len(p) > 4 else ""
        return "\n" + f"{'procs':<{LABEL_W}}" + ", ".join(parts) + more


def _gt(v: float, limit: float) -> bool:
    return bool(np.isfinite(v) and v > limit)


def _hi(*cols: pd.Series) -> float:
    """The largest finite, non-negative value of the columns (the top of a sparkline's scale)."""
    best = np.nan
    for c in cols:
        a = c.to_numpy(dtype=np.float64)
        a = a[np.isfinite(a) & (a >= 0)]
        if a.size:
            best = a.max() if not np.isfinite(best) else max(best, a.max())
    return float(best) if np.isfinite(best) and best > 0 else 1.0


def _mbs(kbs: float) -> str:
    """PCIe throughput in MB/s (NVML gives KB/s); "n/a" when unsupported."""
    return fmt(float(kbs) / 1000.0, ".0f") + "MB/s" if np.isfinite(kbs) and kbs >= 0 else "n/a"
