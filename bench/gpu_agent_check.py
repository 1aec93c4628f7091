"""GPU-machine check of the kdash agent: real CUPTI, a real torch + Triton target, one run.

Phases (each one's result is written to the JSON as soon as it is known, so a failure late in
the run still leaves the earlier evidence):

1. `baseline`: the target (torch matmul + a small Triton kernel + a sync, in a loop) started
   WITHOUT kdash; its iterations/s; no agent socket must appear.
2. `eager`: the same target started with `bootstrap.run_env` (the `kdash run` hook). Its rate
   is measured before attaching, while an `AgentSource` streams activity (~3 s of polls), and
   after detaching. Checks: kernels arrive with names and durations > 0, their timestamps lie
   inside the polling window on our monotonic clock, the agent read the buffers with its fast
   path, nothing was dropped, the target exits normally.
3. `graph`: the target replays a CUDA graph of small kernels (captured before attach); checks
   that kernels arrive with a graph id, and the rate before/with/after.
4. `profiler`: the target runs torch.profiler for its first seconds; while it does, the agent
   must answer "unavailable" and stay idle; afterwards it must attach; the target reports how
   many CUDA kernel events torch.profiler itself recorded (kdash must not have stolen them).
5. `inject`: the eager target started WITHOUT kdash; `inject.check_injectable` + `inject.inject`
   (ptrace on Python 3.10-3.13) put the agent in; seconds from injection to the first kernel,
   and the rate before / with / after, as in `eager`.
6. `nvtx`: NVTX ranges around each step, target started with `run_env(nvtx=True)`: marker
   rows must arrive (NVTX_INJECTION64_PATH pointed at the target's libcupti).
7. `duty`: for the eager and the graph loop (one target each): iterations/s before attaching,
   with kdash's default duty cycle (100 ms of every 1 s), after `set_continuous(True)`, and
   after detaching; then the agent's counters after the detach without starting anything
   (`probe_stats`: does CUPTI still request or hand over buffers? which kinds does the agent's
   ledger hold on?), then a second attach that detaches with cuptiFinalize (opt-in) and the rate
   after that.

Phases 2-6 keep activity continuous (as in the first runs); only `duty` uses the default.

Run on the GPU machine from the repository root (no install needed; see `_kdash_importable`):

    python bench/gpu_agent_check.py            # writes $OUT/agent-h200.json
    python bench/gpu_agent_check.py --phases eager,graph,duty,profiler   # a subset

cupti-python must be importable (PYTHONPATH); if it is not and `.whl/cupti_python-*.whl` is
present, the wheel is unpacked into a temporary folder and put on the targets' PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = Path(os.environ.get("OUT") or REPO / "bench" / "results")
RESULT = OUT / "agent-h200.json"

TARGET = r"""
import os, sys, time
import torch
import triton
import triton.language as tl

mode = sys.argv[1]
seconds = float(sys.argv[2])

@triton.jit
def axpy(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    v = alpha * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m)
    tl.store(out_ptr + offs, v, mask=m)

dev = "cuda"
a = torch.randn(1024, 1024, device=dev)
b = torch.randn(1024, 1024, device=dev)
x = torch.randn(1 << 16, device=dev)
y = torch.randn(1 << 16, device=dev)
out = torch.empty_like(x)
n = x.numel()

def step():
    c = a @ b
    axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)
    torch.cuda.synchronize()
    return c

graph = None
if mode == "graph":
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            for _ in range(50):
                axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(50):
            axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)

def run_once():
    if graph is not None:
        graph.replay()
        torch.cuda.synchronize()
    elif mode == "nvtx":
        torch.cuda.nvtx.range_push("kdash_step")
        step()
        torch.cuda.nvtx.range_pop()
    else:
        step()

for _ in range(20):  # compile and warm up before the clock starts
    run_once()

prof = None
prof_until = 0.0
if mode == "profiler":
    from torch.profiler import ProfilerActivity, profile
    prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    prof.__enter__()
    prof_until = time.monotonic() + 3.0


