"""The NVML collector: per-GPU clocks, thermals, power, utilisation and per-process GPU use.

Why it is built the way it is:

- **Every NVML call goes through one wrapper** (`NvmlCalls.call`). NVML function availability
  varies by GPU, driver and privilege; the wrapper turns "not supported", "no permission",
  "function not found" (old driver) and version mismatches into `None` ("n/a" on screen: NaN for
  floats, -1 for integers in the schema), remembers per device that the call is unsupported and
  never calls it again, and lets nothing escape as an exception. Transient errors (timeouts, "no
  data yet") give `None` for this poll only and are counted.
- **Names resolved at run time**: `nvmlDeviceGetCurrentClocksEventReasons` (new name) is tried
  before `nvmlDeviceGetCurrentClocksThrottleReasons` (old name); the process list tries
  `nvmlDeviceGetComputeRunningProcesses_v3`, then `_v2`, then the unversioned call.
- **Instant power** comes from the field value `NVML_FI_DEV_POWER_INSTANT` where the driver
  offers it: on Hopper-class GPUs `nvmlDeviceGetPowerUsage` is a one-second average that hides
  the power spikes of a kernel burst. It is the fallback.
- **PCIe throughput** comes from the cumulative field counters `NVML_FI_DEV_PCIE_COUNT_TX/RX_BYTES`
  (differenced between polls) where supported, because `nvmlDeviceGetPcieThroughput` samples for
  ~20 ms per call inside the driver. Where only that call exists it is made at most once per
  `PCIE_FALLBACK_PERIOD_S` per GPU and its last value repeated in between.
- **"GPU utilisation" is not SM occupancy**: NVML's `gpu` figure is the share of the sample
  period in which *any* kernel ran, so a memory-bound attention kernel on a few SMs reads ~100%.
  Panes must say so next to it.
- **Per-process SM utilisation** (`nvmlDeviceGetProcessUtilization`) lags, returns samples only
  since the `lastSeen` timestamp we pass (kept per GPU), sometimes returns impossible values
  (>100%, pids long gone) and is unsupported on MIG. Impossible values are dropped; a pid's last
  good sample is repeated for up to `PROC_UTIL_HOLD_S` so a 4 Hz poll does not flicker to n/a
  between the driver's own samples. It does not add up to device utilisation.
- **Container pids**: the NVIDIA driver is not pid-namespace aware. It reports pids of the
  initial (host) pid namespace (newer open kernel modules translate to the caller's namespace).
  kdash reads `NSpid` from `/proc/<pid>/status` for every pid of the target's tree: its first
  entry is the pid as this /proc sees it, the last the pid inside the target's own namespace.
  When kdash runs in the initial pid namespace (on the host, or in a container started with
  `--pid=host` / `hostPID: true`) the first entry is the host pid NVML reports, and the last the
  container pid the user knows. When kdash itself runs inside a private pid namespace and NVML
  reports pids that this /proc cannot see, the mapping is impossible from in here; health becomes
  `degraded: ...` saying to run kdash on the host or with `--pid=host`.
- **Slow fields** (names, UUIDs, max clocks, power limit) are cached; limits are refreshed every
  `SLOW_REFRESH_S` because an admin can change them with `nvidia-smi -pl` while we watch.

`poll` does one sample per call; the recorder owns the schedule and reads `interval_s` (4 Hz by
default, `set_fast(True)` switches to `fast_interval_s` inside a capture window).
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from kdash.schema import Batch, make_batch
from kdash.target import Target

from .base import OK, Health
from .topology import cpus_from_mask_words, format_cpulist, pci_local_cpus

log = logging.getLogger("kdash.collectors.nvml")

# Inode number of the initial pid namespace (PROC_PID_INIT_INO in the kernel, fixed since 3.8).
PROC_PID_INIT_INO = 0xEFFFFFFC

# NVML return codes (values are part of NVML's stable C ABI; named here so the wrapper does not
# depend on which constants a given pynvml release exports).
_ERR_INVALID_ARGUMENT = 2
_ERR_NOT_SUPPORTED = 3
_ERR_NO_PERMISSION = 4
_ERR_NOT_FOUND = 6
_ERR_DRIVER_NOT_LOADED = 9
_ERR_LIBRARY_NOT_FOUND = 12
_ERR_FUNCTION_NOT_FOUND = 13
_ERR_GPU_IS_LOST = 15
_ERR_NO_DATA = 21
_ERR_ARGUMENT_VERSION_MISMATCH = 25
_ERR_DEPRECATED = 26

# Errors that will not go away while this process lives: cache the call as unsupported.
PERMANENT_ERRORS = frozenset(
    {
        _ERR_INVALID_ARGUMENT,
        _ERR_NOT_SUPPORTED,
        _ERR_NO_PERMISSION,
        _ERR_FUNCTION_NOT_FOUND,
        _ERR_ARGUMENT_VERSION_MISMATCH,
        _ERR_DEPRECATED,
    }
)
# "Nothing to report right now" from list-style calls (e.g. no utilisation samples since lastSeen).
EMPTY_ERRORS = frozenset({0, _ERR_NOT_FOUND, _ERR_NO_DATA})

# Field ids (NVML ABI) with the pynvml names they have.
FI_POWER_INSTANT = 186  # NVML_FI_DEV_POWER_INSTANT, mW
FI_PCIE_TX_BYTES = 197  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES, cumulative bytes
FI_PCIE_RX_BYTES = 198  # NVML_FI_DEV_PCIE_COUNT_RX_BYTES, cumulative bytes

_CLOCK_SM = 1  # NVML_CLOCK_SM
_CLOCK_MEM = 2  # NVML_CLOCK_MEM
_TEMPERATURE_GPU = 0  # NVML_TEMPERATURE_GPU
_PCIE_UTIL_TX = 0  # NVML_PCIE_UTIL_TX_BYTES
_PCIE_UTIL_RX = 1  # NVML_PCIE_UTIL_RX_BYTES
_PSTATE_UNKNOWN = 32

REASON_CALLS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)
PROCESS_CALLS = (
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "nvmlDeviceGetComputeRunningProcesses_v2",
    "nvmlDeviceGetComputeRunningProcesses",
)

DEFAULT_INTERVAL_S = 0.25
FAST_INTERVAL_S = 0.1
SLOW_REFRESH_S = 10.0
PCIE_FALLBACK_PERIOD_S = 1.0
PROC_UTIL_HOLD_S = 2.0
MIB = 1024 * 1024
NAN = math.nan


def _err_code(e: BaseException) -> int | None:
    """The NVML return code carried by a pynvml NVMLError (its `value`), else None."""
    v = getattr(e, "value", None)
    return v if isinstance(v, int) else None


class NvmlCalls:
    """The one wrapper every NVML call goes through: nothing escapes it but `_Failed`.

    `call(gpu, fn, *args)` calls `lib.<fn>(handle_of_gpu, *args)` (no handle for `gpu=-1`) and
    returns its result or raises the internal `_Failed` carrying the NVML code, for callers that
    must tell "no samples yet" from "unsupported"; `get` returns `None` instead of raising. A call
    that fails with a permanent error is remembered per device under `key` (default: the
    function name plus its arguments) and from then on fails without touching the driver. The
    first failure of each key is logged once.
    """

    def __init__(self, lib: Any) -> None:
        self.lib = lib
        self.handles: dict[int, Any] = {}
        self.unsupported: dict[tuple[int, str], str] = {}  # (gpu, key) -> why
        self.transient_errors = 0
        self.lost: set[int] = set()
        self.calls = 0

    def is_unsupported(self, gpu: int, key: str) -> bool:
        return (gpu, key) in self.unsupported

    def mark_unsupported(self, gpu: int, key: str, why: str) -> None:
        if (gpu, key) not in self.unsupported:
            log.info("NVML %s on GPU %d: %s; shown as n/a from now on", key, gpu, why)
            self.unsupported[(gpu, key)] = why

    def call(self, gpu: int, fn: str, *args: Any, key: str | None = None) -> Any | None:
        key = key or (fn if not args else f"{fn}{args!r}")
        if (gpu, key) in self.unsupported or gpu in self.lost:
            raise _Failed(None)
        func: Callable[..., Any] | None = getattr(self.lib, fn, None)
        if func is None:
            self.mark_unsupported(gpu, key, "not in this pynvml")
            raise _Failed(None)
        if gpu >= 0:
            handle = self.handles.get(gpu)
            if handle is None:
                raise _Failed(None)
            args = (handle, *args)
        self.calls += 1
        try:
            return func(*args)
        except Exception as e:  # noqa: BLE001 - NVML must never raise into the app
            code = _err_code(e)
            if code in PERMANENT_ERRORS or code is None:
                # code None: not an NVMLError (e.g. NVMLLibraryMismatchError, a ctypes error):
                # retrying will not help either.
                self.mark_unsupported(gpu, key, f"{type(e).__name__}: {_safe_str(e)}")
            elif code == _ERR_GPU_IS_LOST:
                log.warning("NVML: GPU %d is lost", gpu)
                self.lost.add(gpu)
            elif code not in EMPTY_ERRORS:  # "nothing new" is an answer, not an error
                self.transient_errors += 1
            raise _Failed(code) from None

    def get(self, gpu: int, fn: str, *args: Any, key: str | None = None) -> Any | None:
        """`call` that maps every failure to None (most fields want exactly that)."""
        try:
            return self.call(gpu, fn, *args, key=key)
        except _Failed:
            return None

    def first(self, gpu: int, fns: Iterable[str], *args: Any) -> tuple[str | None, Any | None]:
        """Try alternative names of one call in order; the first one not unsupported wins.

        Returns (name used, value). A transient failure of a supported name does not fall
        through to the next name (it would then be marked unsupported for the wrong reason).
        """
        for fn in fns:
            if self.is_unsupported(gpu, fn):
                continue
            try:
                return fn, self.call(gpu, fn, *args, key=fn)
            except _Failed:
                if self.is_unsupported(gpu, fn):
                    continue
                return fn, None
        return None, None

    def fields(self, gpu: int, field_ids: list[int]) -> dict[int, float]:
        """Read several field values in one driver call; unsupported fields cached per device.

        Returns field id -> value for the fields that answered this time.
        """
        wanted = [f for f in field_ids if not self.is_unsupported(gpu, f"field:{f}")]
        if not wanted:
            return {}
        vals = self.get(gpu, "nvmlDeviceGetFieldValues", wanted, key="nvmlDeviceGetFieldValues")
        if vals is None:
            if self.is_unsupported(gpu, "nvmlDeviceGetFieldValues"):
                for f in wanted:
                    self.mark_unsupported(gpu, f"field:{f}", "field values not supported")
            return {}
        out: dict[int, float] = {}
        for fid, v in zip(wanted, vals, strict=False):
            ret = int(getattr(v, "nvmlReturn", 0))
            if ret != 0:
                if ret in PERMANENT_ERRORS:
                    self.mark_unsupported(gpu, f"field:{fid}", f"NVML return {ret}")
                continue
            x = _field_value(v)
            if x is not None:
                out[fid] = x
        return out


class _Failed(Exception):
    """Internal: an NVML call failed (already classified and recorded by `NvmlCalls`)."""

    def __init__(self, code: int | None) -> None:
        super().__init__(code)
        self.code = code


def _safe_str(e: BaseException) -> str:
    try:
        return str(e)
    except Exception:  # noqa: BLE001 - pynvml's __str__ itself calls into NVML
        return repr(e)


def _field_value(v: Any) -> float | None:
    """The number in an nvmlFieldValue_t, by its valueType (a C union)."""
    member = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}
    name = member.get(int(getattr(v, "valueType", -1)))
    if name is None:
        return None
    try:
        return float(getattr(v.value, name))
    except (AttributeError, TypeError, ValueError):
        return None


def _text(x: Any) -> str:
    if x is None:
        return ""
    return x.decode(errors="replace") if isinstance(x, bytes) else str(x)


def _num(x: Any, scale: float = 1.0) -> float:
    """A driver number scaled to our unit, NaN for n/a."""
    if x is None:
        return NAN
    try:
        return float(x) * scale
    except (TypeError, ValueError):
        return NAN


# --------------------------------------------------------------------------- pid namespaces


def read_nspid(pid: int, proc_root: Path = Path("/proc")) -> list[int]:
    """The `NSpid` line of /proc/<pid>/status: the pid in each pid namespace, outermost first.

    The first entry is the pid as this /proc sees it; the last the pid inside the process's own
    namespace. Kernels before 4.1 have no NSpid line: then [pid]. A vanished process: [].
    """
    try:
        text = (proc_root / str(pid) / "status").read_text()
    except OSError:
        return []
    for line in text.splitlines():
        if line.startswith("NSpid:"):
            try:
                return [int(x) for x in line.split()[1:]]
            except ValueError:
                return [pid]
    return [pid]


def in_initial_pid_namespace(proc_root: Path = Path("/proc")) -> bool | None:
    """Whether this process sees the host's pids (None when it cannot tell)."""
    try:
        return os.stat(proc_root / "self" / "ns" / "pid").st_ino == PROC_PID_INIT_INO
    except OSError:
        return None


