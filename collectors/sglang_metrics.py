"""SGLang's Prometheus /metrics text and its /v1/loads objects reduced to the server pane's
rows: gauges combined over DP ranks, histograms as cumulative buckets (their quantiles are
`kdash.histogram`'s), counters for per-second rates.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

PREFIX = "sglang:"
# Scheduler gauges and how the DP ranks' values add up. Each scheduler writes its own series
# (labels tp_rank, pp_rank, and dp_rank with DP): by default only attention-TP rank 0 of each
# DP rank does; with --enable-metrics-for-all-schedulers every TP rank repeats the same figure.
# So one series is taken per DP rank (lowest pp, tp), then the DP ranks are combined.
GAUGES: dict[str, str] = {
    "num_running_reqs": "sum",
    "num_queue_reqs": "sum",
    "token_usage": "max",
    "gen_throughput": "sum",
    "cache_hit_rate": "mean",
    "utilization": "max",
    "num_used_tokens": "sum",
    "max_total_num_tokens": "sum",
    "is_cuda_graph": "mean",
}
# Histograms -> short names of the server rows (`<short>_p50_s`, `<short>_p99_s`, `<short>_n`).
HISTOGRAMS: dict[str, str] = {
    "time_to_first_token_seconds": "ttft",
    "inter_token_latency_seconds": "itl",
    "e2e_request_latency_seconds": "e2e",
    "queue_time_seconds": "queue",
    # SGLang 0.4.x's name for the inter-token histogram; used as `itl` when that is absent
    "time_per_output_token_seconds": "tpot",
}
# Scheduler histograms with a `stage` label -> `stage.<stage>` shorts (p50/p99/n rows only).
STAGE_HISTOGRAM = "per_stage_req_latency_seconds"
# Counters -> per-second rates (prometheus_client's parser drops the `_total` suffix).
COUNTERS: dict[str, str] = {
    "prompt_tokens": "prompt_tokens_per_s",
    "generation_tokens": "generation_tokens_per_s",
    "num_requests": "requests_per_s",
}
# Scheduler counters, one series per DP rank like the gauges, summed over their other labels
# (`category`) and averaged over DP ranks: GPU-busy seconds per second of one scheduler.
SCHED_COUNTERS: dict[str, str] = {"gpu_execution_seconds": "gpu_busy_frac"}
QUANTILES = ((0.5, "p50"), (0.99, "p99"))


_RANK_LABELS = ("dp_rank", "tp_rank", "pp_rank")


@dataclass
class Scrape:
    """One /metrics scrape reduced to what the server pane needs."""

    gauges: dict[str, float] = field(default_factory=dict)
    ranked: dict[str, float] = field(default_factory=dict)  # e.g. "num_running_reqs[dp=1]"
    hist: dict[str, dict[float, float]] = field(default_factory=dict)  # short -> le -> cum count
    counters: dict[str, float] = field(default_factory=dict)


def _rank_num(labels: Mapping[str, str], key: str) -> int:
    try:
        return int(labels.get(key, 0))
    except ValueError:
        return 0


def one_per_dp(
    series: Iterable[tuple[Mapping[str, str], float]], keep: Iterable[str] = ()
) -> dict[str, list[tuple[Mapping[str, str], float]]]:
    """DP rank ("" without the label) -> the series of its lowest (pp_rank, tp_rank) scheduler.

    `keep` names labels that tell apart series of one scheduler (`category`, `stage`): all of
    those are kept for the chosen scheduler.
    """
    keep = tuple(keep)
    groups: dict[str, list[tuple[Mapping[str, str], float]]] = {}
    for labels, v in series:
        groups.setdefault(labels.get("dp_rank", ""), []).append((labels, v))
    out = {}
    for dp, items in groups.items():
        best = min((_rank_num(lb, "pp_rank"), _rank_num(lb, "tp_rank")) for lb, _ in items)
        out[dp] = [
            (lb, v)
            for lb, v in items
            if (_rank_num(lb, "pp_rank"), _rank_num(lb, "tp_rank")) == best
        ]
        if not keep:
            out[dp] = out[dp][:1]
    return out


def _combine(vals: list[float], how: str) -> float:
    if how == "sum":
        return sum(vals)
    if how == "max":
        return max(vals)
    return sum(vals) / len(vals)


def parse_metrics(text: str) -> Scrape:
    """Parse SGLang's Prometheus text with prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out = Scrape()
    gauge_series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for fam in text_string_to_metric_families(text):
        if not fam.name.startswith(PREFIX):
            continue
        name = fam.name[len(PREFIX) :]
        base = name[: -len("_total")] if name.endswith("_total") else name
        if name in GAUGES:
            gauge_series[name] = [(s.labels, float(s.value)) for s in fam.samples]
        elif name in HISTOGRAMS:
            _add_buckets(out.hist.setdefault(HISTOGRAMS[name], {}), fam.samples)
        elif name == STAGE_HISTOGRAM:
            _add_stage_buckets(out.hist, fam.samples)
        elif base in SCHED_COUNTERS:
            samples = [(s.labels, float(s.value)) for s in fam.samples if s.name.endswith("_total")]
            per_dp = [sum(v for _, v in items) for items in one_per_dp(samples, ("x",)).values()]
            if per_dp:
                out.counters[SCHED_COUNTERS[base]] = sum(per_dp) / len(per_dp)
        elif base in COUNTERS:
            total = sum(float(s.value) for s in fam.samples if not s.name.endswith("_created"))
            out.counters[COUNTERS[base]] = total
    if "itl" not in out.hist and "tpot" in out.hist:
        out.hist["itl"] = out.hist.pop("tpot")
    _add_gauges(out, gauge_series)
    return out


