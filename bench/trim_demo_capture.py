"""Apply the agent's window-edge trim (collectors/agent/trim.py) to a duty-cycled capture
recorded before the agent trimmed at send time, giving what the current agent sends.

The raw H200 demo (tests/data/h200-demo-duty-untrimmed.kdash) was recorded before the trim
existed: graph kernels queued when a window switched activity off carry ends 1.4 ms to 1.3 s
late. Trimmed here against the capture's own "activity on" windows, every one ended by a
switch-off at this duty cycle, exactly as the agent's outbox trims (kernels and memcpy rows).

Run: python bench/trim_demo_capture.py RAW.kdash OUT.kdash
"""

from __future__ import annotations

import sys

import numpy as np
from kdash.collectors.agent.constants import WINDOW_DOMAIN, WINDOW_NAME
from kdash.collectors.agent.outbox import TRIMMED
from kdash.collectors.agent.trim import trim_to_windows

from kdash.capture import load_capture, write_capture


def main(raw: str, out: str) -> None:
    cap = load_capture(raw)
    m = cap.tables["markers"]
    w = m[(m["name"] == WINDOW_NAME) & (m["domain"] == WINDOW_DOMAIN)]
    windows = [(int(s), int(e), True) for s, e in zip(w["start_ns"], w["end_ns"], strict=True)]
    if not windows:
        raise SystemExit(f"{raw}: no recording windows, nothing to trim")
    tables = {}
    for name in cap.tables:
        b = cap.batch(name)
        if name in TRIMMED and len(b["start_ns"]):
            lanes = (b["device"], b["stream"])
            keep, end, clipped, dropped = trim_to_windows(
                b["start_ns"], b["end_ns"], windows, None, lanes
            )
            b = dict(b, end_ns=np.asarray(end, dtype=np.int64))
            b = {c: v[keep] for c, v in b.items()}
            print(f"{name}: {clipped} ends cut back to their window, {dropped} rows dropped")
        tables[name] = b
    meta = {k: v for k, v in cap.meta.items() if k not in ("format", "schema_version", "tables")}
    print(write_capture(out, meta, tables))


if __name__ == "__main__":
    main(*sys.argv[1:3])
