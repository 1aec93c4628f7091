"""The agent's ctypes PC Sampling structs against the real `cupti_pcsampling.h`.

How: a C program compiled with gcc against the header of the installed nvidia-cuda-cupti wheel
(`nvidia/cu13/include`) prints sizeof and offsetof of every struct and field, and the
`...ParamsSize` macros; the test compares them with the ctypes layouts. The header includes
<cuda.h> for one type (CUcontext, a pointer); a one-line stand-in cuda.h is written next to the
program so no CUDA toolkit is needed. Skipped, saying why, when the wheel or gcc is missing.
"""

from __future__ import annotations

import ctypes
import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest
from kdash.collectors.agent import pcsampling as pcs


def _header_dir() -> Path | None:
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        for sub in ("cu13/include", "cuda_cupti/include"):
            d = Path(loc) / sub
            if (d / "cupti_pcsampling.h").exists():
                return d
    return None


HEADER_DIR = _header_dir()
pytestmark = [
    pytest.mark.skipif(
        HEADER_DIR is None,
        reason="cupti_pcsampling.h not found: pip install 'nvidia-cuda-cupti==13.0.*'",
    ),
    pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc not found"),
]


def _fields(struct: type[ctypes.Structure]) -> list[str]:
    return [name for name, *_ in struct._fields_ if name != "_tail"]


@pytest.fixture(scope="module")
def c_layout(tmp_path_factory) -> dict[str, int]:
    d = tmp_path_factory.mktemp("cupti_layout")
    (d / "cuda.h").write_text("typedef struct CUctx_st *CUcontext;\n")
    lines = [
        "#include <stdio.h>",
        "#include <stddef.h>",
        '#include "cupti_pcsampling.h"',
        "int main(void) {",
    ]
    for name, struct in pcs.STRUCTS.items():
        lines.append(f'printf("{name} %zu\\n", sizeof({name}));')
        for f in _fields(struct):
            lines.append(f'printf("{name}.{f} %zu\\n", offsetof({name}, {f}));')
    for name in pcs.PARAMS_LAST_FIELD:
        lines.append(f'printf("{name}Size %zu\\n", (size_t)({name}Size));')
    union = "CUpti_PCSamplingConfigurationInfo"
    for member in (
        "samplingPeriodData.samplingPeriod",
        "stallReasonData.stallReasonCount",
        "stallReasonData.pStallReasonIndex",
        "hardwareBufferSizeData.hardwareBufferSize",
        "collectionModeData.collectionMode",
        "enableStartStopControlData.enableStartStopControl",
        "samplingDataBufferData.samplingDataBuffer",
    ):
        key = f"{union}.attributeData.{member}"
        lines.append(f'printf("{key} %zu\\n", offsetof({union}, attributeData.{member}));')
    lines += ["return 0;", "}"]
    src = d / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = d / "layout"
    subprocess.run(
        ["gcc", "-std=c11", "-I", str(d), "-I", str(HEADER_DIR), str(src), "-o", str(exe)],
        check=True,
        capture_output=True,
    )
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return {k: int(v) for k, v in (ln.split() for ln in out.splitlines())}


@pytest.mark.parametrize("name", list(pcs.STRUCTS))
def test_size_and_offsets_match_header(c_layout, name):
    struct = pcs.STRUCTS[name]
    assert ctypes.sizeof(struct) == c_layout[name], f"sizeof {name}"
    for f in _fields(struct):
        assert getattr(struct, f).offset == c_layout[f"{name}.{f}"], f"offsetof {name}.{f}"


@pytest.mark.parametrize("name", list(pcs.PARAMS_LAST_FIELD))
def test_params_size_macros(c_layout, name):
    assert (
        pcs.params_size(pcs.STRUCTS[name], pcs.PARAMS_LAST_FIELD[name]) == c_layout[name + "Size"]
    )


def test_packed_structs_are_packed_and_padded(c_layout):
    """The PACKED_ALIGNMENT cases the ctypes emulation exists for: a trailing uint32 (PCData:
    60 bytes of fields -> 64) and a trailing uint8 (PCSamplingData: 73 -> 80)."""
    assert c_layout["CUpti_PCSamplingPCData"] == 64
    assert c_layout["CUpti_PCSamplingPCData.correlationId"] == 56
    assert c_layout["CUpti_PCSamplingData"] == 80
    assert c_layout["CUpti_PCSamplingData.hardwareBufferFull"] == 72
    arr = (pcs.CUpti_PCSamplingPCData * 2)()
    assert ctypes.addressof(arr[1]) - ctypes.addressof(arr[0]) == 64


