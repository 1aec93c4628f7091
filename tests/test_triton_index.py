"""The `@triton.jit` index: a temp folder laid out like SGLang's attention kernels (real-shaped
files written here: same names, decorators, aliases and launch style as SGLang's, bodies cut
down), the project's own kernels/, and the installed triton package itself."""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from kdash import triton_index as ti

DECODE = """
import triton
import triton.language as tl


@triton.jit
def _fwd_kernel_stage1(Q, K_Buffer, sm_scale, Att_Out, BLOCK_DMODEL: tl.constexpr,
                       BLOCK_N: tl.constexpr, NUM_KV_SPLITS: tl.constexpr):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    split_kv_id = tl.program_id(2)
    tl.store(Att_Out + cur_batch, cur_head + split_kv_id)


@triton.jit
def _fwd_kernel_stage2(Mid_O, O, B_Seqlen, NUM_KV_SPLITS: tl.constexpr):
    cur_batch = tl.program_id(0)
    cur_head = tl.program_id(1)
    tl.store(O + cur_batch, cur_head)


def decode_attention_fwd(q, k_buffer, o, num_kv_splits=8):
    grid = (q.shape[0], q.shape[1], num_kv_splits)
    _fwd_kernel_stage1[grid](q, k_buffer, 1.0, o, BLOCK_DMODEL=128, BLOCK_N=64,
                             NUM_KV_SPLITS=num_kv_splits, num_warps=4, num_stages=2)
    _fwd_kernel_stage2[(q.shape[0], q.shape[1])](o, o, o, NUM_KV_SPLITS=num_kv_splits,
                                                 num_warps=4)
"""

EXTEND = """
from triton import jit as tjit
import triton.language as tl


@tjit
def _fwd_kernel(Q_Extend, K_Extend, O_Extend, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    cur_seq = tl.program_id(0)
    cur_head = tl.program_id(1)
    cur_block_m = tl.program_id(2)
    tl.store(O_Extend + cur_seq, cur_head + cur_block_m)


def extend_attention_fwd(q, k, o):
    _fwd_kernel[(4, 32, 8)](q, k, o, BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=1)
"""

PREFILL = """
import triton as tr
import triton.language as tl


@tr.autotune(configs=[tr.Config({"BLOCK": 64}, num_warps=4)], key=["N"])
@tr.jit(do_not_specialize=["N"])
def _fwd_kernel(Q, K, V, Out, N, BLOCK: tl.constexpr):
    start_m = tl.program_id(0)
    cur_bh = tl.program_id(1)
    tl.store(Out + start_m, cur_bh)


def context_attention_fwd(q, k, v, o):
    _fwd_kernel[(4, 32)](q, k, v, o, 16, num_warps=4)


class Wrapper:
    @staticmethod
    @tr.jit
    def _inner_kernel(X):
        pass
"""

LAUNCHER = """
from pkg.srt.layers.attention.triton_ops.extend_attention import _fwd_kernel as ext_kernel


def run(q, k, o):
    ext_kernel[(1, 1, 1)](q, k, o, BLOCK_M=64, BLOCK_N=64, num_warps=2)
"""

GLUON = """
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

try:
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier
except ImportError:
    mbarrier = None

if mbarrier is not None:

    @gluon.jit
    def _ws_attention(Q, Out, BLOCK: gl.constexpr):
        pid = gl.program_id(0)

    def attention(q, o):
        _ws_attention[(132,)](q, o, BLOCK=64, num_warps=4)
"""

NOT_KERNELS = """
import functools
import triton

def jit(fn):  # a local helper called jit: not triton's
    return fn

@jit
def not_a_kernel():
    pass

@functools.lru_cache
def cached():
    return triton.__version__
"""


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    ops = tmp_path / "pkg" / "srt" / "layers" / "attention" / "triton_ops"
    ops.mkdir(parents=True)
    for name, text in {
        "decode_attention.py": DECODE,
        "extend_attention.py": EXTEND,
        "prefill_attention.py": PREFILL,
        "launcher.py": LAUNCHER,
        "helpers.py": NOT_KERNELS,
        "gluon_attention.py": GLUON,
        "broken.py": "import triton\n@triton.jit\ndef oops(:\n",
        "plain.py": "def f():\n    return 1\n",
    }.items():
        (ops / name).write_text(textwrap.dedent(text))
    return tmp_path


