"""What watching costs a target, against a never-attached twin (the project's cost method).

Two processes of the same loop (bench/ab_target.py) run one after the other: a control that
nothing touches, and a treated one that kdash attaches to and detaches from mid-run. Rates are
counted in 2-s bins from each process's `ready`; the treated/control ratio per bin is
normalised by its median over the bins before the first attach; bins are then grouped by phase
(`before`, `attached`: wholly inside an attach, `after`: wholly after a detach and outside any
attach; bins that straddle an edge are left out). The SM clock (NVML) is kept per bin so a
clock drift can be told from kdash's cost.

`python bench/gpu_ab_cost.py [--targets eager,graph_tiny,decode_graph] [--pc]` runs the A/B:
per target a control and a treated run of 40 s with `kdash attach --pid PID --headless
--duration 6` at 8 s and at 22 s (injection at the first, the agent found at the second);
`--pc` adds a treated run with `--pc-sampling`. Output: $OUT/agent-ab-h200.json (else
bench/results/) with a `summary` per target: `attached_vs_twin_pct`, `after_detach_vs_twin_pct`
(median of the phase's bins), `estimate_pct` (what kdash said), `max_stall_ms` (the longest
iteration of the treated loop during the attaches, less the control's longest).

`python bench/gpu_ab_cost.py --screen graph_tiny` runs the factor screen instead: one treated
run per factor of bench/ab_target.py (and `agent`, `agent_idle`: the real attach, and the
injection alone), 20 s each, the factor on from 6 s for 4 s, a control before every four.
Output: $OUT/agent-factors-h200.json.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = Path(os.environ.get("OUT") or HERE / "results")
BIN_S = 2.0
SCREEN_FACTORS = [
    "thread",
    "register",
    "kernel",
    "kernel_cont",
    "runtime",
    "driver",
    "narrow",
    "narrow_restore",
    "sync",
    "copies_markers",
    "perapi",
    "agent_idle",
    "agent",
]
# what a graph-replaying target goes through, one part at a time (`--screen graph_probe`)
# (NAME#2: the same factor again, in its own process; a control before every four)
PROBE_FACTORS = ["import_only", "probe_fin", "import_only#2", "probe_fin#2", "agent", "probe_fin#3"]


def host_sample(pid: int) -> tuple[int, float | None, int, int] | None:
    """Where the target's main thread is on the host now: (CPU it last ran on, that CPU's MHz
    from /proc/cpuinfo, its involuntary context switches so far, runnable tasks on the
    machine); None once it has gone. The eager loop's twins differ by ±5-10% for 10-20 s at a
    time with the SM clock flat at 1980 MHz in every run, so its noise is the host's."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, `processor`
        with open(f"/proc/{pid}/status") as f:
            nvcsw = next(int(line.split()[1]) for line in f if line.startswith("nonvoluntary_ctxt"))
    except (OSError, IndexError, ValueError, StopIteration):
        return None
    mhz = None
    running = 0
    try:
        with open("/proc/cpuinfo") as f:
            proc = -1
            for line in f:
                if line.startswith("processor"):
                    proc = int(line.split(":")[1])
                elif proc == cpu and line.startswith("cpu MHz"):
                    mhz = float(line.split(":")[1])
                    break
        with open("/proc/stat") as f:
            running = next((int(x.split()[1]) for x in f if x.startswith("procs_running")), 0)
    except (OSError, ValueError):
        pass
    return cpu, mhz, nvcsw, running


class Clocks:
    """GPU 0's SM clock every 0.5 s on a thread (NVML), and the target's place on the host
    (`host_sample`) when its pid is given, to join rates by bin."""

    def __init__(self, pid: int | None = None) -> None:
        self.samples: list[tuple[int, int]] = []
        self.host: list[tuple[int, int, float | None, int, int]] = []
        self.pid = pid
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        h = None
        try:
            import pynvml

            pynvml.nvmlInit()
            h = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception as e:  # noqa: BLE001 - the clocks are a figure beside the rates
            print("no NVML:", e, flush=True)
        while not self._stop.wait(0.5):
            t = time.monotonic_ns()
            if h is not None:
                mhz = int(pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM))
                self.samples.append((t, mhz))
            hs = host_sample(self.pid) if self.pid is not None else None
            if hs is not None:
                self.host.append((t, *hs))

    def __enter__(self) -> Clocks:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(2)


def kdash_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kdash.cli", *args]


