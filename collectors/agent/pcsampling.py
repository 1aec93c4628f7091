"""ctypes layouts of CUPTI's PC Sampling API (`cupti_pcsampling.h`, CUPTI 13.0).

Why ctypes and not cupti-python: cupti-python 13.0 does not wrap the PC Sampling API, and the
agent already talks to libcupti through ctypes for its activity buffers. Why the layouts matter:
CUPTI reads and writes these structs in place, so one wrong offset is silent memory corruption
in the user's server. tests/test_pcsampling_layout.py compiles a C program against the real
header (from the nvidia-cuda-cupti wheel) and compares every size and field offset.

Packing, from cupti_common.h: on GCC `PACKED_ALIGNMENT` is
`__attribute__((packed)) __attribute__((aligned(8)))`: no padding between fields, the struct
aligned to 8 and its size rounded up to 8. ctypes has no such attribute, so the packed structs
below use `_pack_ = 1` plus an explicit tail pad to the 8-byte multiple (`_tail`), and
`PCData` arrays (which CUPTI strides by sizeof) then have the C stride. The `*Params` structs
and `CUpti_PCSamplingConfigurationInfo` are not packed in the header: natural C layout.

`PCSampler` (below) drives one sampling range: enable and configure, Start, Stop, read;
`SamplingRanges` runs one range at a time around it for the agent's session (pcrun.py: ranges
of pc_on_ms every pc_period_ms, each while kernel activity is off, its rows sent with their
window). The plumbing is tested on the CPU against a stand-in libcupti compiled from C against
the real header; what it did on the H200 is noted above PCSampler.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import numpy as np

c_size_t = ctypes.c_size_t
c_uint8 = ctypes.c_uint8
c_uint32 = ctypes.c_uint32
c_uint64 = ctypes.c_uint64
c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p

CUPTI_STALL_REASON_STRING_SIZE = 128

# CUpti_PCSamplingCollectionMode
COLLECTION_MODE_CONTINUOUS = 1
COLLECTION_MODE_KERNEL_SERIALIZED = 2
# CUpti_PCSamplingOutputDataFormat
OUTPUT_DATA_FORMAT_PARSED = 1
# CUpti_PCSamplingConfigurationAttributeType
ATTR_SAMPLING_PERIOD = 1
ATTR_STALL_REASON = 2
ATTR_SCRATCH_BUFFER_SIZE = 3
ATTR_HARDWARE_BUFFER_SIZE = 4
ATTR_COLLECTION_MODE = 5
ATTR_ENABLE_START_STOP_CONTROL = 6
ATTR_OUTPUT_DATA_FORMAT = 7
ATTR_SAMPLING_DATA_BUFFER = 8
ATTR_WORKER_THREAD_PERIODIC_SLEEP_SPAN = 9


def _packed8(name: str, fields: list[tuple[str, type]]) -> type[ctypes.Structure]:
    """A `PACKED_ALIGNMENT` struct: fields back to back, size rounded up to 8 with `_tail`."""
    raw = type(name + "_raw", (ctypes.Structure,), {"_pack_": 1, "_fields_": fields})
    size = ctypes.sizeof(raw)
    pad = (-size) % 8
    full = list(fields) + ([("_tail", ctypes.c_uint8 * pad)] if pad else [])
    return type(name, (ctypes.Structure,), {"_pack_": 1, "_fields_": full})


CUpti_PCSamplingStallReason = _packed8(
    "CUpti_PCSamplingStallReason",
    [("pcSamplingStallReasonIndex", c_uint32), ("samples", c_uint32)],
)

CUpti_PCSamplingPCData = _packed8(
    "CUpti_PCSamplingPCData",
    [
        ("size", c_size_t),
        ("cubinCrc", c_uint64),
        ("pcOffset", c_uint64),
        ("functionIndex", c_uint32),
        ("pad", c_uint32),
        ("functionName", c_char_p),
        ("stallReasonCount", c_size_t),
        ("stallReason", ctypes.POINTER(CUpti_PCSamplingStallReason)),
        ("correlationId", c_uint32),
    ],
)

CUpti_PCSamplingData = _packed8(
    "CUpti_PCSamplingData",
    [
        ("size", c_size_t),
        ("collectNumPcs", c_size_t),
        ("totalSamples", c_uint64),
        ("droppedSamples", c_uint64),
        ("totalNumPcs", c_size_t),
        ("remainingNumPcs", c_size_t),
        ("rangeId", c_uint64),
        ("pPcData", ctypes.POINTER(CUpti_PCSamplingPCData)),
        ("nonUsrKernelsTotalSamples", c_uint64),
        ("hardwareBufferFull", c_uint8),
    ],
)


class _StallReasonData(ctypes.Structure):
    _fields_ = [("stallReasonCount", c_size_t), ("pStallReasonIndex", ctypes.POINTER(c_uint32))]


class _AttributeData(ctypes.Union):
    """The union inside CUpti_PCSamplingConfigurationInfo (24 bytes: `invalidData.data[3]`)."""

    _fields_ = [
        ("invalidData", c_uint64 * 3),
        ("samplingPeriod", c_uint32),
        ("stallReasonData", _StallReasonData),
        ("scratchBufferSize", c_size_t),
        ("hardwareBufferSize", c_size_t),
        ("collectionMode", c_uint32),  # an enum: 4 bytes on GCC
        ("enableStartStopControl", c_uint32),
        ("outputDataFormat", c_uint32),
        ("samplingDataBuffer", c_void_p),
        ("workerThreadPeriodicSleepSpan", c_uint32),
    ]


class CUpti_PCSamplingConfigurationInfo(ctypes.Structure):
    _fields_ = [
        ("attributeType", c_uint32),
        ("attributeStatus", c_uint32),
        ("attributeData", _AttributeData),
    ]


class CUpti_PCSamplingConfigurationInfoParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("pPriv", c_void_p),
        ("ctx", c_void_p),
        ("numAttributes", c_size_t),
        ("pPCSamplingConfigurationInfo", ctypes.POINTER(CUpti_PCSamplingConfigurationInfo)),
    ]


class CUpti_PCSamplingGetDataParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("pPriv", c_void_p),
        ("ctx", c_void_p),
        ("pcSamplingData", c_void_p),
    ]


class _CtxParams(ctypes.Structure):
    """The shape shared by Enable/Disable/Start/Stop params: size, pPriv, ctx."""

    _fields_ = [("size", c_size_t), ("pPriv", c_void_p), ("ctx", c_void_p)]


class CUpti_PCSamplingEnableParams(_CtxParams):
    pass


class CUpti_PCSamplingDisableParams(_CtxParams):
    pass


class CUpti_PCSamplingStartParams(_CtxParams):
    pass


class CUpti_PCSamplingStopParams(_CtxParams):
    pass


class CUpti_PCSamplingGetNumStallReasonsParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("pPriv", c_void_p),
        ("ctx", c_void_p),
        ("numStallReasons", ctypes.POINTER(c_size_t)),
    ]


class CUpti_PCSamplingGetStallReasonsParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("pPriv", c_void_p),
        ("ctx", c_void_p),
        ("numStallReasons", c_size_t),
        ("stallReasonIndex", ctypes.POINTER(c_uint32)),
        ("stallReasons", ctypes.POINTER(ctypes.c_char_p)),
    ]


class CUpti_GetSassToSourceCorrelationParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("cubin", c_void_p),
        ("functionName", c_char_p),
        ("cubinSize", c_size_t),
        ("lineNumber", c_uint32),
        ("pcOffset", c_uint64),
        ("fileName", c_void_p),  # malloc'd by CUPTI: read, then free()
        ("dirName", c_void_p),
    ]


class CUpti_GetCubinCrcParams(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("cubinSize", c_size_t),
        ("cubin", c_void_p),
        ("cubinCrc", c_uint64),
    ]


def params_size(struct: type[ctypes.Structure], last_field: str) -> int:
    """`CUPTI_PCSAMPLING_STRUCT_SIZE(type, lastfield)`: what the `size` member must hold."""
    f = getattr(struct, last_field)
    return f.offset + f.size


# The `...ParamsSize` macros of the header, by struct name.
PARAMS_LAST_FIELD: dict[str, str] = {
    "CUpti_PCSamplingConfigurationInfoParams": "pPCSamplingConfigurationInfo",
    "CUpti_PCSamplingGetDataParams": "pcSamplingData",
    "CUpti_PCSamplingEnableParams": "ctx",
    "CUpti_PCSamplingDisableParams": "ctx",
    "CUpti_PCSamplingStartParams": "ctx",
    "CUpti_PCSamplingStopParams": "ctx",
    "CUpti_PCSamplingGetNumStallReasonsParams": "numStallReasons",
    "CUpti_PCSamplingGetStallReasonsParams": "stallReasons",
    "CUpti_GetSassToSourceCorrelationParams": "dirName",
    "CUpti_GetCubinCrcParams": "cubinCrc",
}

STRUCTS: dict[str, type[ctypes.Structure]] = {
    "CUpti_PCSamplingStallReason": CUpti_PCSamplingStallReason,
    "CUpti_PCSamplingPCData": CUpti_PCSamplingPCData,
    "CUpti_PCSamplingData": CUpti_PCSamplingData,
    "CUpti_PCSamplingConfigurationInfo": CUpti_PCSamplingConfigurationInfo,
    "CUpti_PCSamplingConfigurationInfoParams": CUpti_PCSamplingConfigurationInfoParams,
    "CUpti_PCSamplingGetDataParams": CUpti_PCSamplingGetDataParams,
    "CUpti_PCSamplingEnableParams": CUpti_PCSamplingEnableParams,
    "CUpti_PCSamplingDisableParams": CUpti_PCSamplingDisableParams,
    "CUpti_PCSamplingStartParams": CUpti_PCSamplingStartParams,
    "CUpti_PCSamplingStopParams": CUpti_PCSamplingStopParams,
    "CUpti_PCSamplingGetNumStallReasonsParams": CUpti_PCSamplingGetNumStallReasonsParams,
    "CUpti_PCSamplingGetStallReasonsParams": CUpti_PCSamplingGetStallReasonsParams,
    "CUpti_GetSassToSourceCorrelationParams": CUpti_GetSassToSourceCorrelationParams,
    "CUpti_GetCubinCrcParams": CUpti_GetCubinCrcParams,
}


# -- the sampler --------------------------------------------------------------------------------
# What it does follows what worked on the H200 (bench/results/pcsampling-h200.json for this
# code): CONTINUOUS mode with start/stop control, all stall reasons, a large hardware
# buffer, one Start/Stop around a stretch of launches; after Stop, the records already in the
# configured buffer are read first (GetData would overwrite them), then GetData until no PCs
# remain. Seen on the H200 with this code: 1.6-1.9 M samples per 200 ms range of a decode +
# prefill loop, none dropped, hardware buffer never full; the first Enable took 0.2 s and the
# first Start 0.47 s, later Starts 0.2 ms; Stop plus the reads 0.23-0.29 s of wall time.
# CUPTI refuses kernel activity (cuptiActivityEnable: ERROR_NOT_COMPATIBLE) while PC sampling
# is enabled on the context, so the agent disables one before enabling the other.
# `functionName` is not freed: whether CUPTI allocates it per record is not documented.
CUPTI_ERRORS: dict[int, str] = {
    1: "CUPTI_ERROR_INVALID_PARAMETER",
    7: "CUPTI_ERROR_INVALID_OPERATION",
    8: "CUPTI_ERROR_OUT_OF_MEMORY (hardware buffer full)",
    14: "CUPTI_ERROR_NOT_COMPATIBLE (another profiler holds the counters)",
    15: "CUPTI_ERROR_NOT_INITIALIZED",
    27: "CUPTI_ERROR_NOT_SUPPORTED",
    35: "CUPTI_ERROR_INSUFFICIENT_PRIVILEGES (ERR_NVGPUCTRPERM: counters restricted to admins)",
    39: "CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED (another profiler)",
}


class CuptiError(RuntimeError):
    """A CUPTI call failed; `str()` is one line naming the call and the error."""

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        super().__init__(f"{call}: {CUPTI_ERRORS.get(code, f'CUPTI error {code}')}")


def _ctx_params(cls: type[ctypes.Structure], ctx: int) -> ctypes.Structure:
    p = cls()
    p.size = params_size(cls, "ctx")
    p.ctx = ctx
    return p


class PCBuffer:
    """A CUpti_PCSamplingData with room for `max_pcs` records of `num_reasons` reasons each,
    every pointer owned by this object (CUPTI writes into it; Python must keep it alive).

    The stall-reason arrays of all records are one block (record i's at i * num_reasons), so
    `columns` reads a whole buffer with numpy: a range of the H200 decode loop held ~52,000
    records, which `rows` (one Python object per row) took ~0.1 s of the GIL to turn into rows.
    """

    def __init__(self, max_pcs: int, num_reasons: int) -> None:
        self.max_pcs, self.num_reasons = max_pcs, num_reasons
        self.pcs = (CUpti_PCSamplingPCData * max_pcs)()
        self.block = (CUpti_PCSamplingStallReason * (max_pcs * max(num_reasons, 1)))()
        rsize = ctypes.sizeof(CUpti_PCSamplingStallReason)
        base = ctypes.addressof(self.block)
        self.reason_addrs = [base + i * num_reasons * rsize for i in range(max_pcs)]
        for i in range(max_pcs):
            self.pcs[i].size = ctypes.sizeof(CUpti_PCSamplingPCData)
            self.pcs[i].stallReason = ctypes.cast(
                self.reason_addrs[i], ctypes.POINTER(CUpti_PCSamplingStallReason)
            )
        self.data = CUpti_PCSamplingData()
        self.data.size = ctypes.sizeof(CUpti_PCSamplingData)
        self.data.collectNumPcs = max_pcs
        self.data.pPcData = ctypes.cast(self.pcs, ctypes.POINTER(CUpti_PCSamplingPCData))

    def rows(self, names: dict[int, str]) -> list[dict]:
        """The records CUPTI wrote: one row per (PC, stall reason) with samples > 0."""
        out = []
        for i in range(int(self.data.totalNumPcs)):
            pc = self.pcs[i]
            fn = pc.functionName.decode("utf-8", "replace") if pc.functionName else ""
            for j in range(int(pc.stallReasonCount)):
                r = pc.stallReason[j]
                if r.samples:
                    idx = int(r.pcSamplingStallReasonIndex)
                    out.append(
                        {
                            "kernel": fn,
                            "cubin_crc": int(pc.cubinCrc),
                            "pc_offset": int(pc.pcOffset),
                            "stall_reason": names.get(idx, f"reason_{idx}"),
                            "count": int(r.samples),
                        }
                    )
        return out

    def columns(self, names: dict[int, str]) -> dict[str, np.ndarray]:
        """`rows` as columns (kernel and stall_reason as object arrays of str, cubin_crc as the
        uint64 CRC's int64 bits), read with numpy. Falls back to `rows` if CUPTI moved a
        record's stall-reason pointer away from our block."""
        n = int(self.data.totalNumPcs)
        if n == 0:
            return empty_columns()
        f = CUpti_PCSamplingPCData
        pc_dt = np.dtype(
            {
                "names": ["crc", "off", "fn", "count", "reasons"],
                "formats": ["<u8", "<u8", "<u8", "<u8", "<u8"],
                "offsets": [
                    f.cubinCrc.offset,
                    f.pcOffset.offset,
                    f.functionName.offset,
                    f.stallReasonCount.offset,
                    f.stallReason.offset,
                ],
                "itemsize": ctypes.sizeof(f),
            }
        )
        pcs = np.frombuffer(self.pcs, dtype=pc_dt, count=min(n, self.max_pcs))
        if not np.array_equal(pcs["reasons"], np.asarray(self.reason_addrs[: len(pcs)], "u8")):
            return columns_from_rows(self.rows(names))
        r_dt = np.dtype({"names": ["idx", "n"], "formats": ["<u4", "<u4"], "offsets": [0, 4]})
        nr = self.num_reasons
        block = np.frombuffer(self.block, dtype=r_dt).reshape(self.max_pcs, nr)[: len(pcs)]
        used = np.arange(nr)[None, :] < np.minimum(pcs["count"], nr).astype(np.int64)[:, None]
        ii, jj = np.nonzero(used & (block["n"] > 0))
        uniq_fn, inv = np.unique(pcs["fn"], return_inverse=True)
        fn_names = np.array(
            [ctypes.string_at(int(p)).decode("utf-8", "replace") if p else "" for p in uniq_fn],
            dtype=object,
        )
        idx = block["idx"][ii, jj]
        uniq_r, inv_r = np.unique(idx, return_inverse=True)
        r_names = np.array([names.get(int(i), f"reason_{int(i)}") for i in uniq_r], dtype=object)
        return {
            "kernel": fn_names[inv][ii],
            "cubin_crc": pcs["crc"][ii].view(np.int64),
            "pc_offset": pcs["off"][ii].astype(np.int64),
            "stall_reason": r_names[inv_r] if len(idx) else np.array([], dtype=object),
            "count": block["n"][ii, jj].astype(np.int64),
        }

    def stats(self) -> dict[str, int]:
        d = self.data
        return {
            "total_samples": int(d.totalSamples),
            "dropped_samples": int(d.droppedSamples),
            "non_user_samples": int(d.nonUsrKernelsTotalSamples),
            "hardware_buffer_full": int(d.hardwareBufferFull),
            "range_id": int(d.rangeId),
        }

    def reset(self) -> None:
        self.data.totalNumPcs = 0
        self.data.remainingNumPcs = 0


SAMPLE_COLUMNS = ("kernel", "cubin_crc", "pc_offset", "stall_reason", "count")


def empty_columns() -> dict[str, np.ndarray]:
    return {
        "kernel": np.array([], dtype=object),
        "cubin_crc": np.array([], dtype=np.int64),
        "pc_offset": np.array([], dtype=np.int64),
        "stall_reason": np.array([], dtype=object),
        "count": np.array([], dtype=np.int64),
    }


def columns_from_rows(rows: list[dict]) -> dict[str, np.ndarray]:
    if not rows:
        return empty_columns()
    return {
        "kernel": np.array([r["kernel"] for r in rows], dtype=object),
        "cubin_crc": np.array([r["cubin_crc"] for r in rows], dtype=np.uint64).view(np.int64),
        "pc_offset": np.array([r["pc_offset"] for r in rows], dtype=np.int64),
        "stall_reason": np.array([r["stall_reason"] for r in rows], dtype=object),
        "count": np.array([r["count"] for r in rows], dtype=np.int64),
    }


def concat_columns(parts: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    parts = [p for p in parts if len(p["count"])]
    if not parts:
        return empty_columns()
    return {c: np.concatenate([p[c] for p in parts]) for c in SAMPLE_COLUMNS}


class PCSampler:
    """PC sampling on one CUDA context through libcupti's C API (see the block comment above).

    Use: `s = PCSampler(lib, ctx); s.enable(); s.start(); ...launches...; rows, stats =
    s.stop(); s.disable()`. The caller synchronises the device before `start` and `stop` (the
    H200 run did, and CUPTI's Stop decodes what the hardware buffer holds at that moment).
    """

    def __init__(
        self,
        lib: ctypes.CDLL,
        ctx: int,
        *,
        period: int = 11,
        hardware_buffer: int = 256 << 20,
        scratch_buffer: int = 32 << 20,
        max_pcs: int = 8192,
    ) -> None:
        self.lib, self.ctx = lib, ctx
        self.period, self.hw, self.scratch, self.max_pcs = (
            period,
            hardware_buffer,
            scratch_buffer,
            max_pcs,
        )
        self.reason_names: dict[int, str] = {}
        self.config_buf: PCBuffer | None = None
        self.read_buf: PCBuffer | None = None
        self.enabled = False

    def _call(self, name: str, params: ctypes.Structure) -> None:
        rc = getattr(self.lib, name)(ctypes.byref(params))
        if rc != 0:
            raise CuptiError(name, int(rc))

    def stall_reasons(self) -> dict[int, str]:
        """CUPTI's stall-reason index -> name (e.g. "smsp__pcsamp_warps_issue_stalled_wait")."""
        n = c_size_t(0)
        p = CUpti_PCSamplingGetNumStallReasonsParams()
        p.size = params_size(CUpti_PCSamplingGetNumStallReasonsParams, "numStallReasons")
        p.ctx = self.ctx
        p.numStallReasons = ctypes.pointer(n)
        self._call("cuptiPCSamplingGetNumStallReasons", p)
        count = int(n.value)
        idx = (c_uint32 * count)()
        bufs = [ctypes.create_string_buffer(CUPTI_STALL_REASON_STRING_SIZE) for _ in range(count)]
        ptrs = (ctypes.c_char_p * count)(*[ctypes.cast(b, ctypes.c_char_p) for b in bufs])
        q = CUpti_PCSamplingGetStallReasonsParams()
        q.size = params_size(CUpti_PCSamplingGetStallReasonsParams, "stallReasons")
        q.ctx = self.ctx
        q.numStallReasons = count
        q.stallReasonIndex = idx
        q.stallReasons = ptrs
        self._call("cuptiPCSamplingGetStallReasons", q)
        return {int(idx[i]): bufs[i].value.decode("utf-8", "replace") for i in range(count)}

    def enable(self) -> None:
        """Enable on the context and configure: all reasons, CONTINUOUS, start/stop control."""
        self._call("cuptiPCSamplingEnable", _ctx_params(CUpti_PCSamplingEnableParams, self.ctx))
        self.enabled = True
        self.reason_names = self.stall_reasons()
        n = len(self.reason_names)
        if self.config_buf is None or self.config_buf.num_reasons != n:  # kept across ranges
            self.config_buf = PCBuffer(self.max_pcs, n)
            self.read_buf = PCBuffer(self.max_pcs, n)
        self._reason_idx = (c_uint32 * n)(*sorted(self.reason_names))
        infos = (CUpti_PCSamplingConfigurationInfo * 7)()
        settings = [
            (ATTR_SAMPLING_PERIOD, "samplingPeriod", self.period),
            (ATTR_SCRATCH_BUFFER_SIZE, "scratchBufferSize", self.scratch),
            (ATTR_HARDWARE_BUFFER_SIZE, "hardwareBufferSize", self.hw),
            (ATTR_COLLECTION_MODE, "collectionMode", COLLECTION_MODE_CONTINUOUS),
            (ATTR_ENABLE_START_STOP_CONTROL, "enableStartStopControl", 1),
            (ATTR_OUTPUT_DATA_FORMAT, "outputDataFormat", OUTPUT_DATA_FORMAT_PARSED),
        ]
        for i, (attr, field_name, value) in enumerate(settings):
            infos[i].attributeType = attr
            setattr(infos[i].attributeData, field_name, value)
        infos[6].attributeType = ATTR_STALL_REASON
        infos[6].attributeData.stallReasonData.stallReasonCount = n
        infos[6].attributeData.stallReasonData.pStallReasonIndex = self._reason_idx
        self._infos = infos
        # The sampling data buffer separately: CUPTI wants a pointer to our CUpti_PCSamplingData.
        buf_info = (CUpti_PCSamplingConfigurationInfo * 1)()
        buf_info[0].attributeType = ATTR_SAMPLING_DATA_BUFFER
        buf_info[0].attributeData.samplingDataBuffer = ctypes.cast(
            ctypes.pointer(self.config_buf.data), c_void_p
        )
        self._buf_info = buf_info
        for arr, count in ((infos, 7), (buf_info, 1)):
            p = CUpti_PCSamplingConfigurationInfoParams()
            p.size = params_size(
                CUpti_PCSamplingConfigurationInfoParams, "pPCSamplingConfigurationInfo"
            )
            p.ctx = self.ctx
            p.numAttributes = count
            p.pPCSamplingConfigurationInfo = arr
            self._call("cuptiPCSamplingSetConfigurationAttribute", p)

    def start(self) -> None:
        assert self.config_buf is not None
        self.config_buf.reset()
        self._call("cuptiPCSamplingStart", _ctx_params(CUpti_PCSamplingStartParams, self.ctx))

    def stop(self) -> tuple[list[dict], dict[str, int]]:
        """Stop the range; its rows (configured buffer first, then GetData until empty) and
        the range's totals (samples, dropped, hardware buffer full)."""
        parts, stats = self._stop_and_read(lambda b: b.rows(self.reason_names))
        return [r for p in parts for r in p], stats

    def stop_columns(self) -> tuple[dict[str, np.ndarray], dict[str, int]]:
        """`stop`, read with numpy into the columns of `PCBuffer.columns`."""
        parts, stats = self._stop_and_read(lambda b: b.columns(self.reason_names))
        return concat_columns(parts), stats

    def _stop_and_read(self, read: Any) -> tuple[list[Any], dict[str, int]]:
        assert self.config_buf is not None and self.read_buf is not None
        self._call("cuptiPCSamplingStop", _ctx_params(CUpti_PCSamplingStopParams, self.ctx))
        parts = [read(self.config_buf)]
        stats = self.config_buf.stats()
        for _ in range(1_000_000):
            self.read_buf.reset()
            p = CUpti_PCSamplingGetDataParams()
            p.size = params_size(CUpti_PCSamplingGetDataParams, "pcSamplingData")
            p.ctx = self.ctx
            p.pcSamplingData = ctypes.cast(ctypes.pointer(self.read_buf.data), c_void_p)
            self._call("cuptiPCSamplingGetData", p)
            parts.append(read(self.read_buf))
            # The range's totals come from the configured buffer (on the H200 GetData was
            # called once per range, with nothing left to read).
            stats["get_data_calls"] = stats.get("get_data_calls", 0) + 1
            stats["hardware_buffer_full"] |= int(self.read_buf.data.hardwareBufferFull)
            if self.read_buf.data.remainingNumPcs == 0 or self.read_buf.data.totalNumPcs == 0:
                break
        return parts, stats

    def disable(self) -> None:
        if self.enabled:
            self.enabled = False
            self._call(
                "cuptiPCSamplingDisable", _ctx_params(CUpti_PCSamplingDisableParams, self.ctx)
            )


# -- a CUDA context and one sampling range at a time, for the agent's own thread ------------------
CUDA_SUCCESS = 0


class CudaError(RuntimeError):
    """A CUDA driver call failed; `str()` is one line naming the call."""

    def __init__(self, call: str, code: int) -> None:
        self.call, self.code = call, code
        super().__init__(f"{call}: CUDA error {code}")


class NoActiveContext(CudaError):
    """The process has made no CUDA context (yet): a process of the tree that maps libcuda
    without using a GPU (a compile worker), or a server before its model loads."""


class CudaContext:
    """The primary context of the target's GPU, reached from a thread of the agent's own.

    Why the primary context: torch (and SGLang on it) runs on each device's primary context,
    and the agent's thread has no current context of its own. Why only an active one: retaining
    the primary context of a device the target never used would create a context there
    (hundreds of MB of GPU memory in the user's server), so a device is chosen only among those
    whose primary context is already active (`cuDevicePrimaryCtxGetState`), the `device` hint
    first (the device kernel records came from).
    """

    def __init__(self, device: int | None = None, libcuda: str = "libcuda.so.1") -> None:
        lib = ctypes.PyDLL(libcuda)  # the GIL stays held in these calls: see SamplingRanges
        self.lib = lib
        # cuda.h maps these names to their _v2 entry points; the unversioned symbols are the
        # old ABI (cuCtxPushCurrent refused the primary context with error 201 on the H200)
        self._push = self._fn("cuCtxPushCurrent")
        self._pop = self._fn("cuCtxPopCurrent")
        self._release = self._fn("cuDevicePrimaryCtxRelease")
        self._chk("cuInit", lib.cuInit(0))
        n = ctypes.c_int(0)
        self._chk("cuDeviceGetCount", lib.cuDeviceGetCount(ctypes.byref(n)))
        order = list(range(n.value))
        if device is not None and device in order:
            order.remove(device)
            order.insert(0, device)
        self.dev = None
        for ordinal in order:
            dev = ctypes.c_int(0)
            self._chk("cuDeviceGet", lib.cuDeviceGet(ctypes.byref(dev), ordinal))
            flags, active = c_uint32(0), ctypes.c_int(0)
            self._chk(
                "cuDevicePrimaryCtxGetState",
                lib.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)),
            )
            if active.value:
                self.dev, self.ordinal = dev, ordinal
                break
        if self.dev is None:
            raise NoActiveContext(
                "cuDevicePrimaryCtxGetState (no device with an active context)", -1
            )
        ctx = c_void_p(0)
        self._chk(
            "cuDevicePrimaryCtxRetain", lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), self.dev)
        )
        self.ctx = int(ctx.value or 0)
        self.pushed = False

    def _fn(self, name: str):
        """`name`_v2 where the driver has it (as cuda.h would call), else `name`."""
        return getattr(self.lib, name + "_v2", None) or getattr(self.lib, name)

    @staticmethod
    def _chk(call: str, rc: int) -> None:
        if rc != CUDA_SUCCESS:
            raise CudaError(call, int(rc))

    def push(self) -> None:
        """Make the context current on this thread (CUPTI's PC sampling calls are made here)."""
        if not self.pushed:
            self._chk("cuCtxPushCurrent", self._push(c_void_p(self.ctx)))
            self.pushed = True

    def pop(self) -> None:
        if self.pushed:
            old = c_void_p(0)
            self.pushed = False
            self._chk("cuCtxPopCurrent", self._pop(ctypes.byref(old)))

    def synchronize(self) -> None:
        """Wait for the GPU work queued so far (the H200 run synchronised around Start/Stop)."""
        self._chk("cuCtxSynchronize", self.lib.cuCtxSynchronize())

    def release(self) -> None:
        self.pop()
        if self.dev is not None:
            self._release(self.dev)
            self.dev = None


