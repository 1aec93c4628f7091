"""GPU time accounting: per GPU, how the recorded time splits into busy and idle, and why idle.

One pure analysis over the `kernels`, `memcpy`, `markers` and `api` tables, shared by the kernel
pane's line, `kdash report` (its tables, its findings and `gpu_time` in `--json`) and the
Perfetto export, so they never disagree.

- *Recorded* time: the agent's "activity on" windows (markers rows, domain "kdash") of the
  processes that ran on the GPU when it duty-cycles, else the span of the GPU's activity
  records. Records that lie outside every window still count as recorded (a window's row is
  written when it closes, so the live tail has kernels before its window).
- *Busy*: the union of kernel, memcpy and memset intervals. Kernel time and copy time are each
  their own union; copy engines run beside kernels, so the two can add up to more than busy.
  A copy is never idle time, and never charged to `host`.
- *Idle* = recorded - busy, as gaps. Gaps shorter than `MIN_GAP_US` are the GPU finishing
  work faster than the host submits it (launch- or submission-bound): only their count and
  total are kept, since a launch-bound loop has one per kernel. Longer gaps are explained one
  by one by `kernel_findings.gap_causes` (sync, host, quiet, gpu, unknown) from the record
  that ended them; a gap cut by the end of a recording window has no recorded end and stays
  `unknown`.

Everything is vectorised numpy (sort, running maximum, searchsorted): captures hold up to
millions of kernels.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from kdash.analyses.kernel_findings import CAUSES, MIN_GAP_US, SHORT, gap_causes
from kdash.analyses.kernels import ACTIVITY_DOMAIN, ACTIVITY_NAME

GAP_COLUMNS = ["device", "start_ns", "end_ns", "gap_us"]

_EMPTY = np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class GpuTime:
    """One GPU's recorded time, busy and idle (nanoseconds; see the module docstring)."""

    gpu: int
    recorded_ns: int
    busy_ns: int
    kernel_ns: int
    copy_ns: int
    short_gaps: int
    short_gap_idle_ns: int
    short_gap_median_us: float  # NaN without short gaps
    long_gaps: int
    idle_by_cause_ns: dict[str, int] = field(default_factory=dict)  # largest first
    duty_cycled: bool = False  # recorded time came from the agent's windows
    first_ns: int = 0  # the first and last activity record on this GPU
    last_ns: int = 0

    @property
    def idle_ns(self) -> int:
        return self.recorded_ns - self.busy_ns

    @property
    def long_gap_idle_ns(self) -> int:
        return self.idle_ns - self.short_gap_idle_ns

    def share(self, ns: float) -> float:
        return ns / self.recorded_ns if self.recorded_ns > 0 else 0.0

    def classes_ns(self) -> dict[str, int]:
        """Idle time by class: `SHORT` and each long-gap cause, largest first."""
        out = {SHORT: self.short_gap_idle_ns, **self.idle_by_cause_ns}
        return dict(sorted(((k, v) for k, v in out.items() if v > 0), key=lambda kv: -kv[1]))

    def to_json(self) -> dict:
        """The report's `gpu_time` object (seconds; the schema in kdash/data/report.schema.json)."""

        def s(ns: int) -> float:
            return round(ns * 1e-9, 9)

        return {
            "gpu": self.gpu,
            "duty_cycled": self.duty_cycled,
            "recorded_s": s(self.recorded_ns),
            "busy_s": s(self.busy_ns),
            "kernel_s": s(self.kernel_ns),
            "copy_s": s(self.copy_ns),
            "copy_only_s": s(self.busy_ns - self.kernel_ns),
            "idle_s": s(self.idle_ns),
            "busy_share": self.share(self.busy_ns),
            "idle_share": self.share(self.idle_ns),
            "short_gap_us": MIN_GAP_US,
            "short_gaps": self.short_gaps,
            "short_gap_idle_s": s(self.short_gap_idle_ns),
            "short_gap_median_us": (
                None if np.isnan(self.short_gap_median_us) else self.short_gap_median_us
            ),
            "long_gaps": self.long_gaps,
            "long_gap_idle_s": s(self.long_gap_idle_ns),
            "idle_by_cause_s": {c: s(v) for c, v in self.idle_by_cause_ns.items()},
        }


