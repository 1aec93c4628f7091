"""The recorder against real /proc: polling into the store, and a capture window cut to disk."""

import subprocess
import sys
import time

import pytest
from kdash.collectors.sched import SchedSource

from kdash import clock
from kdash.capture import load_capture
from kdash.session import Recorder, RecorderOptions
from kdash.store import Store
from kdash.target import Target


@pytest.fixture
def child():
    p = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    time.sleep(0.2)
    yield p
    p.kill()
    p.wait()


PATIENCE_S = 60.0  # a safety net for a hung test; a loaded machine passes long before it


def wait_for(pred, timeout=PATIENCE_S):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_capture_window(tmp_path, child):
    target = Target.from_pid(child.pid)
    events = []
    # a 3 s window: "recording" and its countdown are looked at right after the key, which a
    # loaded machine may delay by a good part of a second
    pre_s, post_s = 0.5, 3.0
    opts = RecorderOptions(interval_s=0.1, pre_s=pre_s, post_s=post_s, capture_dir=tmp_path)
    rec = Recorder(
        [SchedSource(target, interval_s=0.1)],
        Store(),
        target,
        opts,
        on_event=lambda e, p: events.append(e),
    )
    rec.start()
    try:
        time.sleep(0.8)  # longer than pre_s: the window's start is not cut at the recorder's
        t_before = clock.now_ns()
        assert rec.trigger_capture()
        t_after = clock.now_ns()
        assert not rec.trigger_capture()  # one at a time
        assert rec.capture.phase == "recording"
        assert 0.0 < rec.capture.remaining_s(clock.now_ns()) <= post_s
        assert wait_for(lambda: rec.capture.phase in ("saved", "failed"))
    finally:
        rec.stop()
    assert rec.capture.phase == "saved", rec.capture.error
    assert events[0] == "capture-started" and "capture-saved" in events
    cap = load_capture(rec.capture.path)
    w = cap.meta["window"]
    t_key = w["trigger_ns"]
    assert t_before <= t_key <= t_after
    assert (
        w["start_ns"] <= t_key - (pre_s - 0.1) * 1e9 and w["end_ns"] >= t_key + (post_s - 0.1) * 1e9
    )
    th = cap.tables["threads"]
    assert len(th) and th["t_ns"].min() >= w["start_ns"] and th["t_ns"].max() <= w["end_ns"]
    assert child.pid in set(th["pid"])
    assert cap.meta["target"]["pid"] == child.pid
    assert (
        cap.meta["sources"]["sched"].startswith("ok") or "degraded" in cap.meta["sources"]["sched"]
    )
    # Polling goes on inside the window after the key: 10 a second asked for; a loaded machine
    # may deliver fewer, so at least 2 a second (6 or more samples) are required.
    after = th[th["t_ns"] > t_key]["t_ns"].nunique() / post_s
    assert after >= 2, after


def test_target_exit_is_reported(tmp_path):
    # the target ends when the test says so (its stop file), after the recorder is watching
    stop = tmp_path / "stop"
    code = (
        "import os, sys, time\n"
        "end = time.monotonic() + 300\n"  # a safety net: the stop file ends it
        "while not os.path.exists(sys.argv[1]) and time.monotonic() < end: time.sleep(0.01)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(stop)])
    target = Target.from_pid(p.pid)
    events = []
    rec = Recorder(
        [SchedSource(target, interval_s=0.1)],
        Store(),
        target,
        RecorderOptions(interval_s=0.1, capture_dir=tmp_path),
        on_event=lambda e, payload: events.append(e),
    )
    rec.start()
    try:
        time.sleep(0.3)  # a few polls of the live target
        assert "target-exited" not in events
        stop.touch()
        p.wait(PATIENCE_S)
        assert wait_for(lambda: "target-exited" in events)
    finally:
        rec.stop()
        if p.poll() is None:
            p.kill()
            p.wait()


def test_source_health_survives_a_failing_extra_health():
    """A source's extra_health bug shows as a degraded line; the other lines are kept."""
    from kdash.collectors.base import Health

    from kdash.session import source_health

    class Ok:
        name = "agent"
        health = Health()

        def extra_health(self) -> dict:
            return {"pc sampling": "off"}

    class Broken:
        name = "sched"
        health = Health()

        def extra_health(self) -> dict:
            raise RuntimeError("boom")

    h = source_health([Ok(), Broken()])
    assert h["agent"] == "ok" and h["pc sampling"] == "off" and h["sched"] == "ok"
    assert h["sched (detail)"].startswith("degraded: extra_health failed: RuntimeError: boom")
