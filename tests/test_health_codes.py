"""Health as data: the codes each producer sets, the panes switching on them (never on the
reason text), captures keeping them, and old captures' lines still read.

Pure: the agent clients here are never connected (no GPU, no agent process); their health is
set from the STATUS bodies an agent sends, through the client's own decoding."""

from __future__ import annotations

import ast
import json
import os
import re
from pathlib import Path

import pytest
from kdash.collectors.agent.client import AgentSource, _health_from_status
from kdash.collectors.agents import AgentTreeSource
from kdash.collectors.base import Health, as_health, health_from_text
from kdash.tui.app import activity_label
from kdash.tui.panes.kernels import NO_KERNELS
from kdash.tui.panes.kernels import empty_line as kernel_line
from kdash.tui.panes.source import why_no_samples

from kdash.capture import read_meta, validate_meta
from kdash.session import build_meta, capture_healths, source_healths

ROOT = Path(__file__).resolve().parents[1]

# -- no pane parses health text -------------------------------------------------------------

# what the panes and the app used to look for inside health lines
NEEDLES = {
    "--no-inject",
    "or its children: ",
    "nvgpuctrperm",
    "insufficient_privileges",
    "another",
    "in use",
    "not_compatible",
    "metrics off",
    "ok: continuous",
    "ok: sampling",
}
STATE_WORDS = {"ok", "starting", "off", "unavailable", "degraded", "ok: continuous", "ok: sampling"}
# a health line or its reason by name (not a stall reason column)
HEALTHY_NAME = re.compile(r"health|(?<![a-z_])reason\b|\bpcs\b|\blow\b")
TEXT_METHODS = {"startswith", "endswith", "split", "rsplit", "partition", "find", "index"}


def _strs(node: ast.AST) -> set[str]:
    """The string constants of a constant or a tuple of them."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, ast.Tuple):
        return {e.value for e in node.elts if isinstance(e, ast.Constant)}
    return set()


def _reads_text(node: ast.Call) -> bool:
    """A text method called on a health line or a reason, or with a state word, or a regex
    over the state words."""
    assert isinstance(node.func, ast.Attribute)
    owner = ast.unparse(node.func.value).lower()
    args = set().union(*(_strs(a) for a in node.args)) if node.args else set()
    if node.func.attr in ("match", "search", "fullmatch"):
        return owner == "re" and any("unavailable" in a or "degraded" in a for a in args)
    if node.func.attr not in TEXT_METHODS:
        return False
    return bool(HEALTHY_NAME.search(owner) or args & STATE_WORDS)


def text_matches(source: str) -> list[str]:
    """The places in `source` that read a health line as text, one "line: code" each."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(
            isinstance(o, ast.In | ast.NotIn) for o in node.ops
        ):
            hit = bool(_strs(node.left) & NEEDLES)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            hit = _reads_text(node)
        else:
            hit = isinstance(node, ast.Name) and node.id == "NO_INJECT_MARK"
        if hit:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_the_old_ways_of_reading_health():
    """The scan below is not vacuous: each way the panes used to parse health is caught."""
    old = [
        "if NO_INJECT_MARK in agent_health: pass",
        'if "or its children: " in agent_health: pass',
        'x = agent_health.split(": ", 1)[-1]',
        'if "nvgpuctrperm" in low: pass',
        'if low.startswith("ok"): pass',
        'ok = health.startswith(("ok", "starting"))',
        'a = agent_health.startswith("ok: continuous")',
        'state = health.split(":", 1)[0]',
        'if "metrics off" in h: pass',
        'm = re.match(r"(unavailable|degraded|starting): (.*)", agent_health)',
        'x = src.health.reason.split(": ")',
    ]
    for snippet in old:
        assert text_matches(snippet), snippet
    assert not text_matches('if h.code == "no_inject": line = "Kernel timeline: " + h.reason')


