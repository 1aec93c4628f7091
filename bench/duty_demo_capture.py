"""A MADE-UP duty-cycled capture from the real demo, for trying the kernel pane's window view.

No shipped capture holds the agent's "activity on" windows yet (the bundled demo was recorded
with continuous activity). This keeps the demo's kernel, API and copy rows that start inside
windows of ON_MS every PERIOD_S (as a duty-cycled agent would have recorded them) and adds the
windows' markers rows in the agent's format (domain "kdash", name "activity on", tid -1). The
title says the windows are made up.

Run: python bench/duty_demo_capture.py OUT.kdash [PERIOD_S [ON_MS]]   (default 3 s, 100 ms)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from kdash import schema
from kdash.capture import load_capture, write_capture

DEMO = Path(__file__).resolve().parents[1] / "kdash" / "data" / "demo-h200.kdash"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("output")
    ap.add_argument("period_s", nargs="?", type=float, default=3.0)
    ap.add_argument("on_ms", nargs="?", type=float, default=100.0)
    args = ap.parse_args()
    cap = load_capture(DEMO)
    t0, t1 = int(cap.meta["window"]["start_ns"]), int(cap.meta["window"]["end_ns"])
    ws = np.arange(t0 + 500_000_000, t1, int(args.period_s * 1e9), dtype=np.int64)
    we = np.minimum(ws + int(args.on_ms * 1e6), t1)
    tables = {}
    for name in schema.TABLES:
        b = cap.batch(name)
        if name in ("kernels", "api", "memcpy") and len(b["start_ns"]):
            s = b["start_ns"]
            i = np.searchsorted(ws, s, side="right") - 1
            keep = (i >= 0) & (s < we[np.maximum(i, 0)])
            b = {c: v[keep] for c, v in b.items()}
        tables[name] = b
    tables["markers"] = schema.make_batch(
        "markers",
        start_ns=ws,
        end_ns=we,
        name=["activity on"] * len(ws),
        domain=["kdash"] * len(ws),
        pid=np.zeros(len(ws), dtype=np.int64),
        tid=np.full(len(ws), -1, dtype=np.int64),
    )
    meta = dict(cap.meta)
    meta["title"] = "duty-cycled demo (MADE-UP windows) replay"
    write_capture(args.output, meta, tables)
    print(f"{args.output}: {len(ws)} windows, {len(tables['kernels']['start_ns'])} kernels")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
