"""The CLI contract: exit 0 on success; exit 2 with exactly one `kdash: ` line for bad input.

Every command runs as a real subprocess (`python -m kdash.cli`), the way a user runs it, so a
traceback or a stray second line on stderr fails the test.
"""

import json
import subprocess
import sys
import textwrap
import time
import zipfile
from dataclasses import replace

import pytest

BUSY = textwrap.dedent(
    """
    import ctypes, threading, time
    def spin():
        # Name the OS thread (Python < 3.14 does not), as servers name their threads.
        ctypes.CDLL(None).prctl(15, b"spinner", 0, 0, 0)  # PR_SET_NAME
        x = 0
        while True:
            x += 1
    threading.Thread(target=spin, name="spinner", daemon=True).start()
    time.sleep(120)
    """
)


def kdash(*args, timeout=60):
    return subprocess.run(
        [sys.executable, "-m", "kdash.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_one_line_error(r, *words):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kdash: "), lines[0]
    assert "Traceback" not in r.stderr
    for w in words:
        assert w in lines[0], (w, lines[0])


@pytest.fixture(scope="module")
def busy_pid():
    p = subprocess.Popen([sys.executable, "-c", BUSY])
    time.sleep(0.3)
    yield p.pid
    p.kill()
    p.wait()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory, busy_pid):
    """A real capture: 2 s of a real busy process, recorded headless by the real CLI."""
    out = tmp_path_factory.mktemp("cap") / "busy.kdash"
    r = kdash("attach", "--pid", busy_pid, "--headless", "--duration", 2, "--output", out)
    assert r.returncode == 0, r.stderr
    assert out.exists()
    return out


def dead_pid():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_version():
    r = kdash("--version")
    assert r.returncode == 0 and r.stdout.startswith("kdash ")


def test_headless_capture_has_real_threads(recorded, busy_pid):
    import kdash as k

    tables = k.read_capture(recorded)
    th = tables["threads"]
    assert busy_pid in set(th["pid"])
    spinner = th[th["name"] == "spinner"]
    assert not spinner.empty
    assert spinner["cpu_pct"].max() > 30  # a spinning thread is busy


def test_report_json_keys(recorded, busy_pid):
    r = kdash("report", recorded, "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in (
        "schema_version",
        "kdash_version",
        "target",
        "window",
        "gpus",
        "tables",
        "findings",
        "top_kernels",
    ):
        assert key in doc
    assert doc["target"]["pid"] == busy_pid
    assert set(doc["target"]) >= {"pid", "cmdline", "host"}
    assert set(doc["window"]) >= {"start_ns", "end_ns", "seconds"}
    assert 1.5 < doc["window"]["seconds"] < 4
    assert doc["tables"]["threads"] > 0
    for f in doc["findings"]:
        assert set(f) >= {"severity", "kind", "subject", "evidence", "advice"}


def test_report_tables(recorded):
    r = kdash("report", recorded)
    assert r.returncode == 0, r.stderr
    assert "Busiest threads" in r.stdout and "spinner" in r.stdout


@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
def test_export_perfetto(recorded, tmp_path, suffix):
    import gzip

    out = tmp_path / f"trace{suffix}"
    r = kdash("export", recorded, "--perfetto", out)
    assert r.returncode == 0, r.stderr
    raw = out.read_bytes()
    doc = json.loads(gzip.decompress(raw) if suffix.endswith(".gz") else raw)
    events = doc["traceEvents"]
    assert any(e["ph"] == "C" and e["name"].startswith("CPU %") for e in events)
    assert all("ts" in e for e in events if e["ph"] in ("X", "C"))


# -- bad input: one line, exit 2 ----------------------------------------------------------
def test_missing_file(tmp_path):
    for cmd in (["open"], ["report"], ["export"]):
        extra = ["--perfetto", tmp_path / "o.json"] if cmd == ["export"] else []
        assert_one_line_error(kdash(*cmd, tmp_path / "nope.kdash", *extra), "no such file")