def test_no_pane_or_app_code_parses_health_text():
    bad = {}
    for path in sorted((ROOT / "tui").rglob("*.py")):
        hits = text_matches(path.read_text())
        if hits:
            bad[str(path.relative_to(ROOT))] = hits
    assert not bad, f"health read as text (switch on Health.code): {bad}"


# -- the codes each producer sets -----------------------------------------------------------


class _NoAgentTree:
    """A target with no agent anywhere: this test process (it has none)."""

    pid = os.getpid()

    def pids(self):
        return [self.pid]


@pytest.mark.parametrize("allowed, code", [(True, "no_agent"), (False, "no_inject")])
def test_tree_without_an_agent(allowed, code):
    src = AgentTreeSource(_NoAgentTree(), inject_allowed=allowed)
    src.start()
    src.poll(0)
    assert src.health.state == "unavailable" and src.health.code == code
    assert src.health.fields["pid"] == os.getpid()
    line = kernel_line(src.health)
    if allowed:
        assert line == NO_KERNELS  # no note: the generic advice
    else:
        assert line == "Kernel timeline: " + src.health.reason


def test_tree_no_agent_with_a_note_names_it():
    src = AgentTreeSource(_NoAgentTree())
    src._no_agent_note = "pid 42 runs as uid 7 and kdash as uid 0: run kdash as that user"
    src._update_health()
    assert src.health.code == "no_agent" and src.health.fields["note"] == src._no_agent_note
    assert kernel_line(src.health) == f"Kernel timeline: no agent — {src._no_agent_note}"


def _tree_with(*bodies: dict) -> AgentTreeSource:
    """A tree whose agents (never connected) said these STATUS bodies."""
    tree = AgentTreeSource(_NoAgentTree())
    for i, body in enumerate(bodies):
        a = AgentSource(1000 + i)
        a.health = _health_from_status(body)
        with a._lock:
            a.stats["sampling"] = body.get("sampling")
        tree.agents[1000 + i] = a
    tree._update_health()
    return tree


SAMPLING = {"state": "active", "line": "active", "sampling": {"period_ms": 1000, "on_ms": 100}}
CONTINUOUS = {"state": "active", "line": "active", "sampling": {"continuous": True}}
NO_DRIVER = {"state": "unavailable", "line": "unavailable: no NVIDIA driver here"}
WAITING = {"state": "waiting", "line": "waiting: pid 1000 has not loaded CUDA yet"}


def test_agent_client_codes():
    assert _health_from_status(SAMPLING).code == "sampling"
    assert _health_from_status(CONTINUOUS).code == "continuous"
    assert _health_from_status(WAITING).code == "agent_waiting"
    busy = {"state": "busy", "line": "busy: another kdash client is attached to 5"}
    assert _health_from_status(busy).code == "agent_busy"
    assert AgentSource(7).health.code == "connecting"
    assert AgentSource(7).health.fields == {"pid": 7}
    missing = AgentSource(os.getpid(), socket_path=None)
    missing.start()  # this process has no agent socket
    assert missing.health.code == "no_socket"


def test_tree_codes_and_what_the_app_and_kernel_pane_make_of_them():
    tree = _tree_with(SAMPLING)
    assert (tree.health.state, tree.health.code) == ("ok", "sampling")
    assert activity_label(tree.health) == "sampled"
    # recording, but no kernel yet (a target still compiling): not the advice to add an agent
    line = kernel_line(tree.health)
    assert line.startswith("Kernel timeline: no kernels yet — the agent is recording (")
    assert tree.health.reason in line and "kdash run" not in line
    tree = _tree_with(CONTINUOUS)
    assert tree.health.code == "continuous" and activity_label(tree.health) == "continuous"
    tree = _tree_with(NO_DRIVER)
    assert tree.health.code == "agent_unavailable" and tree.health.fields == {"pid": 1000}
    assert (
        kernel_line(tree.health) == f"Kernel timeline: no kernels yet — agent {tree.health.reason}"
    )
    assert activity_label(tree.health) == ""
    tree = _tree_with(SAMPLING, NO_DRIVER)
    assert tree.health.code == "agent_degraded" and tree.health.fields == {"pid": 1001}
    tree = _tree_with(WAITING)
    assert tree.health.code == "agent_starting" and tree.health.fields == {"pid": 1000}
    assert "no kernels yet" in kernel_line(tree.health)


