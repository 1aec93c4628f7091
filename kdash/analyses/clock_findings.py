"""The clock findings: CPUs below their frequency (`low-cpu-freq`) and GPUs held back by a
throttle reason (`gpu-throttle`) or with a low SM clock (`low-sm-clock`) while busy."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import numpy as np
import pandas as pd

from kdash import gpu_reasons
from kdash.analyses.finding import Finding
from kdash.analyses.finding_rules import (
    covered_s,
    poll_interval,
    span_words,
    stretches,
    table_frame,
)
from kdash.analyses.thread_view import ThreadView, as_view
from kdash.config import Thresholds
from kdash.cpulist import format_cpulist

# Reasons that are hardware or thermal: the GPU is being protected, not merely capped.
_HARD_REASONS = 0x8 | 0x20 | 0x40 | 0x80


def low_cpu_freq(
    cpu_freq: pd.DataFrame,
    th: Thresholds,
    threads: pd.DataFrame | ThreadView | None = None,
    now_ns: int | None = None,
) -> list[Finding]:
    """Busy CPUs (`busy_cpu_pct`) clocked below `low_cpu_freq_ratio` of their maximum.

    One finding for all such CPUs; `warning` when the target's hot threads ran there, else
    `info` (the host is slow, but not where the target runs). CPUs without a known maximum
    (VMs without cpufreq) cannot be judged and give nothing.
    """
    df = table_frame({"cpu_freq": cpu_freq}, "cpu_freq")
    cpu = df["cpu"].to_numpy(dtype=np.int64)
    t = df["t_ns"].to_numpy(dtype=np.int64)
    order = np.lexsort((t, cpu))
    cpu, t = cpu[order], t[order]
    mhz = df["mhz"].to_numpy(dtype=float)[order]
    mx = df["max_mhz"].to_numpy(dtype=float)[order]
    busy = df["busy_pct"].to_numpy(dtype=float)[order]
    with np.errstate(invalid="ignore"):
        cond = (busy >= th.busy_cpu_pct) & (mx > 0) & (mhz < th.low_cpu_freq_ratio * mx)
    cond = np.nan_to_num(cond, nan=False).astype(bool)
    if not cond.any():
        return []
    window = covered_s(t, now_ns)
    interval = poll_interval(t)
    flagged: dict[int, tuple[float, int]] = {}
    for c in np.unique(cpu[cond]):
        a, b = np.searchsorted(cpu, [c, c + 1])
        run, end, _ = stretches(t[a:b], cond[a:b], interval)
        if run >= th.min_duration_s:
            flagged[int(c)] = (run, end)
    if not flagged:
        return []
    cpus = sorted(flagged)
    run = max(f[0] for f in flagged.values())
    end = max(f[1] for f in flagged.values())
    rows = cond & np.isin(cpu, cpus)
    med_mhz = float(np.median(mhz[rows]))
    med_max = float(np.median(mx[rows]))
    med_busy = float(np.median(busy[rows]))
    users: list[str] = []
    if threads is not None and len(threads):
        tv = as_view(threads, th)
        on = np.flatnonzero(tv.hot & np.isin(tv.cpu, cpus))
        counts = Counter((int(tv.tid[i]), str(tv.name[i])) for i in on)
        users = [f"{name} ({tid})" for (tid, name), _ in counts.most_common(3)]
    evidence = (
        f"CPUs {format_cpulist(cpus)} at {med_mhz / 1000:.2f} GHz (median; max "
        f"{med_max / 1000:.2f} GHz, {med_mhz / med_max:.0%}) while {med_busy:.0f}% busy, "
        f"{span_words(run, window)}"
    )
    if users:
        evidence += "; the target's hot threads there: " + ", ".join(users)
    return [
        Finding(
            t_ns=end,
            severity="warning" if users else "info",
            kind="low-cpu-freq",
            subject=f"CPUs {format_cpulist(cpus)}",
            evidence=evidence,
            advice=(
                "set the performance governor (`cpupower frequency-set -g performance`), check "
                "the BIOS power profile and C-state limits, and power/thermal capping "
                "(`turbostat` shows the package power and throttling)"
            ),
        )
    ]


def _gpu_groups(gpu: pd.DataFrame) -> Iterable[tuple[int, pd.DataFrame]]:
    for g, df in gpu.sort_values(["gpu", "t_ns"], kind="stable").groupby("gpu", sort=True):
        yield int(g), df


def _busy(df: pd.DataFrame, th: Thresholds) -> np.ndarray:
    u = df["util_gpu_pct"].to_numpy(dtype=float)
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(u >= th.gpu_busy_util_pct, nan=False).astype(bool)


def _gpu_state(df: pd.DataFrame, cond: np.ndarray) -> str:
    """SM clock vs max, power vs limit, temperature, over the flagged samples."""

    def med(col: str) -> float:
        v = df[col].to_numpy(dtype=float)[cond]
        v = v[~np.isnan(v)]
        return float(np.median(v)) if len(v) else float("nan")

    parts = []
    sm, smx = med("sm_clock_mhz"), med("sm_clock_max_mhz")
    if not np.isnan(sm):
        parts.append(f"SM clock {sm:.0f}" + (f"/{smx:.0f} MHz" if not np.isnan(smx) else " MHz"))
    p, pl = med("power_w"), med("power_limit_w")
    if not np.isnan(p):
        parts.append(f"power {p:.0f}" + (f"/{pl:.0f} W" if not np.isnan(pl) else " W"))
    temp = med("temp_c")
    if not np.isnan(temp):
        parts.append(f"{temp:.0f} °C")
    util = med("util_gpu_pct")
    if not np.isnan(util):
        parts.append(f"util {util:.0f}%")
    return ", ".join(parts)


_REASON_ADVICE = {
    0x4: "board power at its limit: `nvidia-smi -q -d POWER` shows the limit; raise it "
    "(`nvidia-smi -pl W`, admin) if the board allows, or accept it as the workload's ceiling",
    0x8: "hardware slowdown: check the power supply and cooling, `nvidia-smi -q -d PERFORMANCE` "
    "and `dmesg` for Xid errors",
    0x20: "software thermal slowdown: GPU or HBM too hot; check airflow, fans and inlet "
    "temperature (`nvidia-smi -q -d TEMPERATURE`)",
    0x40: "hardware thermal slowdown: the GPU is overheating; check cooling now",
    0x80: "external power brake asserted by the system (PSU or chassis power management)",
}


def gpu_throttle(gpu: pd.DataFrame, th: Thresholds, now_ns: int | None = None) -> list[Finding]:
    """A busy GPU (`gpu_busy_util_pct`) held back by a throttle reason in
    `gpu_reasons.THROTTLE_MASK` (power cap, thermal, hardware slowdown, power brake).

    `critical` for the hardware and thermal reasons, `warning` for the software power cap.
    """
    window = covered_s(gpu["t_ns"].to_numpy(dtype=np.int64), now_ns)
    out: list[Finding] = []
    for g, df in _gpu_groups(gpu):
        bits = df["throttle_reasons"].to_numpy(dtype=np.int64)
        cond = _busy(df, th) & (bits >= 0) & ((bits & gpu_reasons.THROTTLE_MASK) != 0)
        run, end, _ = stretches(df["t_ns"].to_numpy(dtype=np.int64), cond)
        if run < th.min_duration_s:
            continue
        counts: Counter[int] = Counter()
        for b in bits[cond]:
            for bit in gpu_reasons.REASONS:
                if bit & gpu_reasons.THROTTLE_MASK and b & bit:
                    counts[bit] += 1
        n = int(cond.sum())
        seen = ", ".join(
            f"{gpu_reasons.REASONS[bit][0]} {c / n:.0%}" for bit, c in counts.most_common()
        )
        any_bits = 0
        for bit in counts:
            any_bits |= bit
        out.append(
            Finding(
                t_ns=end,
                severity="critical" if any_bits & _HARD_REASONS else "warning",
                kind="gpu-throttle",
                subject=f"GPU {g}",
                evidence=(
                    f"throttled while busy {span_words(run, window)}: {seen} of {n} busy samples; "
                    f"{_gpu_state(df, cond)}"
                ),
                advice="; ".join(_REASON_ADVICE[bit] for bit, _ in counts.most_common()),
            )
        )
    return out


def low_sm_clock(gpu: pd.DataFrame, th: Thresholds, now_ns: int | None = None) -> list[Finding]:
    """A busy GPU whose SM clock stays below `sm_clock_ratio` of its maximum.

    The evidence names the throttle reasons seen meanwhile, if any; with none, the usual causes
    are locked or application clocks set below the maximum.
    """
    window = covered_s(gpu["t_ns"].to_numpy(dtype=np.int64), now_ns)
    out: list[Finding] = []
    for g, df in _gpu_groups(gpu):
        sm = df["sm_clock_mhz"].to_numpy(dtype=float)
        smx = df["sm_clock_max_mhz"].to_numpy(dtype=float)
        with np.errstate(invalid="ignore"):
            low = np.nan_to_num((smx > 0) & (sm < th.sm_clock_ratio * smx), nan=False)
        cond = _busy(df, th) & low.astype(bool)
        run, end, _ = stretches(df["t_ns"].to_numpy(dtype=np.int64), cond)
        if run < th.min_duration_s:
            continue
        bits = df["throttle_reasons"].to_numpy(dtype=np.int64)[cond]
        names = sorted({n for b in bits for n in gpu_reasons.decode(int(b))} - {"idle"})
        ratio = float(np.median(sm[cond] / smx[cond]))
        why = (
            f"reasons reported meanwhile: {', '.join(names)}"
            if names
            else "no throttle reason reported"
        )
        advice = (
            "see the gpu-throttle finding for the reasons; "
            if set(names)
            & {
                gpu_reasons.REASONS[b][0]
                for b in gpu_reasons.REASONS
                if b & gpu_reasons.THROTTLE_MASK
            }
            else ""
        ) + (
            "check locked and application clocks (`nvidia-smi -q -d CLOCK`; reset with "
            "`nvidia-smi -rgc` and `nvidia-smi -rac`, admin) and the power limit"
        )
        out.append(
            Finding(
                t_ns=end,
                severity="warning",
                kind="low-sm-clock",
                subject=f"GPU {g}",
                evidence=(
                    f"SM clock at {ratio:.0%} of its maximum while busy {span_words(run, window)}: "
                    f"{_gpu_state(df, cond)}; {why}"
                ),
                advice=advice,
            )
        )
    return out
