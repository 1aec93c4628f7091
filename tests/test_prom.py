"""`--prometheus` and `--jsonl`: a live headless attach on a real process, scraped over HTTP."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from kdash.errors import UserError
from kdash.prom import parse_listen

SPIN = "import time\nwhile True:\n    sum(range(50000))\n    time.sleep(0.005)\n"


@pytest.fixture
def busy_child():
    p = subprocess.Popen([sys.executable, "-c", SPIN])
    yield p
    p.kill()
    p.wait()


def test_listen_addresses():
    assert parse_listen("9400") == ("127.0.0.1", 9400)  # never the network unless asked
    assert parse_listen("0.0.0.0:9400") == ("0.0.0.0", 9400)
    assert parse_listen("[::1]:9400") == ("::1", 9400)
    for bad in ("", "host:", "x:99999", "nine"):
        with pytest.raises(UserError):
            parse_listen(bad)


def test_a_served_attach_is_scraped_and_stops_on_sigterm(busy_child):
    kd = subprocess.Popen(
        [sys.executable, "-m", "kdash.cli", "attach", "--pid", str(busy_child.pid), "--headless",
         "--prometheus", "127.0.0.1:0", "--no-inject"],
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert kd.stderr is not None
        line = kd.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/metrics", line)
        assert m, line
        url = f"http://127.0.0.1:{m.group(1)}/metrics"
        text = ""
        end = time.monotonic() + 60
        while time.monotonic() < end:  # until the recorder has polled a few times
            text = urllib.request.urlopen(url, timeout=10).read().decode()
            if "kdash_cpu_seconds_total" in text:
                break
            time.sleep(0.5)
        assert re.search(r"# TYPE kdash_cpu_seconds(_total)? counter", text)
        assert "# TYPE kdash_findings gauge" in text
        assert "# TYPE kdash_gpu_time_share gauge" in text
        kd.send_signal(signal.SIGTERM)
        assert kd.wait(60) == 0
        assert "kdash: stopped" in kd.stderr.read()
    finally:
        if kd.poll() is None:
            kd.kill()
            kd.wait()


def test_jsonl_to_stdout_is_one_sample_a_second(busy_child):
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "attach", "--pid", str(busy_child.pid), "--headless",
         "--jsonl", "-", "--duration", "3.5", "--no-inject"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines()]
    assert len(lines) >= 2
    for s in lines:
        assert {"t_ns", "gpus", "kernels", "findings", "kdash_cpu_seconds"} <= set(s)
    assert lines[0]["t_ns"] < lines[-1]["t_ns"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--prometheus", "nine"], "--prometheus"),
        (["--jsonl", "-"], "--jsonl -"),
        (["--headless", "--prometheus", "0", "--output", "x.kdash"], "--output needs"),
    ],
)
def test_bad_exporter_options_are_one_line(args, words, busy_child):
    r = subprocess.run(
        [sys.executable, "-m", "kdash.cli", "attach", "--pid", str(busy_child.pid), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("kdash:") == 1 and words in r.stderr, r.stderr


def test_sample_of_the_demo_capture_has_gpu_kernels_and_time_shares():
    """The recorded H200 demo through the same store the live exporter reads."""
    from pathlib import Path

    from kdash.capture import load_capture
    from kdash.commands import _store_from_capture
    from kdash.prom import TOP_KERNELS, _Collector, sample

    cap = load_capture(Path(__file__).resolve().parent.parent / "kdash/data/demo-h200.kdash")
    store = _store_from_capture(cap)
    end = int(cap.meta["window"]["end_ns"])
    s = sample(store, [], now_ns=end)
    (g,) = s["gpus"]
    assert g["gpu"] == 0 and g["power_limit_w"] == 700.0 and g["sm_clock_mhz"] > 0
    share = g["time_share"]
    assert 0 < share["busy"] < 1 and share["busy"] >= share["kernels"]
    assert 0 < len(s["kernels"]) <= TOP_KERNELS
    assert abs(sum(k["share"] for k in s["kernels"]) - 1) < 0.5
    names = [m.name for m in _Collector(store, []).collect()]
    assert "kdash_gpu_power_limit_w" in names and "kdash_kernel_time_share" in names


def test_the_shipped_grafana_dashboard_uses_only_series_kdash_serves():
    import re as _re
    from pathlib import Path

    from kdash.capture import load_capture
    from kdash.commands import _store_from_capture
    from kdash.prom import _Collector

    data = Path(__file__).resolve().parent.parent / "kdash" / "data"
    dash = json.loads((data / "grafana-dashboard.json").read_text())
    store = _store_from_capture(load_capture(data / "demo-h200.kdash"))
    served = set()
    for fam in _Collector(store, []).collect():
        served.add(fam.name)
        served.update(s.name for s in fam.samples)
    served.add("kdash_cost_estimate_ratio")  # served only while an agent reports a cost
    used = {
        name
        for p in dash["panels"]
        for t in p["targets"]
        for name in _re.findall(r"\bkdash_[a-z_]+", t["expr"])
    }
    assert used and used <= served, used - served
