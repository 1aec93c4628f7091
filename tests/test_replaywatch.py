"""The agent's CUPTI-free graph probe: a one-shot wrapper on torch.cuda.CUDAGraph.replay.

What must hold: the first call is seen and still made, the class then holds the very same
function object as before (or after a disarm without a call), nobody else's replacement is
undone, and an attach to a process that replays torch graphs never touches CUPTI. No CUDA graph
can exist on this machine (torch is the CPU build), so the real-process test calls the real
class's `replay` on an object made without its constructor, which fails after the wrapper has
run; the test says so where it does it.
"""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path

import pytest
from kdash.collectors.agent import replaywatch
from test_agent import (
    PATIENCE_S,
    finish,
    kinds_left_on,
    log_lines,
    start_target,
    wait_for,
    wait_socket,
)


class Graph:
    def __init__(self) -> None:
        self.n = 0

    def replay(self, k: int = 1) -> int:
        self.n += k
        return self.n


def test_on_fire_runs_once_on_the_callers_thread_before_the_original():
    """The graph guard's hook: at the first call, on the thread that makes it, before the
    original runs; a hook that raises is kept as fire_error and the call still goes through."""
    seen = []
    g = Graph()
    w = replaywatch.ReplayWatch(Graph, on_fire=lambda: seen.append((g.n, threading.get_ident())))
    assert w.arm()
    assert g.replay(2) == 2 and g.replay() == 3
    assert seen == [(0, threading.get_ident())]
    boom = replaywatch.ReplayWatch(Graph, on_fire=lambda: 1 / 0)
    assert boom.arm() and g.replay() == 4
    assert boom.fire_error.startswith("ZeroDivisionError") and boom.state == "fired"


def test_the_guard_needs_torch_graphs(monkeypatch):
    """No torch CUDA graphs imported: nothing to guard (None, nothing changed)."""
    monkeypatch.delitem(sys.modules, "torch.cuda.graphs", raising=False)
    assert replaywatch.guard_torch_replays(lambda: None) is None


def test_the_first_call_is_seen_made_and_the_original_is_back():
    orig = Graph.__dict__["replay"]
    w = replaywatch.ReplayWatch(Graph)
    assert w.arm() and w.state == "armed"
    assert Graph.__dict__["replay"] is not orig
    g = Graph()
    assert g.replay(3) == 3 and w.seen.is_set() and w.state == "fired"
    assert Graph.__dict__["replay"] is orig
    assert g.replay() == 4  # later calls go straight to the original
    w.disarm()
    assert w.state == "fired" and Graph.__dict__["replay"] is orig
    assert not w.arm()  # one shot


def test_disarm_without_a_call_restores_the_same_function():
    orig = Graph.__dict__["replay"]
    w = replaywatch.ReplayWatch(Graph)
    assert w.arm()
    assert not w.wait(0.01)
    w.disarm()
    assert w.state == "disarmed" and Graph.__dict__["replay"] is orig
    assert not w.seen.is_set()


def test_someone_elses_replacement_is_left_in_place():
    orig = Graph.__dict__["replay"]
    w = replaywatch.ReplayWatch(Graph)
    assert w.arm()

    def theirs(self, k=1):
        return -k

    Graph.replay = theirs
    try:
        w.disarm()
        assert Graph.__dict__["replay"] is theirs
    finally:
        Graph.replay = orig


def test_not_a_plain_method_changes_nothing():
    class Odd:
        replay = staticmethod(lambda: 1)

    before = Odd.__dict__["replay"]
    w = replaywatch.ReplayWatch(Odd)
    assert not w.arm() and w.state.startswith("failed")
    assert Odd.__dict__["replay"] is before
    assert not replaywatch.ReplayWatch(Graph, "no_such").arm()


