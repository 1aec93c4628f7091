"""PC offsets -> source lines, from a cubin's line table (pure: no Textual, no GPU).

What PC sampling gives is (function name, pc offset inside that function, cubin CRC, stall
reason, count). What a person reads is a source line. The bridge is the cubin's DWARF line table,
which `nvdisasm -gi -c` prints beside every SASS instruction. Why `nvdisasm` and not a DWARF reader
of our own: it is the tool NVIDIA keeps in step with each new architecture's encoding, Triton
ships it (`triton/backends/nvidia/bin`), and on the H200 its mapping agreed with CUPTI's
`cuptiGetSassToSourceCorrelation` on 100% of samples.

How the text is read (`parse_nvdisasm`):

- `//----- .text.NAME -----` starts function NAME; offsets printed as `/*0a30*/` are relative to
  that function's start, which is what CUPTI's `pcOffset` is.
- Before an instruction, a block of `//## File "F", line N [inlined at "G", line M]` lines gives
  its source position: the first line of the block is the innermost frame (e.g. `tl.max` inside
  triton/language/standard.py), the last, without "inlined at", the outermost one, the line of
  the kernel's own body. A position holds until the next block.
- kdash charges an instruction to its outermost frame (the line in the `@triton.jit` function the
  user wrote) and keeps the chain of inlined frames as text for the detail line, so a hot
  `tl.sum` shows on the user's line, not on Triton's standard library.

The cubin CRC: CUPTI stamps each record with `cuptiGetCubinCrc`. The header does not say which
CRC it is, and it is not zlib's CRC-32 of the file (checked: a cubin whose CUPTI CRC is
0x9a72d27b has zlib CRC 0xeb653255, and no CRC-32/32C/32K/32Q variant of the whole file matches),
so kdash does not guess: `cubin_crc` calls libcupti's own function through ctypes. It needs no
GPU and no driver (tested here with the nvidia-cuda-cupti 13.0 wheel's libcupti on a machine
without either). Where libcupti cannot be loaded the CRC is None and samples are matched to a
line table by function name alone (said in `LineTable.match_note`); the sha256 of the cubin is
kept either way, to tell two builds of one kernel apart.

Stale sources: a line table points at files on disk that may have changed since the kernel was
compiled. `line_table` records each source file's sha256 and mtime when it is built (in the
agent, at module load: close to compile time) and, when given, the compile time; `source_status`
says per file "ok", "changed since compile", "changed since capture" or "missing", so the pane
can flag a file instead of drawing heat on the wrong lines.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

# -- stall reasons ----------------------------------------------------------------------------
# The ~20 reasons an H200 reports, in plain words. CUPTI names them
# "smsp__pcsamp_warps_issue_stalled_<reason>" and, for each, a "<reason>_not_issued" form that
# counts the subset of those samples where no instruction issued: a subset, never added in.
STALL_MEANINGS: dict[str, str] = {
    "long_scoreboard": "waiting for a global/local memory load (L1TEX) to return",
    "short_scoreboard": "waiting for shared memory or special math (MUFU) to return",
    "wait": "fixed-latency wait on the previous instruction",
    "barrier": "waiting at a block barrier for the other warps",
    "membar": "waiting at a memory fence",
    "math_pipe_throttle": "the math pipe this instruction needs is busy",
    "mio_throttle": "memory-input/output queue full (shared memory, special math)",
    "lg_throttle": "local/global memory queue full: too many loads in flight",
    "tex_throttle": "texture/L1TEX queue full",
    "drain": "waiting for stores to drain before the warp exits",
    "dispatch_stall": "the dispatcher could not issue (pipeline conflict)",
    "imc_miss": "constant-cache miss",
    "no_instructions": "no instruction fetched (instruction-cache miss, after a branch)",
    "branch_resolving": "waiting for a branch target to be computed",
    "sleeping": "warp asleep (nanosleep, yield)",
    "misc": "other hardware reason",
    "not_selected": "ready, but the scheduler picked another warp",
    "selected": "issuing: the warp was running, not stalled",
    "gmma": "waiting for a warpgroup MMA (wgmma) to finish",
    "tmem": "waiting on tensor memory",
}
_REASON_PREFIXES = ("smsp__pcsamp_warps_issue_stalled_", "smsp__pcsamp_warps_issue_", "stalled_")


def stall_name(raw: str) -> str:
    """CUPTI's reason name shortened to the key of `STALL_MEANINGS` ("long_scoreboard")."""
    s = str(raw).strip()
    for p in _REASON_PREFIXES:
        if s.startswith(p):
            s = s[len(p) :]
            break
    return s


