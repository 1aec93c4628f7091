"""Shared fixtures: a deterministic dashboard, a real capture's store, a real busy child process.

Determinism for the TUI tests (Pilot and snapshots), as harlequin's fixtures do it: the config
lives in a fresh `$XDG_CONFIG_HOME` under tmp (so `t` never writes the user's file and a saved
theme never leaks between tests), `NO_COLOR` is cleared unless a test sets it, animations are
off, and nothing shown depends on the wall clock (replays anchor time at the capture's window).
No widget of the dashboard has a blinking cursor (no Input), so there is no blink to turn off.

`tests/data/local-cpu.kdash` is a real capture recorded on the CI-class machine (2 vCPUs, no
GPU) with the real product path — `python -c "$BUSY_CHILD"` as the target and
`kdash attach --pid PID --headless --duration 12 --output tests/data/local-cpu.kdash` — so it
holds real `threads`/`cpu_freq` rows, real findings (run-queue delay and a shared core: two of
the child's threads are pinned to CPU 0) and the real "nvml unavailable" health line.
`tests/data/h200-*.kdash` are real captures a colleague recorded on the H200 machine (a torch
matmul load, alone and contended); the clock pane's tests and snapshots use them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

DATA = Path(__file__).parent / "data"

# The tests run against the installed kdash (site-packages, or the editable install's mapping),
# never against the checkout's kdash/ folder by accident: `python -m` and `python -c` children
# started with the checkout as their working folder would otherwise find ./kdash first, and
# in a non-editable install that folder has no collectors/, tui/ or kernels/ inside it.
os.environ["PYTHONSAFEPATH"] = "1"


def installed_distribution():
    """kdash's installed distribution (a venv's site-packages, or a folder on PYTHONPATH
    holding the wheel), or None. The checkout's own kdash.egg-info, which setuptools leaves
    at its root, is not an install."""
    import sys
    from importlib.metadata import Distribution

    checkout = Path(__file__).resolve().parent.parent
    where = [p for p in sys.path if Path(p or ".").resolve() != checkout]
    return next(iter(Distribution.discover(name="kdash", path=where)), None)


def installed_kdash_problem() -> str:
    """Why `import kdash` here does not find the installed package ("" when it does).

    An editable install maps `kdash` to the checkout's own folders, so there the two agree by
    construction. A regular install must be what this interpreter imports: `python -m pytest`
    run from the checkout puts the checkout first on sys.path, and ./kdash would shadow it.
    """
    import importlib.util
    import json

    dist = installed_distribution()
    if dist is None:
        return "kdash is not installed in this Python: pip install -e '.[test]' (or '.[test]')"
    direct = dist.read_text("direct_url.json")
    if direct and json.loads(direct).get("dir_info", {}).get("editable"):
        return ""
    spec = importlib.util.find_spec("kdash")
    found = Path(spec.origin).resolve() if spec and spec.origin else None
    installed = Path(str(dist.locate_file("kdash/__init__.py"))).resolve()
    if found == installed:
        return ""
    return (
        f"`import kdash` finds {found}, not the installed {installed}: run the tests as "
        "`pytest` (or `python -P -m pytest`); `python -m pytest` puts the checkout first on "
        "sys.path"
    )


def pytest_configure(config: pytest.Config) -> None:
    problem = installed_kdash_problem()
    if problem:
        raise pytest.UsageError(problem)


LOCAL_CAPTURE = DATA / "local-cpu.kdash"

# A busy target with named threads: two spinners pinned to CPU 0 (they queue behind each
# other: run-queue delay and a shared core), one free spinner, and a light 20%-duty thread.
BUSY_CHILD = r"""
import os, threading, time

def name_me(n):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(n)

def spin(n, cpus):
    name_me(n)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)
    x = 0
    while True:
        x += 1

def light(n):
    name_me(n)
    while True:
        t = time.perf_counter()
        while time.perf_counter() - t < 0.002:
            pass
        time.sleep(0.008)

for n, c in (("launch-0", {0}), ("sched-loop", {0}), ("worker-1", None)):
    threading.Thread(target=spin, args=(n, c), daemon=True).start()
threading.Thread(target=light, args=("tokenizer",), daemon=True).start()
name_me("busy-server")
print("ready", flush=True)
while True:
    time.sleep(0.5)
"""


@pytest.fixture
def kdash_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private config folder and no NO_COLOR; returns the config file's path."""
    cfg_home = tmp_path / "xdg-config"
    cfg_home.mkdir()
    monkeypatch.setenv("XDG_CONFIG_HOME", str(cfg_home))
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TEXTUAL_ANIMATIONS", "none")
    return cfg_home / "kdash" / "config.toml"


