"""Host time of DecodePlan.run's own Python on a machine without a GPU (launches stubbed).

The plan is made on CPU tensors (Triton's interpreter compiles nothing), then its bound kernels
are given a stand-in compiled kernel whose C ``launch`` does nothing, so a run takes the same
Python path as on the GPU after its first call: the checks, the pointer launchers of
kernels/launch.py, and the call into the launcher, which here returns at once. What the real
launcher costs (argument parsing, cuLaunchKernelEx) is not in these figures; the GPU's
``decode_host_us`` (kernels/bench.py) has it.

With ``--graph`` the runs go through a graph slot (kernels/graph_launch.py) whose driver is a
stand-in ``libcuda`` built here with ``cc``: the same ctypes calls, functions that return 0.

Run: python bench/decode_host_cpu.py [--profile] [--graph]   (prints us per run, min and median
of 7 x 20,000 runs, for the two-launch, fused and persistent plans, bf16 and fp8 KV; --profile
adds cProfile)
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # CPU tensors; must precede importing triton

import cProfile
import ctypes
import io
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from kdash.kernels import bench, graph_launch
from kdash.kernels.decode_attention import DecodeConfig
from kdash.kernels.launch import BoundKernel

RUNS, REPS = 20_000, 7


def _noop(*_args) -> None:
    return None


def stand_in(bk: BoundKernel, n_runtime: int) -> None:
    """Arm ``bk`` as a first GPU call would, with a compiled kernel whose launch does nothing."""
    import inspect

    from kdash.kernels import launch

    params = list(inspect.signature(getattr(bk.fn, "fn", bk.fn)).parameters.values())
    tail = tuple(bk.meta.get(p.name, p.default) for p in params[n_runtime:])
    runner = SimpleNamespace(
        launch=_noop,
        global_scratch_size=0,
        profile_scratch_size=0,
        launch_cooperative_grid=False,
        launch_pdl=False,
    )
    compiled = SimpleNamespace(run=runner, function=0, packed_metadata=(4, 1, 0))
    bk._compiled, bk._tail = compiled, tail
    bk._stream, bk._device = (lambda _d: 0), 0
    bk._direct = launch._direct_entry(compiled, bk._g, tail)


# The driver calls a graph slot makes: the capture status, its call's result and the launch's
# result set by ``set`` (zero: not capturing, success), launches counted by ``count``; the exec
# handle a 64-bit address, which a launch checks (a handle cut to 32 bits fails with 400). The
# function attribute call's result is set by ``set_attr_rc``, its last arguments read by
# ``attr_call`` (function, attribute, value).
_STAND_IN_C = r"""
static int status, launch_rc, status_rc, launches, attr_rc;
static long long attr_args[3];
void set(int s, int lrc, int src) { status = s; launch_rc = lrc; status_rc = src; }
int count(void) { return launches; }
void set_attr_rc(int rc) { attr_rc = rc; }
long long attr_call(int i) { return attr_args[i]; }
int cuFuncSetAttribute(void *f, int a, int v)
{ attr_args[0] = (long long)f; attr_args[1] = a; attr_args[2] = v; return attr_rc; }
int cuStreamBeginCapture_v2(void *s, int m) { return 0; }
int cuStreamEndCapture(void *s, void **g) { *g = (void *)1; return 0; }
int cuGraphInstantiateWithFlags(void **e, void *g, unsigned long long f)
{ *e = (void *)0x7f0000001000ULL; return 0; }
int cuGraphDestroy(void *g) { return 0; }
int cuGraphExecDestroy(void *e) { return 0; }
int cuStreamIsCapturing(void *s, int *st) { *st = status; return status_rc; }
int cuGraphLaunch(void *e, void *s)
{ if (e != (void *)0x7f0000001000ULL) return 400; launches++; return launch_rc; }
"""


def stand_in_libcuda(cc: str = "cc") -> ctypes.CDLL:
    """The stand-in libcuda above, compiled here with ``cc``."""
    d = Path(tempfile.mkdtemp(prefix="kdash-cuda-stand-in-"))
    (d / "c.c").write_text(_STAND_IN_C)
    subprocess.run([cc, "-shared", "-fPIC", "-O2", "-o", str(d / "s.so"), str(d / "c.c")],
                   check=True)  # fmt: skip
    return ctypes.CDLL(str(d / "s.so"))


def stand_in_driver() -> graph_launch.Driver:
    """A :class:`graph_launch.Driver` on the stand-in libcuda."""
    return graph_launch.Driver(stand_in_libcuda())


def measure(fused: bool | str, fp8: bool, profile: bool, drv=None) -> tuple[float, float]:
    case = bench.DecodeCase([300, 40, 77, 5], 32, 8, 128, fp8)
    plan = case.plan(None if fp8 else DecodeConfig(block_n=64), fused)
    q, k, v = case.q, case.k, case.v
    saved = BoundKernel.__call__
    BoundKernel.__call__ = lambda self, *a: None  # the binding run, without interpreting
    try:
        plan.run(q, k, v)
    finally:
        BoundKernel.__call__ = saved
    stand_in(plan._s1, 7 + len(plan._rest1))
    if plan._s2 is not None:
        stand_in(plan._s2, len(plan._args2))
    plan._arm_fire()
    assert plan._fire is not None, "the pointer launchers were not made"
    if drv is not None:
        plan._slot = graph_launch.GraphSlot(plan._fire, 0, drv)
    for _ in range(2000):
        plan.run(q, k, v)
    per = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        for _ in range(RUNS):
            plan.run(q, k, v)
        per.append((time.perf_counter() - t0) / RUNS * 1e6)
    per.sort()
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(RUNS):
            plan.run(q, k, v)
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(10)
        print(buf.getvalue().rstrip()[-1800:])
    return per[0], per[len(per) // 2]


def main() -> int:
    bench.DEVICE = "cpu"
    profile = "--profile" in sys.argv[1:]
    drv = stand_in_driver() if "--graph" in sys.argv[1:] else None
    for fused in (False, True, "persistent"):
        for fp8 in (False, True):
            lo, mid = measure(fused, fp8, profile, drv)
            name = {False: "two-launch", True: "fused"}.get(fused, fused)
            print(f"{name:>10} {'fp8' if fp8 else 'bf16'}: {lo:.2f} us min, {mid:.2f} us median")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
