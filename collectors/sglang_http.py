"""Talking to a live SGLang server over its own HTTP API: server info, Prometheus metrics, load,
and the torch-profiler capture endpoints.

Checked against SGLang 0.5.10.post1's own code, run on a CPU by tests/test_sglang_real.py
(`bench/sglang_cpu_env.sh` installs it): the FastAPI app with its auth middleware, the
scheduler's profiler and metrics mixins, `/v1/loads`. What kdash relies on:

- `/server_info` (`/get_server_info` is the old name: it still answers, and logs a WARNING on
  every call, so it is asked only when `/server_info` is 404). `/v1/loads` gives, per DP rank,
  `num_running_reqs`, `num_waiting_reqs`, `num_used_tokens`, `max_total_num_tokens`,
  `token_usage`, `gen_throughput`, `utilization`, with or without `--enable-metrics`;
  `/get_load` (deprecated, warns on every call) is asked only when it is 404, and its
  `num_reqs` counts running and waiting requests together.
- Two keys. `/metrics` and `/health*` never need a key. `/server_info`, `/v1/loads` and
  `/get_load` need `--api-key` when the server has one; `/start_profile` and `/stop_profile`
  need `--admin-api-key` when the server has one (then `--api-key` is refused there), else
  `--api-key`. The client sends the admin key to the profile endpoints and the plain key to
  the rest; with only one given it is used for both.
- `POST /start_profile` takes a JSON `ProfileReqInput`: `output_dir`, `start_step`,
  `num_steps`, `activities` ("CPU", "GPU", "MEM", "RPD"), `with_stack`, `record_shapes`,
  `profile_by_stage`, `merge_profiles`, `profile_prefix`, `profile_stages`. Unset `with_stack`
  and `record_shapes` become True in the tokenizer manager, so kdash always sends False.
- A plain start (no `start_step`, no `profile_by_stage`) while a profile runs answers 200: the
  scheduler drops init_profile's refusal and starts a second profiler over the first one. A
  start with `start_step` takes the branch that returns the refusal (500 while busy), arms the
  profile for the next forward step, and records exactly `num_steps` steps. So kdash always
  sends `start_step`, never needs `/stop_profile`, and never stops someone else's profile.
- `SGLANG_PROFILE_V2=1` (a server environment variable) changes the scheduler's profiler: a
  start without `profile_by_stage`, or with `start_step`, fails an assertion that kills the
  scheduler; `/stop_profile` raises; files end in `-prefill`/`-decode`. kdash then sends
  `profile_by_stage` with `profile_stages` and no `start_step` (`ProfileRequest.for_server`).

Errors are `SglangError` (a `UserError`): one line that names the endpoint and says what to do,
with a `kind` ("refused", "timeout", "unauthorized", "busy", "not_found", "http", "bad_reply")
for code that must branch on it (the capture flow, the metrics source's fallback).
"""

from __future__ import annotations

import json
import logging
import math
import socket
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kdash.errors import UserError
from kdash.schema import Batch, make_batch

from .base import Health

log = logging.getLogger("kdash.collectors.sglang")

ACTIVITIES = ("CPU", "GPU", "MEM", "RPD")


