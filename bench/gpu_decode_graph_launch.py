"""Host time of one decode step launched as a CUDA graph the plan holds, against its kernel
launches. (GPU machine)

Per shape (32/8/128, page 16), KV dtype and path (two launches, fused): the plan's ``run`` on
its pointer launchers (``run``, graph launch off), the plan's ``run`` through its graph slot
(``run_graph``, kdash.kernels.graph_launch), ``torch.cuda.CUDAGraph.replay`` of a graph holding
the first, and ``cuGraphLaunch`` on that graph's exec handle through ctypes (``raw``: the least a
run could cost). Per variant: host us per call (no sync, ``bench_host_nosync_us``), do_bench us
(L2 flushed; the launch latency shows there), and whether its output is the kernels'; the
slot's captures; the graph-replay us of the run.
Writes the JSON after every shape.
Run: python bench/gpu_decode_graph_launch.py [--out FILE] [--shapes 1x65536,64xlognormal]
"""

from __future__ import annotations

import ctypes
import json
import sys

import torch
from gpu_decode_persist import lens_of, run_shapes
from kdash.kernels import bench, graph_launch
from kdash.kernels.bench_timing import bench_graph_ms, bench_host_nosync_us, bench_ms
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig


def graph_launchers(fn):
    """(replay, raw): a captured ``fn`` launched by torch's replay and by cuGraphLaunch."""
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    lib = ctypes.CDLL("libcuda.so.1")
    launch = lib.cuGraphLaunch
    launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    launch.restype = ctypes.c_int
    exec_h = g.raw_cuda_graph_exec()
    stream = torch.cuda.current_stream().cuda_stream

    def raw() -> None:
        rc = launch(exec_h, stream)
        if rc:
            raise RuntimeError(f"cuGraphLaunch returned {rc}")

    return g, g.replay, raw


def row_for(shape: str, fp8: bool) -> dict:
    lens = lens_of(shape)
    case = bench.DecodeCase(lens, 32, 8, 128, fp8)
    cfg = DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()
    row: dict = {"shape": shape, "kv": "fp8" if fp8 else "bf16", "tokens": sum(lens)}
    for path in (False, True):
        name = "fused" if path else "two"
        fig: dict = {}
        try:
            graph_launch.GRAPH_LAUNCH_DEFAULT = False
            fn, splits = case.fn(cfg, path)
            fn()
            torch.cuda.synchronize()
            want = case.out.float().clone()
            g, replay, raw = graph_launchers(fn)
            graph_launch.GRAPH_LAUNCH_DEFAULT = True
            fn_g, _ = case.fn(cfg, path)
            plan_g = case.last_plan
            fig = {"path": plan_g.path, "splits": splits}
            for how, f in (("run", fn), ("run_graph", fn_g), ("replay", replay), ("raw", raw)):
                case.out.fill_(float("nan"))
                f()
                f()  # the plan's slot captures on the second run with one key
                torch.cuda.synchronize()
                fig[how] = {
                    "same": bool(torch.equal(case.out.float(), want)),
                    "host_us_nosync": bench_host_nosync_us(f),
                    "us": bench_ms(f) * 1e3,
                }
            slot = plan_g._slot
            fig["slot"] = {
                "captures": slot.captures if slot else None,
                "refused": plan_g.graph_refused,
            }
            fig["us_graph"] = bench_graph_ms(fn) * 1e3
            # Captured by the caller: the slot must step aside (kernel nodes in that graph).
            fig["us_graph_slot"] = bench_graph_ms(fn_g) * 1e3
            del g
        except Exception as e:  # noqa: BLE001 - one variant's failure is a finding
            fig["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        row[name] = fig
        print(f"{shape:>14} {row['kv']} {name:<6} {json.dumps(fig)}", flush=True)
    del case
    torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    return run_shapes(
        "gpu_decode_graph_launch.py", __doc__, "decode-graph-launch-h200.json", row_for, argv
    )


if __name__ == "__main__":
    sys.exit(main())