def is_not_issued(raw: str) -> bool:
    """True for the `_not_issued` forms, which are subsets of their base reason."""
    return str(raw).endswith("_not_issued")


def stall_meaning(raw: str) -> str:
    name = stall_name(raw)
    return STALL_MEANINGS.get(name, "")


# -- the line table ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Instr:
    """One SASS instruction with its source position (file "" when the cubin has no lines)."""

    function: str
    pc_offset: int
    sass: str
    file: str = ""
    line: int = -1
    inlined: str = ""  # innermost-first chain, "standard.py:216 <- decode_attention.py:429"


@dataclass
class LineTable:
    """A cubin's instructions and their lines, and what is known about the cubin's identity."""

    instrs: list[Instr] = field(default_factory=list)
    crc: int | None = None  # cuptiGetCubinCrc, None when libcupti could not be loaded
    sha256: str = ""
    why: str = ""  # non-empty when the table could not be built (no nvdisasm, not a cubin)
    crc_note: str = ""  # why the CRC is None
    file_sha256: dict[str, str] = field(default_factory=dict)  # at build time; "" = unreadable
    file_mtime_ns: dict[str, int] = field(default_factory=dict)
    compiled_ns: int | None = None  # wall-clock ns the cubin was built, when known

    @property
    def functions(self) -> list[str]:
        return list(dict.fromkeys(i.function for i in self.instrs))

    @property
    def has_lines(self) -> bool:
        return any(i.line > 0 for i in self.instrs)

    @property
    def files(self) -> list[str]:
        return list(dict.fromkeys(i.file for i in self.instrs if i.file))

    @property
    def match_note(self) -> str:
        """How samples are matched to this table, in words (shown when it is the weaker way)."""
        if self.crc is not None:
            return ""
        return "samples matched by kernel name (no cubin CRC: " + (self.crc_note or "n/a") + ")"

    @property
    def no_lines_hint(self) -> str:
        if self.instrs and not self.has_lines:
            return (
                "this cubin has no line info: SASS heat only (compile with -lineinfo, or keep "
                "Triton's default line info, to get source lines)"
            )
        return ""

    def frame(self) -> pd.DataFrame:
        """One row per instruction: function, pc_offset, file, line, inlined, sass."""
        return pd.DataFrame(
            {
                "function": [i.function for i in self.instrs],
                "pc_offset": pd.array([i.pc_offset for i in self.instrs], dtype="int64"),
                "file": [i.file for i in self.instrs],
                "line": pd.array([i.line for i in self.instrs], dtype="int64"),
                "inlined": [i.inlined for i in self.instrs],
                "sass": [i.sass for i in self.instrs],
            }
        )

    def definition_line(self, function: str | None = None) -> tuple[str, int] | None:
        """The first mapped line of a function (for Triton: its `def` line)."""
        for i in self.instrs:
            if (function is None or i.function == function) and i.line > 0:
                return i.file, i.line
        return None


_FUNC_RE = re.compile(r"^//-+\s+\.text\.(\S+)\s+-+\s*$")
_FILE_RE = re.compile(
    r'^//##\s+File\s+"([^"]*)",\s+line\s+(\d+)(?:\s+inlined at\s+"([^"]*)",\s+line\s+(\d+))?'
)
_INSTR_RE = re.compile(r"^/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;?\s*(?:/\*.*\*/)?\s*$")