def store_from_capture(cap):
    """A store holding the whole capture (no trimming), as `kdash open` builds it."""
    from kdash import schema
    from kdash.store import Store

    store = Store(retention_s=10**7, max_rows=10**9)
    for t in schema.TABLES:
        store.append(t, cap.batch(t))
    return store


@pytest.fixture
def local_capture():
    """The committed real capture, loaded (meta + pandas tables)."""
    from kdash.capture import load_capture

    assert LOCAL_CAPTURE.exists(), f"missing {LOCAL_CAPTURE}"
    return load_capture(LOCAL_CAPTURE)


@pytest.fixture
def capture_store(local_capture):
    """A store pre-filled from the real capture, ready for a replay app."""
    return store_from_capture(local_capture)


@pytest.fixture
def make_app(kdash_env):
    """Factory for a deterministic KdashApp: `make_app(mode=..., store=..., meta=..., ...)`."""
    from kdash.tui.app import KdashApp

    from kdash.config import load_config

    def build(
        *,
        store,
        meta: dict,
        mode: str = "replay",
        recorder=None,
        theme: str | None = "dark",
        redraw_hz: float = 2.0,
        title: str | None = None,
    ) -> KdashApp:
        app = KdashApp(
            store=store,
            recorder=recorder,
            meta=meta,
            mode=mode,
            config=load_config(),
            theme=theme,
            redraw_hz=redraw_hz,
            title=title,
        )
        app.animation_level = "none"
        return app

    return build


@pytest.fixture
def replay_app(make_app, capture_store, local_capture):
    """A replay of the committed capture, as `kdash open tests/data/local-cpu.kdash` shows it."""
    meta = dict(local_capture.meta)
    meta["capture_path"] = str(LOCAL_CAPTURE)
    return make_app(store=capture_store, meta=meta, mode="replay")


@pytest.fixture
def replay_of(make_app):
    """Factory: `replay_of("h200-matmul.kdash")` -> a replay app of that capture in tests/data."""
    from kdash.capture import load_capture

    def build(name: str, **kwargs):
        path = DATA / name
        cap = load_capture(path)
        meta = dict(cap.meta)
        meta["capture_path"] = str(path)
        return make_app(store=store_from_capture(cap), meta=meta, mode="replay", **kwargs)

    return build