def run_target(
    mode: str,
    seconds: float,
    factor: str = "none",
    on_s: float = 0.0,
    hold_s: float = 0.0,
    attaches: list[tuple[float, float]] | None = None,
    attach_extra: list[str] | None = None,
    treat: str = "attach",
    pin: int | None = None,
    target_env: dict[str, str] | None = None,
) -> dict:
    """One process of the loop, treated (treat_once: `attach` by default, with `attach_extra`)
    at each (t, duration) of `attaches`. `pin` puts the target on one CPU; `target_env` is
    added to its environment (what the agent reads there)."""
    inproc = factor not in ("none", "agent", "agent_idle")
    argv = [sys.executable, "-u", str(HERE / "ab_target.py"), mode, str(seconds)]
    if pin is not None:
        argv = ["taskset", "-c", str(pin), *argv]
    if inproc:
        argv += [factor, str(on_s), str(hold_s)]
    env = dict(os.environ)
    env.pop("KDASH_AGENT", None)
    env.update(target_env or {})
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=HERE
    )
    ticks: list[tuple[int, int, int]] = []
    lines: list[str] = []
    ready = threading.Event()
    t_ready = [0]

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            parts = line.split()
            if parts[:1] == ["tick"] and len(parts) == 4:
                ticks.append((int(parts[1]), int(parts[2]), int(parts[3])))
            elif parts[:1] == ["ready"]:
                t_ready[0] = int(parts[2])
                ready.set()
            else:
                lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    err: list[str] = []
    threading.Thread(
        target=lambda: err.extend(proc.stderr or []),
        daemon=True,  # type: ignore[arg-type]
    ).start()
    events: list[dict] = []
    with Clocks(proc.pid) as clocks:
        if not ready.wait(240):
            proc.kill()
            raise RuntimeError(f"{mode} never ready: {''.join(err)[-2000:]}")
        t0 = t_ready[0]
        todo = list(attaches or [])
        if factor in ("agent", "agent_idle"):
            todo = [(on_s, hold_s)]
        for at, dur in todo:
            delay = t0 / 1e9 + at - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            kind = "agent_idle" if factor == "agent_idle" else treat
            ev = treat_once(proc.pid, kind, dur, attach_extra or [])
            ev["treat"], ev["at_s"] = kind, at
            ev["start_s"] = (ev.pop("start_ns") - t0) / 1e9
            ev["end_s"] = (ev.pop("end_ns") - t0) / 1e9
            events.append(ev)
        rc = proc.wait(seconds + 120)
    reader.join(5)
    return {
        "mode": mode,
        "factor": factor,
        "rc": rc,
        "t0": t0,
        "ticks": ticks,
        "events": events,
        "lines": lines[-20:],
        "stderr": "".join(err)[-1500:],
        "clocks": [((t - t0) / 1e9, mhz) for t, mhz in clocks.samples],
        "host": [((t - t0) / 1e9, *rest) for t, *rest in clocks.host],
        "on_s": on_s,
        "hold_s": hold_s,
    }


SLOT_S = 1.0


