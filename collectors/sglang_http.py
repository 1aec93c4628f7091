"""Talking to a live SGLang server over its own HTTP API: the metrics source that polls it into
`server` rows, and the names the rest of kdash imports from here.

The parts, each checked against SGLang 0.5.10.post1's own code (run on a CPU by
tests/test_sglang_real.py, `bench/sglang_cpu_env.sh` installs it): `sglang_client` (the HTTP
client: endpoints, keys, one-line errors), `sglang_metrics` (the Prometheus series and the
load objects as server rows) and `sglang_profile` (a capture window through the server's
`/start_profile`).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any

from kdash.errors import UserError
from kdash.histogram import BUCKET_TAG, bucket_delta, bucket_quantile, le_text, window_buckets
from kdash.schema import Batch, make_batch

from .base import Health
from .sglang_client import ADMIN_PATHS, SglangClient, SglangError
from .sglang_metrics import (
    COUNTERS,
    GAUGES,
    HISTOGRAMS,
    PREFIX,
    QUANTILES,
    SCHED_COUNTERS,
    STAGE_HISTOGRAM,
    Scrape,
    load_rows,
    one_per_dp,
    parse_metrics,
)
from .sglang_profile import (
    ACTIVITIES,
    NEVER_STEP,
    ProfileRequest,
    ServerCapture,
    capture_via_server,
    disarm,
    missing_ranks,
    new_prefix,
    take_profile,
)

__all__ = [
    "ACTIVITIES",
    "ADMIN_PATHS",
    "BUCKET_TAG",
    "COUNTERS",
    "GAUGES",
    "HISTOGRAMS",
    "NEVER_STEP",
    "PREFIX",
    "QUANTILES",
    "SCHED_COUNTERS",
    "STAGE_HISTOGRAM",
    "ProfileRequest",
    "Scrape",
    "ServerCapture",
    "SglangClient",
    "SglangError",
    "SglangMetricsSource",
    "UserError",
    "bucket_delta",
    "bucket_quantile",
    "capture_via_server",
    "disarm",
    "load_rows",
    "missing_ranks",
    "new_prefix",
    "one_per_dp",
    "parse_metrics",
    "take_profile",
    "window_buckets",
]

log = logging.getLogger("kdash.collectors.sglang")


class SglangMetricsSource:
    """A Source that polls /metrics (or /get_load when metrics are off) into `server` rows.

    Row names (`server.metric`): the gauges by their SGLang name without the `sglang:` prefix
    (`num_running_reqs`, `num_queue_reqs`, `token_usage`, `gen_throughput`, `cache_hit_rate`),
    per-rank copies as `num_running_reqs[dp=1]` when the server exports one series per rank,
    `ttft_p50_s`/`ttft_p99_s`/`ttft_n` (and `itl_`, `e2e_`, `queue_`) over the last `hist_window_s`
    (bucket deltas between scrapes; nothing emitted when no request finished in the window),
    and counter rates `prompt_tokens_per_s`, `generation_tokens_per_s`, `requests_per_s`.
    With each histogram row set come its bucket deltas since the previous scrape,
    `ttft_le:0.1` ... `ttft_le:+Inf` (see `window_buckets`), for quantiles over any window.
    Gauges also `utilization`, `num_used_tokens`, `max_total_num_tokens`, `is_cuda_graph`;
    `stage.<stage>_p50_s`/`_p99_s`/`_n` from per_stage_req_latency_seconds (no bucket rows);
    `gpu_busy_frac` (GPU-execution seconds per second of one scheduler per DP rank).
    Without /metrics ("load" mode): /v1/loads' `num_running_reqs`, `num_queue_reqs`,
    `num_used_tokens`, `max_total_num_tokens`, `token_usage`, `gen_throughput`, `utilization`.

    `poll` does one HTTP request with a short timeout (`timeout_s`, default min(2 s,
    interval)); the recorder calls it every `interval_s` from its worker thread, and calls that
    come sooner (the recorder's faster pace inside a capture window) return nothing. While the
    server is unreachable it retries every `retry_s`, so a dead server costs the shared poll
    loop one timeout per `retry_s`, not one per poll.
    """

    name = "sglang"

    def __init__(
        self,
        url: str,
        interval_s: float = 1.0,
        api_key: str | None = None,
        timeout_s: float | None = None,
        hist_window_s: float | None = None,
        retry_s: float = 5.0,
        client: SglangClient | None = None,
    ) -> None:
        self.url = url
        self.interval_s = interval_s
        self.timeout_s = timeout_s if timeout_s is not None else min(2.0, max(0.2, interval_s))
        self.hist_window_s = hist_window_s if hist_window_s is not None else interval_s
        self.retry_s = retry_s
        self.client = client or SglangClient(url, api_key=api_key, timeout_s=self.timeout_s)
        self.health = Health("starting")
        self.mode: str | None = None  # "metrics" | "load" | None until the first answer
        # The mode of the last answer, kept after stop() (capture metadata is written then).
        self.last_mode: str | None = None
        self._hist_hist: deque[tuple[int, dict[str, dict[float, float]]]] = deque()
        self._last_counters: tuple[int, dict[str, float]] | None = None
        self._prev_hist: dict[str, dict[float, float]] | None = None
        self._next_try_ns = 0
        self._last_poll_ns: int | None = None
        self._min_gap_ns = int(interval_s * 0.9e9)
        self._lock = threading.Lock()
        self.polls = 0
        self.failures = 0
        self.last_latency_s = math.nan
        # /get_server_info, read once after the first answer (for the status bar, the capture
        # metadata and GPU mapping); None until then or when the server would not give it.
        self.server_info: dict[str, Any] | None = None
        self.info_error = ""  # why /server_info was not read (e.g. it wants --api-key)
        self._info_tried = False

    def start(self) -> None:
        self.health = Health("starting")

    def stop(self) -> None:
        self.mode = None

    def poll(self, now_ns: int) -> dict[str, Batch]:
        with self._lock:  # polls never overlap, even if a caller misbehaves
            try:
                return self._poll(now_ns)
            except Exception as e:
                log.exception("sglang metrics poll failed")
                self.health = Health.degraded(f"poll failed: {type(e).__name__}: {e}")
                return {}

    def _poll(self, now_ns: int) -> dict[str, Batch]:
        if now_ns < self._next_try_ns:
            return {}
        # Self-paced: the recorder polls every source faster inside a capture window, but the
        # server's metrics change at its own pace and each scrape costs the server a little.
        if self._last_poll_ns is not None and now_ns - self._last_poll_ns < self._min_gap_ns:
            return {}
        self._last_poll_ns = now_ns
        self.polls += 1
        t0 = time.monotonic()
        rows: dict[str, float] | None = None
        try:
            if self.mode != "load":
                try:
                    rows = self._from_metrics(now_ns, self.client.metrics_text(self.timeout_s))
                    self.mode = self.last_mode = "metrics"
                    self.health = Health()
                except SglangError as e:
                    if e.kind != "not_found":
                        raise
                    self.mode = "load"
            if self.mode == "load":
                rows = load_rows(self.client.get_load(self.timeout_s))
                self.last_mode = "load"
                self.health = Health.degraded(
                    "metrics off (start the server with --enable-metrics); using "
                    f"{self.client._load_path or '/v1/loads'}",
                    "metrics_off",
                )
        except SglangError as e:
            self.failures += 1
            self._next_try_ns = now_ns + int(self.retry_s * 1e9)
            self.health = Health.unavailable(str(e))
            return {}
        finally:
            self.last_latency_s = time.monotonic() - t0
        if not self._info_tried:
            self._info_tried = True
            try:
                self.server_info = self.client.get_server_info()
            except SglangError as e:
                self.info_error = str(e)
                log.info("no /server_info: %s", e)
        if not rows:
            return {}
        names = sorted(rows)
        return {
            "server": make_batch(
                "server",
                t_ns=[now_ns] * len(names),
                metric=names,
                value=[rows[n] for n in names],
            )
        }

    def server_summary(self) -> dict[str, Any]:
        """The server facts a person checks first, from /server_info (empty until read)."""
        info = self.server_info or {}
        keys = (
            "version",
            "model_path",
            "tp_size",
            "dp_size",
            "pp_size",
            "ep_size",
            "attention_backend",
            "disable_cuda_graph",
            "enable_dp_attention",
            "enable_metrics",
            "base_gpu_id",
        )
        return {k: info[k] for k in keys if k in info}

    def _from_metrics(self, now_ns: int, text: str) -> dict[str, float]:
        try:
            scrape = parse_metrics(text)
        except ValueError as e:
            raise SglangError(
                f"{self.url}/metrics: not Prometheus text ({e})", "bad_reply"
            ) from None
        rows = dict(scrape.gauges)
        rows.update(scrape.ranked)
        # Histograms: compare with the newest scrape at least hist_window_s old (less half a
        # poll interval, so a poll that comes a little early still pairs with the previous one).
        min_age = int((self.hist_window_s - self.interval_s / 2) * 1e9)
        self._window_quantiles(rows, scrape, now_ns, min_age)
        self._bucket_rows(rows, scrape)
        self._prev_hist = scrape.hist
        self._hist_hist.append((now_ns, scrape.hist))
        while len(self._hist_hist) > 1 and now_ns - self._hist_hist[1][0] >= min_age:
            self._hist_hist.popleft()
        self._counter_rates(rows, scrape, now_ns)
        self._last_counters = (now_ns, scrape.counters)
        return rows

    def _window_quantiles(
        self, rows: dict[str, float], scrape: Scrape, now_ns: int, min_age: int
    ) -> None:
        """Count and quantile rows per histogram over the observations since the newest kept
        scrape at least `min_age` old; none before there is one."""
        base = None
        for t, h in self._hist_hist:
            if now_ns - t >= min_age:
                base = h
            else:
                break
        if base is None:
            return
        for short, buckets in scrape.hist.items():
            delta = bucket_delta(buckets, base.get(short, {}))
            n = delta.get(math.inf, 0.0)
            if n > 0:
                rows[f"{short}_n"] = n
                for q, tag in QUANTILES:
                    rows[f"{short}_{tag}_s"] = bucket_quantile(q, delta)

    def _bucket_rows(self, rows: dict[str, float], scrape: Scrape) -> None:
        # Bucket counts observed since the previous scrape, one row per bound
        # (`ttft_le:0.1`, ..., `ttft_le:+Inf`; cumulative within the delta, as Prometheus
        # buckets are): summing them over any span of rows gives that span's histogram, so a
        # pane can take p50/p99 over its whole window, not only per scrape.
        if self._prev_hist is None:
            return
        for short, buckets in scrape.hist.items():
            if short.startswith("stage."):
                continue  # 30 buckets per stage: quantile rows only
            delta = bucket_delta(buckets, self._prev_hist.get(short, {}))
            if delta.get(math.inf, 0.0) > 0:
                for le, c in delta.items():
                    rows[f"{short}{BUCKET_TAG}{le_text(le)}"] = c

    def _counter_rates(self, rows: dict[str, float], scrape: Scrape, now_ns: int) -> None:
        """Per-second rates of the counters since the previous scrape (a reset gives none)."""
        if self._last_counters is None:
            return
        t_old, old = self._last_counters
        dt = (now_ns - t_old) / 1e9
        if dt > 0:
            for k, v in scrape.counters.items():
                if k in old and v >= old[k]:
                    rows[k] = (v - old[k]) / dt
