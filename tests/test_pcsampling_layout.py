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