class SglangError(UserError):
    """One-line failure of an SGLang endpoint; `kind` says which for callers that branch."""

    def __init__(self, message: str, kind: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.status = status


@dataclass
class ProfileRequest:
    """The body of `/start_profile`, field for field SGLang's `ProfileReqInput`."""

    output_dir: str | None = None
    start_step: int | None = None
    num_steps: int | None = None
    activities: list[str] | None = None
    with_stack: bool | None = None
    record_shapes: bool | None = None
    profile_by_stage: bool = False
    merge_profiles: bool = False
    profile_prefix: str | None = None
    profile_stages: list[str] | None = None

    def validate(self) -> None:
        """Refuse what the server would refuse later, with a clearer line."""
        if self.activities is not None:
            bad = [a for a in self.activities if a not in ACTIVITIES]
            if bad or not self.activities:
                raise UserError(
                    f"profile activities must be some of {', '.join(ACTIVITIES)}; got "
                    f"{self.activities}"
                )
        for name in ("start_step", "num_steps"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise UserError(f"profile {name} must be a non-negative integer; got {v!r}")
        if self.num_steps == 0:
            raise UserError("profile num_steps must be at least 1")
        if self.profile_prefix is not None and ("/" in self.profile_prefix):
            raise UserError(f"profile prefix must not contain '/': {self.profile_prefix!r}")

    def to_json(self) -> dict[str, Any]:
        """Set fields only; booleans that are False are SGLang's defaults and are left out."""
        self.validate()
        out: dict[str, Any] = {}
        for key in (
            "output_dir",
            "start_step",
            "num_steps",
            "activities",
            "with_stack",
            "record_shapes",
            "profile_prefix",
            "profile_stages",
        ):
            v = getattr(self, key)
            if v is not None:
                out[key] = list(v) if key in ("activities", "profile_stages") else v
        if self.profile_by_stage:
            out["profile_by_stage"] = True
        if self.merge_profiles:
            out["merge_profiles"] = True
        return out

    @classmethod
    def for_capture(
        cls,
        *,
        output_dir: str,
        num_steps: int,
        activities: list[str],
        prefix: str,
        profile_v2: bool | None,
    ) -> ProfileRequest:
        """kdash's own start: `num_steps` steps from the next one, no stacks or shapes.

        `profile_v2` False: `start_step`, so a busy server refuses (500) instead of having its
        profile replaced. True or None (the server's SGLANG_PROFILE_V2 could not be read): by
        stage, decode steps only, no `start_step`: the one shape V2 accepts, and one the classic
        profiler takes without harm (it refuses it while busy too).
        """
        common = {
            "output_dir": output_dir,
            "num_steps": num_steps,
            "activities": list(activities),
            "with_stack": False,
            "record_shapes": False,
            "profile_prefix": prefix,
        }
        if profile_v2 is False:
            return cls(start_step=1, **common)
        return cls(profile_by_stage=True, profile_stages=["decode"], **common)


ADMIN_PATHS = ("/start_profile", "/stop_profile")


class SglangClient:
    """urllib client with timeouts; every failure becomes one `SglangError` line.

    `api_key` goes to the plain endpoints, `admin_api_key` (else `api_key`) to the profile ones;
    nothing to /metrics and /health, which never want one.
    """

    def __init__(
        self,
        url: str,
        api_key: str | None = None,
        timeout_s: float = 5.0,
        admin_api_key: str | None = None,
    ) -> None:
        text = url.strip().rstrip("/")
        if "://" not in text:
            text = "http://" + text
        self.base = text
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        self.timeout_s = timeout_s
        # Which name of an endpoint this server answers, once known ("/server_info" or the
        # old "/get_server_info"; "/v1/loads" or "/get_load").
        self._info_path: str | None = None
        self._load_path: str | None = None
        # No proxies: kdash runs on the server's own machine, and an http_proxy set for the
        # user's downloads must not swallow requests to 127.0.0.1.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    # -- plumbing --------------------------------------------------------------------------
    def _request(
        self,
        path: str,
        body: Mapping[str, Any] | None = None,
        method: str | None = None,
        timeout_s: float | None = None,
    ) -> tuple[int, str]:
        data = None
        headers = {"Accept": "*/*", "User-Agent": "kdash"}
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        key = self._key_for(path)
        if key:
            headers["Authorization"] = f"Bearer {key}"
        req = urllib.request.Request(
            self.base + path,
            data=data,
            headers=headers,
            method=method or ("POST" if data else "GET"),
        )
        timeout = self.timeout_s if timeout_s is None else timeout_s
        try:
            with self._opener.open(req, timeout=timeout) as resp:
                return resp.status, resp.read().decode(errors="replace")
        except urllib.error.HTTPError as e:
            try:
                text = e.read().decode(errors="replace")
            except OSError:
                text = ""
            raise self._http_error(path, e.code, text) from None
        except urllib.error.URLError as e:
            raise self._conn_error(path, e.reason, timeout) from None
        except TimeoutError:
            raise SglangError(
                f"{self.base}{path}: no answer in {timeout:g} s (server busy or hung?)", "timeout"
            ) from None
        except (ConnectionError, OSError) as e:
            raise self._conn_error(path, e, timeout) from None

    def _key_for(self, path: str) -> str | None:
        if path.startswith(("/metrics", "/health")):
            return None
        if path in ADMIN_PATHS:
            return self.admin_api_key or self.api_key
        return self.api_key or self.admin_api_key

    def _conn_error(self, path: str, reason: object, timeout: float) -> SglangError:
        if isinstance(reason, ConnectionRefusedError):
            return SglangError(
                f"cannot connect to SGLang at {self.base}: connection refused (is the server "
                "up, and is this its port?)",
                "refused",
            )
        if isinstance(reason, TimeoutError | socket.timeout):
            return SglangError(
                f"{self.base}{path}: no answer in {timeout:g} s (server busy or hung?)", "timeout"
            )
        if isinstance(reason, socket.gaierror):
            return SglangError(f"cannot resolve the host of {self.base}: {reason}", "refused")
        text = getattr(reason, "strerror", None) or str(reason)
        return SglangError(f"cannot reach SGLang at {self.base}: {text}", "refused")

    def _http_error(self, path: str, status: int, text: str) -> SglangError:
        detail = _one_line(_error_message(text))
        if status in (401, 403):
            if path in ADMIN_PATHS:
                sent = "no key" if not self._key_for(path) else "the key kdash sent"
                hint = (
                    f"{sent} was refused: give kdash the server's --admin-api-key "
                    "(--admin-api-key), or its --api-key when it has no admin key"
                )
            else:
                sent = "no key" if not self._key_for(path) else "the key kdash sent"
                hint = f"{sent} was refused: give kdash the server's --api-key (--api-key)"
            return SglangError(
                f"{self.base}{path}: {status} unauthorized — {hint}", "unauthorized", status
            )
        if "already" in detail.lower() and "profil" in detail.lower():
            return SglangError(
                f"{self.base}{path}: a profile is already running on the server (wait for it "
                "or call /stop_profile)",
                "busy",
                status,
            )
        if status == 404:
            return SglangError(f"{self.base}{path}: 404 not found", "not_found", status)
        if path == "/start_profile" and status >= 500:
            return SglangError(
                f"{self.base}{path}: the server refused to start a profile ({status} "
                f"{detail or 'server error'}; usually one is already running — see its log)",
                "busy",
                status,
            )
        if path == "/stop_profile" and status >= 500:
            return SglangError(
                f"{self.base}{path}: the server refused to stop ({status} "
                f"{detail or 'server error'}; usually no profile is running)",
                "http",
                status,
            )
        return SglangError(
            f"{self.base}{path}: HTTP {status} {detail or 'error'}".rstrip(), "http", status
        )

    def _json(self, path: str, text: str) -> Any:
        try:
            return json.loads(text)
        except ValueError:
            raise SglangError(
                f"{self.base}{path}: answer is not JSON (is this an SGLang server?)", "bad_reply"
            ) from None

    # -- endpoints -------------------------------------------------------------------------
    def _first_of(self, paths: tuple[str, ...], known: str | None, **kw: Any) -> tuple[str, str]:
        """(path, text) of the first of `paths` that is not 404 (the known one first)."""
        order = (known,) if known else paths
        err: SglangError | None = None
        for path in order:
            try:
                return path, self._request(path, **kw)[1]
            except SglangError as e:
                if e.kind != "not_found":
                    raise
                err = e
        assert err is not None
        raise err

    def get_server_info(self) -> dict[str, Any]:
        path, text = self._first_of(("/server_info", "/get_server_info"), self._info_path)
        self._info_path = path
        info = self._json(path, text)
        if not isinstance(info, dict):
            raise SglangError(f"{self.base}{path}: not an object", "bad_reply")
        return info

    def health(self, timeout_s: float | None = None) -> int:
        """HTTP status of /health (200 up, 503 starting or shutting down); needs no key."""
        try:
            return self._request("/health", timeout_s=timeout_s)[0]
        except SglangError as e:
            if e.status is not None:
                return e.status
            raise

    def metrics_text(self, timeout_s: float | None = None) -> str:
        """Prometheus text of /metrics; SglangError kind "not_found" when metrics are off."""
        return self._request("/metrics", timeout_s=timeout_s)[1]

    def get_load(self, timeout_s: float | None = None) -> list[dict[str, Any]]:
        """One dict per DP rank, from /v1/loads (else the old /get_load); each dict carries
        `_endpoint` so `load_rows` knows which counting it holds."""
        path, text = self._first_of(
            ("/v1/loads", "/get_load"), self._load_path, timeout_s=timeout_s
        )
        self._load_path = path
        data = self._json(path, text)
        if path == "/v1/loads" and isinstance(data, dict):
            data = data.get("loads")
        elif isinstance(data, dict):
            data = [data]
        if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
            raise SglangError(f"{self.base}{path}: unexpected answer shape", "bad_reply")
        return [dict(d, _endpoint=path) for d in data]

    def start_profile(self, req: ProfileRequest) -> str:
        """Start a torch.profiler window in every scheduler; returns the server's text."""
        _, text = self._request("/start_profile", body=req.to_json(), method="POST")
        return text.strip()

    def stop_profile(self, timeout_s: float | None = None) -> str:
        """Stop it; the schedulers write their trace files after answering (takes seconds)."""
        _, text = self._request("/stop_profile", body={}, method="POST", timeout_s=timeout_s)
        return text.strip()


def _error_message(text: str) -> str:
    """The message of a JSON error body (FastAPI/OpenAI shapes), else the text itself."""
    try:
        data = json.loads(text)
    except ValueError:
        return text
    if isinstance(data, dict):
        for key in ("message", "detail", "error"):
            v = data.get(key)
            if isinstance(v, dict):
                v = v.get("message")
            if isinstance(v, str) and v:
                return v
    return text


def _one_line(text: str, limit: int = 160) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


# -- Prometheus -> server rows -------------------------------------------------------------
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
BUCKET_TAG = "_le:"  # `ttft_le:0.1` rows: bucket counts between two scrapes


def _le_text(le: float) -> str:
    return "+Inf" if math.isinf(le) else f"{le:g}"


def window_buckets(metrics: Iterable[str], values: Iterable[float], short: str) -> dict:
    """Sum the `<short>_le:<bound>` rows of a span into one cumulative histogram
    (bound -> count) that `bucket_quantile` reads; empty when no request finished."""
    tag = short + BUCKET_TAG
    out: dict[float, float] = {}
    for m, v in zip(metrics, values, strict=True):
        if m.startswith(tag):
            text = m[len(tag) :]
            le = math.inf if text == "+Inf" else float(text)
            out[le] = out.get(le, 0.0) + float(v)
    return out


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


def bucket_quantile(q: float, buckets: Mapping[float, float]) -> float:
    """Prometheus' `histogram_quantile` on cumulative bucket counts (upper bound -> count).

    Linear interpolation inside the bucket that holds the rank; the +Inf bucket answers with
    the largest finite bound. NaN when there are no observations.
    """
    bounds = sorted(buckets)
    if not bounds or bounds[-1] != math.inf:
        return math.nan
    total = buckets[math.inf]
    if total <= 0:
        return math.nan
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for b in bounds:
        c = buckets[b]
        if c >= rank:
            if b == math.inf:
                return prev_bound if len(bounds) > 1 else math.nan
            if c == prev_count:
                return b
            return prev_bound + (b - prev_bound) * (rank - prev_count) / (c - prev_count)
        prev_bound, prev_count = b, c
    return bounds[-2] if len(bounds) > 1 else math.nan


def bucket_delta(new: Mapping[float, float], old: Mapping[float, float]) -> dict[float, float]:
    """Observations between two scrapes; a counter that went down (restart) starts afresh."""
    if not old or any(new.get(b, 0.0) < c for b, c in old.items()):
        return dict(new)
    return {b: c - old.get(b, 0.0) for b, c in new.items()}


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
                    rows[f"{short}{BUCKET_TAG}{_le_text(le)}"] = c

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


# -- a capture window through the server's own profiler ------------------------------------
def new_prefix() -> str:
    """A profile_prefix no other capture shares: kdash-<our pid>-<ms>, safe in a file name."""
    import os

    return f"kdash-{os.getpid()}-{int(time.time() * 1000)}"


# The step an armed profile waits for when kdash gives up on it: never reached, so a rank that
# got no forward step does not start kdash's profile long after the capture ended.
NEVER_STEP = 2**31


def disarm(client: SglangClient, server_dir: str, prefix: str) -> None:
    """Move kdash's armed, never started profile to a step no server reaches.

    A rank that got no forward step still holds kdash's `start_step`; /stop_profile cannot
    clear it (it refuses: nothing in progress). A new start with a far `start_step` replaces
    it; a server busy with a profile refuses that (500) and keeps its own. Errors are logged.
    """
    req = ProfileRequest(
        output_dir=server_dir,
        start_step=NEVER_STEP,
        num_steps=1,
        activities=["CPU"],
        with_stack=False,
        record_shapes=False,
        profile_prefix=prefix,
    )
    try:
        client.start_profile(req)
    except SglangError as e:
        log.info("disarming kdash's profile: %s", e)


def take_profile(
    client: SglangClient,
    *,
    ranks: int,
    server_dir: str,
    local_dir: str | None = None,
    num_steps: int = 20,
    activities: tuple[str, ...] = ("CPU", "GPU"),
    prefix: str | None = None,
    profile_v2: bool | None = False,
    timeout_s: float = 120.0,
    stable_s: float = 1.0,
    poll_s: float = 0.2,
) -> list[Path]:
    """Profile `num_steps` forward steps in every scheduler and return the trace files.

    `server_dir` is the folder as the server names it (it writes there); `local_dir` the same
    folder as kdash reaches it (`path_in_process` for a server in a container; default the same
    path). The request is `ProfileRequest.for_capture`: the server stops by itself, a busy one
    refuses, and /stop_profile is never sent (it would stop whichever profile runs, someone
    else's too). `ranks` is the number of scheduler processes: the wait ends when that many
    files came (with V2 or by stage, one per rank and stage seen), or at `timeout_s` with the
    files that came (a DP rank that got no request writes none). With none at all, UserError.
    """
    from kdash.kineto import settled_traces

    prefix = prefix or new_prefix()
    req = ProfileRequest.for_capture(
        output_dir=server_dir,
        num_steps=num_steps,
        activities=list(activities),
        prefix=prefix,
        profile_v2=profile_v2,
    )
    client.start_profile(req)
    folder = Path(local_dir or server_dir)
    deadline = time.monotonic() + timeout_s
    sizes: dict[Path, tuple[int, float]] = {}
    while True:
        files, settled = settled_traces(folder, prefix, sizes, stable_s)
        if len(files) >= ranks and settled >= len(files):
            return files
        if time.monotonic() >= deadline:
            break
        time.sleep(poll_s)
    if profile_v2 is False:
        disarm(client, server_dir, prefix + "-off")
    if files:
        end = time.monotonic() + stable_s + 5 * poll_s
        while settled < len(files) and time.monotonic() < end:
            time.sleep(poll_s)
            files, settled = settled_traces(folder, prefix, sizes, stable_s)
        return files
    raise UserError(
        f"no trace with prefix {prefix!r} in {folder} after {timeout_s:g} s: no forward step "
        "(no requests reached the server? send traffic and capture again), or the server "
        "cannot write there"
    )


def missing_ranks(files: list[Path], expect: list[tuple[int | None, int, int | None]]) -> list[str]:
    """Labels (`DP1 TP0`) of the expected (dp, tp, pp) schedulers without a trace file."""
    from kdash.kineto import parse_trace_name

    seen = set()
    for f in files:
        n = parse_trace_name(f.name)
        seen.add((n.dp or 0, n.tp or 0, n.pp or 0))
    out = []
    for dp, tp, pp in expect:
        if (dp or 0, tp, pp or 0) not in seen:
            parts = ([f"DP{dp}"] if dp is not None else []) + (
                [f"PP{pp}"] if pp is not None else []
            )
            out.append(" ".join([*parts, f"TP{tp}"]))
    return out


@dataclass
class ServerCapture:
    """What a capture through the server brought back: rows on kdash's clock, the files."""

    tables: dict[str, Batch]
    traces: list[Any]  # kdash.kineto.TraceInfo, one per rank file
    files: list[Path]
    note: str = ""  # set when the traces hold no GPU kernel, saying the likely reason
    missing: list[str] = field(default_factory=list)  # ranks with no step (no trace file)
    partial: str = ""  # the one line that says so; the capture still holds the other ranks


def capture_via_server(
    client: SglangClient,
    *,
    ranks: int,
    server_dir: str,
    local_dir: str | None = None,
    wall_offset_ns: int | None = None,
    num_steps: int = 20,
    activities: tuple[str, ...] = ("CPU", "GPU"),
    timeout_s: float = 120.0,
    stable_s: float = 1.0,
    prefix: str | None = None,
    profile_v2: bool | None = False,
    expect: list[tuple[int | None, int, int | None]] | None = None,
) -> ServerCapture:
    """`take_profile`, then every rank's trace read onto the host monotonic clock
    (`wall_offset_ns` from kdash.clock, as the session keeps it), ready to merge into a
    capture window. `expect` ((dp, tp, pp) per scheduler) names the ranks that wrote nothing.
    When GPU activity was asked for and no kernel came, `note` says why that usually is:
    another CUPTI client (kdash's own agent, Nsight) held CUPTI."""
    from kdash.kineto import read_traces

    files = take_profile(
        client,
        ranks=ranks,
        server_dir=server_dir,
        local_dir=local_dir,
        num_steps=num_steps,
        activities=activities,
        timeout_s=timeout_s,
        stable_s=stable_s,
        prefix=prefix,
        profile_v2=profile_v2,
    )
    tables, infos = read_traces(files, wall_offset_ns=wall_offset_ns)
    note = ""
    if "GPU" in activities and len(tables["kernels"]["start_ns"]) == 0:
        note = (
            "no GPU kernels in the server's traces: another CUPTI client (kdash's agent, "
            "Nsight) held CUPTI while it profiled; switch it off and capture again"
        )
    missing = missing_ranks(files, expect or [])
    partial = ""
    if missing:
        partial = (
            f"no step on {', '.join(missing)} in {timeout_s:g} s (no request reached it): "
            "no trace from it"
        )
    return ServerCapture(
        tables=tables, traces=infos, files=files, note=note, missing=missing, partial=partial
    )
