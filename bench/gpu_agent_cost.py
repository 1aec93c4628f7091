"""GPU-machine measurement of what the kdash agent costs its target, and of how true its
kernel durations are (issue 3, evidence (c) and (e)). One run, three targets, one JSON.

Targets (each started under `kdash run`'s hook, `bootstrap.run_env`):

* `eager`: torch matmul + a small Triton kernel + a sync per iteration (launch-bound);
* `graph`: a CUDA graph of 50 tiny Triton kernels (~1 us each) replayed, a sync per replay:
  the worst case for per-kernel costs;
* `decode`: a decode step of kdash's own demo model (8 layers: RMSNorm, QKV/O/MLP matmuls,
  the paged KV write and kdash's split-KV decode attention; batch 32 at 2k context) captured
  once in a CUDA graph and replayed with a sync per step, as a server's decode loop does.

Per target, in this order (each segment 3 s after 1 s settling; rates are the target's own
iterations/s from its tick lines; `after_X` is the rate once X has detached): `before`;
`lean_duty5` (kernels, memcpy, memset, synchronization, markers: no API records, so no per-API
switch calls; 50 ms of every second); `duty` (all kinds with API records narrowed to launch
and sync calls, 100 ms of every second: kdash's default), `duty_again` (the same, to see the
spread), `duty_long` (500 ms of every 5 s: the same 10% with a fifth of the window edges);
`budget` (100 ms every 2.1 s: what `--cost-budget` 1.5% picks for the decode graph);
`continuous` (all kinds, always on); each followed by its `after_`, and the SM clock (NVML)
taken at every segment's end. `vs_neighbours_pct` compares each attached segment with the
unattached ones on either side. The earlier runs' per-kind ablation on the
eager loop is in bench/results/agent-cost-h200.json (kernels only -3.5..-12.9%, + runtime
-8..-18%, all kinds -10..-25%; the after-detach rates dropped once API records had been on).
Decode also gets `truth`: kdash's per-kernel mean durations (the continuous segment) against
torch.profiler's, run inside the target (SIGUSR1) after kdash has detached.

No cuptiFinalize here: the first run of this script (bench/results/agent-cost-h200-finalize.json)
showed that cuptiFinalize at a window's end kills a target that replays CUDA graphs ("unspecified
launch failure" at its next synchronize), on both graph targets.

Run from the repository root on the GPU machine: `python bench/gpu_agent_cost.py`
(writes $OUT/agent-cost-h200.json, else bench/results/).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_agent_check as gac  # noqa: E402  (helpers: Target, attach, probe_stats, ...)

RESULT = gac.OUT / "agent-cost-h200.json"

TARGET = r"""
import json, os, signal, sys, time
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
graph = None
if mode in ("eager", "graph"):
    a = torch.randn(1024, 1024, device=dev)
    b = torch.randn(1024, 1024, device=dev)
    x = torch.randn(1 << 16, device=dev)
    y = torch.randn(1 << 16, device=dev)
    out = torch.empty_like(x)
    n = x.numel()

    def body():
        if mode == "eager":
            a @ b
            axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)
        else:
            for _ in range(50):
                axpy[(n // 1024,)](x, y, out, n, 0.5, BLOCK=1024)
else:
    from kdash.kernels.decode_attention import decode_attention
    from kdash.kernels.kv_cache import write_kv
    from kdash.kernels.workload import Engine, ModelConfig

    B, CTX, PAGE = 32, 2048, 16
    cfg = ModelConfig(layers=8)
    eng = Engine(cfg, num_pages=B * CTX // PAGE + 8, page_size=PAGE, max_running=B,
                 max_context=CTX, device=dev)
    pt = torch.arange(B * CTX // PAGE, device=dev, dtype=torch.int32).view(B, CTX // PAGE)
    pos = torch.full((B,), CTX - 1, device=dev, dtype=torch.int32)
    lens = torch.full((B,), CTX, device=dev, dtype=torch.int32)
    req = torch.arange(B, device=dev)
    tokens = torch.randint(0, cfg.vocab, (B,), device=dev)

    def body():
        h = eng.embed[tokens]
        for i, lw in enumerate(eng.layers):
            q, k, v = eng._qkv(h, lw)
            write_kv(eng.k_cache[i], eng.v_cache[i], pt, req, pos, k, v, None, None)
            o = decode_attention(q.contiguous(), eng.k_cache[i], eng.v_cache[i], pt, lens,
                                 max_seq_len=CTX, total_tokens=B * CTX)
            h = h + o.view(B, -1) @ lw["wo"]
            h = eng._mlp(h, lw)
        return (eng._rms(h, 1.0) @ eng.embed.T).argmax(-1)

if mode in ("graph", "decode"):
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            body()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()

def run_once():
    if graph is not None:
        graph.replay()
    else:
        body()
    torch.cuda.synchronize()

for _ in range(20):
    run_once()

want_profile = [False]
signal.signal(signal.SIGUSR1, lambda *a: want_profile.__setitem__(0, True))

def profile_window(sec):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t_end = time.monotonic() + sec
        while time.monotonic() < t_end:
            run_once()
    stats = {}
    cuda = torch.autograd.DeviceType.CUDA
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != cuda:
            continue
        c = stats.setdefault(e.name(), [0, 0])
        c[0] += 1
        c[1] += e.duration_ns()
    print("profmeans " + json.dumps({k: [c, t / c / 1000.0] for k, (c, t) in stats.items()}),
          flush=True)

print("ready", os.getpid(), flush=True)
iters = 0
end = time.monotonic() + seconds
next_tick = time.monotonic()
while True:
    run_once()
    iters += 1
    now = time.monotonic()
    if want_profile[0]:
        want_profile[0] = False
        profile_window(3.0)
        now = time.monotonic()
    if now >= next_tick:
        print("tick", time.monotonic_ns(), iters, flush=True)
        next_tick = now + 0.1
    if now >= end:
        break
print("done", iters, flush=True)
"""


def measure(tgt: gac.Target, seconds: float = 3.0, settle: float = 1.0) -> tuple[int, int]:
    time.sleep(settle)
    t0 = gac.now_ns()
    time.sleep(seconds)
    return t0, gac.now_ns()


def sm_clock_mhz() -> int | None:
    """GPU 0's SM clock now (NVML), so a rate drift can be told from kdash's cost."""
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        return int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
    except Exception:  # noqa: BLE001 - a figure beside the rates, not the point of the run
        return None


def wait_idle(pid: int, timeout: float = 15.0) -> dict:
    """Until the agent's previous session has ended (it serves one client at a time)."""
    end = time.monotonic() + timeout
    probe: dict = {}
    while time.monotonic() < end:
        probe = gac.probe_stats(pid)
        if probe.get("state") == "idle":
            return probe
        time.sleep(0.2)
    return probe


def kernel_means(rows: list[dict]) -> dict[str, list[float]]:
    """name -> [count, mean us] over kernel batches."""
    import numpy as np

    if not rows:
        return {}
    names = np.concatenate([b["name"] for b in rows])
    dur = np.concatenate([b["end_ns"] - b["start_ns"] for b in rows]).astype(np.float64)
    out = {}
    for n in set(names.tolist()):
        m = names == n
        out[n] = [int(m.sum()), float(dur[m].mean() / 1000.0)]
    return out


def segment(pid: int, rows_out: dict, seconds: float = 3.0, **kw: object) -> tuple:
    src = gac.attach(pid, **kw)
    health = str(src.health)
    kernels: list[dict] = []
    time.sleep(0.3)
    t0 = gac.now_ns()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for t, b in src.poll(gac.now_ns()).items():  # type: ignore[attr-defined]
            rows_out[t] = rows_out.get(t, 0) + len(b["start_ns"])
            if t == "kernels":
                kernels.append(b)
        time.sleep(0.1)
    t1 = gac.now_ns()
    src._last_stats_req = 0.0  # type: ignore[attr-defined]
    src.poll(gac.now_ns())  # type: ignore[attr-defined]
    time.sleep(0.4)
    for t, b in src.poll(gac.now_ns()).items():  # type: ignore[attr-defined]
        rows_out[t] = rows_out.get(t, 0) + len(b["start_ns"])
        if t == "kernels":
            kernels.append(b)
    stats = {k: v for k, v in src.stats.items() if k.startswith("agent_")}  # type: ignore
    src.stop()  # type: ignore[attr-defined]
    return health, (t0, t1), stats, kernels


def vs_neighbours(rates: dict) -> dict:
    """Each attached segment's rate against the mean of the unattached segments on either side
    of it (`before`/`after_X`): a target that slows down over its run (clocks settling under a
    power cap) then does not count against kdash, as it does in `vs_before_pct`."""
    names = list(rates)
    out = {}
    for i, k in enumerate(names):
        if k == "before" or k.startswith("after_") or i + 1 >= len(names):
            continue
        a, b = rates.get(names[i - 1]), rates.get(names[i + 1])
        if a and b and rates[k] is not None:
            out[k] = round(100.0 * (rates[k] / ((a + b) / 2) - 1), 2)
    return out


def run_target(mode: str, env: dict, script: Path) -> dict:
    res: dict = {"mode": mode}
    tgt = gac.Target(mode, 120.0, env, script)
    deadline = time.monotonic() + 240
    while not tgt.ready.wait(0.2):
        if tgt.proc.poll() is not None or time.monotonic() > deadline:
            time.sleep(0.3)
            res["error"] = "target never became ready: " + tgt.stderr_tail()
            tgt.proc.kill()
            return res
    pid = tgt.proc.pid
    windows: dict[str, tuple[int, int]] = {}
    windows["before"] = measure(tgt, settle=2.0)
    # lean: no API kinds (so no per-API narrowing calls), 50 ms of every second; the
    # earlier runs' default (all kinds, narrowed, 100 ms/s) after it, then continuous
    lean = ["kernels", "memcpy", "memset", "synchronization", "markers"]
    plan = [
        ("lean_duty5", {"activities": lean, "on_ms": 50}),
        ("duty", {}),
        # the default again, and a longer period at the same 10%: per-window costs (enable,
        # flush, disable) weigh a fifth as much at 500 ms every 5 s
        ("duty_again", {}),
        # (segments of whole periods: 3 s of a 5 s period would hold one window or none)
        ("duty_long", {"period_ms": 5000, "on_ms": 500, "seconds": 10.0}),
        # what the cost budget picks for the decode graph (kdash.analyses.cost.duty_for_budget):
        # the 100 ms window every 2.1 s
        ("budget", {"period_ms": 2100, "on_ms": 100, "seconds": 6.3}),
        ("continuous", {"continuous": True}),
    ]
    clocks: dict[str, int | None] = {"before": sm_clock_mhz()}
    truth_kernels: list[dict] = []
    for name, kw in plan:
        rows: dict = {}
        health, win, stats, kernels = segment(pid, rows, **kw)
        windows[name] = win
        res[name] = {"health": health, "rows": rows, "stats": stats}
        res[name]["probe_after"] = wait_idle(pid)
        clocks[name] = sm_clock_mhz()
        windows["after_" + name] = measure(tgt)
        clocks["after_" + name] = sm_clock_mhz()
        if name == "continuous":
            truth_kernels = kernels
    if mode == "decode":
        # kdash's kernel means (the continuous segment above) vs torch.profiler's, now that
        # kdash has detached (the profiler is then CUPTI's one client)
        os.kill(pid, signal.SIGUSR1)
        end = time.monotonic() + 30
        line = None
        while time.monotonic() < end and line is None:
            line = tgt.line("profmeans ")
            time.sleep(0.2)
        prof = json.loads(line.split(" ", 1)[1]) if line else {}
        ours = kernel_means(truth_kernels)
        cmp = []
        for n, (c, m) in sorted(ours.items(), key=lambda kv: -kv[1][0] * kv[1][1]):
            p = prof.get(n)
            if p is None or c < 50 or p[0] < 50:
                continue
            cmp.append(
                {
                    "name": n[:120],
                    "kdash_n": c,
                    "kdash_mean_us": round(m, 3),
                    "profiler_n": p[0],
                    "profiler_mean_us": round(p[1], 3),
                    "diff_pct": round(100.0 * (m - p[1]) / p[1], 2),
                }
            )
        res["truth"] = {
            "kernels_compared": len(cmp),
            "max_abs_diff_pct": max((abs(c["diff_pct"]) for c in cmp), default=None),
            "top": cmp[:15],
            "profiler_names": len(prof),
        }
    before = tgt.rate(*windows["before"])
    rates = {k: tgt.rate(*w) for k, w in windows.items()}
    res["rate_it_s"] = rates
    res["vs_before_pct"] = {k: gac.pct(before, v) for k, v in rates.items() if k != "before"}
    res["vs_neighbours_pct"] = vs_neighbours(rates)
    res["sm_clock_mhz_at_segment_end"] = clocks
    tgt.proc.send_signal(signal.SIGTERM)
    res["exit_code"] = tgt.finish(30)
    res["stdout_tail"] = [ln[:200] for ln in tgt.lines[-2:]]
    if res["exit_code"] not in (0, -signal.SIGTERM):
        res["stderr_tail"] = tgt.stderr_tail()
    return res


def main() -> int:
    modes = sys.argv[1].split(",") if len(sys.argv) > 1 else ["eager", "graph", "decode"]
    gac.OUT.mkdir(parents=True, exist_ok=True)
    report: dict = {
        "command": " ".join(["python bench/gpu_agent_cost.py", *sys.argv[1:]]),
        "machine": {},
        "targets": {},
    }

    def save() -> None:
        tmp = RESULT.with_suffix(".tmp")
        tmp.write_text(json.dumps(report, indent=2, default=str) + "\n")
        tmp.replace(RESULT)

    try:
        shim = gac._kdash_importable()
        from kdash.collectors.agent import bootstrap

        cupti_dir, note = gac._cupti_path()
        report["cupti_python"] = note
        import platform

        import torch

        report["machine"] = {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0),
        }
        base = dict(os.environ)
        extra = [p for p in (str(shim) if shim else None, cupti_dir) if p]
        if extra:
            base["PYTHONPATH"] = os.pathsep.join(
                extra + [p for p in base.get("PYTHONPATH", "").split(os.pathsep) if p]
            )
        script = Path(tempfile.mkdtemp(prefix="kdash-cost-")) / "target.py"
        script.write_text(TARGET)
        for m in modes:
            t0 = time.monotonic()
            try:
                report["targets"][m] = run_target(m, bootstrap.run_env(base), script)
            except Exception as e:  # noqa: BLE001 - keep the other targets' evidence
                report["targets"][m] = {
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-2000:],
                }
            report["targets"][m]["seconds"] = round(time.monotonic() - t0, 1)
            save()
            print(m, json.dumps(report["targets"][m].get("vs_before_pct")), flush=True)
    except Exception as e:  # noqa: BLE001
        report["error"] = f"{type(e).__name__}: {e}"
        report["traceback"] = traceback.format_exc()[-3000:]
    save()
    print("wrote", RESULT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