def test_foreign_and_truncated(tmp_path, recorded):
    txt = tmp_path / "notes.txt"
    txt.write_text("not a capture\n")
    assert_one_line_error(kdash("report", txt), "not a kdash capture")
    z = tmp_path / "other.zip"
    with zipfile.ZipFile(z, "w") as zf:
        zf.writestr("a", "b")
    assert_one_line_error(kdash("report", z), "not a kdash capture")
    cut = tmp_path / "cut.kdash"
    cut.write_bytes(recorded.read_bytes()[:2000])
    assert_one_line_error(kdash("report", cut))
    assert_one_line_error(kdash("open", cut))


def test_dead_pid_and_bad_pid():
    assert_one_line_error(kdash("attach", "--pid", dead_pid()), "no such process")
    assert_one_line_error(kdash("attach", "--pid", "abc"), "not a process id")
    assert_one_line_error(kdash("attach", "--pid", "-5"))


def test_bad_options(tmp_path, busy_pid):
    assert_one_line_error(kdash("attach", "--pid", busy_pid, "--interval", "-1"), "--interval")
    assert_one_line_error(kdash("attach", "--pid", busy_pid, "--interval", "x"), "--interval")
    assert_one_line_error(kdash("attach", "--pid", busy_pid, "--headless"), "--duration")
    assert_one_line_error(kdash("attach", "--pid", busy_pid, "--theme", "nope"), "nope")
    assert_one_line_error(kdash("attach"), "--pid")
    assert_one_line_error(kdash("frobnicate"))
    assert_one_line_error(kdash("export", tmp_path / "x.kdash"), "--perfetto")
    assert_one_line_error(
        kdash(
            "attach",
            "--pid",
            busy_pid,
            "--headless",
            "--duration",
            1,
            "--output",
            tmp_path / "no" / "dir" / "x.kdash",
        ),
        "no such folder",
    )


def test_never_overwrites(tmp_path, busy_pid, recorded):
    before = recorded.read_bytes()
    r = kdash("attach", "--pid", busy_pid, "--headless", "--duration", 1, "--output", recorded)
    assert_one_line_error(r, "exists")
    assert recorded.read_bytes() == before


def test_export_bad_suffix(recorded, tmp_path):
    assert_one_line_error(kdash("export", recorded, "--perfetto", tmp_path / "t.txt"), ".json")


# -- kdash run ------------------------------------------------------------------------------
def test_run_bad_input(tmp_path):
    assert_one_line_error(kdash("run"), "after `--`")
    assert_one_line_error(kdash("run", "--", tmp_path / "no-such-program"), "cannot run")


def test_run_headless_arms_the_agent(tmp_path):
    """The child gets the agent through its environment; here (no GPU) it says why it is idle."""
    out = tmp_path / "run.kdash"
    env_log = tmp_path / "cmd.log"
    import os

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "kdash.cli",
            "run",
            "--headless",
            "--duration",
            "2",
            "--output",
            str(out),
            "--",
            sys.executable,
            "-c",
            "import os, time; print(os.environ.get('KDASH_AGENT')); time.sleep(30)",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KDASH_RUN_LOG": str(env_log)},
    )
    assert r.returncode == 0, r.stderr
    import kdash as k
    from kdash.capture import read_meta

    agent = read_meta(out)["sources"]["agent"]
    assert agent.startswith(("unavailable", "starting", "ok")), agent
    assert "no kdash agent" not in agent  # the agent was found in the child
    assert env_log.read_text().strip().splitlines()[0] == "1"
    assert len(k.read_capture(out)["threads"]) > 0
    # what watching cost is kept beside it: the estimate (none yet, no GPU here) and the
    # counters of each agent the tree had
    from kdash.collectors.agents import COST_DETAIL_KEYS

    cost = read_meta(out)["agent_cost"]
    assert set(cost) == {"estimate", "agents"}
    assert all(set(a) == set(COST_DETAIL_KEYS) for a in cost["agents"].values()), cost


def test_run_removes_an_empty_command_log(tmp_path):
    """A command that printed nothing leaves no empty `kdash-run-<pid>.log` behind."""
    import os

    log = tmp_path / "quiet.log"
    # quiet even when kdash stops it with SIGINT (a traceback would be output worth keeping)
    QUIET = "import signal, sys, time; signal.signal(2, lambda *a: sys.exit(0)); time.sleep(30)"
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "run", "--headless", "--duration", "1", "--output",
         str(tmp_path / "q.kdash"), "--", sys.executable, "-c", QUIET],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "KDASH_RUN_LOG": str(log)},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "q.kdash").exists() and not log.exists()