def test_scan_finds_kernels_with_lines_and_aliases(tree):
    idx = ti.scan(tree)
    names = sorted(f.qualname.rsplit(".", 1)[-1] for f in idx.functions)
    assert names == [
        "_fwd_kernel",
        "_fwd_kernel",
        "_fwd_kernel_stage1",
        "_fwd_kernel_stage2",
        "_inner_kernel",
        "_ws_attention",
    ]
    s1 = idx.lookup("_fwd_kernel_stage1")[0]
    assert s1.module == "pkg.srt.layers.attention.triton_ops.decode_attention"
    assert s1.file.endswith("decode_attention.py")
    source = Path(s1.file).read_text().splitlines()
    assert source[s1.line - 1].startswith("def _fwd_kernel_stage1(")
    assert source[s1.decorator_line - 1] == "@triton.jit"
    assert s1.constexprs == ("BLOCK_DMODEL", "BLOCK_N", "NUM_KV_SPLITS")
    assert s1.program_axes == (0, 1, 2)
    assert s1.launch_num_warps() == {4}
    prefill = [f for f in idx.lookup("_fwd_kernel") if "prefill" in f.module][0]
    assert prefill.autotuned and prefill.program_axes == (0, 1)
    inner = idx.lookup("_inner_kernel")[0]
    assert inner.qualname.endswith("prefill_attention.Wrapper._inner_kernel")
    assert any(p.endswith("broken.py") for p in idx.files_failed)
    assert idx.files_parsed >= 6 and idx.files_scanned == 8
    assert not idx.lookup("not_a_kernel") and not idx.lookup("cached")


def test_collisions_and_disambiguation(tree):
    idx = ti.scan(tree)
    assert set(idx.collisions()) == {"_fwd_kernel"}
    assert len(idx.lookup("_fwd_kernel")) == 2
    assert idx.best("_fwd_kernel") is None  # a tie without hints: say so, do not guess

    by_module = idx.resolve("_fwd_kernel", module_hint="extend_attention")
    assert "extend_attention" in by_module[0].function.module
    assert by_module[0].score > by_module[1].score
    assert "module matches" in by_module[0].reasons[0]

    # 256 threads = 8 warps: only extend_attention's launch uses num_warps=8
    best = idx.best("_fwd_kernel", block=(256, 1, 1))
    assert best is not None and "extend_attention" in best.module
    # 128 threads = 4 warps: prefill's launch
    assert "prefill_attention" in idx.best("_fwd_kernel", block=(128, 1, 1)).module
    # a 3-D grid: prefill reads only program_id(0) and (1)
    assert "extend_attention" in idx.best("_fwd_kernel", grid=(4, 32, 8)).module
    # launched from launcher.py through `from ...extend_attention import _fwd_kernel as ...`
    launcher = tree / "pkg/srt/layers/attention/triton_ops/launcher.py"
    ranked = idx.resolve("_fwd_kernel", caller_file=str(launcher))
    assert "extend_attention" in ranked[0].function.module
    assert "launched from that file" in ranked[0].reasons


def test_specialised_kernel_names_from_older_triton(tree):
    idx = ti.scan(tree)
    assert idx.lookup("_fwd_kernel_stage2_0d1d2d3de4de")[0].name == "_fwd_kernel_stage2"
    assert idx.lookup("_fwd_kernel_stage9") == []