def parse_nvdisasm(text: str) -> list[Instr]:
    """Instructions with their (outermost) source lines from `nvdisasm -gi -c` (or `-g -c`).

    Positions persist until the next `//##` block, as nvdisasm prints them only on change.
    """
    out: list[Instr] = []
    function = ""
    pending: list[tuple[str, int]] = []
    current: list[tuple[str, int]] = []
    for raw in text.splitlines():
        s = raw.strip()
        if not s:
            continue
        m = _FUNC_RE.match(s)
        if m:
            function, pending, current = m.group(1), [], []
            continue
        m = _FILE_RE.match(s)
        if m:
            pending.append((m.group(1), int(m.group(2))))
            continue
        m = _INSTR_RE.match(s)
        if m and function:
            if pending:
                current, pending = pending, []
            sass = m.group(2).strip().rstrip(";").strip()
            if current:
                file, line = current[-1]  # outermost frame: the kernel's own line
                chain = " <- ".join(f"{os.path.basename(f)}:{n}" for f, n in current)
                inlined = chain if len(current) > 1 else ""
            else:
                file, line, inlined = "", -1, ""
            out.append(Instr(function, int(m.group(1), 16), sass, file, line, inlined))
    return out


# -- tools ------------------------------------------------------------------------------------
def _spec_dir(package: str) -> Path | None:
    """A package's folder without importing it (importing triton costs ~1 s)."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            return Path(loc)
    return Path(spec.origin).parent if spec.origin else None


CUDA_NVDISASM = Path("/usr/local/cuda/bin/nvdisasm")


def find_nvdisasm() -> tuple[str | None, str]:
    """(path, "") or (None, why): $KDASH_NVDISASM, Triton's bundled copy, PATH, /usr/local/cuda."""
    looked = []
    env = os.environ.get("KDASH_NVDISASM")
    if env:
        if os.access(env, os.X_OK):
            return env, ""
        looked.append(f"$KDASH_NVDISASM={env}")
    tdir = _spec_dir("triton")
    if tdir is not None:
        p = tdir / "backends" / "nvidia" / "bin" / "nvdisasm"
        if os.access(p, os.X_OK):
            return str(p), ""
        looked.append(str(p))
    else:
        looked.append("triton (not installed)")
    w = shutil.which("nvdisasm")
    if w:
        return w, ""
    looked.append("PATH")
    if os.access(CUDA_NVDISASM, os.X_OK):
        return str(CUDA_NVDISASM), ""
    looked.append(str(CUDA_NVDISASM))
    return None, (
        "nvdisasm not found (looked in " + ", ".join(looked) + "): install triton or the CUDA "
        "toolkit, or set KDASH_NVDISASM"
    )


def find_libcupti() -> tuple[str | None, str]:
    """(path, "") or (None, why): $KDASH_LIBCUPTI, the nvidia-cuda-cupti wheel, the linker path."""
    env = os.environ.get("KDASH_LIBCUPTI")
    if env:
        return (env, "") if os.path.exists(env) else (None, f"$KDASH_LIBCUPTI={env} not found")
    base = _spec_dir("nvidia")
    if base is not None:
        for sub in ("cu13/lib", "cuda_cupti/lib", "cu12/lib"):
            for cand in sorted((base / sub).glob("libcupti.so*")):
                return str(cand), ""
    found = ctypes.util.find_library("cupti")
    if found:
        return found, ""
    return None, "libcupti not found (pip install nvidia-cuda-cupti, or set KDASH_LIBCUPTI)"


class _GetCubinCrcParams(ctypes.Structure):
    """CUpti_GetCubinCrcParams (cupti_pcsampling.h; natural layout, not packed)."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("cubinSize", ctypes.c_size_t),
        ("cubin", ctypes.c_void_p),
        ("cubinCrc", ctypes.c_uint64),
    ]


@functools.lru_cache(maxsize=4)
def _cupti(path: str) -> ctypes.CDLL:
    return ctypes.CDLL(path)


def cubin_crc(cubin: bytes, libcupti: str | None = None) -> tuple[int | None, str]:
    """(CRC, "") from libcupti's `cuptiGetCubinCrc`, or (None, why). Needs no GPU."""
    path, why = (libcupti, "") if libcupti else find_libcupti()
    if path is None:
        return None, why
    try:
        lib = _cupti(path)
        fn = lib.cuptiGetCubinCrc
    except (OSError, AttributeError) as e:
        return None, f"cannot use {path}: {e}"
    buf = ctypes.create_string_buffer(cubin, len(cubin))
    params = _GetCubinCrcParams(
        ctypes.sizeof(_GetCubinCrcParams), len(cubin), ctypes.cast(buf, ctypes.c_void_p), 0
    )
    fn.restype = ctypes.c_int
    rc = fn(ctypes.byref(params))
    if rc != 0:
        return None, f"cuptiGetCubinCrc returned CUPTI error {rc}"
    return int(params.cubinCrc), ""


