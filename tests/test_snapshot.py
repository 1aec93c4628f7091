"""`kdash snapshot`: a few seconds of a real process, printed once, with the report's numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

SPIN = "import time\nwhile True:\n    sum(range(50000))\n    time.sleep(0.005)\n"


@pytest.fixture
def busy_child():
    p = subprocess.Popen([sys.executable, "-c", SPIN])
    yield p
    p.kill()
    p.wait()


def kdash(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kdash.cli", *args], capture_output=True, text=True, timeout=timeout
    )


def test_json_snapshot_has_the_panes_sections(busy_child):
    r = kdash("snapshot", "--pid", str(busy_child.pid), "--seconds", "1", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    for key in ("target", "gpus", "threads_top", "findings", "top_kernels", "gpu_summary"):
        assert key in doc
    assert doc["target"]["pid"] == busy_child.pid
    assert busy_child.pid in {t["tid"] for t in doc["threads_top"]}
    assert doc["snapshot"] == {"seconds": 1.0, "injected": False}
    assert r.stderr == ""  # no recording chatter: the document is the whole answer
    assert busy_child.poll() is None  # looked at, not touched


def test_text_snapshot_names_the_target_and_its_threads(busy_child):
    r = kdash("snapshot", "--pid", str(busy_child.pid), "--seconds", "1")
    assert r.returncode == 0, r.stderr
    assert f"kdash snapshot (1 s)  pid {busy_child.pid}" in r.stdout
    assert "Busiest threads" in r.stdout


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--pid", "999999999"], "no such process"),
        (["--pid", "1", "--seconds", "0"], "--seconds"),
        (["--pid", "1", "--seconds", "900"], "--seconds"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args, words):
    r = kdash("snapshot", *args)
    assert r.returncode == 2
    assert r.stderr.count("kdash:") == 1 and words in r.stderr and "Traceback" not in r.stderr
