"""The SGLang HTTP client and metrics source against a real HTTP server on 127.0.0.1.

The server is a STAND-IN for SGLang (`StandIn` below says what it mimics and how); no SGLang
server can run on these machines.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PROFILE_FIELDS: dict[str, tuple[type, ...]] = {
    "output_dir": (str,),
    "start_step": (int,),
    "num_steps": (int,),
    "activities": (list,),
    "with_stack": (bool,),
    "record_shapes": (bool,),
    "profile_by_stage": (bool,),
    "merge_profiles": (bool,),
    "profile_prefix": (str,),
    "profile_stages": (list,),
}


class StandIn:
    """A STAND-IN for an SGLang server's HTTP API, for tests: not SGLang.

    No SGLang server can run on the test machines, so this small stdlib `http.server` in a thread
    speaks the endpoints kdash uses, shaped after SGLang's source (http_server.py / io_struct.py
    of the 0.5.x line):

    - `/get_server_info`: a dict of server args (`tp_size`, `base_gpu_id`, `enable_metrics`, ...).
    - `/metrics` (only when `enable_metrics`): Prometheus text produced by `prometheus_client`
      itself (as SGLang does) with SGLang's metric names and labels; 404 otherwise.
    - `/get_load`: one object per DP rank (`dp_rank`, `num_reqs`, `num_waiting_reqs`, `num_tokens`).
    - `/start_profile` and `/stop_profile`: the body is checked field for field against
      `ProfileReqInput` (unknown fields or wrong types -> 400, stricter than SGLang on purpose);
      a second start while one runs -> bare `500 Internal Server Error`, as FastAPI answers for the
      RuntimeError SGLang raises; with `num_steps`, a REAL `torch.profiler` (CPU activity) runs a
      small workload for that many steps and writes `{prefix-}{id}-TP-{tp}.trace.json.gz` into
      `output_dir`, as each SGLang scheduler does.
    - `api_key`: every endpoint answers 401 `{"error": "Unauthorized"}` without
      `Authorization: Bearer KEY`, like SGLang's API-key middleware.
    """

    def __init__(
        self,
        *,
        api_key: str | None = None,
        enable_metrics: bool = True,
        tp_size: int = 1,
        dp_size: int = 1,
        steps_happen: bool = True,
    ) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.api_key = api_key
        self.enable_metrics = enable_metrics
        self.tp_size = tp_size
        self.dp_size = dp_size
        self.steps_happen = steps_happen  # False: an idle server, no forward step, no file
        self.requests: list[tuple[str, str, dict | None, dict[str, str]]] = []
        self.profiling = False
        self.armed: dict | None = None  # a start waiting for a forward step that never came
        self.replaced = 0  # running profiles a plain start took over
        self.profile_thread: threading.Thread | None = None
        self.written: list[Path] = []
        self.registry = CollectorRegistry()
        labels = ["model_name", "dp_rank"]
        self.running = Gauge("sglang:num_running_reqs", "running", labels, registry=self.registry)
        self.queued = Gauge("sglang:num_queue_reqs", "queued", labels, registry=self.registry)
        self.usage = Gauge("sglang:token_usage", "usage", labels, registry=self.registry)
        self.tput = Gauge("sglang:gen_throughput", "tok/s", labels, registry=self.registry)
        self.hit = Gauge("sglang:cache_hit_rate", "hit rate", labels, registry=self.registry)
        self.ttft = Histogram(
            "sglang:time_to_first_token_seconds",
            "ttft",
            ["model_name"],
            buckets=[0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 120, 160],
            registry=self.registry,
        )
        self.itl = Histogram(
            "sglang:inter_token_latency_seconds",
            "itl",
            ["model_name"],
            buckets=[0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.06, 0.1],
            registry=self.registry,
        )
        self.e2e = Histogram(
            "sglang:e2e_request_latency_seconds",
            "e2e",
            ["model_name"],
            buckets=[0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60],
            registry=self.registry,
        )
        self.gen_tokens = Counter(
            "sglang:generation_tokens", "tokens", ["model_name"], registry=self.registry
        )
        self.model = "stand-in/model"
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> StandIn:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        if self.profile_thread is not None:
            self.profile_thread.join(timeout=30)

    def set_load(self, running: list[float], queued: list[float], usage: list[float]) -> None:
        for dp, (r, q, u) in enumerate(zip(running, queued, usage, strict=True)):
            self.running.labels(self.model, str(dp)).set(r)
            self.queued.labels(self.model, str(dp)).set(q)
            self.usage.labels(self.model, str(dp)).set(u)
            self.tput.labels(self.model, str(dp)).set(100.0 * (dp + 1))
            self.hit.labels(self.model, str(dp)).set(0.5)

    # -- HTTP ------------------------------------------------------------------------------
    def _handler(self) -> type[BaseHTTPRequestHandler]:
        return type("Handler", (_Handler,), {"owner": self})

    def _run_profile(self, body: dict) -> None:
        """What each scheduler does: profile `num_steps` forward steps, write its trace."""
        import torch
        from torch.profiler import ProfilerActivity, profile, record_function

        out = Path(body.get("output_dir") or "/tmp")
        out.mkdir(parents=True, exist_ok=True)
        profile_id = f"{time.time():.6f}"
        prefix = body.get("profile_prefix")
        x = torch.randn(64, 64)
        with profile(
            activities=[ProfilerActivity.CPU], record_shapes=bool(body.get("record_shapes"))
        ) as prof:
            for step in range(int(body["num_steps"])):
                with record_function(f"forward_step_{step}"):
                    y = torch.softmax(x @ x, dim=-1)
                    x = y + 1.0
        # One real trace; the other TP ranks get copies of it (a torch.profiler result can be
        # exported once), under their own SGLang names.
        first: Path | None = None
        for tp in range(self.tp_size):
            name = f"{profile_id}-TP-{tp}.trace.json.gz"
            if prefix:
                name = f"{prefix}-{name}"
            path = out / name
            if first is None:
                prof.export_chrome_trace(str(path))
                first = path
            else:
                path.write_bytes(first.read_bytes())
            self.written.append(path)
        self.profiling = False


class _Handler(BaseHTTPRequestHandler):
    """The stand-in's routes; `owner` is set per server by StandIn._handler."""

    owner: StandIn

    def log_message(self, fmt: str, *args: Any) -> None:  # keep pytest output clean
        return

    def _send(self, code: int, body: str | bytes, ctype: str = "application/json"):
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _route(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        self.owner.requests.append((method, self.path, body, dict(self.headers)))
        if self.path == "/health":
            return self._send(200, "")
        if (
            self.owner.api_key
            and self.headers.get("Authorization") != f"Bearer {self.owner.api_key}"
        ):
            return self._send(401, json.dumps({"error": "Unauthorized"}))
        if self.path in ("/server_info", "/get_server_info"):
            info = {
                "tp_size": self.owner.tp_size,
                "dp_size": self.owner.dp_size,
                "pp_size": 1,
                "base_gpu_id": 0,
                "gpu_id_step": 1,
                "enable_dp_attention": False,
                "enable_metrics": self.owner.enable_metrics,
                "attention_backend": "triton",
                "disable_cuda_graph": False,
                "version": "0.5.stand-in",
            }
            return self._send(200, json.dumps(info))
        if self.path == "/metrics":
            if not self.owner.enable_metrics:
                return self._send(404, json.dumps({"detail": "Not Found"}))
            from prometheus_client import generate_latest

            return self._send(
                200, generate_latest(self.owner.registry), "text/plain; version=0.0.4"
            )
        if self.path == "/get_load":
            loads = [
                {
                    "dp_rank": dp,
                    "num_reqs": 3 + dp + dp,  # running + waiting, as 0.5.10 counts
                    "num_waiting_reqs": dp,
                    "num_tokens": 1000 * (dp + 1),
                    "ts_tic": time.time(),
                }
                for dp in range(self.owner.dp_size)
            ]
            return self._send(200, json.dumps(loads))
        if self.path == "/start_profile":
            return self._start(body)
        if self.path == "/stop_profile":
            if not self.owner.profiling:
                return self._send(500, "Internal Server Error", "text/plain")
            self.owner.profiling = False
            return self._send(200, "Stop profiling. This will take some time.\n", "text/plain")
        return self._send(404, json.dumps({"detail": "Not Found"}))

    def _start(self, body: dict | None):
        body = body or {}
        for k, v in body.items():
            if k not in PROFILE_FIELDS or not isinstance(v, PROFILE_FIELDS[k]):
                return self._send(400, json.dumps({"detail": f"bad field {k}"}))
            if k in ("start_step", "num_steps") and isinstance(v, bool):
                return self._send(400, json.dumps({"detail": f"bad field {k}"}))
        # As 0.5.10's scheduler: a start with start_step (or by stage) is refused while
        # a profile runs and only arms one until the next forward step; a plain start
        # is never refused and replaces the running profile.
        guarded = "start_step" in body or bool(body.get("profile_by_stage"))
        if guarded and self.owner.profiling:
            return self._send(500, "Internal Server Error", "text/plain")
        if guarded and not self.owner.steps_happen:
            self.owner.armed = body
            return self._send(200, "Start profiling.\n", "text/plain")
        self.owner.replaced += int(self.owner.profiling)
        self.owner.profiling = True
        if body.get("num_steps") and self.owner.steps_happen:
            self.owner.profile_thread = threading.Thread(
                target=self.owner._run_profile, args=(body,), daemon=True
            )
            self.owner.profile_thread.start()
        return self._send(200, "Start profiling.\n", "text/plain")

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")


# -- tests ---------------------------------------------------------------------------------
import math  # noqa: E402

import pytest  # noqa: E402
from kdash.collectors import sglang_http as sh  # noqa: E402
from kdash.collectors.base import Source  # noqa: E402

from kdash.errors import UserError  # noqa: E402


@pytest.fixture
def server():
    with StandIn(tp_size=2, dp_size=2) as s:
        s.set_load(running=[3, 5], queued=[1, 0], usage=[0.25, 0.75])
        yield s


def test_profile_request_matches_profile_req_input():
    req = sh.ProfileRequest(
        output_dir="/tmp/kd",
        num_steps=5,
        activities=["GPU"],
        profile_prefix="kdash",
        record_shapes=True,
        profile_by_stage=True,
    )
    body = req.to_json()
    assert body == {
        "output_dir": "/tmp/kd",
        "num_steps": 5,
        "activities": ["GPU"],
        "record_shapes": True,
        "profile_prefix": "kdash",
        "profile_by_stage": True,
    }
    assert set(body) <= set(PROFILE_FIELDS)
    assert sh.ProfileRequest().to_json() == {}  # an old server's defaults, nothing extra
    with pytest.raises(UserError, match="activities"):
        sh.ProfileRequest(activities=["CUDA"]).to_json()
    with pytest.raises(UserError, match="num_steps"):
        sh.ProfileRequest(num_steps=0).to_json()
    with pytest.raises(UserError, match="start_step"):
        sh.ProfileRequest(start_step=-1).to_json()


def test_server_info_and_load(server, monkeypatch):
    # a proxy set for downloads must not be used for the server on this machine
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    c = sh.SglangClient(server.url)
    info = c.get_server_info()
    assert info["tp_size"] == 2 and info["enable_metrics"] is True
    loads = c.get_load()
    assert [d["dp_rank"] for d in loads] == [0, 1]
    rows = sh.load_rows(loads)
    assert rows == {"num_running_reqs": 7.0, "num_queue_reqs": 1.0, "num_used_tokens": 3000.0}
    # the newer /get_load field names map to the same rows
    rows = sh.load_rows([{"num_running_reqs": 2, "num_waiting_reqs": 4, "token_usage": 0.5}])
    assert rows == {"num_running_reqs": 2.0, "num_queue_reqs": 4.0, "token_usage": 0.5}


def test_metrics_parsed_with_per_rank_series(server):
    server.ttft.labels(server.model).observe(0.15)
    scrape = sh.parse_metrics(sh.SglangClient(server.url).metrics_text())
    assert scrape.gauges["num_running_reqs"] == 8.0  # summed over DP ranks
    assert scrape.gauges["token_usage"] == 0.75  # the fullest rank
    assert scrape.gauges["cache_hit_rate"] == 0.5
    assert scrape.ranked["num_running_reqs[dp=1]"] == 5.0
    assert scrape.hist["ttft"][math.inf] == 1.0
    assert scrape.hist["ttft"][0.1] == 0.0 and scrape.hist["ttft"][0.2] == 1.0


def test_old_tpot_histogram_stands_in_for_itl():
    """SGLang 0.4.x exported the inter-token histogram as time_per_output_token_seconds."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    reg = CollectorRegistry()
    h = Histogram(
        "sglang:time_per_output_token_seconds",
        "tpot",
        ["model_name"],
        buckets=[0.01, 0.1],
        registry=reg,
    )
    h.labels("m").observe(0.05)
    scrape = sh.parse_metrics(generate_latest(reg).decode())
    assert scrape.hist["itl"][0.1] == 1.0 and "tpot" not in scrape.hist


def test_metrics_source_p50_p99_from_bucket_deltas(server):
    src = sh.SglangMetricsSource(server.url, interval_s=1.0)
    assert isinstance(src, Source)
    src.start()
    for _ in range(5):  # observations before the first scrape are not in any window
        server.ttft.labels(server.model).observe(30.0)
    t0 = 1_000_000_000
    first = src.poll(t0)["server"]
    got = dict(zip(first["metric"], first["value"], strict=True))
    assert src.health.ok and src.mode == "metrics"
    assert got["num_running_reqs"] == 8.0 and got["num_queue_reqs"] == 1.0
    summary = src.server_summary()
    assert summary["tp_size"] == 2 and summary["attention_backend"] == "triton"
    assert sum(1 for r in server.requests if r[1] == "/server_info") == 1
    assert "ttft_p50_s" not in got  # no window yet
    for v in (0.15,) * 98 + (0.5, 0.5):
        server.ttft.labels(server.model).observe(v)
    for _ in range(10):
        server.itl.labels(server.model).observe(0.009)
    server.gen_tokens.labels(server.model).inc(500)
    second = src.poll(t0 + 1_000_000_000)["server"]
    got = dict(zip(second["metric"], second["value"], strict=True))
    assert got["ttft_n"] == 100
    assert 0.1 < got["ttft_p50_s"] < 0.2  # the 30 s requests are outside the window
    assert 0.4 < got["ttft_p99_s"] <= 0.6
    assert 0.008 < got["itl_p50_s"] <= 0.01
    assert "e2e_p50_s" not in got  # nothing finished
    assert got["generation_tokens_per_s"] == pytest.approx(500.0)
    assert np_all_equal(second["t_ns"], t0 + 1_000_000_000)
    # a quiet interval: gauges only
    third = src.poll(t0 + 2_000_000_000)["server"]
    assert "ttft_p50_s" not in set(third["metric"])
    assert sum(1 for r in server.requests if r[1] == "/server_info") == 1  # read once
    # a poll sooner than interval_s (the recorder's capture-window pace) asks nothing
    n = len(server.requests)
    assert src.poll(t0 + 2_100_000_000) == {} and len(server.requests) == n


def np_all_equal(arr, value) -> bool:
    return bool((arr == value).all())


def test_metrics_off_falls_back_to_get_load():
    with StandIn(enable_metrics=False) as s:
        src = sh.SglangMetricsSource(s.url)
        out = src.poll(1_000_000_000)["server"]
        got = dict(zip(out["metric"], out["value"], strict=True))
        assert got["num_running_reqs"] == 3.0
        assert src.mode == "load"
        assert str(src.health) == (
            "degraded: metrics off (start the server with --enable-metrics); using /get_load"
        )
        # it does not ask /metrics again
        n_metrics = sum(1 for r in s.requests if r[1] == "/metrics")
        n_load = sum(1 for r in s.requests if r[1] == "/get_load")
        assert src.poll(2_000_000_000)["server"] is not None
        assert sum(1 for r in s.requests if r[1] == "/metrics") == n_metrics
        assert sum(1 for r in s.requests if r[1] == "/get_load") == n_load + 1


def test_api_key_401_and_bearer():
    with StandIn(api_key="s3cret") as s:
        with pytest.raises(sh.SglangError) as ei:
            sh.SglangClient(s.url).get_server_info()
        assert ei.value.kind == "unauthorized" and ei.value.status == 401
        assert "--api-key" in str(ei.value) and "\n" not in str(ei.value)
        info = sh.SglangClient(s.url, api_key="s3cret").get_server_info()
        assert info["tp_size"] == 1
        assert s.requests[-1][3]["Authorization"] == "Bearer s3cret"
        src = sh.SglangMetricsSource(s.url)
        assert src.poll(1) == {}
        assert src.health.state == "unavailable" and "unauthorized" in src.health.reason


def test_already_profiling_and_stop_without_profile(server):
    c = sh.SglangClient(server.url)
    with pytest.raises(sh.SglangError, match="usually no profile is running"):
        c.stop_profile()
    assert c.start_profile(sh.ProfileRequest(activities=["CPU"])) == "Start profiling."
    # a second plain start is not refused (0.5.10 drops the refusal and replaces the profile)
    c.start_profile(sh.ProfileRequest(activities=["CPU"]))
    assert server.replaced == 1
    with pytest.raises(sh.SglangError) as ei:  # with start_step it is refused
        c.start_profile(sh.ProfileRequest(activities=["CPU"], start_step=1, num_steps=1))
    assert ei.value.kind == "busy" and ei.value.status == 500
    assert "already running" in str(ei.value)
    assert c.stop_profile().startswith("Stop profiling")
    # a server that says so in its body (newer SGLang, other front ends)
    err = c._http_error(
        "/start_profile",
        400,
        '{"message": "Profiling is already in progress. Call /stop_profile first."}',
    )
    assert err.kind == "busy"


def test_connection_refused_and_timeout_are_one_line():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(sh.SglangError) as ei:
        sh.SglangClient(f"127.0.0.1:{port}", timeout_s=2).get_server_info()
    assert ei.value.kind == "refused" and "connection refused" in str(ei.value)
    # a socket that accepts and never answers
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)
    try:
        with pytest.raises(sh.SglangError) as ei:
            sh.SglangClient(f"127.0.0.1:{silent.getsockname()[1]}", timeout_s=0.3).get_load()
        assert ei.value.kind == "timeout" and "no answer in 0.3 s" in str(ei.value)
    finally:
        silent.close()
    src = sh.SglangMetricsSource(f"http://127.0.0.1:{port}", retry_s=5.0)
    assert src.poll(10_000_000_000) == {}
    assert src.health.state == "unavailable" and "connection refused" in src.health.reason
    # waits retry_s (5 s) before the next try, though polled every second
    assert src.poll(11_000_000_000) == {} and src.failures == 1 and src.polls == 1
    assert src.poll(15_000_000_000) == {} and src.failures == 2 and src.polls == 2


def test_not_json_and_not_prometheus():
    with StandIn() as s:
        c = sh.SglangClient(s.url)
        with pytest.raises(sh.SglangError, match="404"):
            c._request("/nope")
    with pytest.raises(ValueError):
        sh.parse_metrics("this is { not prometheus")


def test_capture_through_start_profile_and_import(server, tmp_path):
    """The capture path end to end against the stand-in: /start_profile with a bounded number
    of steps, wait for every rank's file, import them into one capture."""
    from kdash import kineto

    c = sh.SglangClient(server.url)
    req = sh.ProfileRequest(
        output_dir=str(tmp_path), num_steps=3, activities=["CPU"], profile_prefix="kdash"
    )
    assert c.start_profile(req) == "Start profiling."
    files = kineto.wait_for_traces(tmp_path, "kdash", count=2, timeout_s=60, stable_s=0.3)
    assert [kineto.parse_trace_name(f.name).tp for f in files] == [0, 1]
    with pytest.raises(UserError, match="1 of 3 trace files"):
        (tmp_path / "other-1.5-TP-0.trace.json.gz").write_bytes(b"x")
        kineto.wait_for_traces(tmp_path, "other", count=3, timeout_s=0.5)
    res = kineto.import_traces(files, tmp_path / "cap")
    assert res.path.name == "cap.kdash"
    assert res.rows["markers"] - sum(t.cpu_ops for t in res.traces) == 6  # 3 steps x 2 ranks
    assert sorted(t.name.tp for t in res.traces) == [0, 1]
    assert {t.name.prefix for t in res.traces} == {"kdash"}


def test_take_profile_returns_every_rank_file(server, tmp_path):
    files = sh.take_profile(
        sh.SglangClient(server.url),
        ranks=2,
        server_dir=str(tmp_path),
        num_steps=2,
        activities=("CPU",),
        timeout_s=60,
        stable_s=0.3,
    )
    assert len(files) == 2
    start = [r for r in server.requests if r[1] == "/start_profile"][-1]
    assert start[2]["num_steps"] == 2 and start[2]["profile_prefix"].startswith("kdash-")
    assert not [r for r in server.requests if r[1] == "/stop_profile"]  # it stopped itself


def test_take_profile_on_an_idle_server_stops_and_says_why(tmp_path):
    with StandIn(steps_happen=False) as s:
        with pytest.raises(UserError, match="no trace.*no requests"):
            sh.take_profile(
                sh.SglangClient(s.url), ranks=1, server_dir=str(tmp_path), timeout_s=0.5
            )
        assert not [r for r in s.requests if r[1] == "/stop_profile"]  # it would stop anyone's
        assert s.profiling is False and s.replaced == 0
        assert s.armed is not None and s.armed["start_step"] == sh.NEVER_STEP  # disarmed


def test_capture_via_server_lands_on_kdash_clock(server, tmp_path):
    """Kineto's baseTimeNanoseconds + ts is wall time: with the session's wall offset the rows
    land on the host monotonic clock, next to what kdash recorded at the same moment."""
    from kdash import clock

    before = clock.now_ns()
    cap = sh.capture_via_server(
        sh.SglangClient(server.url),
        ranks=2,
        server_dir=str(tmp_path),
        wall_offset_ns=clock.wall_offset_ns(),
        num_steps=2,
        activities=("GPU",),  # the stand-in's profiler records CPU only: no kernels
        timeout_s=60,
        stable_s=0.3,
    )
    after = clock.now_ns()
    m = cap.tables["markers"]
    assert (m["domain"] != "cpu_op").sum() == 4  # 2 steps x 2 ranks; the rest are CPU ops
    assert (m["start_ns"] >= before - 50_000_000).all() and (m["end_ns"] <= after).all()
    assert "another CUPTI client" in cap.note
    assert len(cap.files) == 2 and len(cap.traces) == 2