def _stamp(path: str) -> tuple[str, int]:
    try:
        data = Path(path).read_bytes()
        return hashlib.sha256(data).hexdigest(), os.stat(path).st_mtime_ns
    except OSError:
        return "", -1


def line_table(
    cubin: bytes,
    nvdisasm: str | None = None,
    *,
    libcupti: str | None = None,
    compiled_ns: int | None = None,
    timeout_s: float = 60.0,
) -> LineTable:
    """Disassemble `cubin` with line info; never raises for a missing tool or a bad file.

    The result's `why` says what went wrong (no nvdisasm, not a cubin); `crc_note` why there
    is no CRC. `compiled_ns` (e.g. the mtime of Triton's cached cubin) lets `source_status`
    flag a source edited after the compile.
    """
    lt = LineTable(sha256=hashlib.sha256(cubin).hexdigest(), compiled_ns=compiled_ns)
    if not cubin.startswith(b"\x7fELF"):
        lt.why = "not a cubin (no ELF header)"
        return lt
    tool, why = (nvdisasm, "") if nvdisasm else find_nvdisasm()
    if tool is None:
        lt.why = why
        return lt
    with tempfile.NamedTemporaryFile(suffix=".cubin") as fh:
        fh.write(cubin)
        fh.flush()
        try:
            res = subprocess.run(
                [tool, "-gi", "-c", fh.name], capture_output=True, text=True, timeout=timeout_s
            )
        except (OSError, subprocess.SubprocessError) as e:
            lt.why = f"nvdisasm failed: {e}"
            return lt
    if res.returncode != 0:
        err = (res.stderr or res.stdout).strip().splitlines()
        lt.why = f"nvdisasm failed: {err[-1] if err else f'exit {res.returncode}'}"
        return lt
    lt.instrs = parse_nvdisasm(res.stdout)
    if not lt.instrs:
        lt.why = "nvdisasm printed no instructions"
    lt.crc, lt.crc_note = cubin_crc(cubin, libcupti)
    for f in lt.files:
        lt.file_sha256[f], lt.file_mtime_ns[f] = _stamp(f)
    return lt


def source_status(lt: LineTable) -> dict[str, str]:
    """Per source file: "ok", "missing", "changed since compile" or "changed since capture"."""
    out = {}
    for f in lt.files:
        sha, mtime = _stamp(f)
        if not sha:
            out[f] = "missing"
        elif lt.compiled_ns is not None and mtime > lt.compiled_ns:
            out[f] = "changed since compile"
        elif lt.file_sha256.get(f) and sha != lt.file_sha256[f]:
            out[f] = "changed since capture"
        else:
            out[f] = "ok"
    return out


# -- samples against a table -------------------------------------------------------------------
SAMPLE_COLUMNS = ["kernel", "cubin_crc", "pc_offset", "stall_reason", "count"]


def _matching(samples: pd.DataFrame, lt: LineTable) -> pd.DataFrame:
    """The samples that belong to this cubin: by CRC when both sides have one, else by name;
    `_not_issued` rows dropped (subsets of their base reason)."""
    if samples.empty or not lt.instrs:
        return samples.iloc[0:0]
    s = samples[~samples["stall_reason"].astype(str).str.endswith("_not_issued")]
    names = set(lt.functions)
    if lt.crc is not None and "cubin_crc" in s and (s["cubin_crc"] != -1).any():
        crcs = s["cubin_crc"].to_numpy(dtype=np.int64).view(np.uint64)
        return s[(crcs == np.uint64(lt.crc)) & s["kernel"].isin(names).to_numpy()]
    return s[s["kernel"].isin(names)]


