"""Stand-in for cupti-python's `cupti.cupti` (test fixture: this machine has no GPU and no CUPTI).

It implements the handful of cupti-python calls the agent makes, logs each
enable/disable/flush with a timestamp to $FAKE_CUPTI_LOG, and on every flush hands the agent
generated records (kernels, API calls, copies, a memset, a synchronization, an NVTX range).
The tests put its folder first on a child's PYTHONPATH (tests/test_agent.py, `fake_cupti`),
or load it by path in-process; the FAKE_CUPTI_* environment variables steer it.

Records are laid out back to back in one buffer with the byte layout of cupti-python 13.0's
record dtypes (only the fields kdash reads are declared), and each record object carries both
`.ptr` into that buffer and the attributes, like cupti-python's objects do.
"""

import ctypes
import enum
import os
import threading
import time
from types import SimpleNamespace as NS

import numpy as np


class ActivityKind(enum.IntEnum):
    MEMCPY = 1
    MEMSET = 2
    KERNEL = 3
    DRIVER = 4
    RUNTIME = 5
    MARKER = 12
    CONCURRENT_KERNEL = 10
    SYNCHRONIZATION = 38


class CallbackDomain(enum.IntEnum):
    DRIVER_API = 1
    RUNTIME_API = 2


class ActivityMemcpyKind(enum.IntEnum):
    UNKNOWN = 0
    HTOD = 1
    DTOH = 2


class ActivitySynchronizationType(enum.IntEnum):
    UNKNOWN = 0
    STREAM_SYNCHRONIZE = 3


class Result(enum.IntEnum):
    SUCCESS = 0
    ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED = 39


class cuptiError(Exception):
    def __init__(self, status):
        super().__init__(f"CUPTI error {status}")
        self.status = status


def _dt(itemsize, **fields):
    names = list(fields)
    return np.dtype(
        {
            "names": names,
            "formats": [fields[n][0] for n in names],
            "offsets": [fields[n][1] for n in names],
            "itemsize": itemsize,
        }
    )


activity_kernel10_dtype = _dt(
    216,
    kind=("<i4", 0),
    registers_per_thread=("<u2", 6),
    start=("<u8", 16),
    end=("<u8", 24),
    device_id=("<u4", 40),
    stream_id=("<u4", 48),
    grid_x=("<i4", 52),
    grid_y=("<i4", 56),
    grid_z=("<i4", 60),
    block_x=("<i4", 64),
    block_y=("<i4", 68),
    block_z=("<i4", 72),
    static_shared_memory=("<i4", 76),
    dynamic_shared_memory=("<i4", 80),
    correlation_id=("<u4", 92),
    name=("<i8", 104),
    graph_id=("<u4", 156),
)
activity_api_dtype = _dt(
    40,
    kind=("<i4", 0),
    cbid=("<u4", 4),
    start=("<u8", 8),
    end=("<u8", 16),
    process_id=("<u4", 24),
    thread_id=("<u4", 28),
    correlation_id=("<u4", 32),
)
activity_memcpy6_dtype = _dt(
    96,
    kind=("<i4", 0),
    copy_kind=("u1", 4),
    bytes=("<u8", 8),
    start=("<u8", 16),
    end=("<u8", 24),
    device_id=("<u4", 32),
    stream_id=("<u4", 40),
    correlation_id=("<u4", 44),
    graph_id=("<u4", 72),
)
activity_memset4_dtype = _dt(
    88,
    kind=("<i4", 0),
    bytes=("<u8", 8),
    start=("<u8", 16),
    end=("<u8", 24),
    device_id=("<u4", 32),
    stream_id=("<u4", 40),
    correlation_id=("<u4", 44),
    graph_id=("<u4", 72),
)
activity_synchronization2_dtype = _dt(
    56,
    kind=("<i4", 0),
    type=("<i4", 4),
    start=("<u8", 8),
    end=("<u8", 16),
    correlation_id=("<u4", 24),
    stream_id=("<u4", 32),
)
_pt = np.dtype(
    {
        "names": ["pt"],
        "formats": [np.dtype([("process_id", "<u4"), ("thread_id", "<u4")])],
        "offsets": [0],
        "itemsize": 12,
    }
)
activity_marker2_dtype = _dt(
    56,
    kind=("<i4", 0),
    flags_=("<i4", 4),
    timestamp=("<u8", 8),
    id=("<u4", 16),
    object_kind=("<i4", 20),
    object_id=(_pt, 24),
    name=("<i8", 40),
    domain=("<i8", 48),
)
if os.environ.get("FAKE_CUPTI_NO_DTYPES"):
    del activity_kernel10_dtype

_DTYPES = {
    1: "activity_memcpy6_dtype",
    2: "activity_memset4_dtype",
    3: "activity_kernel10_dtype",
    4: "activity_api_dtype",
    5: "activity_api_dtype",
    10: "activity_kernel10_dtype",
    12: "activity_marker2_dtype",
    38: "activity_synchronization2_dtype",
}
_cstrings = {}


def _cstr(s):
    if s not in _cstrings:
        _cstrings[s] = ctypes.create_string_buffer(s.encode())
    return ctypes.addressof(_cstrings[s])


def materialize(specs):
    """Lay out records (dicts with 'kind' and attribute values) in one buffer."""
    dts = [globals()[_DTYPES[r["kind"]]] for r in specs]
    total = sum(d.itemsize for d in dts)
    buf = np.zeros(total + 8, dtype=np.uint8)
    shift = (-buf.ctypes.data) % 8
    objs, off = [], shift
    for r, d in zip(specs, dts, strict=True):
        rec = np.ndarray((1,), dtype=d, buffer=buf, offset=off)
        for k, v in r.items():
            if k == "object_id" and k in d.names:
                rec["object_id"]["pt"]["thread_id"] = v.pt.thread_id
            elif k in d.names:
                rec[k] = _cstr(v) if k in ("name", "domain") and isinstance(v, str) else v
        objs.append(NS(ptr=buf.ctypes.data + off, **r))
        off += d.itemsize
    return buf, objs


