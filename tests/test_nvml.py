"""Tests of the NVML collector (collectors/nvml.py).

Three kinds of test live here:

1. Real, on this machine: CI has no NVIDIA GPU and no libnvidia-ml, so the real "unavailable"
   path is exercised against the real pynvml (health says why, poll returns {}, nothing raises),
   and the pid-namespace mapping is exercised against the real /proc of this process, a child,
   and a child in a real nested pid namespace made with `unshare` (skipped where unprivileged
   user namespaces are not allowed).
2. With `FakePynvml`: a FAKE pynvml module injected into `sys.modules`. It stands in for a GPU
   driver that cannot run here; it is not evidence of how a real GPU behaves. It exists to drive
   the collector's probing/n-a logic deterministically: a call raising NOT_SUPPORTED becomes NaN
   and is not called again, renamed functions resolved at run time, v3->v2 process-list
   fallback, bogus process-utilisation samples dropped, GPU-lost and init failures.
3. `@pytest.mark.gpu`: the real thing on an NVIDIA GPU (skipped cleanly elsewhere): a torch
   matmul loop in a child process while polling at 4 Hz.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kdash.collectors import nvml as nvml_mod
from kdash.collectors.base import Source, safe_poll
from kdash.collectors.nvml import (
    NvmlSource,
    PidMap,
    in_initial_pid_namespace,
    read_nspid,
)

from kdash import gpu_reasons
from kdash.target import Target

REPO = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- the fake driver


class FakeNVMLError(Exception):
    """Like pynvml.NVMLError: carries the NVML return code in `.value`."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value


NOT_SUPPORTED = 3
NO_PERMISSION = 4
NOT_FOUND = 6
LIBRARY_NOT_FOUND = 12
FUNCTION_NOT_FOUND = 13
GPU_IS_LOST = 15