# -- interval arithmetic -----------------------------------------------------------------------
def merge(starts: np.ndarray, ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The union of intervals [start, end) as sorted, disjoint intervals (touching ones joined).

    An end before its start counts as the start (a zero-length record)."""
    starts = np.asarray(starts, dtype=np.int64)
    ends = np.asarray(ends, dtype=np.int64)
    if not len(starts):
        return _EMPTY, _EMPTY
    order = np.argsort(starts, kind="stable")
    s = starts[order]
    reach = np.maximum.accumulate(np.maximum(ends[order], s))
    new = np.empty(len(s), dtype=bool)
    new[0] = True
    new[1:] = s[1:] > reach[:-1]
    first = np.flatnonzero(new)
    last = np.append(first[1:] - 1, len(s) - 1)
    return s[first], reach[last]


def total(starts: np.ndarray, ends: np.ndarray) -> int:
    """Summed length of disjoint intervals."""
    return int((ends - starts).sum()) if len(starts) else 0


def complement(
    outer: tuple[np.ndarray, np.ndarray], inner: tuple[np.ndarray, np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """outer - inner, for merged interval sets with inner inside outer.

    Inside each outer interval the pieces run outer start -> first inner start, each inner end
    -> the next inner start, the last inner end -> outer end. So the sorted piece starts
    (outer starts and inner ends) pair off with the sorted piece ends (inner starts and outer
    ends) one for one; the empty pieces (an inner interval flush with its outer one) drop."""
    (os_, oe), (is_, ie) = outer, inner
    a = np.sort(np.concatenate([os_, ie]), kind="stable")
    b = np.sort(np.concatenate([is_, oe]), kind="stable")
    keep = b > a
    return a[keep], b[keep]


# -- the accounting ---------------------------------------------------------------------------
def _windows_for(markers: pd.DataFrame | None, pids: np.ndarray) -> pd.DataFrame | None:
    """The "activity on" windows of the processes in `pids` (all windows when none of them wrote
    any: a capture imported without pids), or None when the agent did not duty-cycle."""
    if markers is None or markers.empty or "domain" not in markers:
        return None
    w = markers[(markers["domain"] == ACTIVITY_DOMAIN) & (markers["name"] == ACTIVITY_NAME)]
    if w.empty:
        return None
    own = w[w["pid"].isin(pids)] if "pid" in w else w
    return own if not own.empty else w


def _frame_or_empty(df: pd.DataFrame | None, table: str) -> pd.DataFrame:
    if df is not None:
        return df
    from kdash import schema

    return schema.to_frame(table, schema.empty(table))


def copy_names(memcpy: pd.DataFrame) -> np.ndarray:
    """What a copy is called where it ends a gap: "HtoD copy", "memset"."""
    kinds = memcpy["kind"].astype(str).to_numpy(object)
    return np.array([k if k == "memset" else f"{k} copy" for k in kinds], dtype=object)


@dataclass(frozen=True)
class Accounting:
    """`account`'s result: one `GpuTime` per GPU, and the long gaps with their causes (the
    columns of `kernel_findings.gap_causes`), which the idle lane, the findings and the export
    draw and explain."""

    gpus: list[GpuTime]
    gaps: pd.DataFrame


def account(
    kernels: pd.DataFrame,
    memcpy: pd.DataFrame | None = None,
    markers: pd.DataFrame | None = None,
    api: pd.DataFrame | None = None,
    min_gap_us: float = MIN_GAP_US,
) -> Accounting:
    """Busy, kernel, copy and idle time per GPU over the recorded time (module docstring)."""
    kernels = _frame_or_empty(kernels, "kernels")
    memcpy = _frame_or_empty(memcpy, "memcpy")
    api = _frame_or_empty(api, "api")
    min_ns = min_gap_us * 1e3
    devices = sorted(
        {int(d) for d in kernels["device"].unique()} | {int(d) for d in memcpy["device"].unique()}
    )
    out: list[GpuTime] = []
    long_parts: list[pd.DataFrame] = []
    for dev in devices:
        kd = kernels[kernels["device"] == dev]
        cd = memcpy[memcpy["device"] == dev]
        ks, ke = merge(kd["start_ns"].to_numpy(np.int64), kd["end_ns"].to_numpy(np.int64))
        cs, ce = merge(cd["start_ns"].to_numpy(np.int64), cd["end_ns"].to_numpy(np.int64))
        bs, be = merge(np.concatenate([ks, cs]), np.concatenate([ke, ce]))
        if not len(bs):
            continue
        pids = np.unique(
            np.concatenate([kd["pid"].to_numpy(np.int64), cd["pid"].to_numpy(np.int64)])
        )
        w = _windows_for(markers, pids)
        if w is None:
            recorded = (bs[:1], be[-1:])
        else:
            ws = w["start_ns"].to_numpy(np.int64)
            we = w["end_ns"].to_numpy(np.int64)
            recorded = merge(np.concatenate([ws, bs]), np.concatenate([we, be]))
        gs, ge = complement(recorded, (bs, be))
        glen = ge - gs
        short = glen < min_ns
        out.append(
            GpuTime(
                gpu=dev,
                recorded_ns=total(*recorded),
                busy_ns=total(bs, be),
                kernel_ns=total(ks, ke),
                copy_ns=total(cs, ce),
                short_gaps=int(short.sum()),
                short_gap_idle_ns=int(glen[short].sum()),
                short_gap_median_us=float(np.median(glen[short]) / 1e3) if short.any() else np.nan,
                long_gaps=int((~short).sum()),
                duty_cycled=w is not None,
                first_ns=int(bs[0]),
                last_ns=int(be[-1]),
            )
        )
        long_parts.append(
            pd.DataFrame(
                {
                    "device": np.full(int((~short).sum()), dev, dtype=np.int64),
                    "start_ns": gs[~short],
                    "end_ns": ge[~short],
                    "gap_us": glen[~short] / 1e3,
                }
            )
        )
    gaps = (
        pd.concat(long_parts, ignore_index=True)
        if long_parts
        else pd.DataFrame({c: np.empty(0, dtype=np.int64) for c in GAP_COLUMNS})
    )
    # What ended each gap: a kernel, or a copy (whose API call explains it the same way).
    enders = pd.concat(
        [
            kernels[["device", "start_ns", "name", "correlation_id"]].astype({"device": np.int64}),
            pd.DataFrame(
                {
                    "device": memcpy["device"].to_numpy(np.int64),
                    "start_ns": memcpy["start_ns"].to_numpy(np.int64),
                    "name": copy_names(memcpy),
                    "correlation_id": memcpy["correlation_id"].to_numpy(np.int64),
                }
            ),
        ],
        ignore_index=True,
    )
    gaps = gap_causes(gaps, enders, api)
    by = (
        gaps.assign(ns=gaps["end_ns"] - gaps["start_ns"]).groupby(["device", "cause"])["ns"].sum()
        if len(gaps)
        else pd.Series(dtype=np.int64)
    )
    final = []
    for t in out:
        causes = {c: int(by.get((t.gpu, c), 0)) for c in CAUSES}
        causes = dict(sorted(((c, v) for c, v in causes.items() if v > 0), key=lambda kv: -kv[1]))
        final.append(replace(t, idle_by_cause_ns=causes))
    return Accounting(final, gaps)


def gpu_time(
    kernels: pd.DataFrame,
    memcpy: pd.DataFrame | None = None,
    markers: pd.DataFrame | None = None,
    api: pd.DataFrame | None = None,
) -> list[GpuTime]:
    """`account(...).gpus`."""
    return account(kernels, memcpy, markers, api).gpus


# -- in words ---------------------------------------------------------------------------------
def pct(share: float) -> str:
    """A share as a whole percentage, "<1%" for a small non-zero one."""
    if 0 < share < 0.005:
        return "<1%"
    return f"{100 * share:.0f}%"


def count(n: int) -> str:
    """4 -> "4", 41_234 -> "41k", 1_234_567 -> "1.2M"."""
    if n < 1000:
        return str(n)
    if n < 10_000:
        return f"{n / 1000:.1f}k"
    if n < 1_000_000:
        return f"{n / 1000:.0f}k"
    return f"{n / 1e6:.1f}M"


def causes_text(by_cause_ns: dict[str, int]) -> str:
    """ "host 62%, quiet 38%": each long-gap cause's share of the long-gap idle time."""
    whole = sum(by_cause_ns.values())
    return ", ".join(f"{c} {pct(v / whole)}" for c, v in by_cause_ns.items()) if whole else ""