def _joined(samples: pd.DataFrame, lt: LineTable) -> pd.DataFrame:
    s = _matching(samples, lt)
    if s.empty:
        return s.assign(file="", line=-1, sass="", inlined="")
    table = lt.frame().rename(columns={"function": "kernel"})
    s = s.assign(pc_offset=s["pc_offset"].astype("int64"), stall=s["stall_reason"].map(stall_name))
    return s.merge(table, on=["kernel", "pc_offset"], how="left").fillna(
        {"file": "", "line": -1, "sass": "", "inlined": ""}
    )


def _top_stalls(g: pd.DataFrame, k: int = 3) -> str:
    by = g.groupby("stall")["count"].sum().sort_values(ascending=False)
    tot = float(by.sum()) or 1.0
    return ", ".join(f"{r} {100 * n / tot:.0f}%" for r, n in by.head(k).items())


HOT_LINE_COLUMNS = ["file", "line", "samples", "share", "top_stalls"]


def hot_lines(samples: pd.DataFrame, lt: LineTable) -> pd.DataFrame:
    """Per source line of this cubin: samples, share of the cubin's samples, top stall reasons.

    Shares are of all matched samples, including those on PCs without a line (shown as
    file "" / line -1), so the shares of the lines say how much the lines explain.
    """
    j = _joined(samples, lt)
    if j.empty:
        return pd.DataFrame(columns=HOT_LINE_COLUMNS)
    total = float(j["count"].sum()) or 1.0
    rows = []
    for (file, line), g in j.groupby(["file", "line"], sort=False):
        n = int(g["count"].sum())
        rows.append((file, int(line), n, n / total, _top_stalls(g)))
    out = pd.DataFrame(rows, columns=HOT_LINE_COLUMNS)
    return out.sort_values(["samples", "line"], ascending=[False, True]).reset_index(drop=True)


SASS_COLUMNS = ["kernel", "pc_offset", "sass", "file", "line", "samples", "share", "top_stalls"]


PC_HEAT_COLUMNS = ["pc_offset", "samples", "share", "top_stalls"]

NO_LINE_TABLE = (
    "no line table: kdash gets a cubin from Triton's cache only; a CUDA kernel's cubin needs "
    "CUPTI's module-load callback, which kdash leaves alone (it blinds torch.profiler), and "
    "lines need it built with -lineinfo"
)


def pc_heat(samples: pd.DataFrame, kernel: str) -> pd.DataFrame:
    """Per sampled PC of one kernel, in PC order: samples, share, top stall reasons.

    For kernels kdash has no cubin of (cuBLAS, ATen): the offsets still say where in the
    kernel the warps wait, and which stalls, without the instruction text.
    """
    s = samples[
        (samples["kernel"] == kernel)
        & ~samples["stall_reason"].astype(str).str.endswith("_not_issued")
    ]
    if s.empty:
        return pd.DataFrame(columns=PC_HEAT_COLUMNS)
    s = s.assign(pc_offset=s["pc_offset"].astype("int64"), stall=s["stall_reason"].map(stall_name))
    total = float(s["count"].sum()) or 1.0
    rows = [
        (int(pc), int(g["count"].sum()), float(g["count"].sum()) / total, _top_stalls(g))
        for pc, g in s.groupby("pc_offset", sort=True)
    ]
    return pd.DataFrame(rows, columns=PC_HEAT_COLUMNS)


def sass_heat(samples: pd.DataFrame, lt: LineTable) -> pd.DataFrame:
    """Every instruction of the table in PC order with its samples and share (0 when none)."""
    table = lt.frame().rename(columns={"function": "kernel"})
    j = _joined(samples, lt)
    total = float(j["count"].sum()) if not j.empty else 0.0
    if j.empty:
        counts = pd.DataFrame(columns=["kernel", "pc_offset", "samples", "top_stalls"])
    else:
        counts = (
            j.groupby(["kernel", "pc_offset"], sort=False)
            .apply(
                lambda g: pd.Series(
                    {"samples": int(g["count"].sum()), "top_stalls": _top_stalls(g)}
                ),
                include_groups=False,
            )
            .reset_index()
        )
    out = table.merge(counts, on=["kernel", "pc_offset"], how="left")
    out["samples"] = out["samples"].fillna(0).astype("int64")
    out["top_stalls"] = out["top_stalls"].fillna("")
    out["share"] = out["samples"] / total if total else 0.0
    return out[SASS_COLUMNS]