class FakePynvml:
    """A FAKE pynvml standing in for an NVIDIA driver that cannot run on this machine.

    Functions are looked up by name through `__getattr__` so a test can make a function absent
    (`missing`), make it fail with an NVML code (`fail[name] = code`), and count calls
    (`calls[name]`). Values are H200-like but arbitrary.
    """

    def __init__(self, n_gpus: int = 1) -> None:
        self.n_gpus = n_gpus
        self.calls: Counter[str] = Counter()
        self.missing: set[str] = set()
        self.fail: dict[str, int] = {}
        self.init_error: BaseException | None = None
        self.sm_clock = 1980
        self.reasons = 0x4 | 0x8
        # field id -> (valueType, value); absent ids answer NOT_SUPPORTED per field
        self.fields: dict[int, tuple[int, float]] = {186: (1, 123_456)}  # instant power, mW
        self.field_requests: list[list[int]] = []
        self.procs: list[SimpleNamespace] = []
        self.util_samples: list[SimpleNamespace] = []
        self.util_last_seen_args: list[int] = []
        self.affinity_words = [0b1111]
        self.impl = {
            "nvmlInit": self._init,
            "nvmlShutdown": lambda: None,
            "nvmlDeviceGetCount": lambda: self.n_gpus,
            "nvmlDeviceGetHandleByIndex": lambda i: ("handle", i),
            "nvmlDeviceGetClockInfo": lambda h, t: self.sm_clock if t == 1 else 2619,
            "nvmlDeviceGetMaxClockInfo": lambda h, t: 1980 if t == 1 else 3201,
            "nvmlDeviceGetTemperature": lambda h, s: 41,
            "nvmlDeviceGetFieldValues": self._field_values,
            "nvmlDeviceGetPowerUsage": lambda h: 98_000,
            "nvmlDeviceGetEnforcedPowerLimit": lambda h: 700_000,
            "nvmlDeviceGetPowerManagementLimit": lambda h: 700_000,
            "nvmlDeviceGetTotalEnergyConsumption": lambda h: 5_000_000,
            "nvmlDeviceGetUtilizationRates": lambda h: SimpleNamespace(gpu=97, memory=40),
            "nvmlDeviceGetMemoryInfo": lambda h: SimpleNamespace(
                total=143_771 * 2**20, used=1024 * 2**20, free=0
            ),
            "nvmlDeviceGetPerformanceState": lambda h: 0,
            "nvmlDeviceGetPcieThroughput": lambda h, c: 1000 + c,
            "nvmlDeviceGetCurrentClocksEventReasons": lambda h: self.reasons,
            "nvmlDeviceGetCurrentClocksThrottleReasons": lambda h: self.reasons,
            "nvmlDeviceGetComputeRunningProcesses_v3": lambda h: list(self.procs),
            "nvmlDeviceGetComputeRunningProcesses_v2": lambda h: list(self.procs),
            "nvmlDeviceGetComputeRunningProcesses": lambda h: list(self.procs),
            "nvmlDeviceGetProcessUtilization": self._proc_util,
            "nvmlSystemGetDriverVersion": lambda: "580.95.05",
            "nvmlSystemGetCudaDriverVersion_v2": lambda: 13000,
            "nvmlDeviceGetName": lambda h: b"NVIDIA H200",
            "nvmlDeviceGetUUID": lambda h: f"GPU-fake-{h[1]}",
            "nvmlDeviceGetPciInfo": lambda h: SimpleNamespace(busId=b"00000000:18:00.0"),
            "nvmlDeviceGetCpuAffinity": lambda h, n: list(self.affinity_words),
        }

    def __getattr__(self, name: str) -> Any:
        impl = self.__dict__.get("impl", {})
        if name not in impl or name in self.__dict__.get("missing", set()):
            raise AttributeError(name)

        def fn(*args: Any) -> Any:
            self.calls[name] += 1
            if name in self.fail:
                raise FakeNVMLError(self.fail[name])
            return impl[name](*args)

        return fn

    def _init(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def _field_values(self, h: Any, ids: list[int]) -> list[SimpleNamespace]:
        self.field_requests.append(list(ids))
        out = []
        for fid in ids:
            if fid in self.fields:
                vt, v = self.fields[fid]
                val = SimpleNamespace(uiVal=int(v), ullVal=int(v), dVal=float(v))
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=0, valueType=vt, value=val))
            else:
                out.append(SimpleNamespace(fieldId=fid, nvmlReturn=NOT_SUPPORTED, valueType=0))
        return out

    def _proc_util(self, h: Any, last_seen: int) -> list[SimpleNamespace]:
        self.util_last_seen_args.append(last_seen)
        fresh = [s for s in self.util_samples if s.timeStamp > last_seen]
        if not fresh:
            raise FakeNVMLError(NOT_FOUND)  # what NVML answers when nothing is new
        return fresh


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakePynvml:
    f = FakePynvml()
    monkeypatch.setitem(sys.modules, "pynvml", f)
    return f


@pytest.fixture
def child() -> Any:
    """A real child process of this test, so the target's tree has two pids."""
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield p
    p.kill()
    p.wait()


def _rows(batch: dict, i: int = 0) -> dict:
    return {k: v[i] for k, v in batch.items()}


def _now_us() -> int:
    return int(time.time() * 1e6)


def _absent_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid += 1
    return pid


# --------------------------------------------------------------------------- real: no NVML


def _real_nvml_works() -> bool:
    s = NvmlSource(None)
    s.start()
    ok = s.health.state != "unavailable"
    s.stop()
    return ok


def test_real_unavailable_path_says_why_and_returns_nothing() -> None:
    if _real_nvml_works():
        pytest.skip("this machine has a working NVML; the unavailable path cannot be seen")
    s = NvmlSource(Target.from_pid(os.getpid()))
    assert isinstance(s, Source)
    s.start()
    assert s.health.state == "unavailable"
    assert s.health.reason  # one line saying why ...
    assert "\n" not in s.health.reason
    assert str(s.health).startswith("unavailable: ")
    assert s.poll(time.monotonic_ns()) == {}
    assert safe_poll(s, time.monotonic_ns()) == {}
    assert s.health.state == "unavailable"  # polling did not turn it into a crash report
    assert s.describe() == []
    assert s.unsupported() == {}
    s.stop()


