"""Check the NVML collector against a real GPU under a real load (run ON the GPU machine).

    python3 bench/gpu_nvml_check.py [--gpu 0] [--idle 3] [--load 10] [--hz 4] [--out PATH]

Idle for `--idle` s, then a torch bf16 matmul loop in a child process for `--load` s, then idle
again, polling `NvmlSource` at `--hz` the whole time. The child is a descendant of this process,
so it is in the target's tree and must show up in `gpu_procs`. Prints a summary and writes
`$OUT/nvml-h200.json` (or `--out`): the command, the machine (GPU name, driver), idle-vs-loaded
figures (SM clock, power, temperature, utilisation), which fields were n/a, the throttle reasons
seen, what each poll cost, and pass/fail of the four claims the GPU test makes (SM clock rises,
power rises, utilisation > 90 % while loaded, the child's pid in gpu_procs with memory > 0).
Exit status 0 when all four hold, 1 otherwise, 2 when there is no usable GPU/NVML.

Needs only numpy, psutil, pynvml (nvidia-ml-py) and torch with CUDA; kdash itself comes from
the checkout through PYTHONPATH (no install).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kdash.collectors.nvml import NvmlSource

from kdash import gpu_reasons
from kdash.target import Target

CHILD = r"""
import sys, time, torch
if not torch.cuda.is_available():
    print("NOCUDA", flush=True); sys.exit(3)
gpu, seconds, n = int(sys.argv[1]), float(sys.argv[2]), 8192
torch.cuda.set_device(gpu)
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
(a @ b); torch.cuda.synchronize()
print("READY", torch.__version__, torch.version.cuda, flush=True)
t0 = time.monotonic(); end = t0 + seconds; it = 0
while time.monotonic() < end:
    for _ in range(10):
        c = a @ b
    torch.cuda.synchronize(); it += 10
