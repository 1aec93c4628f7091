"""What the kernel pane's analysis worker costs per run, on the bundled demo capture.

The worker runs at most once a second live (tui/panes/kernels.py, ANALYSIS_EVERY_S) in a
thread that shares the GIL with the UI, so its time is time the dashboard is less responsive.
Measured on the real H200 capture (82k kernels, 88k API calls in 20 s): the per-name table,
the idle-gap causes and launch latency, and `kdash report`'s kernel findings.

    python bench/kernel_analysis_cost.py [--out bench/results/kernel-analysis-cpu.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from kdash.tui.panes.kernels import analysis_notes

from kdash.analyses.kernel_findings import gap_causes, kernel_findings
from kdash.analyses.kernels import idle_gaps, top_kernels
from kdash.capture import load_capture

ROOT = Path(__file__).resolve().parents[1]


def timed(fn, repeat: int = 7) -> dict[str, float]:
    fn()  # warm: caches (demangling), imports
    runs = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        runs.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": round(statistics.median(runs), 2), "min_ms": round(min(runs), 2)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/kernel-analysis-cpu.json")
    args = ap.parse_args()
    cap = load_capture(ROOT / "kdash/data/demo-h200.kdash")
    t = cap.tables
    k, api = t["kernels"], t["api"]
    gaps = idle_gaps(k)
    figures = {
        "kernels": len(k),
        "api_rows": len(api),
        "idle_gaps": len(gaps),
        "top_kernels": timed(lambda: top_kernels(k)),
        "idle_gaps_only": timed(lambda: idle_gaps(k)),
        "gap_causes": timed(lambda: gap_causes(gaps, k, api)),
        "pane_notes_line": timed(lambda: analysis_notes(k, api, t["markers"], t["threads"])),
        "report_kernel_findings": timed(lambda: kernel_findings(t)),
    }
    out = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "python": platform.python_version(),
        },
        "data": "kdash/data/demo-h200.kdash (real, recorded on an H200)",
        "figures": figures,
    }
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