def test_pynvml_missing_is_unavailable_with_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` raise ImportError
    s = NvmlSource(None)
    assert s.poll(1) == {}  # poll starts the source lazily
    assert s.health.state == "unavailable"
    assert "nvidia-ml-py" in s.health.reason


# --------------------------------------------------------------------------- real: /proc NSpid


def test_nspid_of_self_and_child_real_proc(child: subprocess.Popen) -> None:
    me = read_nspid(os.getpid())
    assert me and me[0] == os.getpid()
    kid = read_nspid(child.pid)
    assert kid and kid[0] == child.pid
    pm = PidMap(Target(os.getpid()).pids())
    assert pm.lookup(child.pid) == child.pid
    assert pm.lookup(os.getpid()) == os.getpid()
    assert pm.lookup(_absent_pid()) is None
    assert read_nspid(_absent_pid()) == []


def _unshare_cmd() -> list[str]:
    return ["unshare", "--user", "--map-root-user", "--pid", "--fork", "--mount-proc"]


def _can_unshare() -> bool:
    try:
        r = subprocess.run([*_unshare_cmd(), "true"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return r.returncode == 0


needs_unshare = pytest.mark.skipif(
    not _can_unshare(), reason="unshare of a user+pid namespace not allowed here"
)


@needs_unshare
def test_nspid_maps_host_pid_to_namespace_pid_real_namespace() -> None:
    """A real nested pid namespace: from out here the sleeper has NSpid [host pid, 1]."""
    p = subprocess.Popen([*_unshare_cmd(), "sleep", "60"])
    try:
        deadline = time.monotonic() + 10
        kids: list[int] = []
        while time.monotonic() < deadline and not kids:
            kids = Target(p.pid).pids()[1:]
            time.sleep(0.05)
        assert kids, "unshare did not start its child"
        sleeper = kids[-1]
        ns = read_nspid(sleeper)
        assert ns[0] == sleeper and ns[-1] == 1 and len(ns) >= 2
        pm = PidMap(Target(p.pid).pids())
        assert pm.lookup(sleeper) == sleeper  # NVML's host pid finds the tree pid
        assert pm.ns_pid[sleeper] == 1  # ... and the pid the container knows it by
    finally:
        p.kill()
        p.wait()


@needs_unshare
def test_inside_private_pid_namespace_host_pids_degrade_with_advice(tmp_path: Path) -> None:
    """kdash inside a private pid namespace, NVML (fake) reporting the host pid it can't see."""
    script = textwrap.dedent(
        f"""
        import os, sys, time
        sys.path.insert(0, {str(REPO / "tests")!r})
        import test_nvml
        from kdash.collectors.nvml import NvmlSource, in_initial_pid_namespace, read_nspid
        from kdash.target import Target
        from types import SimpleNamespace
        fake = test_nvml.FakePynvml()
        host_pid = int(sys.argv[1])
        fake.procs = [SimpleNamespace(pid=host_pid, usedGpuMemory=2**30)]
        sys.modules["pynvml"] = fake
        s = NvmlSource(Target(os.getpid()))
        out = s.poll(time.monotonic_ns())
        print("INITIAL", in_initial_pid_namespace())
        print("NSPID", read_nspid(os.getpid()))
        print("ROWS", len(out["gpu_procs"]["pid"]))
        print("HEALTH", s.health)
        """
    )
    path = tmp_path / "inner.py"
    path.write_text(script)
    r = subprocess.run(
        [*_unshare_cmd(), sys.executable, str(path), str(_absent_pid())],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert out["INITIAL"] == "False"
    assert out["NSPID"] == "[1]"  # from inside, the host pid is invisible
    assert out["ROWS"] == "0"
    assert out["HEALTH"].startswith("degraded: ")
    assert "--pid=host" in out["HEALTH"] and "hostPID: true" in out["HEALTH"]
    assert "private pid namespace" in out["HEALTH"]


def test_this_process_namespace_detection_is_consistent() -> None:
    me = read_nspid(os.getpid())
    initial = in_initial_pid_namespace()
    if initial:
        assert len(me) == 1  # the initial namespace has no outer level
    else:
        assert initial is False or initial is None


# --------------------------------------------------------------------------- fake: probing


def test_not_supported_becomes_nan_and_is_not_called_again(fake: FakePynvml) -> None:
    fake.n_gpus = 2
    fake.fail["nvmlDeviceGetTemperature"] = NOT_SUPPORTED
    s = NvmlSource(None)
    for i in range(3):
        out = s.poll(1000 + i)
        b = out["gpu_samples"]
        assert list(b["gpu"]) == [0, 1]
        assert all(math.isnan(x) for x in b["temp_c"])
        assert list(b["sm_clock_mhz"]) == [1980, 1980]  # the rest still flows
    assert fake.calls["nvmlDeviceGetTemperature"] == 2  # once per device, never again
    assert fake.calls["nvmlDeviceGetClockInfo"] == 3 * 2 * 2
    assert s.health.ok
    assert any("Temperature" in k for k in s.unsupported()[0])


def test_no_permission_and_foreign_exceptions_are_n_a_not_raised(fake: FakePynvml) -> None:
    fake.fail["nvmlDeviceGetTotalEnergyConsumption"] = NO_PERMISSION

    def boom(h: Any) -> Any:
        raise TypeError("a ctypes mismatch in this pynvml")

    fake.impl["nvmlDeviceGetPerformanceState"] = boom
    s = NvmlSource(None)
    r = _rows(s.poll(1)["gpu_samples"])
    assert math.isnan(r["energy_j"])
    assert r["pstate"] == -1
    s.poll(2)
    assert fake.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert fake.calls["nvmlDeviceGetPerformanceState"] == 1


def test_transient_error_is_retried(fake: FakePynvml) -> None:
    fake.fail["nvmlDeviceGetUtilizationRates"] = 10  # NVML_ERROR_TIMEOUT
    s = NvmlSource(None)
    assert math.isnan(_rows(s.poll(1)["gpu_samples"])["util_gpu_pct"])
    del fake.fail["nvmlDeviceGetUtilizationRates"]
    assert _rows(s.poll(2)["gpu_samples"])["util_gpu_pct"] == 97
    assert fake.calls["nvmlDeviceGetUtilizationRates"] == 2


def test_units_and_instant_power(fake: FakePynvml) -> None:
    s = NvmlSource(None)
    r = _rows(s.poll(1)["gpu_samples"])
    assert r["power_w"] == pytest.approx(123.456)  # the instant field, not the 98 W average
    assert s.power_source[0] == "instant"
    assert r["power_limit_w"] == pytest.approx(700.0)
    assert r["energy_j"] == pytest.approx(5000.0)
    assert r["mem_used_mib"] == pytest.approx(1024.0)
    assert r["mem_total_mib"] == pytest.approx(143_771.0)
    assert r["sm_clock_max_mhz"] == 1980 and r["mem_clock_max_mhz"] == 3201
    assert r["pstate"] == 0 and r["util_mem_pct"] == 40


def test_instant_power_unsupported_falls_back_to_average(fake: FakePynvml) -> None:
    fake.fields = {}
    s = NvmlSource(None)
    assert _rows(s.poll(1)["gpu_samples"])["power_w"] == pytest.approx(98.0)
    assert s.power_source[0] == "average"
    s.poll(2)
    s.poll(3)
    # unsupported fields are not asked for again; with none left, the call is not made at all
    assert fake.calls["nvmlDeviceGetFieldValues"] == 1


def test_pcie_from_counters(fake: FakePynvml) -> None:
    fake.fields = {186: (1, 100_000), 197: (3, 10_000_000), 198: (3, 0)}
    s = NvmlSource(None)
    r1 = _rows(s.poll(1)["gpu_samples"])
    assert math.isnan(r1["pcie_tx_kbs"])  # a rate needs two samples
    time.sleep(0.05)
    fake.fields[197] = (3, 20_000_000)
    r2 = _rows(s.poll(2)["gpu_samples"])
    assert 10_000 < r2["pcie_tx_kbs"] < 10_000_000 / 0.05 / 1000 * 1.01
    assert r2["pcie_rx_kbs"] == 0
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 0  # the slow call is avoided


def test_pcie_fallback_is_rate_limited(fake: FakePynvml) -> None:
    s = NvmlSource(None)
    for i in range(4):
        r = _rows(s.poll(i)["gpu_samples"])
        assert (r["pcie_tx_kbs"], r["pcie_rx_kbs"]) == (1000, 1001)
    assert fake.calls["nvmlDeviceGetPcieThroughput"] == 2  # tx+rx once, repeated in between


def test_reason_bits_new_name_preferred_and_decoded(fake: FakePynvml) -> None:
    fake.reasons = 0x4 | 0x40
    s = NvmlSource(None)
    bits = int(s.poll(1)["gpu_samples"]["throttle_reasons"][0])
    assert gpu_reasons.decode(bits) == ["sw-power", "hw-thermal"]
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 0
    assert s.reason_call[0] == "nvmlDeviceGetCurrentClocksEventReasons"


def test_reason_bits_old_name_when_new_is_absent(fake: FakePynvml) -> None:
    fake.missing.add("nvmlDeviceGetCurrentClocksEventReasons")  # an older pynvml
    s = NvmlSource(None)
    for i in range(3):
        bits = int(s.poll(i)["gpu_samples"]["throttle_reasons"][0])
        assert gpu_reasons.decode(bits) == ["sw-power", "hw-slowdown"]
    assert fake.calls["nvmlDeviceGetCurrentClocksThrottleReasons"] == 3
    assert s.reason_call[0] == "nvmlDeviceGetCurrentClocksThrottleReasons"


def test_reason_bits_new_name_function_not_found_in_driver(fake: FakePynvml) -> None:
    fake.fail["nvmlDeviceGetCurrentClocksEventReasons"] = FUNCTION_NOT_FOUND  # an older driver
    s = NvmlSource(None)
    s.poll(1)
    assert int(s.poll(2)["gpu_samples"]["throttle_reasons"][0]) == 0x4 | 0x8
    assert fake.calls["nvmlDeviceGetCurrentClocksEventReasons"] == 1


def test_reason_bits_unsupported_everywhere_is_minus_one(fake: FakePynvml) -> None:
    fake.fail["nvmlDeviceGetCurrentClocksEventReasons"] = NOT_SUPPORTED
    fake.fail["nvmlDeviceGetCurrentClocksThrottleReasons"] = NOT_SUPPORTED
    s = NvmlSource(None)
    assert int(s.poll(1)["gpu_samples"]["throttle_reasons"][0]) == -1
    assert gpu_reasons.decode(-1) == []


def test_process_list_v3_falls_back_to_v2(fake: FakePynvml, child: subprocess.Popen) -> None:
    fake.fail["nvmlDeviceGetComputeRunningProcesses_v3"] = FUNCTION_NOT_FOUND
    fake.procs = [
        SimpleNamespace(pid=child.pid, usedGpuMemory=512 * 2**20),
        SimpleNamespace(pid=_absent_pid(), usedGpuMemory=2**30),  # someone else's process
    ]
    s = NvmlSource(Target(os.getpid()))
    for i in range(2):
        p = s.poll(i)["gpu_procs"]
        assert list(p["pid"]) == [child.pid]
        assert p["mem_used_mib"][0] == pytest.approx(512.0)
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v3"] == 1
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 0
    assert s.health.ok  # one of the tree's pids matched: the mapping works


def test_process_utilisation_drops_bogus_samples(fake: FakePynvml, child: subprocess.Popen) -> None:
    now = _now_us()
    me = os.getpid()
    fake.util_samples = [
        SimpleNamespace(pid=child.pid, timeStamp=now - 100_000, smUtil=80),
        SimpleNamespace(pid=me, timeStamp=now - 90_000, smUtil=250),  # impossible: >100%
        SimpleNamespace(pid=_absent_pid(), timeStamp=now - 80_000, smUtil=50),  # not the tree
        SimpleNamespace(pid=me, timeStamp=now - 60_000_000, smUtil=30),  # before lastSeen
    ]
    s = NvmlSource(Target(me))
    p = s.poll(1)["gpu_procs"]
    assert dict(zip(p["pid"], p["sm_util_pct"], strict=True)) == {child.pid: 80.0}
    # the cursor moved to the newest sample seen, so the driver is asked only for newer ones
    assert fake.util_last_seen_args[-1] < now - 100_000
    s.poll(2)
    assert fake.util_last_seen_args[-1] == now - 80_000
    # nothing new (NVML answers NOT_FOUND): not an error, not unsupported; last value held
    p = s.poll(3)["gpu_procs"]
    assert dict(zip(p["pid"], p["sm_util_pct"], strict=True)) == {child.pid: 80.0}
    assert fake.calls["nvmlDeviceGetProcessUtilization"] == 3
    assert not any("ProcessUtilization" in k for k in s.unsupported().get(0, []))


def test_process_utilisation_held_value_expires(
    fake: FakePynvml, child: subprocess.Popen, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(nvml_mod, "PROC_UTIL_HOLD_S", 0.05)
    fake.util_samples = [SimpleNamespace(pid=child.pid, timeStamp=_now_us(), smUtil=70)]
    s = NvmlSource(Target(os.getpid()))
    assert list(s.poll(1)["gpu_procs"]["sm_util_pct"]) == [70.0]
    time.sleep(0.1)
    assert len(s.poll(2)["gpu_procs"]["pid"]) == 0


def test_process_utilisation_unsupported_on_mig_is_n_a(
    fake: FakePynvml, child: subprocess.Popen
) -> None:
    fake.fail["nvmlDeviceGetProcessUtilization"] = NOT_SUPPORTED
    fake.procs = [SimpleNamespace(pid=child.pid, usedGpuMemory=None)]  # memory n/a too
    s = NvmlSource(Target(os.getpid()))
    for i in range(2):
        r = _rows(s.poll(i)["gpu_procs"])
        assert r["pid"] == child.pid
        assert math.isnan(r["mem_used_mib"]) and math.isnan(r["sm_util_pct"])
    assert fake.calls["nvmlDeviceGetProcessUtilization"] == 1


def test_unmappable_pids_degrade_with_advice(fake: FakePynvml) -> None:
    fake.procs = [SimpleNamespace(pid=_absent_pid(), usedGpuMemory=2**30)]
    s = NvmlSource(Target(os.getpid()))
    out = s.poll(1)
    assert len(out["gpu_procs"]["pid"]) == 0
    assert s.health.state == "degraded"
    assert "--pid=host" in s.health.reason and "hostPID: true" in s.health.reason
    assert len(out["gpu_samples"]["gpu"]) == 1  # the device rows still flow
    fake.procs = [SimpleNamespace(pid=os.getpid(), usedGpuMemory=2**30)]
    s.poll(2)
    assert s.health.ok


def test_gpu_lost_degrades_and_skips_that_gpu(fake: FakePynvml) -> None:
    fake.n_gpus = 2
    s = NvmlSource(None)
    s.poll(1)
    orig = fake.impl["nvmlDeviceGetClockInfo"]
    fake.impl["nvmlDeviceGetClockInfo"] = lambda h, t: (
        (_ for _ in ()).throw(FakeNVMLError(GPU_IS_LOST)) if h[1] == 1 else orig(h, t)
    )
    s.poll(2)
    assert s.health.state == "degraded" and "lost" in s.health.reason
    assert list(s.poll(3)["gpu_samples"]["gpu"]) == [0]


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        (lambda f: setattr(f, "init_error", FakeNVMLError(LIBRARY_NOT_FOUND)), "libnvidia-ml"),
        (lambda f: setattr(f, "init_error", FakeNVMLError(9)), "driver not loaded"),
        (lambda f: setattr(f, "init_error", OSError("weird")), "weird"),
        (lambda f: setattr(f, "n_gpus", 0), "no NVIDIA GPU"),
    ],
)
def test_init_failures_are_unavailable(fake: FakePynvml, setup: Any, words: str) -> None:
    setup(fake)
    s = NvmlSource(None)
    assert s.poll(1) == {}
    assert s.health.state == "unavailable"
    assert words in s.health.reason
    assert s.describe() == []


def test_gpu_selection(fake: FakePynvml) -> None:
    fake.n_gpus = 4
    s = NvmlSource(None, gpus=[2, 7])
    assert list(s.poll(1)["gpu_samples"]["gpu"]) == [2]
    assert s.health.state == "degraded" and "[7]" in s.health.reason
    s2 = NvmlSource(None, gpus=[9])
    assert s2.poll(1) == {}
    assert s2.health.state == "unavailable"


def test_slow_fields_cached(fake: FakePynvml) -> None:
    s = NvmlSource(None)
    for i in range(5):
        s.poll(i)
    assert fake.calls["nvmlDeviceGetMaxClockInfo"] == 2  # sm + mem, once
    assert fake.calls["nvmlDeviceGetEnforcedPowerLimit"] == 1


def test_describe(fake: FakePynvml) -> None:
    fake.affinity_words = [0b1111 | (1 << 8), 0b11]
    s = NvmlSource(None)
    s.poll(1)
    (d,) = s.describe()
    assert d["index"] == 0 and d["name"] == "NVIDIA H200" and d["uuid"] == "GPU-fake-0"
    assert d["pci_bus_id"] == "00000000:18:00.0"
    assert d["driver_version"] == "580.95.05" and d["cuda_driver_version"] == "13.0"
    assert d["power_limit_w"] == pytest.approx(700.0)
    assert d["sm_clock_max_mhz"] == 1980
    assert d["local_cpus"] == "0-3,8,64-65" and d["local_cpus_source"] == "nvml"
    assert d["power_source"] == "instant"
    before = fake.calls["nvmlDeviceGetName"]
    s.describe()
    assert fake.calls["nvmlDeviceGetName"] == before  # identity is cached


def test_describe_na_is_none(fake: FakePynvml) -> None:
    fake.fail["nvmlDeviceGetEnforcedPowerLimit"] = NOT_SUPPORTED
    fake.fail["nvmlDeviceGetPowerManagementLimit"] = NOT_SUPPORTED
    (d,) = NvmlSource(None).describe()
    assert d["power_limit_w"] is None  # JSON-safe, not NaN


def test_describe_local_cpus_from_sysfs_when_nvml_has_none(fake: FakePynvml) -> None:
    fake.fail["nvmlDeviceGetCpuAffinity"] = NOT_SUPPORTED
    s = NvmlSource(None)
    (d,) = s.describe()  # before any poll
    assert d["power_source"] == "instant"
    sysfs = Path("/sys/bus/pci/devices/0000:18:00.0/local_cpulist")
    if sysfs.exists():
        assert d["local_cpus_source"] == "sysfs" and d["local_cpus"]
    else:
        assert d["local_cpus"] == "" and d["local_cpus_source"] == ""


def test_set_fast(fake: FakePynvml) -> None:
    s = NvmlSource(None, interval_s=0.25, fast_interval_s=0.05)
    assert s.interval_s == 0.25
    s.set_fast(True)
    assert s.interval_s == 0.05
    s.set_fast(False)
    assert s.interval_s == 0.25


def test_stop_then_poll_restarts(fake: FakePynvml) -> None:
    s = NvmlSource(None)
    s.poll(1)
    s.stop()
    assert len(s.poll(2)["gpu_samples"]["gpu"]) == 1


# --------------------------------------------------------------------------- real GPU

LOAD = textwrap.dedent(
    """
    import sys, time, torch
    if not torch.cuda.is_available():
        print("NOCUDA", flush=True); sys.exit(3)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    (a @ b); torch.cuda.synchronize()
    print("READY", flush=True)
    end = time.monotonic() + float(sys.argv[1])
    while time.monotonic() < end:
        for _ in range(20):
            c = a @ b
        torch.cuda.synchronize()
    print("DONE", flush=True)
    """
)


@pytest.mark.gpu
@pytest.mark.slow
def test_real_gpu_under_matmul_load() -> None:
    probe = NvmlSource(None, gpus=[0])
    probe.start()
    if probe.health.state == "unavailable":
        pytest.skip(f"no NVIDIA GPU/NVML: {probe.health}")
    uuid = probe.describe()[0]["uuid"]  # pins the child to the GPU NVML watches
    probe.stop()
    src = NvmlSource(Target(os.getpid()), gpus=[0], interval_s=0.25)
    idle = []
    for _ in range(8):  # 2 s idle
        idle.append(_rows(src.poll(time.monotonic_ns())["gpu_samples"]))
        time.sleep(0.25)
    env = dict(os.environ, CUDA_VISIBLE_DEVICES=uuid or "0")
    p = subprocess.Popen(
        [sys.executable, "-c", LOAD, "8"], stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        first = p.stdout.readline().strip() if p.stdout else ""
        if first != "READY":
            p.wait(timeout=30)
            pytest.skip(f"torch in a child cannot use CUDA here ({first or p.returncode})")
        t_ready = time.monotonic()
        loaded, procs = [], []
        while p.poll() is None:
            out = src.poll(time.monotonic_ns())
            if time.monotonic() - t_ready > 1.0:  # let clocks and NVML's windows catch up
                loaded.append(_rows(out["gpu_samples"]))
            b = out["gpu_procs"]
            procs += [_rows(b, i) for i in range(len(b["pid"]))]
            time.sleep(0.25)
    finally:
        p.kill()
        p.wait()
    loaded = loaded[:-2]  # the child may have stopped during the last samples
    assert len(loaded) >= 20, len(loaded)
    idle_sm = statistics.median(r["sm_clock_mhz"] for r in idle)
    idle_w = statistics.median(r["power_w"] for r in idle)
    sm = [r["sm_clock_mhz"] for r in loaded]
    w = [r["power_w"] for r in loaded]
    util = [r["util_gpu_pct"] for r in loaded]
    sm_max = max(r["sm_clock_max_mhz"] for r in loaded)
    assert all(0 < c <= sm_max for c in sm), (sm_max, sm)
    if statistics.median(sm) <= idle_sm:
        # A card may idle at its boost clock (an H100 read 1980 MHz idle) and drop under the
        # matmul's power draw (~1350 MHz at the 700 W cap): the clock is still read live when
        # the samples say what held it back. An H200 idles at 345 MHz and rises.
        held = [r["throttle_reasons"] for r in loaded]
        n_held = sum(h > 0 and bool(h & gpu_reasons.THROTTLE_MASK) for h in held)
        assert n_held >= len(held) // 2, (idle_sm, sm, held)
    assert statistics.median(w) > idle_w * 1.5, (idle_w, w)
    assert statistics.median(util) > 90, util
    assert sum(u > 90 for u in util) >= 0.8 * len(util), util
    mine = [r for r in procs if r["pid"] == p.pid]
    assert mine, (p.pid, procs, str(src.health))
    assert max(r["mem_used_mib"] for r in mine) > 0
