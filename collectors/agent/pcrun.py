"""PC-sampling ranges inside a session: each on a thread of its own while kernel activity is
off (CUPTI refuses both at once). The sampling itself is pcsampling.SamplingRanges, imported
(with numpy) at the first range; its rows and window go to the outbox, its costs to STATS."""

from __future__ import annotations

import enum
import os
import sys
import threading
import time

from .constants import ENV_FAKE_PCSAMPLING
from .probes import find_libcupti

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from typing import Any

    from .outbox import Outbox


class PCState(enum.Enum):
    OFF = "off"
    STARTING = "starting"  # asked for, no range finished yet
    OK = "ok"
    UNAVAILABLE = "unavailable"  # a range failed: not tried again this session (`why` says why)


# A range whose samples CUPTI put in its non-user bucket above this share asks for a fresh
# CUPTI before the next range (controller.CuptiActivity.refresh_for_pc says why). A refresh
# costs the target little (finalize at a call's exit; the next enable took 8 ms on the H200),
# so it may come before every range; REFRESH_MIN_S only keeps a target that loads modules all
# the time from paying it more than once a period. The first range after PC sampling is
# switched on asks for one too (want_fresh_start): on the H200 the first range on a CUPTI that
# kernel activity had started put every sample in the bucket, every time, and the ranges after
# a refresh none (bench/NOTES-agent.md).
REFRESH_SHARE = 0.02
REFRESH_MIN_S = 1.5  # under the 2-s range period, so a lossy range is always followed by one


def _no_context(e: BaseException) -> bool:
    """Whether a range failed only because the process has no CUDA context (pcsampling is
    imported by then whenever it could raise that)."""
    mod = sys.modules.get(__package__ + ".pcsampling")
    return mod is not None and isinstance(e, mod.NoActiveContext)


class PCRunner:
    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.state = PCState.OFF
        self.why = ""  # what made it UNAVAILABLE
        self.ranges = 0
        self.rows = 0
        self.last: dict = {}
        self.device_hint: int | None = None
        self._pc: Any = None  # pcsampling.SamplingRanges, made at the first range
        self._thread: threading.Thread | None = None
        self._busy = threading.Event()  # a range runs: the duty cycle keeps activity off
        self._cut = threading.Event()
        self.non_user_share: float | None = None  # of the last range's samples
        self.refresh_wanted = False
        self.last_refresh = -REFRESH_MIN_S  # monotonic s
        self.refresh_note = ""  # why the last refresh could not be done ("" when it was)
        self.no_context_ranges = 0  # ranges skipped: this process had no CUDA context yet
        # `at_call(fn) -> str`: fn run on the target's thread at its next CUDA call (the
        # session's controller.run_in_target), for the calls that begin and end a range
        self.at_call: Any = None

    @property
    def busy(self) -> bool:
        return self._busy.is_set()

    @property
    def unavailable(self) -> bool:
        return self.state is PCState.UNAVAILABLE

    def text(self) -> str:
        """The state as STATS says it: "off", "starting", "ok" or "unavailable: <why>"."""
        if self.state is PCState.UNAVAILABLE:
            return f"unavailable: {self.why}"
        if self.state is PCState.STARTING and self.no_context_ranges:
            return "starting: no CUDA context in this process yet"
        return self.state.value

    def set_state(self, state: PCState) -> None:
        """OFF or STARTING, asked for by the client; a failed sampler stays UNAVAILABLE."""
        if not self.unavailable:
            self.state = state

    def reset(self, state: PCState) -> None:
        """A new START: OFF or STARTING, whatever happened before."""
        self.state, self.why = state, ""
        self.no_context_ranges = 0

    def want_fresh_start(self) -> None:
        """PC sampling was switched on: refresh CUPTI before the first range."""
        self.refresh_wanted, self.last_refresh = True, -REFRESH_MIN_S

    def refresh_due(self, now: float) -> bool:
        return self.refresh_wanted and now - self.last_refresh >= REFRESH_MIN_S

    def refreshed(self, outcome: str, now: float) -> None:
        """What the session's refresh attempt gave: "finalized", or why not."""
        self.last_refresh = now
        if outcome == "finalized":
            self.refresh_wanted, self.refresh_note = False, ""
        else:
            self.refresh_note = outcome

    def cpu_ms_per_range(self) -> float | None:
        if self._pc is not None and self._pc.ranges:
            return round(self._pc.cpu_ms_total / self._pc.ranges, 2)
        return None

    def held_ms_per_range(self) -> float | None:
        """Wall ms per range that the target's GIL is held by the range's CUPTI and driver
        calls (pcsampling.HELD_PARTS)."""
        if self._pc is not None and self._pc.ranges:
            return round(getattr(self._pc, "held_ms_total", 0.0) / self._pc.ranges, 2)
        return None

    def start_range(self, on_s: float) -> None:
        """Run one PC-sampling range on a thread of its own (activity is off meanwhile)."""
        self._busy.set()
        self._cut.clear()
        t = threading.Thread(target=self._range, args=(on_s,), name="kdash-pcs", daemon=True)
        self._thread = t
        t.start()

    def _sampler(self) -> Any:
        if self._pc is None:
            from . import pcsampling

            fake = os.environ.get(ENV_FAKE_PCSAMPLING)
            if fake:
                self._pc = pcsampling.SamplingRanges(fake, libcuda=fake)
            else:
                path, why = find_libcupti()
                if path is None:
                    raise RuntimeError(f"libcupti not found in this process ({why})")
                self._pc = pcsampling.SamplingRanges(path, device=self.device_hint)
        return self._pc

    def _range(self, on_s: float) -> None:
        """The range's thread: a failure makes PC sampling UNAVAILABLE for the rest of the
        session (the source pane shows why). Never raises."""
        try:
            pc = self._sampler()
            t0 = time.monotonic_ns()
            cols, stats = pc.run(on_s, self._cut, self.at_call)
            t1 = time.monotonic_ns()
            import numpy as np

            n = len(cols["count"])
            cols["t_ns"] = np.full(n, t1, dtype=np.int64)
            self.outbox.add_pc_range(cols, t0, t1)
            self.ranges += 1
            self.rows += n
            self.last = stats
            total = int(stats.get("total_samples", 0))
            if total:
                self.non_user_share = int(stats.get("non_user_samples", 0)) / total
                self.refresh_wanted = self.non_user_share > REFRESH_SHARE
            self.state = PCState.OK
        except BaseException as e:  # noqa: BLE001 - never into the target; say why in the pane
            if _no_context(e):
                # nothing was enabled: try again at the next range, a context may come
                self._pc = None
                self.state, self.why = PCState.STARTING, ""
                self.no_context_ranges += 1
                return
            why = str(e) or type(e).__name__
            if "NOT_COMPATIBLE" in why or "MULTIPLE_SUBSCRIBERS" in why:
                why += " (another profiler holds the counters, or kernel activity is on)"
            self.state, self.why = PCState.UNAVAILABLE, why
        finally:
            self._busy.clear()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Cut a running range short and wait for its thread (detach, STOP, SET off)."""
        t = self._thread
        if t is not None and t.is_alive():
            self._cut.set()
            t.join(timeout_s)