def test_calls_from_many_threads_all_go_through_and_fire_once():
    orig = Graph.__dict__["replay"]
    w = replaywatch.ReplayWatch(Graph)
    fired = []
    w._fire_orig = w._fire

    def counting_fire():
        fired.append(1)
        w._fire_orig()

    w._fire = counting_fire
    assert w.arm()
    g = Graph()
    lock = threading.Lock()
    got = []

    def call():
        r = g.replay(0)
        with lock:
            got.append(r)

    threads = [threading.Thread(target=call) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(PATIENCE_S)
    assert len(got) == 16 and w.state == "fired"
    assert Graph.__dict__["replay"] is orig
    assert 1 <= len(fired) <= 16  # threads that looked it up before the restore still fire
    assert w.seen.is_set()


def test_the_real_torch_class_is_found_and_put_back_unchanged():
    torch = pytest.importorskip("torch")
    cls = replaywatch.torch_graph_class()
    assert cls is torch.cuda.CUDAGraph
    orig = cls.__dict__["replay"]
    assert replaywatch.torch_replays_within(0.01) is False
    assert cls.__dict__["replay"] is orig


def test_without_torch_graphs_imported_it_cannot_tell(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch.cuda.graphs", raising=False)
    assert replaywatch.torch_graph_class() is None
    assert replaywatch.torch_replays_within(0.01) is None


# A torch target that "replays" a graph in a loop. No CUDA graph can be made here, so it calls
# the real CUDAGraph.replay on an object built without the constructor (a stand-in for a
# captured graph); the call fails inside torch after the agent's wrapper has run.
TORCH_TARGET = textwrap.dedent(
    """
    import os, sys, time
    import torch
    cls = torch.cuda.CUDAGraph
    orig = cls.__dict__["replay"]
    g = object.__new__(cls)
    end = time.monotonic() + float(sys.argv[1])
    print("ready", flush=True)
    late = os.environ.get("REPLAY_AFTER_GO")  # idle until the stop file's name + ".go" exists
    while time.monotonic() < end and not os.path.exists(sys.argv[2]):
        if not late or os.path.exists(sys.argv[2] + ".go"):
            try:
                g.replay()
            except (AttributeError, RuntimeError):
                pass
        time.sleep(0.002)
    print("done", "same" if cls.__dict__["replay"] is orig else "changed", flush=True)
    """
)


def test_an_attach_to_a_torch_graph_process_never_starts_cupti(fake_libcupti):
    pytest.importorskip("torch")
    from kdash.collectors.agent.client import AgentSource

    p = start_target(fake_libcupti, script=TORCH_TARGET)
    try:
        wait_socket(p.pid)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"  # torch is in
        src = AgentSource(p.pid)
        src.start()
        assert wait_for(lambda: "replays CUDA graphs" in str(src.health)), str(src.health)
        assert "kdash never started CUPTI in it" in str(src.health)
        src.stop()
        events = [w for _, w in log_lines(fake_libcupti)]
        # the stand-in libcupti logs every callback-API and activity call made to it
        assert not [w for w in events if w.startswith(("subscribe", "enable", "cupti finalize"))]
    finally:
        rc, out, err = finish(p)
    assert rc == 0 and out.split()[-2:] == ["done", "same"], err  # the class as it was


def test_a_process_that_replays_only_after_start_is_guarded(fake_libcupti):
    """Kernel activity went on (no replay while START listened); the first replay then
    switches every kind off before it runs, CUPTI is finalized, and the line says the
    process replays graphs. The stand-in libcupti logs the switches; the replays fail inside
    torch after the wrapper has run (no CUDA graph can exist here)."""
    pytest.importorskip("torch")
    from kdash.collectors.agent.client import AgentSource

    p = start_target({**fake_libcupti, "REPLAY_AFTER_GO": "1"}, script=TORCH_TARGET)
    go = Path(str(p.stop_file) + ".go")  # type: ignore[attr-defined]
    try:
        wait_socket(p.pid)
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        src = AgentSource(p.pid, continuous=True)
        src.start()
        assert wait_for(lambda: src.health.ok), str(src.health)
        assert [w for _, w in log_lines(fake_libcupti) if w.startswith("enable")]
        go.touch()
        assert wait_for(lambda: "replays CUDA graphs" in str(src.health)), str(src.health)
        assert "CUPTI was detached" in str(src.health)
        assert wait_for(lambda: "cupti finalize" in [w for _, w in log_lines(fake_libcupti)])
        src.stop()
        assert kinds_left_on([w for _, w in log_lines(fake_libcupti)]) == {}
    finally:
        rc, out, err = finish(p)
    assert rc == 0 and out.split()[-2:] == ["done", "same"], err