def count_profiler_kernels(prof):
    # CUDA kernel events torch.profiler recorded, from Kineto's raw events: building
    # prof.events() (FunctionEvent objects) took ~12 s for 88,740 kernels on the H200 and ran
    # the target past its end while kdash was attached (the "Broken pipe" of the first run).
    try:
        evs = prof.profiler.kineto_results.events()
        cuda = torch.autograd.DeviceType.CUDA
        return sum(1 for e in evs if e.device_type() == cuda)
    except Exception:
        return len([e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA])

print("ready", os.getpid(), flush=True)
iters = 0
end = time.monotonic() + seconds
next_tick = time.monotonic()
while True:
    run_once()
    iters += 1
    now = time.monotonic()
    if prof is not None and now >= prof_until:
        t_exit = time.monotonic()
        prof.__exit__(None, None, None)
        n_kernels = count_profiler_kernels(prof)
        took = time.monotonic() - t_exit
        print("profiler_kernels", n_kernels, "seconds", round(took, 2), flush=True)
        prof = None
        end = max(end, time.monotonic() + 8.0)  # time for kdash to attach after it
        now = time.monotonic()
    if now >= next_tick:
        print("tick", time.monotonic_ns(), iters, flush=True)
        next_tick = now + 0.1
    if now >= end:
        break
print("done", iters, flush=True)
"""


# ---- making kdash and cupti-python importable without installing anything ---------------------


def _kdash_importable() -> Path | None:
    """A folder for PYTHONPATH under which `import kdash.collectors.agent` works from this
    checkout (the repository maps kdash.collectors -> collectors/ etc. only when installed)."""
    try:
        import kdash.collectors.agent.client  # noqa: F401

        return None
    except ImportError:
        pass
    shim = Path(tempfile.mkdtemp(prefix="kdash-shim-"))
    pkg = shim / "kdash"
    pkg.mkdir()
    for entry in (REPO / "kdash").iterdir():
        (pkg / entry.name).symlink_to(entry)
    for sub in ("collectors", "tui", "kernels", "themes"):
        if (REPO / sub).is_dir() and not (pkg / sub).exists():
            (pkg / sub).symlink_to(REPO / sub)
    sys.path.insert(0, str(shim))
    return shim


def _cupti_path() -> tuple[str | None, str]:
    """A folder to add to the targets' PYTHONPATH for cupti-python (None: already importable)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import cupti.cupti\n"
            "try:\n"
            "    import importlib.metadata as m; print(m.version('cupti-python'))\n"
            "except Exception as e:\n"
            "    print('version unknown:', e)",
        ],
        capture_output=True,
        text=True,
    )
    if probe.returncode == 0:
        return None, probe.stdout.strip()
    wheels = sorted((REPO / ".whl").glob("cupti_python-*.whl"))
    if not wheels:
        return None, f"not importable and no wheel in .whl/ ({probe.stderr.strip()[-300:]})"
    dest = Path(tempfile.mkdtemp(prefix="cupti-"))
    with zipfile.ZipFile(wheels[-1]) as z:
        z.extractall(dest)
    return str(dest), f"unpacked {wheels[-1].name}"


# ---- targets ------------------------------------------------------------------------------------