def test_a_graph_replaying_target_is_off_by_design_not_unavailable():
    """The agent leaves a process that replays CUDA graphs without kernel activity on purpose
    (recording their kernels would slow it until it restarts): its STATUS state is "off", the
    tree says so first (beside a helper process still waiting, or one with no driver), the
    kernel pane gives the reason without "no kernels yet", the status bar does not mark it as
    trouble, and an older capture's line for it gets the same code."""
    from kdash.collectors.agent.session import graphs_line, tainted_line
    from kdash.tui.widgets.status import StatusInfo, segments

    graphs = {"state": "off", "line": "off: " + graphs_line(1000, False)}
    h = _health_from_status(graphs)
    assert (h.state, h.code) == ("off", "graphs_off") and h.reason == graphs_line(1000, False)
    for others in ((), (WAITING,), (NO_DRIVER,)):
        tree = _tree_with(graphs, *others)
        assert (tree.health.state, tree.health.code) == ("off", "graphs_off"), others
        assert tree.health.fields == {"pid": 1000} and tree.health.reason == h.reason
        line = kernel_line(tree.health)
        assert line == "Kernel timeline: " + h.reason and "yet" not in line
    assert activity_label(tree.health) == "off (CUDA graphs)"  # the cost estimate goes beside
    assert _tree_with(SAMPLING, graphs).health.code == "sampling"  # another process records
    stopped = _health_from_status({"state": "off", "line": "off: " + tainted_line(1000)})
    assert stopped.code == "graphs_off"
    bad = object()
    info = StatusInfo(mode="live", target="pid 1000", sources={"agent": tree.health})
    seg = next(s for s in segments(info, lambda c: bad) if s.forms[0].startswith("agent"))
    assert seg.style is not bad and seg.forms[-1] == "agent off"
    info = StatusInfo(mode="live", target="pid 1000", sources={"agent": NO_DRIVER["line"]})
    seg = next(s for s in segments(info, lambda c: bad) if s.forms[0].startswith("agent"))
    assert seg.style is bad  # a real failure keeps its mark
    assert "press L" in why_no_samples({"agent": tree.health})  # the agent is there
    old = health_from_text("unavailable: pid 1000: " + graphs_line(1000), "agent")
    assert old.code == "graphs_off" and old.fields == {"pid": 1000}


@pytest.mark.parametrize(
    "text, code, why",
    [
        ("off", "pc_off", "press L"),
        ("starting", "pc_starting", "is starting"),
        ("ok: 3 ranges, 4 ms of the target's CPU each", "pc_on", "window yet"),
        (
            "unavailable: CUPTI_ERROR_INSUFFICIENT_PRIVILEGES (ERR_NVGPUCTRPERM: ...)",
            "pc_unavailable_perm",
            "NVreg_RestrictProfilingToAdminUsers=0",
        ),
        (
            "unavailable: CUPTI_ERROR_NOT_COMPATIBLE (another profiler holds the counters)",
            "pc_unavailable_other_client",
            "another profiler holds the counters",
        ),
        ("unavailable: cupti-python too old", "pc_unavailable", "PC sampling unavailable"),
    ],
)
def test_pc_sampling_codes(text, code, why):
    """The agent says its PC-sampling state as text on the wire (`pcrun.PCRun.text`); the
    tree's `extra_health` turns it into a coded Health, and the source pane switches on it."""
    h = health_from_text(text, "pc sampling")
    assert h.code == code and str(h) == text
    assert why in why_no_samples({"agent": Health("ok", "sampling", "sampling"), "pc sampling": h})


