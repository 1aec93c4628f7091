"""MADE-UP duty-cycled capture from the real demo: keep rows inside 100 ms windows every 3 s."""
import sys
import numpy as np
from kdash import schema
from kdash.capture import load_capture, write_capture
from pathlib import Path
src = Path("/work/main/kdash/data/demo-h200.kdash")
c = load_capture(src)
w = c.meta["window"]
t0, t1 = int(w["start_ns"]), int(w["end_ns"])
period, on = int(float(sys.argv[2]) * 1e9), int(float(sys.argv[3]) * 1e6)
ws = np.arange(t0 + 500_000_000, t1, period, dtype=np.int64)
we = np.minimum(ws + on, t1)
tables = {}
for name, df in c.tables.items():
    b = {col: df[col].to_numpy() for col in df.columns}
    if name in ("kernels", "api", "memcpy") and len(df):
        s = b["start_ns"]
        i = np.searchsorted(ws, s, side="right") - 1
        keep = (i >= 0) & (s < we[np.maximum(i, 0)])
        b = {k: v[keep] for k, v in b.items()}
    tables[name] = b
m = schema.make_batch("markers", start_ns=ws, end_ns=we, name=["activity on"] * len(ws),
    domain=["kdash"] * len(ws), pid=np.zeros(len(ws), dtype=np.int64), tid=np.full(len(ws), -1, dtype=np.int64))
tables["markers"] = m
meta = dict(c.meta); meta["title"] = "duty-cycled demo (MADE-UP windows) replay"
write_capture(sys.argv[1], meta, tables)
print(len(ws), "windows", {k: len(v["start_ns"]) for k, v in tables.items() if "start_ns" in v})