# Sampling period (2^N cycles) of the agent's ranges: at 2^11 a 200 ms range of the H200 decode
# loop held ~1.8 M samples, whose decoding in Stop would hold the target's GIL for ~0.25 s;
# 2^13 takes a quarter of them (still ~450,000 a range: plenty for line heat).
RANGE_PERIOD = 13


# the parts of a range during which the GIL is held (wall ms, see SamplingRanges.run)
HELD_PARTS = ("sync_ms", "enable_ms", "start_ms", "stop_ms", "disable_ms")


class SamplingRanges:
    """One PC-sampling range at a time: enable, start, wait, stop and read, disable.

    Enabled only for the range: CUPTI refuses kernel activity while PC sampling is enabled on
    the context (ERROR_NOT_COMPATIBLE on the H200), so between ranges the agent's activity duty
    cycle runs as before. Every figure a user needs to judge the cost is kept: the wall time of
    enable/start/stop and this thread's CPU time for stop and the reads.
    """

    def __init__(
        self,
        libcupti: str,
        *,
        device: int | None = None,
        libcuda: str = "libcuda.so.1",
        period: int = RANGE_PERIOD,
    ) -> None:
        self.cuda = CudaContext(device, libcuda)
        # PyDLL: the GIL stays held inside every CUPTI and driver call of a range. With
        # ctypes.CDLL (the GIL released) a range started from a second thread while the main
        # thread launched kernels hung the process for good, with or without kernel activity
        # registered; holding the GIL, the same range completed
        # (bench/results/pcs-thread-h200.json). The price: the target's Python waits during
        # Stop's decoding (~135 ns a sample there), hence the coarser default period.
        self.sampler = PCSampler(ctypes.PyDLL(libcupti), self.cuda.ctx, period=period)
        self.ranges = 0
        self.where: list[str] = []  # where the last range began and ended (see `run`)
        # the GPU drained before a range's start and before its stop; "0" in the target's
        # environment (KDASH_AGENT_PC_SYNC) skips both, to measure what the drains cost
        self.sync = os.environ.get("KDASH_AGENT_PC_SYNC", "1") != "0"
        self.last: dict[str, float] = {}
        self.cpu_ms_total = 0.0
        self.held_ms_total = 0.0

    def run(
        self, on_s: float, cut_short: Any = None, at_call: Any = None
    ) -> tuple[dict[str, np.ndarray], dict]:
        """One range of `on_s` seconds (`cut_short`, a threading.Event, ends it early).

        `at_call(fn) -> str` runs `fn` on the target's own thread at its next CUDA call
        (detach.run_in_target: "target", or "here: <why>" when it ran on this thread); the
        range's beginning (enable, start) and end (stop, reads, disable) go through it when
        given, so that no launch of the target's thread is in flight during those calls."""
        import time

        t: dict[str, float] = {}
        got: dict[str, Any] = {}

        def begin() -> None:
            self.cuda.push()
            try:
                t0 = time.perf_counter()
                if self.sync:
                    self.cuda.synchronize()
                t["sync_ms"] = (time.perf_counter() - t0) * 1e3
                t0 = time.perf_counter()
                self.sampler.enable()
                t["enable_ms"] = (time.perf_counter() - t0) * 1e3
                try:
                    t0 = time.perf_counter()
                    self.sampler.start()
                    t["start_ms"] = (time.perf_counter() - t0) * 1e3
                except BaseException:
                    self.sampler.disable()
                    raise
            finally:
                self.cuda.pop()

        def end() -> None:
            self.cuda.push()
            try:
                t0 = time.perf_counter()
                if self.sync:
                    self.cuda.synchronize()
                t["sync_ms"] = t.get("sync_ms", 0.0) + (time.perf_counter() - t0) * 1e3
                t0, c0 = time.perf_counter(), time.thread_time()
                try:
                    got["cols"], got["stats"] = self.sampler.stop_columns()
                    t["stop_ms"] = (time.perf_counter() - t0) * 1e3
                    t["stop_cpu_ms"] = (time.thread_time() - c0) * 1e3
                finally:
                    t0 = time.perf_counter()
                    self.sampler.disable()
                    t["disable_ms"] = (time.perf_counter() - t0) * 1e3
            finally:
                self.cuda.pop()

        run = at_call if at_call is not None else lambda fn: fn() or "here"
        where = [run(begin)]
        try:
            if cut_short is not None:
                cut_short.wait(on_s)
            else:
                time.sleep(on_s)
        finally:
            where.append(run(end))
        self.where = where
        cols, stats = got["cols"], got["stats"]
        self.ranges += 1
        self.cpu_ms_total += t.get("stop_cpu_ms", 0.0)
        # every call above holds the target for as long as it takes, waiting on the driver
        # included (CPU time misses that): run on its own thread, or through PyDLL holding its
        # GIL
        self.held_ms_total += sum(t.get(k, 0.0) for k in HELD_PARTS)
        self.last = {k: round(v, 2) for k, v in t.items()}
        return cols, {**stats, **self.last, "began_on": where[0], "ended_on": where[1]}

    def close(self) -> None:
        self.cuda.release()
