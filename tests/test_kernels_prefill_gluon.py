"""The Gluon prefill kernel (kernels/prefill_gluon.py) where no GPU is: when it is the default,
what it refuses, and that it compiles for sm_90a into the schedule it is written as.

Gluon has no interpreter, so its numerics are gated on the GPU only (``gpu`` tests in
tests/test_kernels_prefill.py, kernel "gluon"). Here the GPU's compute capability is stood in
for where a test needs one (there is no GPU on this machine), and the compile test runs Triton's
real compiler for an sm_90 target on the CPU.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from kdash.kernels import prefill_attention, prefill_gluon, prefill_hopper  # noqa: E402
from kdash.kernels.prefill_attention import chosen_config, extend_attention  # noqa: E402
from kdash.kernels.prefill_gluon import (  # noqa: E402
    GLUON_DEFAULTS,
    GluonConfig,
    default_gluon_config,
    unsupported_reason,
)
from kdash.kernels.prefill_hopper import HOPPER_DEFAULTS, HopperConfig  # noqa: E402

needs_gluon = pytest.mark.skipif(prefill_gluon.gluon is None, reason="no Gluon in this Triton")


def test_default_only_on_sm90_at_its_head_dims(monkeypatch) -> None:
    """sm_90 at D=128 and D=64: the Gluon kernel at its config for the head dim; other GPUs or
    no Gluon: the Triton kernels as before (capability stood in for: no GPU here)."""
    gpu = torch.device("cuda", 0)
    for cap in ((8, 0), (9, 0), (10, 0)):
        monkeypatch.setattr(prefill_gluon, "_capability", lambda _i, cap=cap: cap)
        monkeypatch.setattr(prefill_hopper, "_capability", lambda _i, cap=cap: cap)
        for d in (64, 128):
            for causal in (True, False):
                got = chosen_config(d, causal, gpu)
                if prefill_gluon.gluon is not None and cap == (9, 0):
                    assert got == GLUON_DEFAULTS[d]
                elif cap >= (9, 0) and prefill_hopper.TensorDescriptor is not None:
                    assert got == HOPPER_DEFAULTS[d, causal]
                else:
                    assert not isinstance(got, (GluonConfig, HopperConfig))
    monkeypatch.setattr(prefill_gluon, "gluon", None)
    monkeypatch.setattr(prefill_gluon, "_capability", lambda _i: (9, 0))
    assert default_gluon_config(128, gpu) is None
    assert default_gluon_config(128, torch.device("cpu")) is None


def test_gluon_refuses_what_it_cannot_run(monkeypatch) -> None:
    """An explicit Gluon config on a call it cannot run raises one clear ValueError (never a
    silent wrong answer: it reads no cached prefix); the reason names what is missing."""
    t = torch.zeros(64, 4, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 64], dtype=torch.int32)
    if prefill_gluon.gluon is not None:
        assert "cached prefix" in unsupported_reason(t, t, t, has_prefix=True)
        assert "CUDA" in unsupported_reason(t, t, t)
    # The output is stored by pointer: any row stride, heads side by side.
    wide = torch.zeros(64, 6, 128, dtype=torch.bfloat16)[:, :4]
    assert prefill_gluon._out_ok(wide, t)
    assert not prefill_gluon._out_ok(
        torch.zeros(64, 128, 4, dtype=torch.bfloat16).transpose(1, 2), t
    )
    assert not prefill_gluon._out_ok(torch.zeros(64, 4, 128), t)
    with pytest.raises(ValueError, match="Gluon prefill kernel cannot run"):
        extend_attention(t, t, t, None, None, None, None, cu, 64, config=GluonConfig())
    monkeypatch.setattr(prefill_gluon, "gluon", None)
    assert "no Gluon" in unsupported_reason(t, t, t)


def test_chosen_gluon_falls_back_where_it_cannot_run(monkeypatch) -> None:
    """When the default is the Gluon kernel but the call has a cached prefix (or a layout its
    descriptors cannot take), extend_attention runs the Hopper kernel instead (the choice is
    stood in for: the CPU cannot run the Gluon kernel). Output checked against the same call
    at the Hopper config."""
    monkeypatch.setattr(prefill_attention, "default_gluon_config", lambda d, dev: GluonConfig())
    g = torch.Generator().manual_seed(3)
    q = torch.randn(40, 4, 64, generator=g).to(torch.bfloat16)
    k = torch.randn(40, 2, 64, generator=g).to(torch.bfloat16)
    cu = torch.tensor([0, 40], dtype=torch.int32)
    assert isinstance(chosen_config(64, True, q.device), GluonConfig)
    got = extend_attention(q, k, k, None, None, None, None, cu, 40)
    monkeypatch.undo()
    want = extend_attention(q, k, k, None, None, None, None, cu, 40)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# Run in a child process: the kernel tests of this process interpret (TRITON_INTERPRET=1, read
# when the modules load), and Gluon's code generator does not run under the interpreter.
COMPILE_SM90 = """
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from kdash.kernels import prefill_gluon