def line_stalls(samples: pd.DataFrame, lt: LineTable, file: str, line: int) -> pd.DataFrame:
    """The stall reasons of one line, ranked: reason, samples, share (of the line), meaning."""
    j = _joined(samples, lt)
    j = j[(j["file"] == file) & (j["line"] == line)] if not j.empty else j
    cols = ["reason", "samples", "share", "meaning"]
    if j.empty:
        return pd.DataFrame(columns=cols)
    by = j.groupby("stall")["count"].sum().sort_values(ascending=False)
    tot = float(by.sum()) or 1.0
    return pd.DataFrame(
        [(r, int(n), n / tot, STALL_MEANINGS.get(r, "")) for r, n in by.items()], columns=cols
    )


# -- to and from the capture's source_lines table ----------------------------------------------
def crc_to_i8(crc: int | None) -> int:
    """A uint64 CRC as the schema's signed int64 (same bits); -1 for n/a."""
    if crc is None:
        return -1
    return int(np.uint64(crc).view(np.int64))


def to_rows(lt: LineTable, kernel: str = "", t_ns: int = 0) -> dict[str, list]:
    """Columns of the `source_lines` table for this line table (see kdash.schema)."""
    n = len(lt.instrs)
    return {
        "t_ns": [t_ns] * n,
        "kernel": [kernel or i.function for i in lt.instrs],
        "cubin_crc": [crc_to_i8(lt.crc)] * n,
        "cubin_sha256": [lt.sha256] * n,
        "pc_offset": [i.pc_offset for i in lt.instrs],
        "function": [i.function for i in lt.instrs],
        "file": [i.file for i in lt.instrs],
        "line": [i.line for i in lt.instrs],
        "inlined": [i.inlined for i in lt.instrs],
        "sass": [i.sass for i in lt.instrs],
        "file_sha256": [lt.file_sha256.get(i.file, "") for i in lt.instrs],
    }


def from_frame(df: pd.DataFrame) -> list[LineTable]:
    """Line tables back from a `source_lines` frame, one per cubin (sha256, else CRC)."""
    out: list[LineTable] = []
    if df is None or df.empty:
        return out
    key = df["cubin_sha256"].where(df["cubin_sha256"] != "", df["cubin_crc"].astype(str))
    for _, g in df.groupby(key, sort=False):
        g = g.sort_values(["function", "pc_offset"], kind="stable")
        crc = int(g["cubin_crc"].iloc[0])
        lt = LineTable(
            instrs=[
                Instr(
                    str(r.function),
                    int(r.pc_offset),
                    str(r.sass),
                    str(r.file),
                    int(r.line),
                    str(r.inlined),
                )
                for r in g.itertuples(index=False)
            ],
            crc=(crc & 0xFFFFFFFFFFFFFFFF) if crc != -1 else None,
            sha256=str(g["cubin_sha256"].iloc[0]),
            crc_note="" if crc != -1 else "no CRC recorded with the capture's line table",
        )
        for f, s in zip(g["file"], g["file_sha256"], strict=True):
            if f and f not in lt.file_sha256:
                lt.file_sha256[f] = str(s)
        out.append(lt)
    return out


def table_for_kernel(tables: list[LineTable], kernel: str) -> LineTable | None:
    """The line table that holds `kernel` (the newest one when several builds do)."""
    hit = None
    for lt in tables:
        if kernel in lt.functions:
            hit = lt
    return hit


