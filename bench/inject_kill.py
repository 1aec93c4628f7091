"""Kill kdash during a ptrace injection and see whether the target survives.

Each case starts a fresh Python target that was not started by kdash (it prints a heartbeat
and alternates CPU work with short sleeps, so injections land both in a pending call and in a
wait), starts a driver that injects the agent into it, and sends the driver SIGKILL, SIGTERM
or SIGHUP after a seeded random delay spread over the injection's measured duration. A target
is harmed when it died or its heartbeat stopped.

Drivers:

* `kdash`: what `kdash attach` does (`inject.inject`, the session in a helper process);
* `tracer`: the session in the driver itself (`inject_ptrace(helper=False)`), so the signal
  kills the tracer mid-session; `KDASH_PTRACE_PAUSE_S` stretches the gaps between its steps
  so the delays land in every one of them.

    python bench/inject_kill.py                      # 20 per signal and driver, writes JSON
    python bench/inject_kill.py --inject-from OLD.py --drivers kdash   # another inject.py
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent

TARGET = """
import sys, time
n = 0
while True:
    n += 1
    print("beat", n, flush=True)
    sum(range(20000))
    time.sleep(0.01)
"""

DRIVER = """
import importlib.util, os, sys, time
pid, how, source = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if source:
    spec = importlib.util.spec_from_file_location("kdash_inject_under_test", source)
    inject = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = inject  # its dataclasses look their module up there
    spec.loader.exec_module(inject)
else:
    from kdash.collectors.agent import inject
v = inject.check_injectable(pid, probe=False)
if not v.ok or v.method != "ptrace":
    print("skip", v.reason or v.method, flush=True)
    sys.exit(3)
print("ready", flush=True)
t0 = time.monotonic()
if how == "tracer":
    inject.inject_ptrace(pid, helper=False)
else:
    err = inject.inject(pid, checked=v)
    if err:
        print("error", err, flush=True)