def test_union_members_at_offset_of_attribute_data(c_layout):
    base = c_layout["CUpti_PCSamplingConfigurationInfo.attributeData"]
    u = pcs.CUpti_PCSamplingConfigurationInfo.attributeData.offset
    assert base == u == 8
    assert (
        c_layout[
            "CUpti_PCSamplingConfigurationInfo.attributeData.stallReasonData.pStallReasonIndex"
        ]
        == base + 8
    )
    assert pcs._StallReasonData.pStallReasonIndex.offset == 8


# -- the sampler's plumbing against a stand-in libcupti (compiled against the real header) -----
STANDIN = r"""
#include <string.h>
#include "cupti_pcsampling.h"
static int enabled, configured, started, stopped, getdata_calls, period, mode, startstop;
static size_t nreasons_cfg; static uint32_t reason0;
static CUpti_PCSamplingData *cfg;
static const char *names[3] = {"smsp__pcsamp_warps_issue_stalled_long_scoreboard",
    "smsp__pcsamp_warps_issue_stalled_wait",
    "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued"};
static char fname[] = "_decode_stage1";
int standin(const char *w) {
    if (!strcmp(w, "period")) return period;
    if (!strcmp(w, "mode")) return mode;
    if (!strcmp(w, "startstop")) return startstop;
    if (!strcmp(w, "nreasons")) return (int)nreasons_cfg;
    if (!strcmp(w, "reason0")) return (int)reason0;
    if (!strcmp(w, "getdata")) return getdata_calls;
    if (!strcmp(w, "started")) return started;
    return -1;
}
/* and a stand-in CUDA driver: two devices, only device 1's primary context active */
static int retained[2], pushes, syncs;
int cuInit(unsigned f) { return 0; }
int cuDeviceGetCount(int *n) { *n = 2; return 0; }
int cuDeviceGet(int *d, int ordinal) { *d = ordinal; return 0; }
int cuDevicePrimaryCtxGetState(int d, unsigned *flags, int *active) {
    *flags = 0; *active = (d == 1); return 0;
}
int cuDevicePrimaryCtxRetain(void **ctx, int d) { retained[d]++; *ctx = (void *)0x1234; return 0; }
int cuDevicePrimaryCtxRelease(int d) { retained[d]--; return 0; }
int cuCtxPushCurrent(void *ctx) { if (ctx != (void *)0x1234) return 1; pushes++; return 0; }
int cuCtxPopCurrent(void **old) { pushes--; *old = (void *)0x1234; return 0; }
int cuCtxSynchronize(void) { syncs++; return 0; }
int standin_cuda(const char *w) {
    if (!strcmp(w, "retained0")) return retained[0];
    if (!strcmp(w, "retained1")) return retained[1];
    if (!strcmp(w, "pushes")) return pushes;
    if (!strcmp(w, "syncs")) return syncs;
    if (!strcmp(w, "enabled")) return enabled;
    return -1;
}
CUptiResult cuptiPCSamplingGetNumStallReasons(CUpti_PCSamplingGetNumStallReasonsParams *p) {
    if (p->size != CUpti_PCSamplingGetNumStallReasonsParamsSize) return 1;
    *p->numStallReasons = 3; return 0;
}
CUptiResult cuptiPCSamplingGetStallReasons(CUpti_PCSamplingGetStallReasonsParams *p) {
    if (p->size != CUpti_PCSamplingGetStallReasonsParamsSize || p->numStallReasons != 3) return 1;
    for (int i = 0; i < 3; i++) {
        p->stallReasonIndex[i] = 10 + i;
        strcpy(p->stallReasons[i], names[i]);
    }
    return 0;
}
CUptiResult cuptiPCSamplingEnable(CUpti_PCSamplingEnableParams *p) {
    if (p->size != CUpti_PCSamplingEnableParamsSize || p->ctx != (CUcontext)0x1234) return 1;
    enabled = 1; return 0;
}
CUptiResult cuptiPCSamplingDisable(CUpti_PCSamplingDisableParams *p) { enabled = 0; return 0; }
CUptiResult cuptiPCSamplingSetConfigurationAttribute(CUpti_PCSamplingConfigurationInfoParams *p) {
    if (!enabled) return 7;
    if (p->size != CUpti_PCSamplingConfigurationInfoParamsSize) return 1;
    for (size_t i = 0; i < p->numAttributes; i++) {
        CUpti_PCSamplingConfigurationInfo *c = &p->pPCSamplingConfigurationInfo[i];
        switch (c->attributeType) {
        case CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_PERIOD:
            period = c->attributeData.samplingPeriodData.samplingPeriod; break;
        case CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_COLLECTION_MODE:
            mode = c->attributeData.collectionModeData.collectionMode; break;
        case CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_ENABLE_START_STOP_CONTROL:
            startstop = c->attributeData.enableStartStopControlData.enableStartStopControl; break;
        case CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_STALL_REASON:
            nreasons_cfg = c->attributeData.stallReasonData.stallReasonCount;
            reason0 = c->attributeData.stallReasonData.pStallReasonIndex[0]; break;
        case CUPTI_PC_SAMPLING_CONFIGURATION_ATTR_TYPE_SAMPLING_DATA_BUFFER:
            cfg = c->attributeData.samplingDataBufferData.samplingDataBuffer;
            if (cfg->size != sizeof(CUpti_PCSamplingData)) return 1;
            configured = 1; break;
        default: break;
        }
    }
    return 0;
}
CUptiResult cuptiPCSamplingStart(CUpti_PCSamplingStartParams *p) {
    if (!configured) return 7; started++; stopped = 0; getdata_calls = 0; return 0;
}
static void put(CUpti_PCSamplingPCData *pc, uint64_t off, uint32_t reason, uint32_t n) {
    pc->cubinCrc = 0x9a72d27bULL; pc->pcOffset = off; pc->functionName = fname;
    pc->stallReasonCount = 2;
    pc->stallReason[0].pcSamplingStallReasonIndex = reason; pc->stallReason[0].samples = n;
    pc->stallReason[1].pcSamplingStallReasonIndex = 11; pc->stallReason[1].samples = 0;
}
CUptiResult cuptiPCSamplingStop(CUpti_PCSamplingStopParams *p) {
    if (!started) return 7;
    stopped = 1;
    if (cfg->collectNumPcs < 1) return 1;
    put(&cfg->pPcData[0], 0x40, 10, 5);
    cfg->totalNumPcs = 1; cfg->remainingNumPcs = 3; cfg->totalSamples = 100;
    cfg->droppedSamples = 1; cfg->hardwareBufferFull = 0; cfg->rangeId = 7;
    return 0;
}
CUptiResult cuptiPCSamplingGetData(CUpti_PCSamplingGetDataParams *p) {
    if (!stopped) return 7;
    if (p->size != CUpti_PCSamplingGetDataParamsSize) return 1;
    CUpti_PCSamplingData *d = (CUpti_PCSamplingData *)p->pcSamplingData;
    if (d->size != sizeof(CUpti_PCSamplingData) || d == cfg) return 1;
    getdata_calls++;
    if (getdata_calls == 1) {
        put(&d->pPcData[0], 0x50, 12, 7); put(&d->pPcData[1], 0x60, 10, 3);
        d->totalNumPcs = 2; d->remainingNumPcs = 1;
    } else if (getdata_calls == 2) {
        put(&d->pPcData[0], 0x70, 11, 2); d->totalNumPcs = 1; d->remainingNumPcs = 0;
    } else { d->totalNumPcs = 0; d->remainingNumPcs = 0; }
    return 0;
}
"""