def hot_lines_by_kernel(
    samples: pd.DataFrame, source_lines: pd.DataFrame | None, per_kernel: int = 10
) -> list[dict]:
    """`kdash report`'s hot lines: per sampled kernel, its top lines; kernels with a line table
    first (most samples first), so the first row is the hottest line that has source.

    A kernel with samples but no line table in the capture is listed with file "" and a note,
    so the report says what is missing instead of dropping the kernel.
    """
    if samples is None or samples.empty:
        return []
    real = samples[~samples["stall_reason"].astype(str).str.endswith("_not_issued")]
    tables = from_frame(source_lines) if source_lines is not None else []
    out: list[dict] = []
    per = real.groupby("kernel")["count"].sum().sort_values(ascending=False)
    # kernels whose lines can be named first (most samples first), then the rest by PC
    order = sorted(
        per.index,
        key=lambda k: (table_for_kernel(tables, str(k)) is None, -int(per[k])),
    )
    for kernel in order:
        lt = table_for_kernel(tables, str(kernel))
        if lt is None:
            # No lines to name: its hottest PCs instead (offsets from the kernel's start).
            pcs = pc_heat(real, str(kernel)).sort_values("samples", ascending=False, kind="stable")
            for r in pcs.head(per_kernel).itertuples(index=False):
                out.append(
                    {
                        "kernel": str(kernel),
                        "file": "",
                        "line": -1,
                        "pc_offset": int(r.pc_offset),
                        "samples": int(r.samples),
                        "share": round(float(r.share), 4),
                        "top_stalls": str(r.top_stalls),
                        "note": "no line table for this kernel in the capture",
                    }
                )
            continue
        hot = hot_lines(real[real["kernel"] == kernel], lt).head(per_kernel)
        note = lt.no_lines_hint or lt.match_note
        for r in hot.itertuples(index=False):
            out.append(
                {
                    "kernel": str(kernel),
                    "file": str(r.file),
                    "line": int(r.line),
                    "pc_offset": -1,
                    "samples": int(r.samples),
                    "share": round(float(r.share), 4),
                    "top_stalls": str(r.top_stalls),
                    "note": note,
                }
            )
    return out


# -- cubins from Triton's cache ------------------------------------------------------------------
@dataclass(frozen=True)
class CachedCubin:
    """One compiled kernel in Triton's on-disk cache (`<cache>/<hash>/<name>.cubin` + `.json`)."""

    name: str
    path: str
    arch: int | None
    mtime_ns: int  # when Triton wrote it: the compile time `source_status` checks against


def triton_cache_dir() -> Path:
    """Where Triton caches compiled kernels: $TRITON_CACHE_DIR, else ~/.triton/cache."""
    env = os.environ.get("TRITON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".triton" / "cache"


def triton_cached_cubins(
    names: set[str] | None = None, cache_dir: str | os.PathLike | None = None
) -> list[CachedCubin]:
    """The cubins in Triton's cache, newest first, optionally only for kernel `names`.

    Read from the metadata JSON Triton writes beside each cubin (its `name` and `target`), not
    by importing Triton. Several entries per name are normal (one per specialisation); the
    CRC in the samples says which one ran, so callers make a line table for each.
    """
    import json

    root = Path(cache_dir) if cache_dir is not None else triton_cache_dir()
    out: list[CachedCubin] = []
    if not root.is_dir():
        return out
    for cub in root.glob("*/*.cubin"):
        name = cub.stem
        if names is not None and name not in names:
            continue
        arch = None
        try:
            meta = json.loads(cub.with_suffix(".json").read_text())
            name = str(meta.get("name") or name)
            arch = (meta.get("target") or {}).get("arch")
            mtime = cub.stat().st_mtime_ns
        except (OSError, ValueError):
            continue
        if names is not None and name not in names:
            continue
        out.append(CachedCubin(name, str(cub), arch if isinstance(arch, int) else None, mtime))
    out.sort(key=lambda c: -c.mtime_ns)
    return out


def line_tables_from_triton_cache(
    names: set[str], cache_dir: str | os.PathLike | None = None, nvdisasm: str | None = None
) -> list[LineTable]:
    """Line tables for the named kernels' cached cubins (compile time from the file's mtime)."""
    out = []
    for c in triton_cached_cubins(names, cache_dir):
        try:
            data = Path(c.path).read_bytes()
        except OSError:
            continue
        out.append(line_table(data, nvdisasm, compiled_ns=c.mtime_ns))
    return out