class PidMap:
    """NVML pid -> the pid of the target's tree as our /proc names it (and its namespace pid).

    Built per poll from the tree's pids. `lookup(nvml_pid)` answers the tree pid or None.
    """

    def __init__(self, tree_pids: Iterable[int], proc_root: Path = Path("/proc")) -> None:
        self.proc_root = proc_root
        self.by_nvml: dict[int, int] = {}
        self.ns_pid: dict[int, int] = {}  # tree pid -> pid inside its own namespace
        for p in tree_pids:
            ns = read_nspid(p, proc_root) or [p]
            # NVML gives host pids; our /proc's first NSpid entry is the host pid whenever kdash
            # runs in the initial namespace, and equals p in any case (same /proc).
            self.by_nvml[ns[0]] = p
            self.by_nvml.setdefault(p, p)
            self.ns_pid[p] = ns[-1]

    def lookup(self, nvml_pid: int) -> int | None:
        return self.by_nvml.get(int(nvml_pid))

    def visible(self, nvml_pid: int) -> bool:
        """Whether a pid NVML reports exists in our /proc at all."""
        return (self.proc_root / str(int(nvml_pid))).exists()


# --------------------------------------------------------------------------- the source


class NvmlSource:
    """Samples every GPU (or those given) and the GPU use of the target's process tree.

    Source protocol: `name`, `health`, `start()`, `poll(now_ns)`, `stop()`. `poll` returns
    `{"gpu_samples": batch, "gpu_procs": batch}`, or `{}` when NVML is unavailable. Extra API:
    `describe()` for capture metadata, `unsupported()` for the pane's "n/a because" line,
    `set_fast(bool)` / `interval_s` for the recorder, `last_poll_ms` for the status bar.
    """

    name = "nvml"

    def __init__(
        self,
        target: Target | None,
        gpus: list[int] | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
        fast_interval_s: float = FAST_INTERVAL_S,
        proc_root: Path | str = "/proc",
    ) -> None:
        self.target = target
        self.wanted_gpus = list(gpus) if gpus is not None else None
        self.normal_interval_s = interval_s
        self.fast_interval_s = fast_interval_s
        self.interval_s = interval_s
        self.proc_root = Path(proc_root)
        self.health: Health = Health("starting")
        self.nv: NvmlCalls | None = None
        self.gpus: list[int] = []
        self.last_poll_ms = NAN
        self.power_source: dict[int, str] = {}  # gpu -> "instant" | "average" | "n/a"
        self.reason_call: dict[int, str | None] = {}
        self._lib: Any = None
        self._started = False
        self._lock = threading.Lock()
        self._slow: dict[int, dict[str, Any]] = {}
        self._slow_t: dict[int, float] = {}
        self._pcie_prev: dict[int, tuple[float, float, float]] = {}  # gpu -> (t_s, tx_B, rx_B)
        self._pcie_fallback: dict[int, tuple[float, float, float]] = {}  # gpu -> (t_s, tx, rx)
        self._util_last_seen: dict[int, int] = {}  # gpu -> NVML µs timestamp cursor
        self._util_hold: dict[tuple[int, int], tuple[int, float]] = {}  # (gpu,pid)->(µs,sm%)
        self._pid_problem = ""
        self._identity: dict[int, dict[str, Any]] = {}

    # ------------------------------------------------------------------ lifecycle

    def set_fast(self, fast: bool) -> None:
        """Poll faster inside a capture window (the recorder reads `interval_s`)."""
        self.interval_s = self.fast_interval_s if fast else self.normal_interval_s

    def start(self) -> None:
        """Load NVML and open the GPUs; on any failure health says why and poll returns {}."""
        with self._lock:
            if self._started:
                return
            self._started = True
            self.health = self._start()

    def _start(self) -> Health:
        try:
            lib = importlib.import_module("pynvml")
        except ImportError as e:
            return Health.unavailable(
                f"pynvml not importable ({e}); pip install nvidia-ml-py", "no_pynvml"
            )
        try:
            lib.nvmlInit()
        except Exception as e:  # noqa: BLE001 - every failure here means "no NVML"
            return Health.unavailable(_init_failure(e), "nvml_init_failed")
        self._lib = lib
        nv = NvmlCalls(lib)
        count = nv.get(-1, "nvmlDeviceGetCount")
        if not count:
            self._shutdown(lib)
            return Health.unavailable("NVML sees no NVIDIA GPU", "no_gpu", gpus=0)
        indices = list(range(int(count)))
        missing: list[int] = []
        if self.wanted_gpus is not None:
            missing = [g for g in self.wanted_gpus if g not in indices]
            indices = [g for g in self.wanted_gpus if g in indices]
        for g in indices:
            h = nv.get(-1, "nvmlDeviceGetHandleByIndex", g, key=f"handle{g}")
            if h is not None:
                nv.handles[g] = h
        self.gpus = [g for g in indices if g in nv.handles]
        self.nv = nv
        if not self.gpus:
            self._shutdown(lib)
            self.nv = None
            return Health.unavailable(
                f"none of the GPUs asked for ({self.wanted_gpus}) exist; NVML sees {count}",
                "gpus_not_found",
                gpus=int(count),
            )
        now = time.time()
        for g in self.gpus:
            self._util_last_seen[g] = int((now - 1.0) * 1e6)
        if missing:
            return Health.degraded(
                f"GPU {missing} not found (NVML sees {count}); watching the rest",
                "gpus_not_found",
                gpus=int(count),
            )
        return OK

    @staticmethod
    def _shutdown(lib: Any) -> None:
        try:
            lib.nvmlShutdown()
        except Exception:
            log.debug("nvmlShutdown failed", exc_info=True)

    def stop(self) -> None:
        with self._lock:
            if self.nv is not None and self._lib is not None:
                self._shutdown(self._lib)
            self.nv = None
            self._started = False

    # ------------------------------------------------------------------ polling

    def poll(self, now_ns: int) -> dict[str, Batch]:
        if not self._started:
            self.start()
        with self._lock:
            nv = self.nv
            if nv is None:
                return {}
            t0 = time.perf_counter()
            samples = [self._sample(nv, g, now_ns) for g in self.gpus if g not in nv.lost]
            procs = self._procs(nv, now_ns)
            self.last_poll_ms = (time.perf_counter() - t0) * 1e3
            self.health = self._health(nv)
            return {
                "gpu_samples": make_batch("gpu_samples", samples),
                "gpu_procs": make_batch("gpu_procs", procs),
            }

    def _health(self, nv: NvmlCalls) -> Health:
        if self.health.state == "unavailable":
            return self.health
        problems: list[str] = []
        if nv.lost:
            problems.append(
                f"GPU {sorted(nv.lost)} lost (fell off the bus?): see dmesg; reset or reboot"
            )
        if self._pid_problem:
            problems.append(self._pid_problem)
        if self.wanted_gpus is not None:
            missing = [g for g in self.wanted_gpus if g not in self.gpus]
            if missing:
                problems.append(f"GPU {missing} not found")
        return Health.degraded("; ".join(problems)) if problems else OK

    def _slow_fields(self, nv: NvmlCalls, g: int) -> dict[str, Any]:
        """Max clocks and power limit, refreshed every SLOW_REFRESH_S (they rarely change)."""
        t = time.monotonic()
        if g in self._slow and t - self._slow_t[g] < SLOW_REFRESH_S:
            return self._slow[g]
        limit = nv.get(g, "nvmlDeviceGetEnforcedPowerLimit")
        if limit is None:
            limit = nv.get(g, "nvmlDeviceGetPowerManagementLimit")
        mem = nv.get(g, "nvmlDeviceGetMemoryInfo")
        slow = {
            "sm_clock_max_mhz": _num(nv.get(g, "nvmlDeviceGetMaxClockInfo", _CLOCK_SM)),
            "mem_clock_max_mhz": _num(nv.get(g, "nvmlDeviceGetMaxClockInfo", _CLOCK_MEM)),
            "power_limit_w": _num(limit, 1e-3),
            "mem_total_mib": _num(getattr(mem, "total", None), 1 / MIB),
        }
        self._slow[g] = slow
        self._slow_t[g] = t
        return slow

    def _sample(self, nv: NvmlCalls, g: int, now_ns: int) -> dict[str, Any]:
        row: dict[str, Any] = {"t_ns": now_ns, "gpu": g}
        row.update(self._slow_fields(nv, g))
        row["sm_clock_mhz"] = _num(nv.get(g, "nvmlDeviceGetClockInfo", _CLOCK_SM))
        row["mem_clock_mhz"] = _num(nv.get(g, "nvmlDeviceGetClockInfo", _CLOCK_MEM))
        row["temp_c"] = _num(nv.get(g, "nvmlDeviceGetTemperature", _TEMPERATURE_GPU))

        fv = nv.fields(g, [FI_POWER_INSTANT, FI_PCIE_TX_BYTES, FI_PCIE_RX_BYTES])
        if FI_POWER_INSTANT in fv:
            row["power_w"] = fv[FI_POWER_INSTANT] * 1e-3
            self.power_source[g] = "instant"
        else:
            p = nv.get(g, "nvmlDeviceGetPowerUsage")
            row["power_w"] = _num(p, 1e-3)
            if p is not None:
                self.power_source[g] = "average"
            else:
                self.power_source.setdefault(g, "n/a")
        row["energy_j"] = _num(nv.get(g, "nvmlDeviceGetTotalEnergyConsumption"), 1e-3)

        util = nv.get(g, "nvmlDeviceGetUtilizationRates")
        row["util_gpu_pct"] = _num(getattr(util, "gpu", None))
        row["util_mem_pct"] = _num(getattr(util, "memory", None))
        mem = nv.get(g, "nvmlDeviceGetMemoryInfo")
        row["mem_used_mib"] = _num(getattr(mem, "used", None), 1 / MIB)
        if mem is not None:
            row["mem_total_mib"] = _num(getattr(mem, "total", None), 1 / MIB)
        ps = nv.get(g, "nvmlDeviceGetPerformanceState")
        row["pstate"] = -1 if ps is None or int(ps) == _PSTATE_UNKNOWN else int(ps)
        row["pcie_tx_kbs"], row["pcie_rx_kbs"] = self._pcie(nv, g, fv)

        name, bits = nv.first(g, REASON_CALLS)
        self.reason_call[g] = name
        row["throttle_reasons"] = -1 if bits is None else int(bits)
        return row

    def _pcie(self, nv: NvmlCalls, g: int, fv: dict[int, float]) -> tuple[float, float]:
        """PCIe TX/RX in KB/s (NVML's unit): counter deltas, else the slow call at ≤1 Hz."""
        t = time.monotonic()
        if FI_PCIE_TX_BYTES in fv and FI_PCIE_RX_BYTES in fv:
            tx, rx = fv[FI_PCIE_TX_BYTES], fv[FI_PCIE_RX_BYTES]
            prev = self._pcie_prev.get(g)
            self._pcie_prev[g] = (t, tx, rx)
            if prev is None or t <= prev[0] or tx < prev[1] or rx < prev[2]:
                return NAN, NAN  # first sample, or a counter reset
            dt = t - prev[0]
            return (tx - prev[1]) / dt / 1000.0, (rx - prev[2]) / dt / 1000.0
        last = self._pcie_fallback.get(g)
        if last is not None and t - last[0] < PCIE_FALLBACK_PERIOD_S:
            return last[1], last[2]
        tx_kbs = _num(nv.get(g, "nvmlDeviceGetPcieThroughput", _PCIE_UTIL_TX))
        rx_kbs = _num(nv.get(g, "nvmlDeviceGetPcieThroughput", _PCIE_UTIL_RX))
        self._pcie_fallback[g] = (t, tx_kbs, rx_kbs)
        return tx_kbs, rx_kbs

    # ------------------------------------------------------------------ processes

    def _procs(self, nv: NvmlCalls, now_ns: int) -> list[dict[str, Any]]:
        if self.target is None:
            return []
        pmap = PidMap(self.target.pids(), self.proc_root)
        rows: list[dict[str, Any]] = []
        seen_any_nvml_pid = False
        unmapped_invisible: list[int] = []
        matched = False
        now_us = int(time.time() * 1e6)
        for g in self.gpus:
            if g in nv.lost:
                continue
            mem: dict[int, float] = {}
            _, plist = nv.first(g, PROCESS_CALLS)
            for p in plist or []:
                npid = int(getattr(p, "pid", -1))
                seen_any_nvml_pid = True
                tp = pmap.lookup(npid)
                if tp is None:
                    if not pmap.visible(npid):
                        unmapped_invisible.append(npid)
                    continue
                used = getattr(p, "usedGpuMemory", None)
                mem[tp] = mem.get(tp, 0.0) + _num(used, 1 / MIB)
            util = self._proc_util(nv, g, pmap, now_us)
            for tp in sorted(set(mem) | set(util)):
                matched = True
                rows.append(
                    {
                        "t_ns": now_ns,
                        "gpu": g,
                        "pid": tp,
                        "mem_used_mib": mem.get(tp, NAN),
                        "sm_util_pct": util.get(tp, NAN),
                    }
                )
        self._pid_problem = ""
        if seen_any_nvml_pid and not matched and unmapped_invisible:
            where = (
                "kdash runs in a private pid namespace"
                if in_initial_pid_namespace(self.proc_root) is False
                else "this /proc does not show them"
            )
            shown = ", ".join(map(str, sorted(set(unmapped_invisible))[:4]))
            self._pid_problem = (
                f"NVML reports host pids ({shown})"
                f" that cannot be mapped to the target ({where}); per-process GPU memory/util"
                " unknown: run kdash on the host, or the container with --pid=host"
                " (Kubernetes: hostPID: true)"
            )
        return rows

    def _proc_util(self, nv: NvmlCalls, g: int, pmap: PidMap, now_us: int) -> dict[int, float]:
        """Latest plausible SM-util sample per tree pid on GPU g (held ≤ PROC_UTIL_HOLD_S)."""
        last_seen = self._util_last_seen.get(g, 0)
        try:
            samples = nv.call(
                g,
                "nvmlDeviceGetProcessUtilization",
                last_seen,
                key="nvmlDeviceGetProcessUtilization",
            )
        except _Failed as f:
            samples = [] if f.code in EMPTY_ERRORS else None
        if samples is None and nv.is_unsupported(g, "nvmlDeviceGetProcessUtilization"):
            return {}
        cursor = last_seen
        horizon = now_us + 10_000_000  # a timestamp from the future would stall the cursor
        for s in samples or []:
            ts = int(getattr(s, "timeStamp", 0))
            sm = getattr(s, "smUtil", None)
            if ts <= last_seen or ts > horizon:
                continue
            cursor = max(cursor, ts)
            if sm is None or not 0 <= int(sm) <= 100:
                continue  # impossible value: NVML has been seen returning garbage here
            tp = pmap.lookup(int(getattr(s, "pid", -1)))
            if tp is None:
                continue  # not the target's tree (or a zombie)
            prev = self._util_hold.get((g, tp))
            if prev is None or ts >= prev[0]:
                self._util_hold[(g, tp)] = (ts, float(sm))
        self._util_last_seen[g] = cursor
        out: dict[int, float] = {}
        for (gg, tp), (ts, sm) in list(self._util_hold.items()):
            if gg != g:
                continue
            if now_us - ts > PROC_UTIL_HOLD_S * 1e6 or pmap.lookup(tp) is None:
                del self._util_hold[(gg, tp)]
                continue
            out[tp] = sm
        return out

    # ------------------------------------------------------------------ metadata

    def unsupported(self) -> dict[int, list[str]]:
        """GPU -> the NVML calls/fields found unsupported there (shown as n/a)."""
        out: dict[int, list[str]] = {}
        if self.nv is None:
            return out
        for g, key in self.nv.unsupported:
            out.setdefault(g, []).append(key)
        return {g: sorted(v) for g, v in out.items()}

    def describe(self) -> list[dict[str, Any]]:
        """Per GPU, for the capture's metadata: identity, driver, limits, local CPUs.

        Identity (names, bus ids, driver, local CPUs) is read once and cached: the recorder may
        ask often. Limits come from the slow-field cache. n/a numbers are None (JSON-safe).
        """
        if not self._started:
            self.start()
        with self._lock:
            nv = self.nv
            if nv is None:
                return []
            out = []
            for g in self.gpus:
                ident = self._identity.get(g) or self._read_identity(nv, g)
                slow = self._slow_fields(nv, g)
                if g not in self.power_source:  # describe() before the first poll
                    instant = FI_POWER_INSTANT in nv.fields(g, [FI_POWER_INSTANT])
                    has_avg = nv.get(g, "nvmlDeviceGetPowerUsage") is not None
                    self.power_source[g] = "instant" if instant else "average" if has_avg else "n/a"
                d = {
                    **ident,
                    "memory_total_mib": slow["mem_total_mib"],
                    "sm_clock_max_mhz": slow["sm_clock_max_mhz"],
                    "mem_clock_max_mhz": slow["mem_clock_max_mhz"],
                    "power_limit_w": slow["power_limit_w"],
                    "power_source": self.power_source.get(g, ""),
                }
                out.append(
                    {k: (None if isinstance(v, float) and v != v else v) for k, v in d.items()}
                )
            return out

    def _read_identity(self, nv: NvmlCalls, g: int) -> dict[str, Any]:
        driver = _text(nv.get(-1, "nvmlSystemGetDriverVersion"))
        cuda = nv.get(-1, "nvmlSystemGetCudaDriverVersion_v2")
        if cuda is None:
            cuda = nv.get(-1, "nvmlSystemGetCudaDriverVersion")
        pci = nv.get(g, "nvmlDeviceGetPciInfo")
        bus = _text(getattr(pci, "busId", "")) if pci is not None else ""
        cpus, src = self._local_cpus(nv, g, bus)
        ident = {
            "index": g,
            "name": _text(nv.get(g, "nvmlDeviceGetName")),
            "uuid": _text(nv.get(g, "nvmlDeviceGetUUID")),
            "pci_bus_id": bus,
            "driver_version": driver,
            "cuda_driver_version": f"{int(cuda) // 1000}.{int(cuda) % 1000 // 10}" if cuda else "",
            "local_cpus": cpus,
            "local_cpus_source": src,
        }
        self._identity[g] = ident
        return ident

    def _local_cpus(self, nv: NvmlCalls, g: int, bus_id: str) -> tuple[str, str]:
        """The GPU's local CPUs as a cpulist: NVML's affinity, else sysfs, else ""."""
        words = ((os.cpu_count() or 1) + 63) // 64
        mask = nv.get(g, "nvmlDeviceGetCpuAffinity", words)
        if mask is not None:
            cpus = cpus_from_mask_words(list(mask))
            if cpus:
                return format_cpulist(cpus), "nvml"
        if bus_id:
            try:
                local = pci_local_cpus(bus_id)
            except ValueError:  # not a PCI address: nothing to look up
                local = None
            if local:
                return format_cpulist(local), "sysfs"
        return "", ""


def _init_failure(e: BaseException) -> str:
    """One line saying why NVML could not start, and what to do."""
    code = _err_code(e)
    if code == _ERR_LIBRARY_NOT_FOUND:
        return (
            "libnvidia-ml.so not found: no NVIDIA driver here (in a container: run it with"
            " --gpus all / the NVIDIA container toolkit)"
        )
    if code == _ERR_DRIVER_NOT_LOADED:
        return "NVIDIA driver not loaded (nvidia-smi fails too?): load the kernel module"
    if code == _ERR_NO_PERMISSION:
        return "no permission to open /dev/nvidia*: add the user to the video group"
    return f"NVML init failed: {type(e).__name__}: {_safe_str(e)}"