cfg = prefill_gluon.GLUON_DEFAULTS[128]
sig = {"Q": "*bf16", "K": "*bf16", "V": "*bf16", "Out": "*bf16", "CU": "*i32", "COUNTER": "*i32",
       "qk_scale": "fp32", "stride_qt": "i32", "stride_kt": "i32", "stride_vt": "i32",
       "stride_ot": "i32", "total": "i32", "nblk": "i32", "q_heads": "i32"}
const = {"GROUP": 4, "HEAD_DIM": 128, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
         "STAGES": cfg.stages, "CAUSAL": True, "PINGPONG": cfg.pingpong,
         "Q_LAYOUT": gl.NVMMASharedLayout.get_default_for([cfg.block_m, 128], gl.bfloat16),
         "KV_LAYOUT": gl.NVMMASharedLayout.get_default_for([cfg.block_n, 128], gl.bfloat16)}
names = list(sig) + list(const)
sig.update(dict.fromkeys(const, "constexpr"))
src = GluonASTSource(prefill_gluon._prefill_ws_kernel, sig,
                     {(names.index(k),): v for k, v in const.items()},
                     attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 7, 8, 9,
                                                                       10)})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": 168})
from triton.backends.nvidia.compiler import get_ptxas
print(json.dumps({"num_warps": k.metadata.num_warps, "shared": k.metadata.shared,
                  "ptx": k.asm["ptx"], "ptxas": get_ptxas(90).path}))
"""


@needs_gluon
def test_compiles_for_sm90_into_its_schedule(tmp_path) -> None:
    """Triton's compiler, run for sm_90 on the CPU: 12 warps (two consumer warpgroups and the
    loader's), registers handed between partitions with setmaxnreg (the loader down to 24, the
    consumers up to 240), TMA tile copies, mbarrier waits, asynchronous wgmma with a wait that
    leaves one group in flight, shared memory within the H200's 227 KiB, and the ptxas Triton
    used keeping every wgmma asynchronous (no "serialized" note: C7510-C7515).

    The PTX waits for the last tile's P V after this tile's softmax, but ptxas moves that wait
    to the top of its block, so the softmax does not run under it (bench/NOTES-kernels.md,
    session 28)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    res = subprocess.run(
        [sys.executable, "-c", COMPILE_SM90],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    ptx = got["ptx"]
    assert got["num_warps"] == 12
    assert got["shared"] <= 227 * 1024
    assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx
    assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
    assert "cp.async.bulk.tensor" in ptx
    assert "mbarrier.try_wait" in ptx
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx
    (tmp_path / "k.ptx").write_text(ptx)
    notes = subprocess.run(
        [got["ptxas"], "-v", "-arch=sm_90a", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.o")],
        capture_output=True, text=True, timeout=600, check=True,
    ).stderr  # fmt: skip
    assert "Compiling entry function '_prefill_ws_kernel'" in notes
    assert "serialized" not in notes, notes