print("done", time.monotonic() - t0, flush=True)
"""

SIGNALS = {"SIGKILL": signal.SIGKILL, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}


@dataclass
class Case:
    driver: str
    signal: str
    delay_s: float
    harmed: bool
    why: str
    driver_s: float | None = None  # "ready" to "done", when the driver got that far


class Lines:
    """A child's stdout lines, read by a thread as they come."""

    def __init__(self, proc: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.eof = False
        self.cv = threading.Condition()
        threading.Thread(target=self._read, args=(proc,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            with self.cv:
                self.lines.append(line.strip())
                self.cv.notify_all()
        with self.cv:
            self.eof = True
            self.cv.notify_all()

    def wait(self, pred, timeout: float) -> bool:
        with self.cv:
            self.cv.wait_for(lambda: pred(self.lines) or self.eof, timeout)
            return pred(self.lines)


def _env() -> dict[str, str]:
    from kdash.collectors.agent import bootstrap

    return bootstrap.disarmed_env()


def start_target() -> tuple[subprocess.Popen, Lines]:
    p = subprocess.Popen(
        [sys.executable, "-c", TARGET],
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    lines = Lines(p)
    if not lines.wait(lambda ls: len(ls) >= 3, 60):
        p.kill()
        raise RuntimeError("the target printed no heartbeat")
    return p, lines


def _beats(lines: list[str]) -> int:
    return sum(1 for line in lines if line.startswith("beat"))


def _tracer_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("TracerPid:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def start_driver(
    pid: int, driver: str, source: str, pause_s: float
) -> tuple[subprocess.Popen, Lines]:
    env = _env()
    if pause_s:
        env["KDASH_PTRACE_PAUSE_S"] = str(pause_s)
    d = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(pid), driver, source],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # a SIGHUP here is only the one we send
    )
    lines = Lines(d)
    if not lines.wait(lambda ls: bool(ls) and ls[0].split()[0] in ("ready", "skip"), 120):
        d.kill()
        raise RuntimeError(f"the driver did not get ready: {lines.lines[-3:]}")
    if lines.lines[0].startswith("skip"):
        d.kill()
        raise SkipCase(lines.lines[0])
    return d, lines


class SkipCase(Exception):
    """Injection is not possible on this machine; the line says why."""


def run_case(driver: str, sig: str | None, delay_s: float, source: str, pause_s: float) -> Case:
    """One target, one driver, one signal (None: no signal, to measure)."""
    target, beats = start_target()
    try:
        d, out = start_driver(target.pid, driver, source, pause_s)
        time.sleep(delay_s)
        if sig is not None:
            with contextlib.suppress(ProcessLookupError):  # it may have finished first
                d.send_signal(SIGNALS[sig])
        try:
            d.wait(120)
        except subprocess.TimeoutExpired:
            d.kill()
            d.wait()
        # a helper may still be finishing the session; wait until nothing traces the target
        end = time.monotonic() + 120
        while _tracer_of(target.pid) and time.monotonic() < end:
            time.sleep(0.01)
        before = _beats(beats.lines)
        alive = beats.wait(lambda ls: _beats(ls) >= before + 5, 60) and target.poll() is None
        if target.poll() is not None:
            why = f"target exited with {target.returncode}"
        elif not alive:
            why = "heartbeat stopped"
        else:
            why = ""
        # "done SECONDS"; a driver killed while writing it may leave the word alone
        done = [
            float(w[1]) for w in (x.split() for x in out.lines) if w[:1] == ["done"] and len(w) > 1
        ]
        took = round(done[0], 4) if done else None
        return Case(driver, sig or "none", round(delay_s, 4), bool(why), why, took)
    finally:
        if target.poll() is None:
            target.kill()
        target.wait()


def measure(driver: str, source: str, pause_s: float, n: int = 3) -> float:
    """The median time from the driver's "ready" to its "done", without a signal."""
    times = []
    for _ in range(n):
        case = run_case(driver, None, 0.0, source, pause_s)
        if case.harmed or case.driver_s is None:
            raise RuntimeError(f"an injection without any signal failed: {case.why or 'no done'}")
        times.append(case.driver_s)
    return sorted(times)[len(times) // 2]


def run(
    drivers: list[str], per_signal: int, seed: int, source: str = "", pause_s: float = 0.0
) -> dict:
    rng = random.Random(seed)
    out: dict = {"seed": seed, "per_signal": per_signal, "drivers": {}, "cases": []}
    for driver in drivers:
        span = measure(driver, source, pause_s if driver == "tracer" else 0.0)
        spread = min(max(span * 1.2, 0.02), 3.0)  # a little past the end, too
        out["drivers"][driver] = {"span_s": round(span, 3), "delays_over_s": round(spread, 3)}
        for sig in SIGNALS:
            for _ in range(per_signal):
                delay = rng.uniform(0.0, spread)
                case = run_case(driver, sig, delay, source, pause_s if driver == "tracer" else 0.0)
                out["cases"].append(asdict(case))
    cases = out["cases"]
    out["total"] = {"cases": len(cases), "harmed": sum(c["harmed"] for c in cases)}
    out["by_signal"] = {
        f"{d}/{s}": {
            "cases": sum(1 for c in cases if c["driver"] == d and c["signal"] == s),
            "harmed": sum(
                1 for c in cases if c["driver"] == d and c["signal"] == s and c["harmed"]
            ),
        }
        for d in drivers
        for s in SIGNALS
    }
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-signal", type=int, default=20)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--drivers", default="kdash,tracer")
    ap.add_argument("--pause", type=float, default=0.02, help="tracer driver's step gap (s)")
    ap.add_argument("--inject-from", default="", help="an inject.py to test instead")
    ap.add_argument("--output", default=str(HERE / "results" / "inject-kill-cpu.json"))
    args = ap.parse_args()
    try:
        res = run(args.drivers.split(","), args.per_signal, args.seed, args.inject_from, args.pause)
    except SkipCase as e:
        print(f"injection not possible here: {e}")
        return 2
    res["python"] = sys.version.split()[0]
    res["kernel"] = os.uname().release
    res["cpus"] = os.cpu_count()
    res["inject_from"] = args.inject_from or "kdash.collectors.agent.inject"
    res["pause_s"] = args.pause
    if args.output != "-":
        Path(args.output).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"total": res["total"], "by_signal": res["by_signal"]}, indent=1))
    return 1 if res["total"]["harmed"] else 0


if __name__ == "__main__":
    sys.exit(main())