def test_attach_no_inject(tmp_path, busy_pid):
    """`--no-inject` is accepted and documented, and a tree without an agent records the one
    line that says the flag is why there are no kernels (the host sources go on)."""
    r = kdash("attach", "--help")
    assert r.returncode == 0 and "--no-inject" in r.stdout
    out = tmp_path / "noinject.kdash"
    r = kdash(
        "attach", "--pid", busy_pid, "--no-inject", "--headless", "--duration", 1, "--output", out
    )
    assert r.returncode == 0, r.stderr
    doc = json.loads(kdash("report", out, "--json").stdout)
    agent = doc["sources"]["agent"]
    assert f"no agent in pid {busy_pid} (injection off: --no-inject)" in agent, agent
    assert len(agent.splitlines()) == 1
    assert doc["tables"]["threads"] > 0  # the scheduler source still recorded
    r = kdash("run", "--no-inject", "--", sys.executable, "-c", "pass")
    assert_one_line_error(r, "--no-inject")  # attach only: `run` starts the agent itself


def test_pc_sampling_flag_reaches_the_agent_source():
    import os

    """`--pc-sampling` on attach and run (documented), handed to the tree's agent source,
    which passes it to every agent it connects (AgentSource START `pc_sampling`)."""
    from kdash.collectors.agents import AgentTreeSource

    from kdash.commands import build_sources
    from kdash.target import Target

    for cmd in ("attach", "run"):
        r = kdash(cmd, "--help")
        assert r.returncode == 0 and "--pc-sampling" in r.stdout
    tgt = Target.from_pid(os.getpid())
    tree = [s for s in build_sources(tgt, None, 0.5, pc_sampling=True) if s.name == "agent"]
    assert isinstance(tree[0], AgentTreeSource) and tree[0].pc_sampling is True
    off = [s for s in build_sources(tgt, None, 0.5) if s.name == "agent"][0]
    assert off.pc_sampling is False


