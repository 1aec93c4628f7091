"""Raw CUPTI activity buffers: our own buffer callbacks, and reading records out of a buffer.

Standard library at module level; numpy and ctypes are imported when a buffer is first read
(the agent is loaded into every armed process, and nothing may cost it before a client comes).
"""

from __future__ import annotations

import contextlib
import threading

from .constants import BUFFER_BYTES
from .fields import RECORD_DTYPES

TYPE_CHECKING = False  # not `typing.TYPE_CHECKING`: importing typing costs every armed process
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any


class LayoutMismatch(Exception):
    """The CUPTI buffer does not look the way cupti-python's dtypes say: use the slow path."""


STRETCH_EVERY = 16  # records walked one by one between two looks for a repeating period
MIN_STRETCH = 64  # fewest records a numpy stretch must cover (else the walk goes on)
MAX_PERIOD = 64  # longest period of record kinds looked for (a graph of up to ~60 kernels)


class BufferReader:
    """Reads the fields kdash needs straight out of a completed CUPTI buffer, with numpy.

    Why: each attribute read on a cupti-python record object goes through a one-row numpy
    record array and costs microseconds; a kernel row needs 17 of them. Records of one buffer
    lie back to back in CUPTI's memory, so the agent reads only the first and last record's
    address from cupti-python, walks the buffer by each record's `kind` and size (the sizes of
    cupti-python's own dtypes), and gathers every column with one fancy index per field.

    Trust but verify: the walk must visit exactly as many records as cupti-python delivered and
    end where the last one ends, and on the first buffer the gathered kernel fields are
    compared with the object attributes; any disagreement raises LayoutMismatch, and the agent
    switches to the attribute path for good (and says so in STATUS notes).
    """

    def __init__(self, cupti_mod: Any, kinds: dict[str, int]) -> None:
        import numpy as np

        self.np = np
        self.dtypes: dict[int, Any] = {}
        for kname, dname in RECORD_DTYPES.items():
            dt = getattr(cupti_mod, dname, None)
            if dt is None or kname not in kinds:
                raise LayoutMismatch(f"cupti-python has no {dname}")
            if dt.itemsize % 8:
                raise LayoutMismatch(f"{dname} is {dt.itemsize} bytes, not a multiple of 8")
            self.dtypes[kinds[kname]] = dt
        self.sizes = {k: dt.itemsize for k, dt in self.dtypes.items()}

    def walk(self, activities: list[Any]) -> tuple[Any, Any, Any, Any]:
        """(views by item size, record kinds, byte offsets, span) of the buffer that
        cupti-python's record objects point into; checked against their count."""
        first = int(activities[0].ptr)
        last_obj = activities[-1]
        last = int(last_obj.ptr)
        last_size = self.sizes.get(int(last_obj.kind))
        if last_size is None:
            raise LayoutMismatch(f"record kind {int(last_obj.kind)} has no known layout")
        out = self.walk_span(first, last + last_size - first)
        if len(out[2]) != len(activities):
            raise LayoutMismatch(
                f"walked {len(out[2])} records, cupti-python gave {len(activities)}"
            )
        return out

    def walk_span(self, first: int, span: int) -> tuple[Any, Any, Any, Any]:
        """Walk the records in [first, first + span): they must end exactly at the end.

        A Python step per record (about 0.1 us), except where the kinds repeat with a period of
        up to MAX_PERIOD records (a CUDA graph's kernels and its launch call; an eager loop's
        launch call + kernel): then numpy checks the following repetitions at once
        (`_periodic_stretch`).
        """
        import ctypes

        np = self.np
        # One buffer that we sized (BUFFER_BYTES): a span beyond it would mean the records
        # are not where we think, and reading there could fault in the target.
        if first % 8 or span <= 0 or span % 8 or span > BUFFER_BYTES:
            raise LayoutMismatch(f"records at {first:#x}+{span} are not one aligned buffer")
        mem = (ctypes.c_char * span).from_address(first)
        u8 = np.frombuffer(mem, dtype=np.uint8)
        i32np = u8.view("<i4")
        i32 = memoryview(mem).cast("B").cast("i")
        get = self.sizes.get
        chunks: list[Any] = []  # arrays of offsets: periodic stretches, and the steps between
        offs: list[int] = []
        seq: list[int] = []  # kinds walked one by one since the last numpy stretch
        append = offs.append
        remember = seq.append
        off = 0
        next_try = STRETCH_EVERY
        while off < span:  # every step advances >= 8 bytes, so this ends
            k = i32[off >> 2]
            sz = get(k)
            if sz is None:
                raise LayoutMismatch(f"unknown record kind {k} at byte {off}")
            append(off)
            remember(k)
            off += sz
            if len(seq) >= next_try:
                taken = self._periodic_stretch(seq, i32np, off, span)
                if taken is None:
                    next_try = len(seq) + STRETCH_EVERY
                    continue
                chunks.append(np.asarray(offs, dtype=np.int64))
                chunks.append(taken[0])
                off = taken[1]
                offs, seq = [], []
                append, remember = offs.append, seq.append
                next_try = STRETCH_EVERY
        if off != span:
            raise LayoutMismatch(f"records end at byte {off}, the buffer at {span}")
        chunks.append(np.asarray(offs, dtype=np.int64))
        offsets = np.concatenate(chunks) if len(chunks) > 1 else chunks[0]
        kinds = i32np[offsets >> 2]
        views = {1: u8, 2: u8.view("<u2"), 4: u8.view("<u4"), 8: u8.view("<u8")}
        return views, kinds, offsets, span

    def _periodic_stretch(
        self, seq: list[int], i32np: Any, off: int, span: int
    ) -> tuple[Any, int] | None:
        """If the kinds walked last repeat with some period p <= MAX_PERIOD (seen twice in a
        row), take every following repetition of that period with numpy: (their offsets, the
        offset after them), or None.

        Every period whose last two repetitions match is a candidate; each is tried on a first
        block of 16 repetitions and the one covering the most records wins (so a graph's run
        of kernels plus its launch call is one period of 19, not a period of one kernel that
        breaks at the call). The winner's repetitions are then checked in blocks that grow 8x:
        a stretch that ends soon costs a small block, not a pass over the rest of the buffer
        (which once made a 19-record period cost 5 us per record).
        """
        np = self.np
        last = seq[-1]
        best: tuple | None = None  # (records covered, p, stride, phases, kinds, block full)
        for p in range(1, min(MAX_PERIOD, len(seq) // 2) + 1):
            if seq[-1 - p] != last or seq[-2 * p : -p] != seq[-p:]:
                continue
            kinds = seq[-p:]
            sizes = [self.sizes[k] for k in kinds]
            stride = sum(sizes)
            n_max = (span - off) // stride
            if n_max < 2:
                continue
            phases = np.cumsum([0, *sizes[:-1]])
            kinds_np = np.asarray(kinds, dtype=np.int32)
            m0 = min(n_max, max(16, -(-MIN_STRETCH // p)))
            n = self._repeats(i32np, off, stride, phases, kinds_np, 0, m0)
            if n and (best is None or n * p > best[0]):
                best = (n * p, p, stride, phases, kinds_np, n == m0)
                if n == m0:
                    break
        if best is None or best[0] < MIN_STRETCH and best[0] // best[1] < (span - off) // best[2]:
            return None  # too short to pay for itself: walk on, a longer period may show
        _, p, stride, phases, kinds_np, full = best
        n = best[0] // p
        n_max = (span - off) // stride
        block = 8 * n
        while full and n < n_max:  # the first block was full: grow until a repetition differs
            m = min(block, n_max - n)
            got = self._repeats(i32np, off, stride, phases, kinds_np, n, m)
            n += got
            if got < m:
                break
            block *= 8
        base = off + stride * np.arange(n, dtype=np.int64)
        taken = (base[:, None] + phases[None, :]).ravel()
        return taken, off + stride * n

    def _repeats(
        self, i32np: Any, off: int, stride: int, phases: Any, kinds: Any, n0: int, m: int
    ) -> int:
        """How many of repetitions n0 .. n0+m-1 of a period, counted from the first, match."""
        np = self.np
        base = off + stride * np.arange(n0, n0 + m, dtype=np.int64)
        ok = (i32np[(base[:, None] + phases[None, :]) >> 2] == kinds[None, :]).all(axis=1)
        bad = np.flatnonzero(~ok)
        return int(bad[0]) if bad.size else m

    def field(self, views: dict, offs: Any, dt: Any, name: str) -> Any:
        """Column `name` of the records at byte offsets `offs`, all of record dtype `dt`."""
        fdt, foff = dt.fields[name][:2]
        size = fdt.itemsize
        if foff % size:
            raise LayoutMismatch(f"{name} at offset {foff} is not {size}-byte aligned")
        return views[size][(offs + foff) // size].view(fdt.newbyteorder("<"))


def c_strings(ptrs: Any) -> Any:
    """Object array of the C strings at `ptrs` (one ctypes read per distinct pointer)."""
    import ctypes

    import numpy as np

    uniq, inv = np.unique(ptrs, return_inverse=True)
    names = np.empty(len(uniq), dtype=object)
    for i, p in enumerate(uniq.tolist()):
        names[i] = ctypes.string_at(p).decode("utf-8", "replace") if p else ""
    return names[inv]


class RawBuffers:
    """Our own CUPTI buffer callbacks, registered with libcupti through ctypes.

    Why not cupti-python's `activity_register_callbacks`: it hands the callback one Python
    object per record, each built around a one-row numpy record array; measured on the H200
    (bench/results/agent-h200.json, first run) that cost the target 73% of its iterations/s on
    an eager loop and 98% on CUDA-graph replays, because that work holds the GIL. Here CUPTI
    gets plain 8-byte-aligned buffers from us and hands them back as (address, valid bytes);
    `on_buffer` reads them with numpy (BufferReader.walk_span). Still the Activity API only
    (cuptiActivityRegisterCallbacks); enabling, flushing and disabling stay in cupti-python.

    Both callbacks catch everything: an error is counted, the buffer is given back, and the
    records in it are counted as lost (`bytes_lost`).
    """

    def __init__(self, lib_path: str, on_buffer: Callable[[int, int], None]) -> None:
        import ctypes

        self.ctypes = ctypes
        self.lib = ctypes.CDLL(lib_path)
        self.on_buffer = on_buffer
        u8p = ctypes.POINTER(ctypes.c_uint8)
        req_t = ctypes.CFUNCTYPE(
            None,
            ctypes.POINTER(u8p),
            ctypes.POINTER(ctypes.c_size_t),
            ctypes.POINTER(ctypes.c_size_t),
        )
        done_t = ctypes.CFUNCTYPE(
            None, ctypes.c_void_p, ctypes.c_uint32, u8p, ctypes.c_size_t, ctypes.c_size_t
        )
        # kept referenced for the life of the process: CUPTI may call them at any time
        self._req = req_t(self._requested)
        self._done = done_t(self._completed)
        self._u8p = u8p
        self._live: dict[int, Any] = {}
        self._free: list[Any] = []
        self._lock = threading.Lock()
        self.errors = 0
        self.last_error = ""
        self.bytes_lost = 0
        self.buffers = 0
        self.requested = 0  # buffers CUPTI asked for: after a detach this must stop growing

    def register(self) -> int:
        """cuptiActivityRegisterCallbacks(ours); the CUptiResult (0 = success)."""
        fn = self.lib.cuptiActivityRegisterCallbacks
        fn.restype = self.ctypes.c_int
        fn.argtypes = [self.ctypes.c_void_p, self.ctypes.c_void_p]
        return int(
            fn(
                self.ctypes.cast(self._req, self.ctypes.c_void_p),
                self.ctypes.cast(self._done, self.ctypes.c_void_p),
            )
        )

    def _requested(self, pbuf: Any, psize: Any, pmax: Any) -> None:
        ct = self.ctypes
        try:
            self.requested += 1
            with self._lock:
                arr = self._free.pop() if self._free else None
            if arr is None:
                arr = (ct.c_uint8 * (BUFFER_BYTES + 8))()
            addr = (ct.addressof(arr) + 7) & ~7
            with self._lock:
                self._live[addr] = arr
            pbuf[0] = ct.cast(addr, self._u8p)
            psize[0] = BUFFER_BYTES
            pmax[0] = 0
        except BaseException as e:  # noqa: BLE001 - CUPTI then drops records and counts them
            self.errors += 1
            self.last_error = f"buffer request: {type(e).__name__}: {e}"
            with contextlib.suppress(BaseException):
                pbuf[0] = ct.cast(None, self._u8p)
                psize[0] = 0

    def _completed(self, ctx: Any, stream: int, buf: Any, size: int, valid: int) -> None:
        addr = 0
        try:
            addr = self.ctypes.cast(buf, self.ctypes.c_void_p).value or 0
            self.buffers += 1
            if addr and valid:
                self.on_buffer(addr, int(valid))
        except BaseException as e:  # noqa: BLE001 - nothing may raise into CUPTI
            self.errors += 1
            self.bytes_lost += int(valid or 0)
            self.last_error = f"buffer completion: {type(e).__name__}: {e}"
        finally:
            with self._lock:
                arr = self._live.pop(addr, None)
                if arr is not None and len(self._free) < 4:
                    self._free.append(arr)


# ---- the CUPTI controller -----------------------------------------------------------------------
