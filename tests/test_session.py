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


def wait_for(pred, timeout=10.0):
    t_end = time.monotonic() + timeout
    while time.monotonic() < t_end:
        if pred():
            return True
        time.sleep(0.05)
    return False


def test_capture_window(tmp_path, child):
    target = Target.from_pid(child.pid)
    events = []
    opts = RecorderOptions(interval_s=0.1, pre_s=0.5, post_s=0.6, capture_dir=tmp_path)
    rec = Recorder(
        [SchedSource(target, interval_s=0.1)],
        Store(),
        target,
        opts,
        on_event=lambda e, p: events.append(e),
    )
    rec.start()
    try:
        time.sleep(0.8)
        t_key = clock.now_ns()
        assert rec.trigger_capture()
        assert not rec.trigger_capture()  # one at a time
        assert rec.capture.phase == "recording"
        assert 0.0 < rec.capture.remaining_s(clock.now_ns()) <= 0.6
        assert wait_for(lambda: rec.capture.phase in ("saved", "failed"))
    finally:
        rec.stop()
    assert rec.capture.phase == "saved", rec.capture.error
    assert events[0] == "capture-started" and "capture-saved" in events
    cap = load_capture(rec.capture.path)
    w = cap.meta["window"]
    assert w["start_ns"] <= t_key - 0.4e9 and w["end_ns"] >= t_key + 0.5e9
    th = cap.tables["threads"]
    assert len(th) and th["t_ns"].min() >= w["start_ns"] and th["t_ns"].max() <= w["end_ns"]
    assert child.pid in set(th["pid"])
    assert cap.meta["target"]["pid"] == child.pid
    assert (
        cap.meta["sources"]["sched"].startswith("ok") or "degraded" in cap.meta["sources"]["sched"]
    )
    # Faster polling inside the window: more samples per second after the key than before.
    after = th[th["t_ns"] > t_key]["t_ns"].nunique() / 0.6
    assert after >= 5


def test_target_exit_is_reported(tmp_path):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
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
        p.wait()
        assert wait_for(lambda: "target-exited" in events, timeout=5)
    finally:
        rec.stop()


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