def gpu_time_text(t: GpuTime, with_copies: bool = True) -> str:
    """`GPU0 busy 14% (kernels 13%, copies 1%) · idle 86%: 74% in 41k gaps <100 µs, 12%
    longer (host 95%)`: the pane's line and the report's. `with_copies`: whether the copy
    records were looked at (then "copies 0%" is a fact, not a blank)."""
    return f"GPU{t.gpu} {time_text(t, with_copies)}"


def time_text(t: GpuTime, with_copies: bool = True) -> str:
    """`gpu_time_text` without the GPU's name (a finding's subject already says it)."""
    parts = [f"kernels {pct(t.share(t.kernel_ns))}"]
    if with_copies:
        parts.append(f"copies {pct(t.share(t.copy_ns))}")
    line = f"busy {pct(t.share(t.busy_ns))} ({', '.join(parts)})"
    line += f" · idle {pct(t.share(t.idle_ns))}"
    bits = []
    if t.short_gaps:
        short = f"{pct(t.share(t.short_gap_idle_ns))} in {count(t.short_gaps)} gaps"
        bits.append(f"{short} <{MIN_GAP_US:.0f} µs")
    if t.long_gaps:
        longer = f"{pct(t.share(t.long_gap_idle_ns))} "
        longer += "longer" if t.short_gaps else f"in {count(t.long_gaps)} gaps ≥{MIN_GAP_US:.0f} µs"
        bits.append(f"{longer} ({causes_text(t.idle_by_cause_ns)})")
    if bits:
        line += ": " + ", ".join(bits)
    return line