def _add_buckets(buckets: dict[float, float], samples: Iterable[Any]) -> None:
    """A histogram family's bucket samples summed into `buckets` (upper bound -> count)."""
    for s in samples:
        if s.name.endswith("_bucket") and "le" in s.labels:
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + float(s.value)


def _add_stage_buckets(hist: dict[str, dict[float, float]], samples: Iterable[Any]) -> None:
    """The per-stage histogram as one `stage.<name>` histogram per stage, one DP rank each."""
    series = [(s.labels, float(s.value)) for s in samples if s.name.endswith("_bucket")]
    for items in one_per_dp(series, keep=("stage", "le")).values():
        for labels, v in items:
            if "le" not in labels or "stage" not in labels:
                continue
            buckets = hist.setdefault(f"stage.{labels['stage']}", {})
            le = float(labels["le"])
            buckets[le] = buckets.get(le, 0.0) + v


def _add_gauges(out: Scrape, gauge_series: dict[str, list[tuple[dict[str, str], float]]]) -> None:
    """Gauges combined over DP ranks, and one ranked row per rank when there are several."""
    for name, series in gauge_series.items():
        per_dp = {
            dp: items[0][1]
            for dp, items in one_per_dp(series).items()
            if not math.isnan(items[0][1])
        }
        if not per_dp:
            continue
        out.gauges[name] = _combine(list(per_dp.values()), GAUGES[name])
        if len(per_dp) > 1:
            for dp, v in per_dp.items():
                if dp != "":
                    out.ranked[f"{name}[dp={dp}]"] = v


def _num(d: Mapping[str, Any], *names: str) -> float | None:
    for n in names:
        v = d.get(n)
        if isinstance(v, int | float) and not isinstance(v, bool):
            return float(v)
    return None


def load_rows(loads: Iterable[Mapping[str, Any]]) -> dict[str, float]:
    """Per-DP load objects -> the gauges the server pane shows, combined over DP ranks.

    /v1/loads counts running and waiting apart. The old /get_load's `num_reqs` is running plus
    waiting (SGLang 0.5.10), so its running figure is `num_reqs - num_waiting_reqs`.
    """
    per: dict[str, list[float]] = {}
    for d in loads:
        old = d.get("_endpoint") == "/get_load" or ("num_reqs" in d and "num_running_reqs" not in d)
        row: dict[str, float | None] = {
            "num_queue_reqs": _num(d, "num_waiting_reqs", "num_queue_reqs"),
            "num_used_tokens": _num(d, "num_used_tokens", "num_tokens"),
            "gen_throughput": _num(d, "gen_throughput"),
            "token_usage": _num(d, "token_usage"),
            "utilization": _num(d, "utilization"),
            "max_total_num_tokens": _num(d, "max_total_num_tokens"),
            "cache_hit_rate": _num(d, "cache_hit_rate"),
        }
        if old:
            total = _num(d, "num_reqs")
            waiting = row["num_queue_reqs"] or 0.0
            row["num_running_reqs"] = None if total is None else max(total - waiting, 0.0)
        else:
            row["num_running_reqs"] = _num(d, "num_running_reqs")
        for k, v in row.items():
            if v is not None:
                per.setdefault(k, []).append(v)
    return {k: _combine(vals, GAUGES[k]) for k, vals in per.items()}