def test_projects_own_kernels():
    kernels = Path(__file__).resolve().parents[1] / "kernels"
    idx = ti.scan(kernels)
    stage1 = idx.lookup("_decode_stage1")
    assert len(stage1) == 1 and stage1[0].file.endswith("decode_attention.py")
    lines = Path(stage1[0].file).read_text().splitlines()
    assert lines[stage1[0].line - 1].startswith("def _decode_stage1(")
    # The Gluon prefill kernel: `@gluon.jit`, defined under `if gluon is not None:`.
    ws = idx.lookup("_prefill_ws_kernel")
    assert len(ws) == 1 and ws[0].file.endswith("prefill_gluon.py")
    lines = Path(ws[0].file).read_text().splitlines()
    assert lines[ws[0].line - 1].strip().startswith("def _prefill_ws_kernel(")


def test_gluon_kernels_under_a_guard(tree):
    """`@gluon.jit` (Triton's explicit-layout dialect) counts as a kernel, inside an `if` block
    as libraries guard them on what their Triton has; its launch site is found."""
    idx = ti.scan(tree)
    (fn,) = idx.lookup("_ws_attention")
    assert fn.file.endswith("gluon_attention.py")
    assert fn.constexprs == ("BLOCK",) and fn.program_axes == (0,)
    assert [s.num_warps for s in fn.launches] == [4]


def test_installed_triton_package():
    """Triton's own library is `@jit` through a relative import (`from ..runtime.jit import jit`),
    and defines some names twice: a real collision."""
    triton = pytest.importorskip("triton")
    pkg = Path(triton.__file__).parent
    idx = ti.scan(pkg, module_root=pkg.parent)
    soft = idx.lookup("softmax")
    assert soft and soft[0].module == "triton.language.standard"
    assert Path(soft[0].file).read_text().splitlines()[soft[0].line - 1].startswith("def softmax(")
    assert len(idx.functions) > 20


def test_site_packages_of_this_process():
    roots = ti.site_packages_of_pid(__import__("os").getpid())
    # numpy/pyarrow shared objects are mapped, so the venv's site-packages is seen
    assert any(r.name == "site-packages" for r in roots)
    assert all(str(r).startswith("/proc/") for r in roots)


def test_demangle():
    mangled = "_ZN2at6native29vectorized_elementwise_kernelILi4ENS0_11FillFunctorIfEEEEviT0_"
    plain = "_fwd_kernel_stage1"
    assert ti.demangle(plain) == plain
    out = ti.demangle_many([mangled, plain, "_Znot-a-real-name"])
    assert out[plain] == plain
    assert out["_Znot-a-real-name"] == "_Znot-a-real-name"  # unparseable: raw name back
    if shutil.which("c++filt"):
        assert out[mangled].startswith("void at::native::vectorized_elementwise_kernel<4")
        assert ti.demangle(mangled) == out[mangled]
    else:
        assert out[mangled] in (mangled,) or out[mangled].startswith("void at::native")


def test_resolve_kernels_of_a_batch(tree):
    """A kernels batch as an import makes it: two `_fwd_kernel` launches with extend's shape."""
    from kdash.schema import make_batch

    idx = ti.scan(tree)
    rows = [
        {
            "name": "_fwd_kernel",
            "block_x": 256,
            "block_y": 1,
            "block_z": 1,
            "grid_x": 4,
            "grid_y": 32,
            "grid_z": 8,
        },
        {
            "name": "_fwd_kernel",
            "block_x": 256,
            "block_y": 1,
            "block_z": 1,
            "grid_x": 4,
            "grid_y": 32,
            "grid_z": 8,
        },
        {
            "name": "_fwd_kernel_stage2",
            "block_x": 128,
            "block_y": 1,
            "block_z": 1,
            "grid_x": 2,
            "grid_y": 8,
            "grid_z": 1,
        },
        {"name": "ampere_bf16_s16816gemm", "block_x": 256, "block_y": 1, "block_z": 1},
    ]
    got = ti.resolve_kernels(idx, make_batch("kernels", rows))
    assert "extend_attention" in got["_fwd_kernel"].function.module
    assert got["_fwd_kernel_stage2"].function.name == "_fwd_kernel_stage2"
    assert got["ampere_bf16_s16816gemm"] is None