class Target:
    """A target process and its tick stream (monotonic ns, iterations)."""

    def __init__(self, mode: str, seconds: float, env: dict[str, str], script: Path) -> None:
        self.ticks: list[tuple[int, int]] = []
        self.lines: list[str] = []
        self.ready = threading.Event()
        self.proc = subprocess.Popen(
            [sys.executable, str(script), mode, str(seconds)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self._t = threading.Thread(target=self._read, daemon=True)
        self._t.start()
        self._err: list[str] = []
        self._te = threading.Thread(target=self._read_err, daemon=True)
        self._te.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.strip()
            if line.startswith("tick "):
                _, t, n = line.split()
                self.ticks.append((int(t), int(n)))
            else:
                self.lines.append(line)
                if line.startswith("ready"):
                    self.ready.set()

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._err.append(line.rstrip())

    def stderr_tail(self) -> str:
        return "\n".join(self._err[-30:])

    def rate(self, t0: int, t1: int) -> float | None:
        """Iterations/s between monotonic ns t0 and t1, from the ticks inside that window."""
        inside = [(t, n) for t, n in self.ticks if t0 <= t <= t1]
        if len(inside) < 2:
            return None
        (ta, na), (tb, nb) = inside[0], inside[-1]
        return (nb - na) / ((tb - ta) / 1e9) if tb > ta else None

    def line(self, prefix: str) -> str | None:
        return next((ln for ln in self.lines if ln.startswith(prefix)), None)

    def finish(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return -9


def now_ns() -> int:
    return time.monotonic_ns()


def pct(a: float | None, b: float | None) -> float | None:
    return None if not a or b is None else round(100.0 * (b - a) / a, 2)


# ---- phases -------------------------------------------------------------------------------------


def watch(pid: int, seconds: float, continuous: bool = True) -> dict:
    """Attach an AgentSource, poll for `seconds` once ok, stop; what arrived and what it said.

    Continuous by default, so the eager/graph/inject/nvtx phases measure what they measured in
    the first runs (activity always on); the duty phase measures the default duty cycle."""
    import numpy as np
    from kdash.collectors.agent.client import AgentSource, find_agent_socket

    res: dict = {"socket": find_agent_socket(pid)}
    src = AgentSource(pid, continuous=continuous)
    t_attach = now_ns()
    src.start()
    tables: dict[str, list] = {}
    t_ok = None
    t_first_kernel = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not src.health.ok:
        if src.health.state == "unavailable":
            break
        time.sleep(0.02)
    if src.health.ok:
        t_ok = now_ns()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for t, b in src.poll(now_ns()).items():
                tables.setdefault(t, []).append(b)
                if t == "kernels" and t_first_kernel is None and len(b["name"]):
                    t_first_kernel = now_ns()
            time.sleep(0.1)
    t_window_end = now_ns()
    # a last STATS round trip before detaching
    src._last_stats_req = 0.0
    src.poll(now_ns())
    time.sleep(0.5)
    for t, b in src.poll(now_ns()).items():
        tables.setdefault(t, []).append(b)
    res["health"] = str(src.health)
    res["status_line"] = src.status_line
    res["hello"] = src.hello
    res["stats"] = dict(src.stats)
    src.stop()
    t_detach = now_ns()
    res.update(
        t_attach=t_attach,
        t_ok=t_ok,
        t_window_end=t_window_end,
        t_detach=t_detach,
        t_first_kernel=t_first_kernel,
        seconds_to_ok=None if t_ok is None else round((t_ok - t_attach) / 1e9, 3),
        seconds_to_first_kernel=(
            None if t_first_kernel is None else round((t_first_kernel - t_attach) / 1e9, 3)
        ),
    )
    counts = {t: int(sum(len(b["start_ns"]) for b in bs)) for t, bs in tables.items()}
    res["rows"] = counts
    if tables.get("kernels"):
        k = {c: np.concatenate([b[c] for b in tables["kernels"]]) for c in tables["kernels"][0]}
        dur = k["end_ns"] - k["start_ns"]
        names, inv = np.unique(k["name"].astype(str), return_inverse=True)
        per = []
        for i, nm in enumerate(names):
            d = dur[inv == i]
            per.append(
                {
                    "name": nm[:160],
                    "calls": int(d.size),
                    "mean_us": round(float(d.mean()) / 1e3, 3),
                    "min_us": round(float(d.min()) / 1e3, 3),
                }
            )
        per.sort(key=lambda r: -r["calls"])
        res["kernels"] = {
            "count": int(dur.size),
            "distinct_names": int(len(names)),
            "all_durations_positive": bool((dur > 0).all()),
            "nonpositive_durations": int((dur <= 0).sum()),
            "start_min_minus_attach_ms": round((int(k["start_ns"].min()) - t_attach) / 1e6, 3),
            "end_max_minus_window_end_ms": round((int(k["end_ns"].max()) - t_window_end) / 1e6, 3),
            "inside_attach_window": bool(
                k["start_ns"].min() >= t_attach - 50_000_000
                and k["end_ns"].max() <= t_detach + 50_000_000
            ),
            "with_graph_id": int((k["graph_id"] >= 0).sum()),
            "devices": sorted({int(v) for v in k["device"]}),
            "streams": sorted({int(v) for v in k["stream"]})[:10],
            "top": per[:12],
            "sample_row": {
                c: (str(v[0]) if v.dtype == object else int(v[0])) for c, v in k.items()
            },
        }
    if tables.get("api"):
        a = np.concatenate([b["name"] for b in tables["api"]]).astype(str)
        names, cnt = np.unique(a, return_counts=True)
        order = np.argsort(-cnt)[:10]
        res["api_top"] = {str(names[i]): int(cnt[i]) for i in order}
    if tables.get("markers"):
        m = {c: np.concatenate([b[c] for b in tables["markers"]]) for c in ("name", "domain")}
        names, cnt = np.unique(m["name"].astype(str), return_counts=True)
        res["markers_top"] = {str(n): int(c) for n, c in zip(names[:10], cnt[:10], strict=True)}
    if tables.get("memcpy"):
        kinds = np.concatenate([b["kind"] for b in tables["memcpy"]]).astype(str)
        names, cnt = np.unique(kinds, return_counts=True)
        res["memcpy_kinds"] = {str(n): int(c) for n, c in zip(names, cnt, strict=True)}
    st = res["stats"]
    seen = st.get("agent_records_seen") or 0
    res["agent_cost_per_record_ns"] = {
        "callback_wall": round(st.get("agent_callback_ns", 0) / seen, 1) if seen else None,
        "callback_cpu": round(st.get("agent_callback_cpu_ns", 0) / seen, 1) if seen else None,
        "flush_cpu_incl_cupti_python": (
            round(st.get("agent_flush_cpu_ns", 0) / seen, 1) if seen else None
        ),
    }
    return res


def run_phase(name: str, mode: str, env: dict, script: Path, armed: bool) -> dict:
    from kdash.collectors.agent.client import find_agent_socket

    res: dict = {"mode": mode, "armed": armed}
    tgt = Target("eager" if mode == "inject" else mode, 16.0 if armed else 6.0, env, script)
    deadline = time.monotonic() + 180
    while not tgt.ready.wait(0.2):
        if tgt.proc.poll() is not None or time.monotonic() > deadline:
            time.sleep(0.3)  # let the stderr reader catch up
            res["error"] = "target never became ready: " + tgt.stderr_tail()
            tgt.proc.kill()
            return res
    pid = tgt.proc.pid
    res["pid"] = pid
    time.sleep(0.5 if mode == "profiler" else 3.0)  # profiler: while it still holds CUPTI
    t_before = now_ns()
    if not armed:
        time.sleep(1.0)
        res["agent_socket"] = find_agent_socket(pid)
        res["rate_it_s"] = tgt.rate(t_before - 3_000_000_000, now_ns())
        res["exit_code"] = tgt.finish()
        res["stdout_tail"] = tgt.lines[-3:]
        return res
    if mode == "profiler":
        # torch.profiler holds CUPTI for the target's first 4 s: kdash must stay idle
        w = watch(pid, 1.0)
        res["while_profiler"] = {
            k: w.get(k) for k in ("health", "status_line", "rows", "seconds_to_ok")
        }
        deadline = time.monotonic() + 40
        while time.monotonic() < deadline and tgt.line("profiler_kernels") is None:
            if tgt.proc.poll() is not None:
                break
            time.sleep(0.1)
        res["profiler_kernels_recorded_by_torch"] = tgt.line("profiler_kernels")
        time.sleep(0.5)
        w2 = watch(pid, 2.0)
        res["after_profiler"] = {
            k: w2.get(k)
            for k in (
                "health",
                "status_line",
                "rows",
                "seconds_to_ok",
                "seconds_to_first_kernel",
                "stats",
            )
        }
        res["target_TEARDOWN_CUPTI"] = env.get("TEARDOWN_CUPTI")
        res["exit_code"] = tgt.finish()
        res["stdout_tail"] = tgt.lines[-3:]
        if res["exit_code"] != 0:
            res["stderr_tail"] = tgt.stderr_tail()
        return res
    if mode == "inject":
        from kdash.collectors.agent import inject

        v = inject.check_injectable(pid)
        res["checks"] = [(c.name, c.ok, c.detail) for c in v.checks]
        res["python"] = v.python
        t_inj = now_ns()
        res["inject_result"] = inject.inject(pid, checked=v) if v.ok else v.reason
        res["inject_seconds"] = round((now_ns() - t_inj) / 1e9, 3)
        if res["inject_result"] is not None:
            res["exit_code"] = tgt.finish()
            res["stderr_tail"] = tgt.stderr_tail()
            return res
    w = watch(pid, 3.0)
    if mode == "inject" and w.get("t_first_kernel"):
        res["seconds_inject_to_first_kernel"] = round((w["t_first_kernel"] - t_inj) / 1e9, 3)
    time.sleep(3.0)
    t_end = now_ns()
    before = tgt.rate(t_before - 3_000_000_000, w["t_attach"])
    during = tgt.rate(w["t_ok"] or w["t_attach"], w["t_window_end"])
    after = tgt.rate(w["t_detach"] + 500_000_000, t_end)
    res["watch"] = w
    res["rate_it_s"] = {
        "before": before,
        "with_kdash": during,
        "after_detach": after,
        "with_vs_before_pct": pct(before, during),
        "after_vs_before_pct": pct(before, after),
    }
    res["exit_code"] = tgt.finish()
    res["stdout_tail"] = tgt.lines[-3:]
    if res["exit_code"] != 0:
        res["stderr_tail"] = tgt.stderr_tail()
    return res


def probe_stats(pid: int) -> dict:
    """The agent's counters without starting anything: connect, read HELLO, ask STATS, leave.

    Used after a detach to see whether CUPTI still works for us in the target: buffers it still
    requests or completes, bytes it still hands over (we discard them), kinds our ledger says
    are on. A session that never STARTs touches no CUPTI call."""
    import socket

    from kdash.collectors.agent import wire
    from kdash.collectors.agent.client import find_agent_socket

    path = find_agent_socket(pid)
    if path is None:
        return {"error": "no agent socket"}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5.0)
    try:
        s.connect(path)
        dec = wire.Decoder()
        wire.recv_message(s, dec)  # HELLO (or STATUS busy)
        s.sendall(wire.encode_control(wire.MsgType.STATS, {}))
        while True:
            msg = wire.recv_message(s, dec)
            if msg is None:
                return {"error": "agent closed the connection"}
            if msg.type == wire.MsgType.STATS:
                keep = (
                    "state",
                    "kinds_on",
                    "enabled",
                    "buffers_requested",
                    "raw_buffers",
                    "discarded_bytes",
                    "discarded_records",
                    "records_seen",
                    "finalized",
                    "windows_sent",
                    "on_ns",
                    "last_error",
                    "last_disconnect",
                )
                return {k: msg.body.get(k) for k in keep} | {"t_ns": now_ns()}
    except (OSError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        s.close()


def _drain(src: object, seconds: float, rows: dict) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for t, b in src.poll(now_ns()).items():  # type: ignore[attr-defined]
            if t == "markers":
                win = b["domain"] == "kdash"
                rows["windows"] = rows.get("windows", 0) + int(win.sum())
                rows["window_on_ms"] = rows.get("window_on_ms", 0.0) + float(
                    (b["end_ns"][win] - b["start_ns"][win]).sum() / 1e6
                )
            rows[t] = rows.get(t, 0) + len(b["start_ns"])
        time.sleep(0.1)


def attach(pid: int, **kw: object) -> object:
    """An AgentSource that is ok (or has said why not), retrying while the agent is still
    ending the previous session (a probe's): it serves one client at a time."""
    from kdash.collectors.agent.client import AgentSource

    end = time.monotonic() + 10
    while True:
        src = AgentSource(pid, **kw)  # type: ignore[arg-type]
        src.start()
        while time.monotonic() < end and src.health.state == "starting":
            time.sleep(0.02)
        if "another kdash client" not in str(src.health) or time.monotonic() >= end:
            return src
        src.stop()
        time.sleep(0.1)


def duty_phase(mode: str, env: dict, script: Path) -> dict:
    """One target: rate before / with kdash's default duty cycle / continuous / after detach,
    then CUPTI's state after the detach (probe_stats), then once more with cuptiFinalize on
    detach (START finalize_on_detach) and the rate after that."""
    res: dict = {"mode": mode}
    tgt = Target(mode, 30.0, env, script)
    deadline = time.monotonic() + 180
    while not tgt.ready.wait(0.2):
        if tgt.proc.poll() is not None or time.monotonic() > deadline:
            time.sleep(0.3)
            res["error"] = "target never became ready: " + tgt.stderr_tail()
            tgt.proc.kill()
            return res
    pid = tgt.proc.pid
    res["pid"] = pid
    time.sleep(2.0)
    t_b0 = now_ns()
    time.sleep(3.0)
    t_b1 = now_ns()
    src = attach(pid)  # kdash's default: the duty cycle
    res["duty_health"] = str(src.health)
    if not src.health.ok:
        src.stop()
        res["exit_code"] = tgt.finish()
        res["stderr_tail"] = tgt.stderr_tail()
        return res
    duty_rows: dict = {}
    t_d0 = now_ns()
    _drain(src, 4.0, duty_rows)
    t_d1 = now_ns()
    src.set_continuous(True)
    end = time.monotonic() + 3
    while time.monotonic() < end and str(src.health) != "ok: continuous":
        _drain(src, 0.05, duty_rows)
    res["continuous_health"] = str(src.health)
    cont_rows: dict = {}
    t_c0 = now_ns()
    _drain(src, 3.0, cont_rows)
    t_c1 = now_ns()
    src._last_stats_req = 0.0
    _drain(src, 0.5, cont_rows)
    res["stats"] = {k: v for k, v in src.stats.items() if k.startswith("agent_")}
    src.stop()
    t_det = now_ns()
    time.sleep(0.5)
    probe_a = probe_stats(pid)
    t_a0 = now_ns()
    time.sleep(3.0)
    t_a1 = now_ns()
    probe_b = probe_stats(pid)
    res["duty_rows"], res["continuous_rows"] = duty_rows, cont_rows
    res["after_detach_probes"] = [probe_a, probe_b]
    # again, continuous for 1 s, detaching with cuptiFinalize (opt-in; may be unsafe: watch
    # the exit code)
    src2 = attach(pid, continuous=True)  # every detach finalizes now (collectors/agent/detach.py)
    fin_rows: dict = {}
    _drain(src2, 1.0, fin_rows)
    src2.stop()
    res["finalize"] = {"health": str(src2.health), "rows": fin_rows, "status": src2.status_line}
    time.sleep(0.5)
    t_f0 = now_ns()
    time.sleep(3.0)
    t_f1 = now_ns()
    res["finalize"]["probe"] = probe_stats(pid)
    before = tgt.rate(t_b0, t_b1)
    rates = {
        "before": before,
        "duty": tgt.rate(t_d0, t_d1),
        "continuous": tgt.rate(t_c0, t_c1),
        "after_detach": tgt.rate(t_a0, t_a1),
        "after_finalize": tgt.rate(t_f0, t_f1),
    }
    res["rate_it_s"] = rates | {
        f"{k}_vs_before_pct": pct(before, v) for k, v in rates.items() if k != "before"
    }
    res["t_detach"] = t_det
    res["exit_code"] = tgt.finish()
    res["stdout_tail"] = tgt.lines[-3:]
    if res["exit_code"] != 0:
        res["stderr_tail"] = tgt.stderr_tail()
    return res


PHASES = ("baseline", "eager", "graph", "profiler", "inject", "nvtx", "duty")


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"comma-separated subset of {','.join(PHASES)} (default: all)",
    )
    args = ap.parse_args()
    wanted = [p.strip() for p in args.phases.split(",") if p.strip()]
    unknown = [p for p in wanted if p not in PHASES]
    if unknown:
        ap.error(f"unknown phase(s) {unknown}; choose from {PHASES}")
    OUT.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": " ".join(["python bench/gpu_agent_check.py", *sys.argv[1:]]),
        "phases_run": wanted,
        "machine": {"python": platform.python_version(), "host": platform.node()},
        "phases": {},
    }

    def save() -> None:
        tmp = RESULT.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        tmp.replace(RESULT)

    try:
        shim = _kdash_importable()
        from kdash.collectors.agent import bootstrap, server

        cupti_dir, cupti_note = _cupti_path()
        report["cupti_python"] = cupti_note
        report["driver_cuda"] = server.driver_cuda_version()
        try:
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            )
            report["machine"]["gpus"] = smi.stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError) as e:
            report["machine"]["gpus"] = f"nvidia-smi failed: {e}"
        try:
            import torch

            report["machine"]["torch"] = torch.__version__
        except ImportError as e:
            report["machine"]["torch"] = f"not importable: {e}"
        base = dict(os.environ)
        extra = [p for p in (str(shim) if shim else None, cupti_dir) if p]
        if extra:
            base["PYTHONPATH"] = os.pathsep.join(
                extra + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
            )
        base.pop("KDASH_AGENT", None)
        script = Path(tempfile.mkdtemp(prefix="kdash-target-")) / "target.py"
        script.write_text(TARGET)
        plan = [
            ("baseline", "eager", bootstrap.disarmed_env(base), False),
            ("eager", "eager", bootstrap.run_env(base), True),
            ("graph", "graph", bootstrap.run_env(base), True),
            ("profiler", "profiler", bootstrap.run_env(base), True),
            # started WITHOUT kdash; the agent is injected (ptrace on 3.10-3.13)
            ("inject", "inject", bootstrap.disarmed_env(base), True),
            # NVTX ranges around each step, with the opt-in NVTX hook
            ("nvtx", "nvtx", bootstrap.run_env(base, nvtx=True), True),
            # kdash's default duty cycle vs continuous vs after detach, eager and graph
            ("duty", "duty", bootstrap.run_env(base), True),
        ]
        for name, mode, env, armed in plan:
            if name not in wanted:
                continue
            t0 = time.monotonic()
            try:
                if name == "duty":
                    report["phases"][name] = {
                        m: duty_phase(m, env, script) for m in ("eager", "graph")
                    }
                else:
                    report["phases"][name] = run_phase(name, mode, env, script, armed)
            except Exception as e:  # noqa: BLE001 - keep going; record what broke
                report["phases"][name] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-2000:],
                }
            report["phases"][name]["phase_seconds"] = round(time.monotonic() - t0, 1)
            save()
            print(name, json.dumps(report["phases"][name], default=str)[:600], flush=True)
        eager = report["phases"].get("eager", {})
        k = (eager.get("watch") or {}).get("kernels") or {}
        base_rate = report["phases"].get("baseline", {}).get("rate_it_s")
        ew = eager.get("watch") or {}
        report["verdict"] = {
            "record_reader": (ew.get("stats") or {}).get("agent_record_reader"),
            "agent_cost_per_record_ns": ew.get("agent_cost_per_record_ns"),
            "kernels_arrived": bool(k.get("count")),
            "names_and_positive_durations": bool(k.get("distinct_names"))
            and bool(k.get("all_durations_positive")),
            "timestamps_on_host_clock": bool(k.get("inside_attach_window")),
            "baseline_rate_it_s": base_rate,
            "eager_rates": eager.get("rate_it_s"),
            "inject": {
                k: report["phases"].get("inject", {}).get(k)
                for k in ("inject_result", "seconds_inject_to_first_kernel", "rate_it_s")
            },
            "nvtx_marker_rows": (
                (report["phases"].get("nvtx", {}).get("watch") or {}).get("rows") or {}
            ).get("markers"),
            "graph_rates": report["phases"].get("graph", {}).get("rate_it_s"),
            "profiler": {
                k: report["phases"].get("profiler", {}).get(k)
                for k in ("while_profiler", "profiler_kernels_recorded_by_torch")
            },
            "graph_kernels_with_graph_id": (
                (report["phases"].get("graph", {}).get("watch") or {}).get("kernels") or {}
            ).get("with_graph_id"),
            "duty": {
                m: {
                    "rate_it_s": d.get("rate_it_s"),
                    "health": [d.get("duty_health"), d.get("continuous_health")],
                    "after_detach_probes": d.get("after_detach_probes"),
                    "finalize": d.get("finalize"),
                    "exit_code": d.get("exit_code"),
                }
                for m, d in (report["phases"].get("duty") or {}).items()
                if isinstance(d, dict)
            },
        }
    except Exception as e:  # noqa: BLE001
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-3000:]
    save()
    print("wrote", RESULT, flush=True)
    print(json.dumps(report.get("verdict", report.get("error")), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