def compile_standin(d: Path) -> Path:
    """The stand-in compiled into folder `d` (a test fixture; also used by test_agent.py)."""
    (d / "cuda.h").write_text("typedef struct CUctx_st *CUcontext;\n")
    (d / "standin.c").write_text(STANDIN)
    so = d / "libcupti_standin.so"
    subprocess.run(
        ["gcc", "-shared", "-fPIC", "-I", str(d), "-I", str(HEADER_DIR), str(d / "standin.c"),
         "-o", str(so)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return so


@pytest.fixture(scope="module")
def standin(tmp_path_factory) -> ctypes.CDLL:
    return ctypes.CDLL(str(compile_standin(tmp_path_factory.mktemp("cupti_standin"))))


def test_sampler_plumbing_against_the_standin(standin):
    """Configure, start, stop, read the configured buffer then GetData until empty: every
    row the stand-in wrote comes back with its reason name; zero-sample reasons are skipped."""
    standin.standin.argtypes = [ctypes.c_char_p]
    s = pcs.PCSampler(standin, 0x1234, period=11, max_pcs=4)
    s.enable()
    assert s.reason_names == {
        10: "smsp__pcsamp_warps_issue_stalled_long_scoreboard",
        11: "smsp__pcsamp_warps_issue_stalled_wait",
        12: "smsp__pcsamp_warps_issue_stalled_long_scoreboard_not_issued",
    }
    assert standin.standin(b"period") == 11
    assert standin.standin(b"mode") == pcs.COLLECTION_MODE_CONTINUOUS
    assert standin.standin(b"startstop") == 1
    assert standin.standin(b"nreasons") == 3 and standin.standin(b"reason0") == 10
    s.start()
    rows, stats = s.stop()
    got = [(r["pc_offset"], r["stall_reason"].rsplit("stalled_", 1)[1], r["count"]) for r in rows]
    assert got == [
        (0x40, "long_scoreboard", 5),
        (0x50, "long_scoreboard_not_issued", 7),
        (0x60, "long_scoreboard", 3),
        (0x70, "wait", 2),
    ]
    assert {r["kernel"] for r in rows} == {"_decode_stage1"}
    assert {r["cubin_crc"] for r in rows} == {0x9A72D27B}
    assert stats["total_samples"] == 100 and stats["dropped_samples"] == 1
    assert stats["get_data_calls"] == 2 == standin.standin(b"getdata")
    # a second range reuses the buffers, read with numpy this time: the same rows
    s.start()
    cols, stats2 = s.stop_columns()
    got2 = list(
        zip(
            cols["pc_offset"].tolist(),
            [r.rsplit("stalled_", 1)[1] for r in cols["stall_reason"]],
            cols["count"].tolist(),
            strict=True,
        )
    )
    assert got2 == got and standin.standin(b"started") == 2
    assert set(cols["kernel"]) == {"_decode_stage1"}
    assert set(cols["cubin_crc"].view("u8").tolist()) == {0x9A72D27B}
    assert stats2["get_data_calls"] == 2
    s.disable()


def test_sampler_errors_name_the_call(standin):
    s = pcs.PCSampler(standin, 0x9999)  # the stand-in refuses this context
    with pytest.raises(
        pcs.CuptiError, match="cuptiPCSamplingEnable: CUPTI_ERROR_INVALID_PARAMETER"
    ):
        s.enable()


def test_sampling_range_on_the_active_primary_context_only(standin, tmp_path):
    """SamplingRanges retains the primary context of the device the target uses (device 1
    here; device 0 has none and must not get one), runs one range with the context current,
    synchronised around it, and leaves PC sampling disabled and the context released."""
    path = standin._name
    standin.standin_cuda.argtypes = [ctypes.c_char_p]
    r = pcs.SamplingRanges(path, libcuda=path)
    assert r.cuda.ordinal == 1
    assert standin.standin_cuda(b"retained0") == 0 and standin.standin_cuda(b"retained1") == 1
    cols, stats = r.run(0.01)
    assert sorted(cols["pc_offset"].tolist()) == [0x40, 0x50, 0x60, 0x70]
    assert stats["total_samples"] == 100 and "stop_cpu_ms" in stats and "enable_ms" in stats
    assert standin.standin_cuda(b"syncs") >= 2
    assert standin.standin_cuda(b"pushes") == 0  # popped again
    assert standin.standin_cuda(b"enabled") == 0  # disabled after the range
    r.run(0.01)
    assert r.ranges == 2
    r.close()
    assert standin.standin_cuda(b"retained1") == 0


def test_a_ranges_edges_go_through_the_runner_it_is_given(standin):
    """With `at_call` (the session's way of running a call on the target's own thread at its
    next CUDA call, controller.run_in_target), the range's beginning and its end are each one
    call of it, in order, with the sampling wait between them on the range's thread; the
    range is the same, and where each edge ran is in its stats."""
    import threading

    path = standin._name
    standin.standin_cuda.argtypes = [ctypes.c_char_p]
    r = pcs.SamplingRanges(path, libcuda=path)
    log: list[str] = []

    def at_call(fn) -> str:
        # a thread of its own stands in for the target's (test only: no target here)
        before = standin.standin_cuda(b"enabled")
        t = threading.Thread(target=fn, name="target")
        t.start()
        t.join()
        log.append(f"{before}->{standin.standin_cuda(b'enabled')}")
        return "target"

    cols, stats = r.run(0.01, None, at_call)
    assert log == ["0->1", "1->0"]  # enabled by the first edge, disabled by the second
    assert sorted(cols["pc_offset"].tolist()) == [0x40, 0x50, 0x60, 0x70]
    assert (stats["began_on"], stats["ended_on"]) == ("target", "target")
    assert standin.standin_cuda(b"pushes") == 0 and r.where == ["target", "target"]

    def refuses(fn) -> str:
        raise pcs.CuptiError("cuptiPCSamplingEnable", 1)

    with pytest.raises(pcs.CuptiError):
        r.run(0.01, None, refuses)
    assert standin.standin_cuda(b"enabled") == 0
    r.close()