dt = time.monotonic() - t0
print("DONE", it, dt, it * 2 * n**3 / dt / 1e12, flush=True)
"""

COLS = [
    "sm_clock_mhz",
    "mem_clock_mhz",
    "sm_clock_max_mhz",
    "mem_clock_max_mhz",
    "temp_c",
    "power_w",
    "power_limit_w",
    "energy_j",
    "util_gpu_pct",
    "util_mem_pct",
    "mem_used_mib",
    "mem_total_mib",
    "pstate",
    "pcie_tx_kbs",
    "pcie_rx_kbs",
    "throttle_reasons",
]


def _f(x: Any) -> float | int | None:
    """JSON-safe number (NaN -> None)."""
    if x is None:
        return None
    x = x.item() if hasattr(x, "item") else x
    if isinstance(x, float) and math.isnan(x):
        return None
    return x


def _stats(vals: list[float]) -> dict[str, float | None]:
    v = [x for x in vals if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(v), "median": statistics.median(v), "min": min(v), "max": max(v)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--idle", type=float, default=3.0)
    ap.add_argument("--load", type=float, default=10.0)
    ap.add_argument("--hz", type=float, default=4.0)
    default_out = Path(os.environ.get("OUT", "bench/results")) / "nvml-h200.json"
    ap.add_argument("--out", type=Path, default=default_out)
    a = ap.parse_args()
    period = 1.0 / a.hz

    src = NvmlSource(Target.from_pid(os.getpid()), gpus=[a.gpu], interval_s=period)
    src.start()
    result: dict[str, Any] = {
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "when_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "health_at_start": str(src.health),
    }
    if src.health.state == "unavailable":
        print(f"no usable NVML: {src.health}", file=sys.stderr)
        _write(a.out, result)
        return 2
    gpus = src.describe()
    result["machine"] = {
        "host": socket.gethostname(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gpus": gpus,
    }

    samples: list[dict[str, Any]] = []
    procs: list[dict[str, Any]] = []
    costs: list[float] = []
    phase = ["idle-before"]
    t_start = time.monotonic()

    def poll_once() -> None:
        now = time.monotonic_ns()
        out = src.poll(now)
        costs.append(src.last_poll_ms)
        b = out.get("gpu_samples", {})
        avg = src.nv.get(a.gpu, "nvmlDeviceGetPowerUsage") if src.nv else None
        for i in range(len(b.get("gpu", []))):
            row = {c: _f(b[c][i]) for c in COLS}
            row["t_s"] = round(now / 1e9 - t_start, 3)
            row["phase"] = phase[0]
            row["power_avg_w"] = None if avg is None else avg / 1000
            row["reasons"] = gpu_reasons.decode(int(b["throttle_reasons"][i]))
            samples.append(row)
        p = out.get("gpu_procs", {})
        for i in range(len(p.get("pid", []))):
            procs.append(
                {
                    "t_s": round(now / 1e9 - t_start, 3),
                    "phase": phase[0],
                    "pid": int(p["pid"][i]),
                    "mem_used_mib": _f(p["mem_used_mib"][i]),
                    "sm_util_pct": _f(p["sm_util_pct"][i]),
                }
            )

    def poll_for(seconds: float, stop: threading.Event | None = None) -> None:
        end = time.monotonic() + seconds
        nxt = time.monotonic()
        while time.monotonic() < end and not (stop and stop.is_set()):
            poll_once()
            nxt += period
            time.sleep(max(0.0, nxt - time.monotonic()))

    poll_for(a.idle)

    # The load: a child process (so it is in our tree), started now, READY after CUDA init.
    # Pin the child to the very GPU NVML watches: CUDA's device order need not match NVML's
    # indices, a UUID in CUDA_VISIBLE_DEVICES does.
    env = dict(os.environ)
    uuid = gpus[0]["uuid"] if gpus else ""
    if uuid:
        env["CUDA_VISIBLE_DEVICES"] = uuid
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "0" if uuid else str(a.gpu), str(a.load)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    phase[0] = "warmup"
    lines: list[str] = []
    ready = threading.Event()
    done = threading.Event()

    def reader() -> None:
        assert child.stdout is not None
        for line in child.stdout:
            lines.append(line.strip())
            if line.startswith("READY"):
                ready.set()
        done.set()

    threading.Thread(target=reader, daemon=True).start()
    while not ready.is_set() and not done.is_set():
        poll_once()
        time.sleep(period)
    if not ready.is_set():
        child.wait()
        result["child_output"] = lines
        result["error"] = f"load child failed (exit {child.returncode}): {lines}"
        print(result["error"], file=sys.stderr)
        _write(a.out, result)
        return 2
    result["child_pid"] = child.pid
    phase[0] = "load"
    poll_for(a.load + 30, stop=done)
    child.wait()
    result["child_output"] = lines
    phase[0] = "idle-after"
    poll_for(a.idle)
    result["transient_errors"] = src.nv.transient_errors if src.nv else None
    result["nvml_calls"] = src.nv.calls if src.nv else None
    src.stop()

    # Figures. "loaded" skips the first second after READY (clocks and NVML windows catch up)
    # and the last sample (the child may already be tearing down).
    load_rows = [r for r in samples if r["phase"] == "load"]
    t_ready = load_rows[0]["t_s"] if load_rows else 0.0
    steady = [r for r in load_rows if r["t_s"] >= t_ready + 1.0][:-1]
    idle = [r for r in samples if r["phase"] == "idle-before"]
    after = [r for r in samples if r["phase"] == "idle-after"]
    figs: dict[str, Any] = {}
    for name, rows in (("idle_before", idle), ("loaded", steady), ("idle_after", after)):
        figs[name] = {
            c: _stats([r[c] for r in rows])
            for c in (
                "sm_clock_mhz",
                "mem_clock_mhz",
                "power_w",
                "power_avg_w",
                "temp_c",
                "util_gpu_pct",
                "util_mem_pct",
                "mem_used_mib",
                "pcie_tx_kbs",
                "pcie_rx_kbs",
            )
        }
        figs[name]["pstates"] = sorted({r["pstate"] for r in rows if r["pstate"] is not None})
        seen: dict[str, int] = {}
        for r in rows:
            for n in r["reasons"]:
                seen[n] = seen.get(n, 0) + 1
        figs[name]["reasons_seen"] = seen
    result["figures"] = figs
    result["sm_clock_max_mhz"] = samples[0]["sm_clock_max_mhz"] if samples else None
    result["power_limit_w"] = samples[0]["power_limit_w"] if samples else None
    result["power_source"] = src.power_source.get(a.gpu)
    result["reason_call"] = src.reason_call.get(a.gpu)
    result["na_columns"] = [c for c in COLS if all(r[c] in (None, -1) for r in samples)]
    result["unsupported_calls"] = src.unsupported().get(a.gpu, [])
    result["poll_cost_ms"] = {
        **_stats(costs),
        "p95": sorted(costs)[int(0.95 * (len(costs) - 1))] if costs else None,
    }
    mine = [p for p in procs if p["pid"] == child.pid]
    result["child_in_gpu_procs"] = {
        "rows": len(mine),
        "max_mem_used_mib": max((p["mem_used_mib"] or 0 for p in mine), default=None),
        "sm_util_pct": _stats([p["sm_util_pct"] for p in mine if p["phase"] == "load"]),
        "other_pids_seen": sorted({p["pid"] for p in procs} - {child.pid}),
    }
    result["health_at_end"] = str(src.health)
    li, ll = figs["idle_before"], figs["loaded"]

    def gt(x: float | None, y: float | None, k: float = 1.0) -> bool:
        return x is not None and y is not None and x > y * k

    utils = [r["util_gpu_pct"] for r in steady if r["util_gpu_pct"] is not None]
    result["checks"] = {
        "sm_clock_rises": gt(ll["sm_clock_mhz"]["median"], li["sm_clock_mhz"]["median"]),
        "power_rises": gt(ll["power_w"]["median"], li["power_w"]["median"], 1.5),
        "util_over_90_loaded": bool(utils)
        and statistics.median(utils) > 90
        and sum(u > 90 for u in utils) >= 0.8 * len(utils),
        "child_pid_in_gpu_procs_with_mem": bool(mine)
        and (result["child_in_gpu_procs"]["max_mem_used_mib"] or 0) > 0,
    }
    result["samples"] = samples
    result["procs"] = procs
    _write(a.out, result)
    _print(result)
    return 0 if all(result["checks"].values()) else 1


def _write(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)
    print(f"wrote {path}")


def _print(r: dict[str, Any]) -> None:
    g = r["machine"]["gpus"][0] if r["machine"]["gpus"] else {}
    print(
        f"GPU {g.get('index')}: {g.get('name')}  driver {g.get('driver_version')}"
        f"  CUDA {g.get('cuda_driver_version')}  local CPUs {g.get('local_cpus')}"
    )
    print(f"power source: {r['power_source']}  reasons via: {r['reason_call']}")
    for name in ("idle_before", "loaded", "idle_after"):
        f = r["figures"][name]

        def m(c: str, f: dict[str, Any] = f) -> str:
            v = f[c]["median"]
            return "n/a" if v is None else f"{v:.0f}"

        print(
            f"{name:12s} SM {m('sm_clock_mhz'):>5} MHz  mem {m('mem_clock_mhz'):>5} MHz"
            f"  power {m('power_w'):>4} W (avg {m('power_avg_w'):>4})  temp {m('temp_c'):>3} C"
            f"  util {m('util_gpu_pct'):>3} %  pstates {f['pstates']}  reasons {f['reasons_seen']}"
        )
    pc = r["poll_cost_ms"]
    print(f"poll cost ms: median {pc['median']:.2f}  p95 {pc['p95']:.2f}  max {pc['max']:.2f}")
    print(f"n/a columns: {r['na_columns']}  unsupported: {r['unsupported_calls']}")
    print(f"child in gpu_procs: {r['child_in_gpu_procs']}")
    print(f"health: {r['health_at_end']}")
    print(f"checks: {r['checks']}")


if __name__ == "__main__":
    sys.exit(main())