def test_nvml_codes():
    from kdash.collectors.nvml import NvmlSource

    from kdash.target import Target

    s = NvmlSource(Target.from_pid(os.getpid()))
    assert s.health.code == "starting"
    s.start()
    try:
        if s.health.state == "unavailable":  # no GPU here: which of the reasons it is
            assert s.health.code in ("no_pynvml", "nvml_init_failed", "no_gpu"), s.health
        else:
            assert s.health.code in ("ok", "gpus_not_found", "degraded"), s.health
    finally:
        s.stop()


def test_sched_code_when_the_target_exits():
    import subprocess
    import time

    from kdash.collectors.sched import SchedSource

    from kdash.target import Target

    p = subprocess.Popen(["sleep", "30"])
    try:
        src = SchedSource(Target.from_pid(p.pid))
        src.start()
        src.poll(time.monotonic_ns())
    finally:
        p.kill()
        p.wait(timeout=10)
    src.tree_interval_s = 0.0  # re-read the tree now
    for _ in range(50):  # the tree is re-read on a poll; a loaded machine may need a few
        src.poll(time.monotonic_ns())
        if src.health.state == "unavailable":
            break
        time.sleep(0.05)
    src.stop()
    assert src.health.code == "target_exited" and src.health.fields == {"pid": p.pid}


def test_sglang_metrics_off_code():
    h = health_from_text("degraded: metrics off (start ...); using /v1/loads", "sglang")
    assert h.code == "metrics_off"


def test_a_health_made_without_a_code_is_read_from_its_text():
    """Sources that set no code (older code paths) still switch the panes as before."""
    h = as_health(Health("ok", "continuous"), "agent")
    assert h.code == "continuous" and str(h) == "ok: continuous"
    assert as_health(Health("ok", "x", "sampling"), "agent").code == "sampling"


# -- captures -------------------------------------------------------------------------------


def _meta(sources: dict) -> dict:
    return build_meta(
        target=None,
        gpus=[],
        sources=sources,
        start_ns=0,
        end_ns=1_000_000_000,
        trigger_ns=None,
        wall_offset_ns=0,
    )


def test_meta_keeps_health_as_data_and_the_lines_unchanged():
    tree = AgentTreeSource(_NoAgentTree(), inject_allowed=False)
    tree.start()
    tree.poll(0)
    meta = json.loads(json.dumps(_meta(source_healths([tree]))))  # as a capture stores it
    assert validate_meta(meta) == ""
    assert meta["sources"] == {"agent": str(tree.health)}
    stored = meta["sources_health"]["agent"]
    assert stored["code"] == "no_inject" and stored["reason"] == tree.health.reason
    back = capture_healths(meta)["agent"]
    assert back == tree.health and str(back) == str(tree.health)


def test_a_bad_sources_health_is_refused():
    meta = _meta({"agent": Health("ok")})
    meta["sources_health"]["agent"]["state"] = 3
    assert "sources_health.agent.state" in validate_meta(meta)


OLD_CAPTURES = sorted((ROOT / "tests" / "data").glob("*.kdash")) + [
    ROOT / "kdash" / "data" / "demo-h200.kdash"
]


@pytest.mark.parametrize("path", OLD_CAPTURES, ids=lambda p: p.name)
def test_old_captures_give_healths_from_their_lines(path):
    meta = read_meta(path)
    healths = capture_healths(meta)
    lines = meta.get("sources") or {}
    assert set(healths) == {str(k) for k in lines}
    for k, v in lines.items():
        assert str(healths[str(k)]) == str(v)  # every line as users saw it
    if "agent" in lines:
        assert healths["agent"].code in ("ok", "sampling", "continuous")
    if "pc sampling" in lines:
        off = str(lines["pc sampling"]) == "off"
        assert healths["pc sampling"].code == ("pc_off" if off else "pc_on")
