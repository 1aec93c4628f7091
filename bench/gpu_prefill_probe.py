"""Why SDPA-cuDNN is fastest per key tile at 16/16/128 non-causal S=4k (the shape that sets
``prefill_vs_sdpa_cudnn``), and what our fixed cost per query tile is: ours and cuDNN at
S = 2k, 4k (16k tokens and 64k tokens), 8k and 16k, each timed three ways in turns:

- ``flush``: do_bench's median (256 MiB zeroed before each call), as the bench times;
- ``b2b``: 20 calls back to back between two events (mean), no flush;
- the SM clock and board power, read by NVML every 10 ms while each do_bench runs (median,
  the first fifth of the readings left out: bench/gpu_decode_clocks.py's sampler);
- ``--energy``: the board's energy counter over ~2 s of calls back to back (three windows each,
  in turns): joules a call, mean watts and clock, so the two kernels' energy per call can be
  set side by side (at the 700 W cap, a kernel that takes more energy a call runs at lower
  clocks).

Per shape also the cuDNN kernel's name (torch.profiler), so a change of kernel between lengths
shows. Per key tile times are ``us / waves / key_tiles`` with ``waves = tiles / SMs`` (128-row
query tiles, 128-key tiles). One JSON line per shape on stdout and into ``--out``.

Run: python bench/gpu_prefill_probe.py --out probe.json   (a CUDA GPU; kdash importable)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_ms
from torch.nn.attention import SDPBackend

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling scripts
from gpu_decode_clocks import Sampler  # NVML on a thread: the clocks script's reader

CASES = ((2048, 16384), (4096, 16384), (4096, 65536), (8192, 16384), (16384, 16384))


def back_to_back_us(fn, n: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / n


def kernel_names(fn) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = {e.key for e in prof.key_averages() if e.device_type.name == "CUDA"}
    return sorted(n[:160] for n in names)


def energy_window(fn, sampler: Sampler, seconds: float = 2.0) -> dict[str, float]:
    """Calls of ``fn`` back to back for about ``seconds``: joules a call (NVML's energy
    counter, mJ), us a call, mean watts and the median SM clock."""
    nv, h = sampler.nv, sampler.h
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls = 0
    sampler.start()
    e0 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            fn()
        calls += 10
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    e1 = nv.nvmlDeviceGetTotalEnergyConsumption(h)
    m = sampler.stop()
    return {
        "j_per_call": round((e1 - e0) / 1e3 / calls, 5),
        "us_per_call": round((t1 - t0) * 1e6 / calls, 1),
        "watts": round((e1 - e0) / 1e3 / (t1 - t0), 1),
        "mhz": round(m.get("sm_MHz_median", 0)),
    }


def probe(seq: int, tokens: int, sampler: Sampler, energy: bool = False) -> dict[str, Any]:
    bench.PREFILL_TOKENS = tokens
    case = bench.PrefillCase(seq, 16, 16, 128, False)
    fns = {"ours": case.ours(None), "cudnn": case.sdpa(SDPBackend.CUDNN_ATTENTION)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    tiles = case.batch * 16 * (seq // 128)
    row: dict[str, Any] = {"seq": seq, "batch": case.batch, "tiles": tiles, "sms": sms}
    row["cudnn_kernels"] = kernel_names(fns["cudnn"])
    got: dict[str, dict[str, list]] = {
        k: {"flush": [], "b2b": [], "mhz": [], "watts": []} for k in fns
    }
    for _ in range(3):
        for name, fn in fns.items():
            sampler.start()
            us = bench_ms(fn, rep=60) * 1e3
            m = sampler.stop()
            got[name]["flush"].append(round(us, 1))
            got[name]["mhz"].append(round(m.get("sm_MHz_median", 0)))
            got[name]["watts"].append(round(m.get("power_W_median", 0)))
            got[name]["b2b"].append(round(back_to_back_us(fn), 1))
    row["rounds"] = got
    waves = tiles / sms
    for name, g in got.items():
        us = sorted(g["flush"])[1]
        row[f"{name}_us"] = us
        row[f"{name}_us_per_key_tile"] = round(us / waves / (seq // 128), 4)
        row[f"{name}_b2b_us"] = sorted(g["b2b"])[1]
        row[f"{name}_TFLOPs"] = round(case.flops() / us / 1e6, 1)
    if energy:
        windows: dict[str, list] = {k: [] for k in fns}
        for _ in range(3):
            for name, fn in fns.items():
                windows[name].append(energy_window(fn, sampler))
        row["energy"] = windows
        for name, w in windows.items():
            row[f"{name}_j_per_call"] = sorted(x["j_per_call"] for x in w)[1]
    row["ratio_flush"] = round(row["cudnn_us"] / row["ours_us"], 3)
    row["ratio_b2b"] = round(row["cudnn_b2b_us"] / row["ours_b2b_us"], 3)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--energy", action="store_true", help="also joules a call, back to back")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_prefill_probe: no CUDA GPU here", file=sys.stderr)
        return 2
    sampler = Sampler()
    rows = []
    for seq, tokens in CASES:
        row = probe(seq, tokens, sampler, args.energy)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "gpu": torch.cuda.get_device_name(0),
                       "rows": rows}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
