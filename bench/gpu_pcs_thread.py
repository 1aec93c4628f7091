"""Does a PC-sampling range run from a second thread while the main thread launches? (GPU)

The agent's first PC range under the demo workload never finished and the workload stopped
(bench/results/pcs-agent-h200-hang.json). Here, per variant in its own process with a 25 s
limit: the main thread loops torch matmuls (syncing each 20); a thread runs one
SamplingRanges range of 0.2 s. Variants: `cdll` (ctypes releases the GIL during CUPTI calls,
as the agent did), `pydll` (the GIL is held during them), `cdll_activity` (kernel activity
callbacks registered, enabled and disabled before, as the agent's duty cycle leaves them).
Writes $OUT/pcs-thread-h200.json.
"""

import json
import os
import subprocess
import sys
import time

CHILD = r"""
import ctypes, sys, threading, time, json
import torch
from cupti import cupti
variant = sys.argv[1]
from kdash.collectors.agent import pcsampling as pcs
from kdash.collectors.agent.server import find_libcupti
a = torch.randn(2048, 2048, device="cuda")
for _ in range(5): a @ a
torch.cuda.synchronize()
cupti.get_timestamp()
if variant == "cdll_activity":
    cupti.activity_register_callbacks(lambda: (8 << 20, 0), lambda acts: None)
    cupti.activity_enable(cupti.ActivityKind.CONCURRENT_KERNEL)
    for _ in range(5): a @ a
    torch.cuda.synchronize()
    cupti.activity_disable(cupti.ActivityKind.CONCURRENT_KERNEL)
    cupti.activity_flush_all(1)
path, _ = find_libcupti()
if variant == "pydll":
    orig = ctypes.CDLL
    ctypes.CDLL = ctypes.PyDLL
r = pcs.SamplingRanges(path)
if variant == "pydll":
    ctypes.CDLL = orig
out = {}
def rng():
    t0 = time.monotonic()
    try:
        cols, st = r.run(0.2)
        out["rows"] = len(cols["count"]); out["stats"] = st
    except Exception as e:
        out["error"] = repr(e)
    out["range_s"] = time.monotonic() - t0
th = threading.Thread(target=rng, daemon=True)
n = 0; t0 = time.monotonic(); th.start(); marks = []
while time.monotonic() - t0 < 4.0:
    a @ a; n += 1
    if n % 20 == 0:
        torch.cuda.synchronize(); marks.append(round(time.monotonic() - t0, 3))
th.join(5)
out["iters"] = n; out["alive_after"] = th.is_alive(); out["max_gap_s"] = max(
    (b - a_ for a_, b in zip([0.0] + marks, marks)), default=None)
print("RESULT " + json.dumps(out, default=str), flush=True)
"""

res = {"command": "python bench/gpu_pcs_thread.py", "variants": {}}
for v in ("cdll", "pydll", "cdll_activity"):
    t0 = time.monotonic()
    try:
        p = subprocess.run(
            [sys.executable, "-c", CHILD, v], capture_output=True, text=True, timeout=25
        )
        line = next((ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")), None)
        res["variants"][v] = (
            json.loads(line[7:]) if line else {"rc": p.returncode, "stderr": p.stderr[-800:]}
        )
    except subprocess.TimeoutExpired:
        res["variants"][v] = {"hung": True}
    res["variants"][v]["seconds"] = round(time.monotonic() - t0, 1)
    print(v, json.dumps(res["variants"][v], default=str)[:600], flush=True)
out = os.path.join(os.environ.get("OUT", "."), "pcs-thread-h200.json")
with open(out, "w") as f:
    f.write(json.dumps(res, indent=2, default=str) + "\n")
