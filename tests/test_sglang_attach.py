"""`kdash attach --sglang` / `--pid` of an SGLang server, and `c` through the server's profiler.

No SGLang server can run here. The server is the STAND-IN of tests/test_sglang_http.py (its
docstring says what it mimics): over real HTTP, with a real torch.profiler (CPU activity only:
no GPU here, so its traces hold CPU ops and step markers, never a kernel). The process tree is
real: a root started as `python -m sglang.launch_server` serving the stand-in, and children
retitled `sglang::scheduler_TP{n}` with setproctitle (tests/sglang_fixtures.py).
"""

from __future__ import annotations

import contextlib
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kdash.collectors import sglang_http as sh
from kdash.collectors.agents import AgentTreeSource
from kdash.collectors.base import Health
from kdash.collectors.sglang_tree import Ranks, SglangProcess, SglangTree
from sglang_fixtures import standin_tree
from test_sglang_http import StandIn

from kdash.capture import load_capture, read_meta
from kdash.session import RecorderOptions
from kdash.sglang import (
    ServerCaptureOptions,
    SglangRecorder,
    SglangServer,
    discover_from_pid,
    discover_from_url,
)
from kdash.store import Store
from kdash.target import Target

pytest.importorskip("setproctitle")


def kdash(*args: object, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kdash.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(r: subprocess.CompletedProcess, *words: str) -> str:
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kdash: "), r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])
    return lines[0]


LISTENER = (
    "import socket, sys; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(1); "
    "print(s.getsockname()[1], flush=True); sys.stdin.read()"
)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A real stand-in TP=2 server tree, shared by the module's tests (starting one costs ~1 s)."""
    with standin_tree(tmp_path_factory.mktemp("sgl")) as (root, info):
        yield root, info


# -- attach ----------------------------------------------------------------------------------
def test_attach_sglang_headless_records_server_rows_and_meta(tree, tmp_path):
    root, info = tree
    out = tmp_path / "sgl.kdash"
    # long enough for the first scrapes on a loaded machine (one a second is asked for)
    r = kdash("attach", "--sglang", info["url"], "--headless", "--duration", 5, "--output", out)
    assert r.returncode == 0, r.stderr
    cap = load_capture(out)
    server = cap.tables["server"]
    got = dict(zip(server["metric"], server["value"], strict=True))
    assert got["num_running_reqs"] == 4.0 and got["num_queue_reqs"] == 1.0
    assert got["token_usage"] == pytest.approx(0.3)
    sg = cap.meta["sglang"]
    assert sg["url"] == info["url"] and sg["root"] == root.pid
    assert [s["pid"] for s in sg["schedulers"]] == info["kids"]
    assert [s["ranks"] for s in sg["schedulers"]] == ["TP0", "TP1"]
    # no NVML here: SGLang's rank rule, said as such
    assert [(s["gpu"], s["gpu_source"]) for s in sg["schedulers"]] == [(0, "rank"), (1, "rank")]
    assert {r["role"] for r in sg["roles"]} == {"root", "scheduler"}
    assert sg["server"]["tp_size"] == 2 and sg["server"]["attention_backend"] == "triton"
    assert sg["server"]["disable_cuda_graph"] is False and sg["server"]["enable_metrics"] is True
    assert cap.meta["sources"]["sglang"] == "ok"
    # written after the sources stopped: still says how metrics were read (issue 16, item 9)
    assert sg["metrics"] == "metrics"
    # the whole tree is watched from its root: the schedulers' threads are in the capture
    assert cap.meta["target"]["pid"] == root.pid
    assert set(info["kids"]) <= set(cap.tables["threads"]["pid"])


def test_attach_pid_of_a_scheduler_finds_the_server(tree, tmp_path):
    root, info = tree
    server = discover_from_pid(info["kids"][1])
    assert server is not None
    assert server.tree.root.pid == root.pid and server.url == info["url"]
    assert server.server_info["tp_size"] == 2
    out = tmp_path / "pid.kdash"
    r = kdash("attach", "--pid", info["kids"][1], "--headless", "--duration", 1, "--output", out)
    assert r.returncode == 0, r.stderr
    meta = read_meta(out)
    assert meta["target"]["pid"] == root.pid
    assert meta["sglang"]["url"] == info["url"]
    # a wrapper above the server (here: pytest itself) finds the server's port below it
    wrapper = discover_from_pid(os.getpid())
    assert wrapper is not None and wrapper.url == info["url"]
    # a process with no SGLang process in its tree stays a plain attach
    plain = subprocess.Popen(["sleep", "30"])
    try:
        assert discover_from_pid(plain.pid) is None
    finally:
        plain.kill()
        plain.wait()


def test_tree_is_re_read_while_watching(tree, tmp_path):
    """A server seen while starting (root only) gets its schedulers once they are up."""
    root, info = tree
    server = discover_from_url(info["url"])
    server.tree.schedulers = []
    rec = SglangRecorder([], Store(), Target.from_pid(root.pid), None, server)
    assert rec.sglang_meta()["schedulers"] == []
    rec.tree_every_s = 0.0
    meta = rec.sglang_meta(max_age_s=0.0)
    assert [s["pid"] for s in meta["schedulers"]] == info["kids"]
    assert [s["gpu"] for s in meta["schedulers"]] == [0, 1]


def test_run_of_an_sglang_launch_is_watched_as_a_server(tmp_path):
    """`kdash run -- python -m sglang.launch_server --port P`: the server pane's rows and
    meta["sglang"] come without a second command; the tree is found once it is spawned."""
    import json
    import textwrap

    from sglang_fixtures import _CHILD, _ROOT, TESTS

    pkg = tmp_path / "sglang"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(_ROOT)
    port = _free_port()
    out = tmp_path / "run.kdash"
    env = dict(
        os.environ,
        PYTHONPATH=str(tmp_path),
        KDASH_TESTS_DIR=str(TESTS),
        KDASH_STANDIN_SPEC=json.dumps({"titles": ["sglang::scheduler"], "tp": 1, "stdin": False}),
        KDASH_CHILD=_CHILD,
        KDASH_RUN_LOG=str(tmp_path / "run.log"),
    )
    # the tree is spawned, found and scraped inside the run's fixed duration: about 2 s on an
    # idle machine, several times that on a loaded one
    cmd = [sys.executable, "-m", "kdash.cli", "run", "--headless", "--duration", "12"]
    cmd += ["--output", str(out), "--", sys.executable, "-m", "sglang.launch_server"]
    cmd += ["--port", str(port)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, (r.stderr, textwrap.shorten((tmp_path / "run.log").read_text(), 500))
    cap = load_capture(out)
    sg = cap.meta["sglang"]
    assert sg["url"] == f"http://127.0.0.1:{port}"
    assert [s["title"] for s in sg["schedulers"]] == ["sglang::scheduler"]
    assert sg["server"]["tp_size"] == 1  # read by the metrics source once the server answered
    got = dict(zip(cap.tables["server"]["metric"], cap.tables["server"]["value"], strict=True))
    assert got["num_running_reqs"] == 4.0


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_attach_sglang_errors_are_one_line(tree):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    one_line_error(kdash("attach", "--sglang", f"http://127.0.0.1:{port}"), "listens on port")
    # a port held by a process that is not SGLang (a plain Python listener)
    listener = subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True
    )
    try:
        lport = int(listener.stdout.readline())
        line = one_line_error(kdash("attach", "--sglang", f"127.0.0.1:{lport}"), "not an SGLang")
        assert str(listener.pid) in line
    finally:
        listener.kill()
        listener.wait()
    one_line_error(kdash("attach", "--sglang", "http://192.0.2.1:30000"), "not this machine")
    one_line_error(kdash("attach", "--sglang", "x", "--pid", "1"), "not allowed with")
    one_line_error(kdash("attach"), "--pid", "--sglang")


def test_attach_sglang_with_api_key(tmp_path):
    with standin_tree(tmp_path, ("sglang::scheduler",), api_key="k3y") as (_, info):
        # /server_info wants the key; /health does not, so kdash attaches and says why
        keyless = discover_from_url(info["url"])
        assert not keyless.server_info and "401" in keyless.info_error
        assert "--api-key" in keyless.info_error
        server = discover_from_url(info["url"], api_key="k3y")
        assert server.server_info["tp_size"] == 1
        # Once, on a loaded CI machine, a scan found the root but not its scheduler child
        # (cause not found); the dashboard rescans the tree each second, so the test does too
        # before it judges, up to a margin a loaded machine keeps.
        deadline = time.monotonic() + 20
        while not server.tree.schedulers and time.monotonic() < deadline:
            time.sleep(0.5)
            server = discover_from_url(info["url"], api_key="k3y")
        assert [s.ranks for s in server.tree.schedulers] == [Ranks(tp=0)]


# -- the window's quantiles from bucket rows -------------------------------------------------
def test_bucket_rows_sum_to_the_window_histogram():
    with StandIn() as srv:
        src = sh.SglangMetricsSource(srv.url, interval_s=1.0)
        rows: dict[str, float] = {}
        src.poll(1_000_000_000)
        for i, v in enumerate((0.15, 0.15, 0.5, 3.0)):
            srv.ttft.labels(srv.model).observe(v)
            out = src.poll((i + 2) * 1_000_000_000)["server"]
            for m, val in zip(out["metric"], out["value"], strict=True):
                if m.startswith("ttft_le:"):
                    rows[m] = rows.get(m, 0.0) + val
    b = sh.window_buckets(list(rows), list(rows.values()), "ttft")
    assert b[math.inf] == 4 and b[0.2] == 2 and b[0.6] == 3 and b[4.0] == 4
    assert 0.1 < sh.bucket_quantile(0.5, b) <= 0.2
    assert 2.0 < sh.bucket_quantile(0.99, b) <= 4.0


# -- capture through the server --------------------------------------------------------------
def _server(url: str | None, ranks: int = 2, key: str | None = None) -> SglangServer:
    """A server description whose schedulers are this process (same root: no /proc/PID/root)."""
    me = os.getpid()
    tree = SglangTree(root=SglangProcess(me, os.getppid(), "root", "python -m sglang"))
    tree.schedulers = [
        SglangProcess(me, me, "scheduler", f"sglang::scheduler_TP{r}", Ranks(tp=r))
        for r in range(ranks)
    ]
    return SglangServer(tree=tree, url=url, api_key=key, server_info={"tp_size": ranks})


def _recorder(
    tmp_path: Path, server: SglangServer, sources: list | None = None, **opts: object
) -> SglangRecorder:
    defaults = dict(num_steps=2, server_dir=str(tmp_path / "traces"), timeout_s=30.0, stable_s=0.3)
    defaults.update(opts)
    rec = SglangRecorder(
        sources or [],
        Store(retention_s=60),
        Target.from_pid(os.getpid()),
        RecorderOptions(interval_s=0.05, pre_s=0.2, post_s=0.2, capture_dir=tmp_path),
        server,
        ServerCaptureOptions(**defaults),
    )
    rec.tree_every_s = math.inf  # the made-up tree's root is pytest: never re-read it
    return rec


def _capture_now(rec: SglangRecorder, via_server: bool | None = None) -> None:
    """Trigger, run the server job as the app's worker would, then write as the recorder's
    writer thread does (synchronously here)."""
    assert rec.trigger_capture(pre_s=0.1, post_s=0.0, via_server=via_server)
    if rec.server_job is not None:
        rec.run_server_job(rec.server_job)
    rec._write_capture()


def test_capture_cpu_activities_merges_the_ranks_traces(tmp_path):
    """Asked for CPU activity (what the stand-in's profiler records), the capture is saved
    with both ranks' step markers on kdash's clock and no kernel (honest: no GPU here)."""
    with StandIn(tp_size=2) as srv:
        # the default folder: the server's (here: this process's) uid, made by the server
        rec = _recorder(tmp_path, _server(srv.url), activities=("CPU",), server_dir=None)
        before = time.monotonic_ns()
        _capture_now(rec)
        start = [r for r in srv.requests if r[1] == "/start_profile"][-1][2]
    assert rec.capture.phase == "saved", rec.capture.error
    assert start["activities"] == ["CPU"] and start["num_steps"] == 2
    folder = Path(f"/tmp/kdash-sglang-{os.getuid()}")
    assert start["output_dir"] == str(folder)
    assert start["profile_prefix"] == rec.server_job.prefix
    cap = load_capture(rec.capture.path)
    m = cap.tables["markers"]
    m = m[m["domain"] != "cpu_op"]  # the steps' CPU ops are markers rows too
    assert sorted(m["name"]) == ["forward_step_0"] * 2 + ["forward_step_1"] * 2
    assert (m["start_ns"] >= before - 50_000_000).all()
    assert len(cap.tables["kernels"]) == 0
    sgc = cap.meta["sglang"]["capture"]
    assert sgc["via"] == "server /start_profile" and sgc["kernels"] == 0
    assert len(sgc["files"]) == 2 and len(cap.meta["traces"]) == 2
    assert not any(Path(f).exists() for f in sgc["files"])  # kdash's own traces cleaned up
    assert all(Path(f).parent == folder for f in sgc["files"])
    with contextlib.suppress(OSError):  # left empty by kdash; another run may be using it
        folder.rmdir()


@pytest.mark.parametrize(
    "case, words",
    [
        ("unauthorized", ["401 unauthorized", "--api-key"]),
        ("busy", ["already running"]),
        ("idle", ["no trace", "no requests"]),
        ("no-kernels", ["no GPU kernels", "another CUPTI client"]),
        ("no-url", ["no HTTP port"]),
    ],
)
def test_capture_failures_are_one_line(tmp_path, case, words):
    """Every way the server can fail a capture ends as one line; the host window is saved."""
    kwargs = {"api_key": "k"} if case == "unauthorized" else {}
    with StandIn(tp_size=2, steps_happen=case != "idle", **kwargs) as srv:
        if case == "busy":  # someone else's profile is running
            sh.SglangClient(srv.url).start_profile(sh.ProfileRequest(activities=["CPU"]))
        # only the idle server is waited on until the timeout: keep that one short
        timeout = 1.5 if case == "idle" else 60.0
        url = None if case == "no-url" else srv.url
        rec = _recorder(tmp_path, _server(url), timeout_s=timeout)
        if case == "no-url":
            rec.server.info_error = "the root listens on no TCP port"
        _capture_now(rec, via_server=True if case == "no-url" else None)
        if case == "idle":
            assert srv.profiling is False and srv.armed is not None  # never started
        if case == "busy":
            assert srv.replaced == 0  # the other user's profile is untouched
    cap = rec.capture
    assert cap.phase == "failed", case
    assert "\n" not in cap.error
    for w in words:
        assert w in cap.error, (w, cap.error)
    assert f"host-only window saved: {cap.path}" in cap.error
    assert load_capture(cap.path).meta["sglang"]["capture"]["phase"] in ("failed", "done")


class _FakeAgent:
    """Stands in for one connected AgentSource (no CUPTI here): records when it is stopped."""

    name = "agent"

    def __init__(self) -> None:
        self.health = Health()
        self.stopped_at: float | None = None

    def stop(self) -> None:
        self.stopped_at = time.monotonic()

    def poll(self, now_ns: int) -> dict:
        return {}

    def dropped(self) -> int:
        return 0


def test_agents_switched_off_for_the_server_profile_and_back_on(tmp_path):
    agents = AgentTreeSource(Target.from_pid(os.getpid()))
    fake = _FakeAgent()
    agents.agents = {os.getpid(): fake}
    with StandIn(tp_size=1) as srv:
        rec = _recorder(tmp_path, _server(srv.url, ranks=1), [agents], activities=("CPU",))
        # an active agent holds CUPTI: plain `c` does not go through the server...
        assert rec.agents_active() == [os.getpid()]
        assert rec.trigger_capture(pre_s=0.1, post_s=0.0)
        assert rec.server_job is None
        rec._write_capture()
        assert rec.capture.phase == "saved"
        # ...`C` does, with the agents off while the server profiles
        t_start: list[float] = []
        orig = rec.server.client

        def client(timeout_s: float = 5.0):
            c = orig(timeout_s)
            real = c.start_profile

            def start(req):
                t_start.append(time.monotonic())
                assert agents.paused and not agents.agents
                return real(req)

            c.start_profile = start
            return c

        rec.server.client = client
        _capture_now(rec, via_server=True)
    assert rec.capture.phase == "saved", rec.capture.error
    assert fake.stopped_at is not None and fake.stopped_at < t_start[0]
    assert rec.server_job.paused_agents == [os.getpid()]
    assert not agents.paused  # back on: the next poll rescans and reconnects
    assert load_capture(rec.capture.path).meta["sglang"]["capture"]["agents_paused"] == [
        os.getpid()
    ]
