"""One of kdash's host sources on its own, polled as `kdash attach` polls it (4 Hz), for the
twin benches' factor runs (bench/gpu_ab_cost.py `--variants nvml_only,sched_only`).

`python ab_poller.py nvml|nvml_dev|sched PID SECONDS` (kdash installed); `nvml_dev` is the NVML
source without a target: device fields only, no per-process calls. Prints the polls made and
the source's health at the end.
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    which, pid, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    from kdash.target import Target

    target = Target.from_pid(pid)
    if which in ("nvml", "nvml_dev"):
        from kdash.collectors.nvml import NvmlSource

        src = NvmlSource(target if which == "nvml" else None, interval_s=0.25)
    else:
        from kdash.collectors.sched import SchedSource

        src = SchedSource(target, interval_s=0.25)
    start = getattr(src, "start", None)
    if start is not None:
        start()
    n, end = 0, time.monotonic() + seconds
    nxt = time.monotonic()
    while time.monotonic() < end:
        src.poll(time.time_ns())
        n += 1
        nxt += 0.25
        time.sleep(max(0.0, nxt - time.monotonic()))
    print(f"{which}: {n} polls, health {src.health}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