def treat_once(
    pid: int, treat: str, dur: float, extra: list[str], avoid_cpu: int | None = None
) -> dict:
    """One treatment of pid for dur seconds, timed, with kdash's (or the stand-in's) CPU:
    `null` (a `sleep`: the method's own noise), `burn` (a CPU-bound process beside the target),
    `poll:SOURCE` (one of kdash's host sources alone, bench/ab_poller.py), `agent_idle` (the
    injection alone), `attach` (`kdash attach --headless` with `extra`)."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    a = time.monotonic_ns()
    cap = Path(f"/tmp/ab-{pid}-{a}.kdash")  # `attach` writes its capture here; not kept
    if treat == "null":
        argv = ["sleep", str(dur)]
    elif treat == "burn":
        argv = [
            sys.executable,
            "-c",
            f"import time\ne=time.time()+{dur}\nwhile time.time()<e: pass",
        ]
    elif treat.startswith("poll:"):
        argv = [sys.executable, str(HERE / "ab_poller.py"), treat[5:], str(pid), str(dur)]
    elif treat == "agent_idle":
        code = f"from kdash.collectors.agent import inject; print(inject.inject({pid}))"
        argv = [sys.executable, "-c", code]
    else:
        argv = kdash_cmd(
            "attach",
            "--pid",
            str(pid),
            "--headless",
            "--duration",
            str(dur),
            "--output",
            str(cap),
            *extra,
        )
    if avoid_cpu is not None:
        others = sorted(os.sched_getaffinity(0) - {avoid_cpu})
        if others:
            argv = ["taskset", "-c", ",".join(map(str, others)), *argv]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=dur + 90)
    cost = capture_cost(cap)
    cap.unlink(missing_ok=True)
    b = time.monotonic_ns()
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {
        "start_ns": a,
        "end_ns": b,
        "rc": r.returncode,
        "cpu_s": round(cpu, 3),
        "out": (r.stdout + r.stderr)[-1500:],
        "agent_cost": cost,
    }


def capture_cost(cap: Path) -> dict | None:
    """The estimate and the agents' counters behind it that an attach's capture kept
    (`agent_cost` in its metadata: switch_us_per_window and the rest), if it wrote one."""
    if not cap.exists():
        return None
    try:
        from kdash.capture import read_meta

        return read_meta(cap).get("agent_cost")
    except Exception as e:  # noqa: BLE001 - a figure lost, said so
        return {"error": f"{type(e).__name__}: {e}"}


def edge_us(events: list[dict], key: str = "switch_us_per_window") -> list[float]:
    """`key` (switch_us_per_window, narrow_us_per_window) of every agent in every attach of a
    run."""
    out = []
    for e in events:
        for a in ((e.get("agent_cost") or {}).get("agents") or {}).values():
            if a.get(key) is not None:
                out.append(a[key])
    return out


def run_pair(
    mode: str,
    seconds: float,
    attaches: list[tuple[float, float]],
    treat: str,
    extra: list[str],
    pin: int | None = None,
    target_env: dict[str, str] | None = None,
) -> dict:
    """Interleaved twins: a control and a treated process of the loop, alive together, take
    turns in alternate slots of SLOT_S (control first); kdash treats the treated one at each
    (t, duration) of `attaches`, t counted from the first slot. Each treated slot is compared
    with the mean of the control slots either side of it, so a drift of the machine falls on
    both; ratios are normalised by their median before the first treatment.

    `pin`: both processes on that one CPU, and kdash (the treatment) on every other. On the
    H200 machine the vCPUs' speeds drift apart by 15-50% for tens of seconds (session 10:
    a null read -15% over a whole run, a process that moved CPU ran 50-150% faster), so twins
    on different CPUs compare the CPUs, not kdash. The treated process's agent threads share
    that CPU with the control's turns too, which makes a cost read low by their CPU share."""
    env = dict(os.environ, AB_SLOTS="1")
    head = ["taskset", "-c", str(pin)] if pin is not None else []
    env.pop("KDASH_AGENT", None)
    procs = []
    for i in range(2):  # the control, then the treated one (`target_env` in its environment)
        procs.append(
            subprocess.Popen(
                [*head, sys.executable, "-u", str(HERE / "ab_target.py"), mode, str(seconds)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env={**env, **(target_env or {})} if i else env,
                cwd=HERE,
            )
        )
    for p in procs:
        assert p.stdout is not None
        while True:
            line = p.stdout.readline()
            if not line:
                raise RuntimeError(f"{mode} ended before ready: {p.stderr.read()[-2000:]}")
            if line.startswith("ready"):
                break
    n = int(seconds / SLOT_S)
    slot_ns = int(SLOT_S * 1e9)
    t0 = time.monotonic_ns() + 500_000_000
    for parity, p in enumerate(procs):
        assert p.stdin is not None
        p.stdin.write(f"go {t0} {slot_ns} {parity} {n}\n")
        p.stdin.flush()
    rows: dict[int, list[tuple[int, int, int, int]]] = {0: [], 1: []}

    def read(i: int) -> None:
        out = procs[i].stdout
        assert out is not None
        for line in out:
            parts = line.split()
            if parts[:1] == ["slot"]:
                rows[i].append(tuple(int(x) for x in parts[1:5]))  # type: ignore[arg-type]

    readers = [threading.Thread(target=read, args=(i,), daemon=True) for i in (0, 1)]
    for t in readers:
        t.start()
    events = []
    for at, dur in attaches:
        delay = (t0 + at * 1e9 - time.monotonic_ns()) / 1e9
        if delay > 0:
            time.sleep(delay)
        ev = treat_once(procs[1].pid, treat, dur, extra, avoid_cpu=pin)
        ev["start_s"] = (ev.pop("start_ns") - t0) / 1e9
        ev["end_s"] = (ev.pop("end_ns") - t0) / 1e9
        events.append(ev)
    for p in procs:
        p.wait(seconds + 120)
    for t in readers:
        t.join(5)
    rate = {i: {k: it / (ns / 1e9) for k, it, ns, _w in rows[i] if ns > 0} for i in (0, 1)}
    ivals = [(e["start_s"], e["end_s"]) for e in events]
    slot_phase = phases(ivals, n, SLOT_S)
    out_slots = []
    for k, r in sorted(rate[1].items()):
        ctl = [rate[0][j] for j in (k - 1, k + 1) if j in rate[0]]
        if ctl and k < n - 1:  # the last slot is cut short by the run's end (read -50%)
            out_slots.append((k, r / statistics.mean(ctl), slot_phase[k]))
    base = [x for _k, x, ph in out_slots if ph == "before"]
    norm = statistics.median(base) if base else 1.0
    rel = [(k, round(100 * (x / norm - 1), 2), ph) for k, x, ph in out_slots]

    def med(ph: str) -> float | None:
        v = [x for _k, x, q in rel if q == ph]
        return round(statistics.median(v), 2) if v else None

    before = [x for _k, x, q in rel if q == "before"]
    return {
        "slots_pct": rel,
        "before_spread_pct": [min(before), max(before)] if before else None,
        "before_pct": med("before"),
        "attached_pct": med("attached"),
        "after_pct": med("after"),
        "events": events,
        "iters": [sum(r[1] for r in rows[i]) for i in (0, 1)],
        "rc": [p.returncode for p in procs],
        "max_worst_ms_treated": round(max((r[3] for r in rows[1]), default=0) / 1e6, 1),
        "max_worst_ms_control": round(max((r[3] for r in rows[0]), default=0) / 1e6, 1),
    }


def interleaved(
    targets: list[str],
    variants: list[str],
    name: str,
    repeat: int,
    pin: int | None = None,
    attach_s: float = 6.0,
) -> int:
    # two attaches of attach_s, at 8 s and 10 s after the first detach (6 s: at 8 and 24 s of
    # a 44-s run, as before the option)
    attaches = [(8.0, attach_s), (18.0 + attach_s, attach_s)]
    seconds = 32.0 + 2 * attach_s
    res: dict = {
        "command": "python bench/gpu_ab_cost.py " + " ".join(sys.argv[1:]),
        "method": "interleaved twins: control and treated alive together, alternate 1-s "
        "turns (control first); each treated slot over the mean of the control slots either "
        "side, normalised by the median before the first treatment; kdash attached at "
        f"{attaches[0][0]:g} s and {attaches[1][0]:g} s for {attach_s:g} s",
        "machine": machine(),
        "runs": {},
        "per_run": {},
        "summary": {},
    }
    res["pin"] = pin
    path = OUT / name
    for mode in targets:
        for rep in range(repeat):
            for vname in variants:
                treat, vargs = VARIANTS[vname.split("#")[0]]
                key = f"{mode}/{vname}/{rep}"
                try:
                    env = TARGET_ENV.get(vname.split("#")[0])
                    run = run_pair(mode, seconds, attaches, treat, vargs, pin, env)
                except Exception:  # noqa: BLE001 - keep the other runs' figures
                    res["runs"][key] = {"error": traceback.format_exc()[-2000:]}
                    print(key, "failed", traceback.format_exc()[-800:], flush=True)
                    continue
                res["runs"][key] = run
                brief = {k: run[k] for k in ("attached_pct", "after_pct", "before_spread_pct")}
                brief["estimate_pct"] = estimate_from(run["events"])
                brief["cpu_s"] = [e["cpu_s"] for e in run["events"]]
                brief["switch_us_per_window"] = edge_us(run["events"])
                brief["narrow_us_per_window"] = edge_us(run["events"], "narrow_us_per_window")
                brief["attached_slots"] = [x for _k, x, q in run["slots_pct"] if q == "attached"]
                it_c, it_t = run["iters"]
                brief["whole_run_vs_twin_pct"] = (
                    round(100 * (it_t / it_c - 1), 2) if it_c and it_t else None
                )
                res["per_run"][key] = brief
                print(key, brief, flush=True)
                path.write_text(json.dumps(res, indent=1))
        res["summary"].update(target_summary(mode, res["runs"], res["per_run"]))
        path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return 0


def target_summary(mode: str, runs: dict, per_run: dict) -> dict:
    """The issue's summary keys per target and variant, over the repeats of each: the median
    of their phase medians (`attached_vs_twin_pct`, `after_detach_vs_twin_pct`), the largest
    estimate kdash printed, and the longest iteration of the treated loop less the control's
    (`max_stall_ms`); each variant but `default` under `MODE_VARIANT`."""
    out: dict = {}
    groups: dict[str, list[str]] = {}
    for key in per_run:
        m, vname, _rep = key.split("/")
        if m == mode:
            groups.setdefault(vname.split("#")[0], []).append(key)
    for vname, keys in groups.items():

        def med(field: str, keys: list[str] = keys) -> float | None:
            vals = [per_run[k][field] for k in keys if per_run[k].get(field) is not None]
            return round(statistics.median(vals), 2) if vals else None

        ests = [per_run[k]["estimate_pct"] for k in keys if per_run[k]["estimate_pct"] is not None]
        stalls = [
            runs[k]["max_worst_ms_treated"] - runs[k]["max_worst_ms_control"]
            for k in keys
            if "max_worst_ms_treated" in runs[k]
        ]
        out[mode if vname == "default" else f"{mode}_{vname}"] = {
            "attached_vs_twin_pct": med("attached_pct"),
            "after_detach_vs_twin_pct": med("after_pct"),
            "estimate_pct": max(ests) if ests else None,
            "max_stall_ms": round(max(stalls), 1) if stalls else None,
            "repeats": len(keys),
            "attached_each_pct": [per_run[k]["attached_pct"] for k in keys],
            "after_each_pct": [per_run[k]["after_pct"] for k in keys],
            "before_spread_each_pct": [per_run[k]["before_spread_pct"] for k in keys],
            "after_each_detach_pct": [after_each_detach(runs[k]) for k in keys],
        }
    return out


def after_each_detach(run: dict) -> list[float | None]:
    """The median `after` slot before the second attach and after the second detach (an
    attach twice in a row on one process, the rate after each); [] for one attach."""
    events = run.get("events") or []
    if len(events) < 2:
        return []
    parts: tuple[list[float], list[float]] = ([], [])
    for k, pct, phase in run.get("slots_pct") or []:
        if phase == "after":
            parts[k * SLOT_S >= events[1]["end_s"]].append(pct)
    return [round(statistics.median(v), 2) if v else None for v in parts]


def bin_rates(run: dict, seconds: float) -> list[float | None]:
    """Iterations per second in each BIN_S bin after `ready` (interpolated between ticks)."""
    t0, ticks = run["t0"], run["ticks"]
    if len(ticks) < 2:
        return []
    xs = [0.0] + [(t - t0) / 1e9 for t, _, _ in ticks]  # no iteration had ended at `ready`
    ys = [0] + [n for _, n, _ in ticks]

    def at(x: float) -> float | None:
        if x < xs[0] or x > xs[-1]:
            return None
        lo, hi = 0, len(xs) - 1
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if xs[mid] <= x:
                lo = mid
            else:
                hi = mid
        if xs[hi] == xs[lo]:
            return float(ys[lo])
        return ys[lo] + (ys[hi] - ys[lo]) * (x - xs[lo]) / (xs[hi] - xs[lo])

    out: list[float | None] = []
    for k in range(int(seconds // BIN_S)):
        a, b = at(k * BIN_S), at((k + 1) * BIN_S)
        out.append(None if a is None or b is None else (b - a) / BIN_S)
    return out


def bin_clocks(run: dict, nbins: int) -> list[float | None]:
    out: list[float | None] = []
    for k in range(nbins):
        vals = [m for t, m in run["clocks"] if k * BIN_S <= t < (k + 1) * BIN_S]
        out.append(round(statistics.mean(vals)) if vals else None)
    return out


def bin_host(run: dict, nbins: int) -> list[dict | None]:
    """Per bin: the CPUs the target's main thread was seen on, their mean MHz, its involuntary
    context switches per second and the machine's mean runnable tasks."""
    out: list[dict | None] = []
    rows = run.get("host") or []
    for k in range(nbins):
        b = [r for r in rows if k * BIN_S <= r[0] < (k + 1) * BIN_S]
        if not b:
            out.append(None)
            continue
        mhz = [r[2] for r in b if r[2] is not None]
        prev = [r for r in rows if r[0] < k * BIN_S]
        start = prev[-1] if prev else b[0]
        span = b[-1][0] - start[0]
        out.append(
            {
                "cpus": sorted({r[1] for r in b}),
                "mhz": round(statistics.mean(mhz)) if mhz else None,
                "nvcsw_per_s": round((b[-1][3] - start[3]) / span, 1) if span > 0 else None,
                "running": round(statistics.mean(r[4] for r in b), 1),
            }
        )
    return out


def intervals(run: dict) -> list[tuple[float, float]]:
    """The treated process's attach intervals, seconds after ready."""
    if run["events"]:
        return [(e["start_s"], e["end_s"]) for e in run["events"]]
    if run["factor"] != "none":
        return [(run["on_s"], run["on_s"] + run["hold_s"])]
    return []


def phases(ivals: list[tuple[float, float]], nbins: int, width: float = BIN_S) -> list[str]:
    """The phase of each bin of `width` s from 0: before the first treatment, wholly inside
    one (`attached`), straddling an edge, or after."""
    out = []
    for k in range(nbins):
        a, b = k * width, (k + 1) * width
        if not ivals or b <= ivals[0][0]:
            out.append("before")
        elif any(s <= a and b <= e for s, e in ivals):
            out.append("attached")
        elif any(a < e and s < b for s, e in ivals):
            out.append("edge")
        else:
            out.append("after")
    return out


def compare(treated: dict, control: dict, seconds: float) -> dict:
    rt, rc = bin_rates(treated, seconds), bin_rates(control, seconds)
    n = min(len(rt), len(rc))
    ratio = [rt[k] / rc[k] if rt[k] and rc[k] else None for k in range(n)]
    ph = phases(intervals(treated), n)
    base = [r for r, p in zip(ratio, ph, strict=True) if p == "before" and r]
    norm = statistics.median(base) if base else 1.0
    rel = [None if r is None else round(100 * (r / norm - 1), 2) for r in ratio]

    def med(p: str) -> float | None:
        vals = [v for v, q in zip(rel, ph, strict=True) if q == p and v is not None]
        return round(statistics.median(vals), 2) if vals else None

    stall = None
    ivals = intervals(treated)
    if ivals:

        def worst(run: dict, lo: float, hi: float) -> int:
            return max(
                (w for t, _, w in run["ticks"] if lo <= (t - run["t0"]) / 1e9 <= hi), default=0
            )

        st = max(worst(treated, s, e + 0.2) for s, e in ivals)
        ct = max(worst(control, s, e + 0.2) for s, e in ivals)
        stall = round((st - ct) / 1e6, 1)
    return {
        "bins_pct": rel,
        "phases": ph,
        "before_spread_pct": [
            min(v for v, q in zip(rel, ph, strict=True) if q == "before" and v is not None),
            max(v for v, q in zip(rel, ph, strict=True) if q == "before" and v is not None),
        ]
        if base
        else None,
        "before_pct": med("before"),
        "attached_pct": med("attached"),
        "after_pct": med("after"),
        "max_stall_ms": stall,
        "sm_clock_treated": bin_clocks(treated, n),
        "sm_clock_control": bin_clocks(control, n),
        "host_treated": bin_host(treated, n),
        "host_control": bin_host(control, n),
    }


def estimate_from(events: list[dict]) -> float | None:
    """The `kdash cost ≈ N%` that each attach printed (the largest of them), if any."""
    import re

    vals = []
    for e in events:
        for m in re.finditer(r"kdash cost ≈ (<?)(\d+(?:\.\d+)?)%", e.get("out", "")):
            vals.append(0.5 if m.group(1) else float(m.group(2)))
    return max(vals) if vals else None


def whole_run_pct(treated: dict, control: dict) -> float | None:
    """Iterations the treated process made over its whole run against the control's, in %."""
    t = treated["ticks"][-1][1] if treated.get("ticks") else 0
    c = control["ticks"][-1][1] if control.get("ticks") else 0
    return round(100 * (t / c - 1), 2) if t and c else None


def slim(run: dict) -> dict:
    keep = {k: v for k, v in run.items() if k not in ("ticks", "clocks", "host")}
    keep["iters"] = run["ticks"][-1][1] if run["ticks"] else 0
    return keep


FINALIZE_FACTORS = {
    "graph_tiny": ["fin_exit", "fin_windows", "fin_windows_all", "fin_direct"],
    "decode_graph": ["fin_exit", "fin_windows", "fin_windows_all", "fin_direct"],
    "eager": ["register", "fin_exit"],
}


FINALIZE2_FACTORS = {
    "graph_tiny": ["import_only", "register_fin", "kernel_sync_fin", "graph_trace"],
}


def screen(mode: str) -> int:
    if mode == "finalize2":
        return screen_many(FINALIZE2_FACTORS, "agent-finalize2-h200.json")
    if mode == "finalize":
        return screen_many(FINALIZE_FACTORS, "agent-finalize-h200.json")
    if mode == "graph_probe":
        return screen_many({"graph_tiny": PROBE_FACTORS}, "agent-probe-h200.json", 36.0)
    return screen_many({mode: SCREEN_FACTORS}, "agent-factors-h200.json")


def screen_many(plan: dict[str, list[str]], name: str, seconds: float = 20.0) -> int:
    on_s, hold_s = 6.0, 4.0
    os.environ["AB_PROFILER_CHECK"] = "1"
    res: dict = {
        "command": "python bench/gpu_ab_cost.py " + " ".join(sys.argv[1:]),
        "method": f"twin: control never attached; {seconds:.0f} s runs, factor on at 6 s for "
        "4 s; 2-s bins",
        "machine": machine(),
        "factors": {},
        "controls": [],
    }
    path = OUT / name
    for mode, factors in plan.items():
        control = None
        for i, f in enumerate(factors):
            key = f if len(plan) == 1 else f"{mode}/{f}"
            try:
                if i % 4 == 0:
                    control = run_target(mode, seconds)
                    res["controls"].append(slim(control))
                run = run_target(mode, seconds, f.split("#")[0], on_s, hold_s)
                cmp = compare(run, control, seconds)
                res["factors"][key] = {**cmp, "run": slim(run)}
                brief = {k: cmp[k] for k in ("before_pct", "attached_pct", "after_pct")}
                print(key, brief, run["rc"], run["lines"][-3:], flush=True)
            except Exception:  # noqa: BLE001 - keep the other factors' figures
                res["factors"][key] = {"error": traceback.format_exc()[-2000:]}
                print(key, "failed", traceback.format_exc()[-600:], flush=True)
            path.write_text(json.dumps(res, indent=1))
    res["summary"] = {
        f: {k: v.get(k) for k in ("attached_pct", "after_pct", "before_spread_pct")}
        for f, v in res["factors"].items()
    }
    path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return 0


def machine() -> dict:
    info: dict = {"python": sys.version.split()[0], "cpus": os.cpu_count()}
    sib = Path("/sys/devices/system/cpu/cpu0/topology/thread_siblings_list")
    if sib.exists():
        info["cpu0_siblings"] = sib.read_text().strip()
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0)
    except Exception as e:  # noqa: BLE001
        info["torch"] = f"unavailable: {e}"
    return info


VARIANTS: dict[str, tuple[str, list[str]]] = {
    "default": ("attach", []),
    "null": ("null", []),
    "burn": ("burn", []),
    "no_inject": ("attach", ["--no-inject"]),
    "pc_sampling": ("attach", ["--pc-sampling"]),
    "slow_poll": ("attach", ["--interval", "2"]),
    "nvml_only": ("poll:nvml", []),
    "nvml_dev_only": ("poll:nvml_dev", []),
    "sched_only": ("poll:sched", []),
    "agent_idle": ("agent_idle", []),  # the injection alone (the second attach finds it in)
    "no_release": ("attach", []),  # CUPTI kept between windows (TARGET_ENV)
    "kernels_only": ("attach", []),  # one activity kind: kernels (TARGET_ENV)
    "no_api": ("attach", []),  # every default kind but the runtime and driver API records
}
# what a variant puts in the target's environment
TARGET_ENV = {
    "no_release": {"KDASH_AGENT_RELEASE": "0"},
    "kernels_only": {"KDASH_AGENT_ACTIVITIES": "kernels"},
    "no_api": {"KDASH_AGENT_ACTIVITIES": "kernels,memcpy,memset,synchronization,markers"},
}


def ab(
    targets: list[str],
    with_pc: bool,
    extra: list[str],
    variants: list[str] | None = None,
    pin: int | None = None,
    name: str = "agent-ab-h200.json",
    attach_s: float = 6.0,
) -> int:
    # two attaches of attach_s, 8 s after ready and 8 s after the first detach; the run ends
    # 10 s after the second (40 s at the default 6-s attaches)
    attaches = [(8.0, attach_s), (16.0 + attach_s, attach_s)]
    seconds = 26.0 + 2 * attach_s
    os.environ["AB_PROFILER_CHECK"] = "1"  # does torch.profiler still see kernels afterwards?
    res: dict = {
        "command": "python bench/gpu_ab_cost.py " + " ".join(sys.argv[1:]),
        "method": f"twin: control never attached; treated attached at 8 s and "
        f"{16 + attach_s:g} s for {attach_s:g} s (`kdash attach --pid --headless --duration "
        f"{attach_s:g}`); 2-s bins; ratio normalised by the bins before the first attach",
        "machine": machine(),
        "runs": {},
        "summary": {},
    }
    path = OUT / name
    res["pin"] = pin
    names = list(variants or ["default"])
    if with_pc and "pc_sampling" not in names:
        names.append("pc_sampling")
    for mode in targets:
        try:
            control = run_target(mode, seconds, pin=pin)
            res["runs"][f"{mode}/control"] = slim(control)
            for vname in names:
                treat, vargs = VARIANTS[vname.split("#")[0]]
                run = run_target(
                    mode,
                    seconds,
                    attaches=attaches,
                    attach_extra=[*extra, *vargs],
                    treat=treat,
                    pin=pin,
                    target_env=TARGET_ENV.get(vname.split("#")[0]),
                )
                cmp = compare(run, control, seconds)
                key = mode if vname == "default" else f"{mode}_{vname}"
                res["runs"][f"{mode}/{vname}"] = {**cmp, "run": slim(run)}
                res["summary"][key] = {
                    "attached_vs_twin_pct": cmp["attached_pct"],
                    "after_detach_vs_twin_pct": cmp["after_pct"],
                    "before_spread_pct": cmp["before_spread_pct"],
                    "estimate_pct": estimate_from(run["events"]),
                    "max_stall_ms": cmp["max_stall_ms"],
                    # iterations over the whole run against the control's: one number per run,
                    # free of the per-bin noise (a null read +0.2% on decode_eager, session 10)
                    "whole_run_vs_twin_pct": whole_run_pct(run, control),
                    "attach_rc": [e["rc"] for e in run["events"]],
                    "treat_cpu_s": [e["cpu_s"] for e in run["events"]],
                    "attached_bins_pct": [
                        v
                        for v, q in zip(cmp["bins_pct"], cmp["phases"], strict=True)
                        if q == "attached"
                    ],
                }
                print(key, res["summary"][key], flush=True)
                path.write_text(json.dumps(res, indent=1))
        except Exception:  # noqa: BLE001 - keep the other targets' figures
            res["runs"][f"{mode}/error"] = traceback.format_exc()[-2000:]
            print(mode, "failed", traceback.format_exc()[-800:], flush=True)
        path.write_text(json.dumps(res, indent=1))
    print(json.dumps(res["summary"], indent=1))
    return 0


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("--screen", metavar="MODE")
    p.add_argument("--targets", default="eager,graph_tiny,decode_graph")
    p.add_argument("--pc", action="store_true")
    p.add_argument(
        "--variants",
        help="treated runs per target, each against the one control: "
        + ", ".join(VARIANTS)
        + " (NAME#2 repeats one)",
    )
    p.add_argument("--pin", type=int, help="run the targets on this one CPU")
    p.add_argument(
        "--interleaved",
        type=int,
        metavar="REPEAT",
        help="interleaved twins (run_pair), each variant REPEAT times",
    )
    p.add_argument("--name", default="agent-ab-h200.json", help="output file under $OUT")
    p.add_argument(
        "--attach-s",
        type=float,
        default=6.0,
        help="length of each of the two attaches (sequential twins: the run is 26 s longer "
        "than both together; interleaved: 32 s longer)",
    )
    p.add_argument("extra", nargs="*", help="more `kdash attach` options")
    a = p.parse_args(argv)
    OUT.mkdir(parents=True, exist_ok=True)
    if a.screen:
        return screen(a.screen)
    variants = a.variants.split(",") if a.variants else None
    if a.interleaved:
        return interleaved(
            a.targets.split(","), variants or ["default"], a.name, a.interleaved, a.pin, a.attach_s
        )
    return ab(a.targets.split(","), a.pc, a.extra, variants, a.pin, a.name, a.attach_s)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
