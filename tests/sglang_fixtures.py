"""Test helpers for the SGLang server pane and attach: a MADE-UP TP=8 server replay, and a
stand-in server tree of real processes.

`tp8_capture()` is a made-up replay of a TP=8 SGLang server (no such server can run here): its
`server` rows come from the REAL metrics source (`SglangMetricsSource.poll` at fixed times)
scraping the stand-in HTTP server of tests/test_sglang_http.py, whose gauges and histograms
the helper sets step by step; its `gpu_samples` (8 GPUs) and `meta["sglang"]` are hand-made.
Everything is a function of fixed numbers, so snapshots are deterministic.

`standin_tree(...)` starts a real process tree that looks like an SGLang server to kdash: the
root runs `python -m sglang.launch_server` from a tiny stand-in `sglang` package and serves the
stand-in HTTP API on a real port; its children take SGLang's scheduler titles with
setproctitle, as SGLang's own processes do.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kdash import schema
from kdash.store import Store

TESTS = Path(__file__).parent
T0 = 1_700_000_000_000_000_000 // 1000  # a fixed monotonic-looking origin (ns)
SECONDS = 30


def tp8_capture(seconds: int = SECONDS, metrics: bool = True) -> tuple[Store, dict]:
    """(store, meta) of the made-up TP=8 replay; `metrics=False`: the /get_load fallback."""
    from kdash.collectors.sglang_http import SglangMetricsSource
    from test_sglang_http import StandIn

    store = Store(retention_s=10**7, max_rows=10**9)
    with StandIn(tp_size=8, enable_metrics=metrics) as srv:
        src = SglangMetricsSource(srv.url, interval_s=1.0)
        for i in range(seconds + 1):
            running = 8 + int(24 * (0.5 + 0.5 * np.sin(i / 4)))
            srv.set_load(running=[running], queued=[max(0, i % 9 - 4)], usage=[0.2 + i / 60])
            for k in range(running):
                srv.ttft.labels(srv.model).observe(0.15 + 0.02 * (k % 5) + (0.6 if k == 0 else 0))
                for j in range(10):
                    srv.itl.labels(srv.model).observe(0.007 + 0.001 * ((k + j) % 4))
            store.extend(src.poll(T0 + i * 1_000_000_000))
        health = str(src.health)
    n = seconds * 4 + 1
    t = T0 + (np.arange(n) * 250_000_000).astype(np.int64)
    rows = []
    for gpu in range(8):
        for i, ts in enumerate(t):
            capped = gpu == 3 and i > n // 2
            rows.append(
                {
                    "t_ns": int(ts),
                    "gpu": gpu,
                    "sm_clock_mhz": 1755.0 if capped else 1980.0,
                    "mem_clock_mhz": 3201.0,
                    "sm_clock_max_mhz": 1980.0,
                    "mem_clock_max_mhz": 3201.0,
                    "temp_c": 55.0 + gpu,
                    "power_w": 700.0 if capped else 520.0 + 10 * gpu,
                    "power_limit_w": 700.0,
                    "util_gpu_pct": 100.0,
                    "pstate": 0,
                    "throttle_reasons": 0x4 if capped else 0,
                }
            )
    store.append("gpu_samples", schema.make_batch("gpu_samples", rows))
    scheds = [
        {
            "pid": 4101 + r,
            "title": f"sglang::scheduler_TP{r}",
            "ranks": f"TP{r}",
            "gpu": r,
            "gpu_source": "nvml",
        }
        for r in range(8)
    ]
    roles = [{"pid": 4100, "role": "root", "title": "python3 -m sglang.launch_server", "label": ""}]
    roles += [{"pid": s["pid"], "role": "scheduler", "title": s["title"], "label": s["ranks"]}
              for s in scheds]  # fmt: skip
    roles.append({"pid": 4110, "role": "detokenizer", "title": "sglang::detokenizer", "label": ""})
    meta = {
        "title": "made-up TP=8 SGLang server (test fixture, not a real server)",
        "target": {"pid": 4100, "cmdline": "python3 -m sglang.launch_server --tp 8", "host": "h"},
        "host": {"hostname": "h"},
        "created_wall_ns": 1_767_225_600_000_000_000,
        "window": {
            "start_ns": T0,
            "end_ns": T0 + seconds * 1_000_000_000,
            "seconds": float(seconds),
            "trigger_ns": None,
        },
        "gpus": [{"index": g, "name": "NVIDIA H200"} for g in range(8)],
        "sources": {
            "sched": "ok",
            "nvml": "ok",
            "agent": "unavailable: no kdash agent in pid 4100 or its children",
            "sglang": health,
        },
        "sglang": {
            "url": "http://127.0.0.1:30000",
            "root": 4100,
            "schedulers": scheds,
            "detokenizer": 4110,
            "dp_controller": None,
            "roles": roles,
            "server": {
                "tp_size": 8,
                "dp_size": 1,
                "attention_backend": "fa3",
                "disable_cuda_graph": False,
                "enable_metrics": metrics,
            },
        },
    }
    return store, meta


# -- a stand-in server tree of real processes ----------------------------------------------
_ROOT = textwrap.dedent(
    """
    import json, os, subprocess, sys, time
    sys.path.insert(0, os.environ["KDASH_TESTS_DIR"])
    import test_sglang_http
    from test_sglang_http import StandIn
    spec = json.loads(os.environ["KDASH_STANDIN_SPEC"])
    if "--port" in sys.argv:  # listen where SGLang's --port says (the stand-in binds port 0)
        port = int(sys.argv[sys.argv.index("--port") + 1])
        base = test_sglang_http.ThreadingHTTPServer
        test_sglang_http.ThreadingHTTPServer = lambda addr, h: base((addr[0], port), h)
    kids = [
        subprocess.Popen([sys.executable, "-c", os.environ["KDASH_CHILD"], t])
        for t in spec["titles"]
    ]
    with StandIn(
        tp_size=spec.get("tp", 1),
        enable_metrics=spec.get("metrics", True),
        api_key=spec.get("api_key"),
        steps_happen=spec.get("steps", True),
    ) as s:
        s.set_load(running=[4], queued=[1], usage=[0.3])
        for _ in range(20):
            s.ttft.labels(s.model).observe(0.12)
        print(json.dumps({"url": s.url, "kids": [k.pid for k in kids]}), flush=True)
        t0 = time.time()
        if spec.get("stdin", True):  # started by the test: until it closes our stdin
            while time.time() - t0 < 120 and sys.stdin.readline() != "":
                pass
        else:  # started by `kdash run`: until it stops us (SIGINT) or goes away
            parent = os.getppid()
            while time.time() - t0 < 120 and os.getppid() == parent:
                time.sleep(0.1)
    for k in kids:
        k.terminate()
    """
)
_CHILD = textwrap.dedent(
    """
    import os, sys, time, setproctitle
    setproctitle.setproctitle(sys.argv[1])
    parent = os.getppid()
    t0 = time.time()
    while time.time() - t0 < 120 and os.getppid() == parent:
        time.sleep(0.1)
    """
)


@contextlib.contextmanager
def standin_tree(
    tmp: Path,
    titles: tuple[str, ...] = ("sglang::scheduler_TP0", "sglang::scheduler_TP1"),
    **spec: object,
) -> Iterator[tuple[subprocess.Popen, dict]]:
    """A real stand-in server tree; yields (root process, {"url", "kids"}). Torn down after."""
    pkg = tmp / "sglang"
    pkg.mkdir(exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "launch_server.py").write_text(_ROOT)
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(tmp), os.environ.get("PYTHONPATH", "")]).rstrip(":"),
        KDASH_TESTS_DIR=str(TESTS),
        KDASH_STANDIN_SPEC=json.dumps(dict(spec, titles=list(titles), tp=len(titles))),
        KDASH_CHILD=_CHILD,
    )
    root = subprocess.Popen(
        [sys.executable, "-m", "sglang.launch_server", "--tp", str(len(titles))],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert root.stdout is not None
        line = root.stdout.readline()
        assert line, "stand-in server did not start"
        info = json.loads(line)
        _wait_titles(info["kids"], titles)
        yield root, info
    finally:
        with contextlib.suppress(OSError):
            assert root.stdin is not None
            root.stdin.close()
        try:
            root.wait(timeout=15)
        except subprocess.TimeoutExpired:
            root.kill()
            root.wait()


def _wait_titles(pids: list[int], titles: tuple[str, ...]) -> None:
    import psutil

    deadline = time.time() + 15
    while time.time() < deadline:
        got = []
        for p in pids:
            with contextlib.suppress(psutil.Error):
                got.append(" ".join(psutil.Process(p).cmdline()))
        if all(any(t in g for g in got) for t in titles):
            return
        time.sleep(0.05)
    raise AssertionError(f"children did not take their titles: {titles}")