@pytest.fixture
def busy_child():
    """A real busy process with named threads (see BUSY_CHILD); killed after the test."""
    proc = subprocess.Popen(
        [sys.executable, "-c", BUSY_CHILD], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.strip() == "ready", f"busy child did not start: {line!r}"
    time.sleep(0.1)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(timeout=5)


@pytest.fixture
def fake_cupti(tmp_path: Path) -> dict[str, str]:
    """Environment additions that give a child the stand-in cupti package (tests/fakes/cupti,
    a fixture: this machine has no GPU and no CUPTI) and a log file of its calls."""
    from fakes import FAKES
    from kdash.collectors.agent.constants import ENV_FAKE_CUDA

    log = tmp_path / "cupti.log"
    log.write_text("")
    return {
        "PYTHONPATH": str(FAKES),
        "FAKE_CUPTI_LOG": str(log),
        ENV_FAKE_CUDA: "13000",
    }


@pytest.fixture
def fake_libcupti(tmp_path: Path, fake_cupti: dict[str, str]) -> dict[str, str]:
    """The stand-in cupti plus a compiled stand-in libcupti.so.13 (test fixture) that calls
    the agent's own ctypes buffer callbacks with CUPTI-layout buffers; skipped without gcc."""
    import shutil
    import subprocess

    from fakes import FAKES

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler to build the stand-in libcupti")
    lib = tmp_path / "libcupti.so.13"
    subprocess.run(
        [cc, "-shared", "-fPIC", "-O1", "-pthread", "-o", str(lib), str(FAKES / "libcupti.c")],
        check=True,
    )
    return {**fake_cupti, "FAKE_CUPTI_LIB": str(lib)}


# ---- test kinds: every test gets exactly one of the markers unit, integration, tui ----------
# `pytest -m unit` is the fast in-process part; `-m integration` starts processes, servers or
# sockets; `-m tui` drives the dashboard (Pilot) or compares snapshots. Chosen here rather than
# by a `pytestmark` in each module, so a module that mixes kinds still splits per test:
#   tui          an async test (every one here runs the app under Pilot) or one using
#                `snap_compare`;
#   integration  a test in one of INTEGRATION_MODULES, one named in INTEGRATION_TESTS, or one
#                using a fixture of PROCESS_FIXTURES;
#   unit         everything else.

# Modules whose tests are mostly about real child processes, servers or sockets.
INTEGRATION_MODULES = frozenset(
    {
        "test_agent",
        "test_agent_abuse",
        "test_agent_lines",
        "test_agent_modules",
        "test_cli",
        "test_completion_man",
        "test_demo_capture",
        "test_health_codes",
        "test_layering",
        "test_names",
        "test_pcsampling_layout",
        "test_prom",
        "test_sched",
        "test_session",
        "test_sglang_attach",
        "test_sglang_http",
        "test_sglang_real",
        "test_sglang_tree",
        "test_snapshot",
        "test_ssh",
        "test_target_python",
    }
)
# The tests that start a process in modules that are otherwise in-process: (module, test).
INTEGRATION_TESTS = frozenset(
    {
        ("test_fuzz_inputs", "test_fuzz_real_command"),
        ("test_h200_pcs_captures", "test_demo_report_hot_lines_start_with_decode_stage1"),
        (
            "test_h200_pcs_captures",
            "test_compile_report_names_the_gemm_without_source_and_starts_hot_lines_with_inductor",
        ),
        ("test_input_hardening", "test_two_imports_to_one_output_only_one_saves"),
        ("test_input_hardening", "test_report_on_a_pipe_does_not_block"),
        ("test_input_hardening", "test_kill_during_the_write_leaves_no_temp"),
        ("test_installed", "test_a_child_started_in_the_checkout_imports_the_same_install"),
        ("test_kineto", "test_streaming_memory_stays_small"),
        ("test_nvml", "test_nspid_maps_host_pid_to_namespace_pid_real_namespace"),
        ("test_nvml", "test_inside_private_pid_namespace_host_pids_degrade_with_advice"),
        ("test_nvml", "test_real_gpu_under_matmul_load"),
        ("test_report_json", "test_top_cuts_the_lists"),
        ("test_report_json", "test_cpu_only_trace_reports_its_cpu_ops"),
        ("test_workload", "test_noisy_neighbour_dies_with_the_workload"),
    }
)
# Fixtures that start a real child process (or build a library for one).
PROCESS_FIXTURES = frozenset({"busy_child", "child", "fake_cupti", "fake_libcupti", "pcs_standin"})


def kind_of(item: pytest.Item) -> str:
    """unit, integration or tui for one collected test (see the table above)."""
    import inspect

    func = getattr(item, "function", None)
    fixtures = set(getattr(item, "fixturenames", ()))
    if inspect.iscoroutinefunction(func) or "snap_compare" in fixtures:
        return "tui"
    module = item.module.__name__.rpartition(".")[2] if getattr(item, "module", None) else ""
    name = getattr(item, "originalname", item.name)
    if (
        module in INTEGRATION_MODULES
        or (module, name) in INTEGRATION_TESTS
        or fixtures & PROCESS_FIXTURES
    ):
        return "integration"
    return "unit"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        item.add_marker(getattr(pytest.mark, kind_of(item)))


@pytest.fixture
def no_stage_hook():
    """The compile-stage hook slot empty before and after (the hook is process-wide state)."""
    from triton import knobs

    saved = knobs.runtime.add_stages_inspection_hook
    knobs.runtime.add_stages_inspection_hook = None
    yield knobs.runtime
    knobs.runtime.add_stages_inspection_hook = saved


@pytest.fixture
def residency_entry():
    """``put(key, per_sm)``: an entry written by hand into the decode plans' residency cache (the
    interpreter compiles nothing, so nothing fills it there), removed again after the test."""
    from kdash.kernels import residency

    keys: list = []

    def put(key, per_sm: int) -> None:
        keys.append(key)
        residency.record(key, residency.Residency(per_sm, 152, 0, 38912))

    yield put
    for k in keys:
        residency.forget(k)


@pytest.fixture
def stand_in_libcuda():
    """bench/decode_host_cpu.py's stand-in libcuda (the real one needs a GPU), compiled here:
    the driver calls kdash makes, their results set from the test, launches counted and the
    function attribute call's arguments kept; skipped without a C compiler."""
    import importlib.util
    import shutil

    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler for the stand-in libcuda")
    path = Path(__file__).resolve().parent.parent / "bench" / "decode_host_cpu.py"
    spec = importlib.util.spec_from_file_location("decode_host_cpu", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.stand_in_libcuda(cc)
