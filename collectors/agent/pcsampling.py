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

Only the layouts and the constants are here and tested (on the CPU). The sampling loop that the
issue describes (ranges on a duty cycle, CONTINUOUS mode with start/stop control, reading the
configured buffer after Stop, then GetData until no PCs remain) is NOT written yet: it cannot be
tested without a GPU.
"""

from __future__ import annotations

import ctypes

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