SKEW = 1_000_000_000  # this clock runs 1 s ahead of time.monotonic_ns
_raw = None  # a compiled stand-in libcupti (FAKE_CUPTI_LIB) for the agent's raw-buffer path
if os.environ.get("FAKE_CUPTI_LIB"):
    _raw = ctypes.CDLL(os.environ["FAKE_CUPTI_LIB"])
    _raw.fake_emit.argtypes = [
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_int,
        ctypes.c_uint32,
        ctypes.c_int,
    ]
_enabled = set()
_owed = [False]  # kernels ran while CONCURRENT_KERNEL was on and no flush has delivered them
_callbacks = None
_corr = [0]


def _log(what):
    with open(os.environ["FAKE_CUPTI_LOG"], "a") as f:
        f.write(f"{time.monotonic():.6f} {what}\n")


def get_timestamp():
    return time.monotonic_ns() + SKEW


def activity_register_callbacks(requested, completed):
    global _callbacks
    _callbacks = (requested, completed)
    if _raw is not None:
        _raw.fake_clear()  # CUPTI keeps only the last registration
    _log("register")


def activity_enable(kind):
    if os.environ.get("FAKE_CUPTI_HELD"):
        raise cuptiError(Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED)
    _enabled.add(int(kind))
    if int(kind) == ActivityKind.CONCURRENT_KERNEL:
        _owed[0] = True
    _log(f"enable {int(kind)}")


def activity_disable(kind):
    _enabled.discard(int(kind))
    _log(f"disable {int(kind)}")


def activity_flush_period(ms):
    _log(f"period {ms}")


def activity_get_num_dropped_records(context, stream_id, addr):
    ctypes.c_size_t.from_address(addr).value = 5 if _enabled else 0


class runtime_api_trace_cbid(enum.IntEnum):
    INVALID = 0
    cudaGetDevice_v3020 = 17
    cudaStreamSynchronize_v3020 = 131
    cudaLaunchKernel_v7000 = 211
    cudaGraphLaunch_v10000 = 311


def activity_enable_runtime_api(cbid, enable):
    _log(f"rtapi {int(cbid)} {int(enable)}")


def get_callback_name(domain, cbid):
    return {1: "cuLaunchKernel", 2: "cudaLaunchKernel"}[int(domain)]


# CUPTI names a record's thread by pthread_self() cut to 32 bits: the main thread's here.
_PTHREAD = threading.main_thread().ident & 0xFFFFFFFF


def generated_specs(now, n=1000):
    pid = os.getpid()
    recs = []
    for i in range(n):
        _corr[0] += 1
        c = _corr[0]
        recs.append(
            dict(
                kind=5,
                cbid=7,
                start=now - 5000,
                end=now - 4000,
                process_id=pid,
                thread_id=_PTHREAD,
                correlation_id=c,
            )
        )
        recs.append(
            dict(
                kind=10,
                start=now - 3000 + i,
                end=now - 1000 + i,
                name=f"fake_gemm_{i % 3}",
                device_id=0,
                stream_id=7,
                grid_x=128,
                grid_y=1,
                grid_z=1,
                block_x=256,
                block_y=1,
                block_z=1,
                registers_per_thread=64,
                static_shared_memory=1024,
                dynamic_shared_memory=49152,
                correlation_id=c,
                graph_id=(5 if i % 2 and os.environ.get("FAKE_CUPTI_GRAPHS") else 0),
            )
        )
    recs.append(
        dict(
            kind=1,
            copy_kind=1,
            bytes=4096,
            start=now - 900,
            end=now - 800,
            device_id=0,
            stream_id=7,
            correlation_id=1,
        )
    )
    recs.append(
        dict(
            kind=2,
            bytes=64,
            start=now - 700,
            end=now - 650,
            device_id=0,
            stream_id=7,
            correlation_id=2,
        )
    )
    recs.append(
        dict(kind=38, type=3, start=now - 600, end=now - 100, correlation_id=3, stream_id=7)
    )
    pt = NS(pt=NS(process_id=pid, thread_id=_PTHREAD))
    recs.append(
        dict(
            kind=12,
            flags_=2,
            timestamp=now - 950,
            id=_corr[0],
            name="decode_step",
            domain="sglang",
            object_id=pt,
        )
    )
    recs.append(
        dict(kind=12, flags_=4, timestamp=now - 50, id=_corr[0], name="", domain="", object_id=pt)
    )
    return recs


def finalize():
    _enabled.clear()
    _log("finalize")


def activity_flush_all(flag):
    _log(f"flush {flag}")
    if ActivityKind.CONCURRENT_KERNEL not in _enabled:
        if not _owed[0]:
            return
        _owed[0] = False  # records of a window that has just ended: delivered once
    if _raw is not None and _raw.fake_registered():
        _corr[0] += 1
        bad = 1 if os.environ.get("FAKE_CUPTI_BAD_RAW") else 0
        bad = 2 if os.environ.get("FAKE_CUPTI_BAD_TIMES") else bad
        _raw.fake_emit(1000, get_timestamp(), 1, _corr[0], bad)
        return
    if _callbacks is None:
        return
    buf, objs = materialize(generated_specs(get_timestamp()))
    _callbacks[1](objs)
    del buf