def test_python_dash_m_kdash_is_the_cli(tmp_path):
    """`python -m kdash` works where the console script is not on PATH (run from elsewhere
    than the repository, so the installed package answers)."""
    ok = subprocess.run(
        [sys.executable, "-m", "kdash", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert ok.returncode == 0 and ok.stdout.startswith("kdash ")
    bad = subprocess.run(
        [sys.executable, "-m", "kdash", "report", str(tmp_path / "missing.kdash")],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert bad.returncode == 2 and bad.stderr.count("kdash:") == 1


def test_the_dashboard_without_a_terminal_says_what_works_instead(tmp_path):
    """Into a pipe the app would write screen codes and never end (stdin/stdout are pipes
    here): one line, exit 2, pointing at what does work without a terminal."""
    import os
    from pathlib import Path

    from kdash.commands import DEMO_CAPTURE

    demo = Path(__file__).resolve().parent.parent / "kdash" / "data" / DEMO_CAPTURE
    r = kdash("open", demo)
    assert_one_line_error(r, "needs a terminal", "kdash report")
    r = kdash("attach", "--pid", str(os.getpid()))
    assert_one_line_error(r, "needs a terminal", "--headless", "kdash snapshot")
    r = kdash("run", "--", sys.executable, "-c", "pass")
    assert_one_line_error(r, "needs a terminal", "--headless")


def test_dash_o_is_output(tmp_path):
    """`-o` is `--output`, as in other Unix tools (here: import of a shipped trace)."""
    from pathlib import Path

    data = Path(__file__).resolve().parent / "data"
    trace = sorted(data.glob("*.trace.json.gz"))[0]
    out = tmp_path / "t.kdash"
    r = kdash("import", trace, "-o", out)
    assert r.returncode == 0, r.stderr
    assert out.is_file() and str(out) in r.stdout + r.stderr


def test_export_refuses_an_existing_output_unless_forced(tmp_path):
    from pathlib import Path

    cap = Path(__file__).resolve().parent / "data" / "h200-matmul.kdash"
    out = tmp_path / "t.json"
    out.write_text("mine")
    assert_one_line_error(kdash("export", cap, "--perfetto", out), "exists", "--force")
    assert out.read_text() == "mine"
    r = kdash("export", cap, "--perfetto", out, "--force")
    assert r.returncode == 0, r.stderr
    assert out.read_text().startswith('{"traceEvents"')


def test_report_into_a_pipe_is_not_cut_to_80_columns():
    import os
    from pathlib import Path

    demo = Path(__file__).resolve().parent.parent / "kdash" / "data" / "demo-h200.kdash"
    # a clean environment: something under pytest puts COLUMNS=80 into children's
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    wide = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "report", str(demo)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert wide.returncode == 0, wide.stderr
    assert max(len(line) for line in wide.stdout.splitlines()) > 80
    narrow = kdash("report", demo, "--width", "80")
    assert max(len(line) for line in narrow.stdout.splitlines()) <= 80
    assert_one_line_error(kdash("report", demo, "--width", "3"), "--width")


def test_demo_replay_says_replay_first(monkeypatch):
    """At 80 columns the header keeps about 60 characters: "replay" must be among them."""
    from kdash import commands
    from kdash.options import DemoOptions

    seen = {}
    monkeypatch.setattr(
        commands, "open_capture", lambda path, theme, title=None: seen.setdefault("t", title)
    )
    commands.cmd_demo(DemoOptions(replay=True))
    assert seen["t"].startswith("replay")


def test_an_output_that_cannot_be_written_is_refused_before_recording(busy_pid):
    """/proc passes every existence and permission check a root kdash makes; making a file
    there fails. That must end the command before the recording, not after it."""
    r = kdash("attach", "--pid", busy_pid, "--headless", "--duration", 30, "--output", "/proc/x")
    assert_one_line_error(r, "cannot write in /proc")
    assert "recording" not in r.stderr


def test_capture_dir_is_checked_as_output_is(tmp_path, busy_pid):
    missing = tmp_path / "typo"
    r = kdash("attach", "--pid", busy_pid, "--capture-dir", missing)
    assert_one_line_error(r, "no such folder", "--capture-dir")
    assert not missing.exists()


def test_gpus_are_checked_against_the_machine(monkeypatch):
    """No GPU here: NVML is a stand-in that reports two devices (test only)."""
    import types

    from kdash import commands
    from kdash.errors import UserError

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlDeviceGetCount=lambda: 2, nvmlShutdown=lambda: None
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    commands._check_gpus([0, 1])
    with pytest.raises(UserError, match=r"--gpus 7: this machine has GPUs 0-1"):
        commands._check_gpus([1, 7])
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not importable: NVML cannot say
    commands._check_gpus([7])


def test_demo_replays_decode_from_graphs_and_asks_for_their_kernels(monkeypatch) -> None:
    """`kdash demo` runs the workload the way a server does (graph-replayed decode, the agent
    asked for graph kernels); `--eager-decode` gives the host-bound loop without that ask.
    cmd_run is replaced: starting the workload needs a GPU."""
    from kdash import commands
    from kdash.options import DemoOptions, RunOptions

    seen: list[RunOptions] = []
    monkeypatch.setattr(commands, "cmd_run", lambda a, **_kw: seen.append(a) or 0)
    monkeypatch.setattr(commands, "_gpu_name", lambda: "a GPU")
    base = {"theme": None, "headless": True, "duration": 1.0, "output": None}
    commands._demo_live(DemoOptions(**base))
    commands._demo_live(DemoOptions(**base, eager_decode=True))
    graph, eager = seen
    assert all(isinstance(a, RunOptions) for a in seen)
    # the rest of `kdash run`'s options keep their defaults (pc_sampling and cost_budget too)
    assert replace(graph, cmd=[], graph_kernels=False, headless=False, duration=None) == (
        RunOptions()
    )
    assert graph.cmd[-1] == "--graph-decode" and graph.graph_kernels is True
    assert commands._agent_opts(graph)["graph_kernels"] is True
    assert eager.cmd[-1] == "--eager-decode" and eager.graph_kernels is False
    assert commands._agent_opts(eager)["graph_kernels"] is False
