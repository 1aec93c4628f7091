"""One of the project's Triton decode kernels compiled for sm_90 on the CPU, in a child process
(Triton's real pipeline and bundled ptxas, no GPU; a private Triton cache, no interpreter).

The kernel's runtime arguments get the types a plan passes: ``ptrs`` for the leading pointers,
fp32 for ``qk_scale``, i32 for the rest; pointers and strides 16-divisible, as the plan's buffers
and the workload's caches are. ``meta`` is the plan's compile-time values (``num_warps``,
``num_stages`` and ``maxnreg`` are compile options); constexprs it leaves out take their
defaults. With ``hint``, kdash's L2 hook is installed first (kernels/l2_hint.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdash.kernels import l2_hint

meta, where, ptrs, hint = json.loads(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3]), sys.argv[4]
if hint == "1":
    assert l2_hint.install() is None
module, name = where.split(":")
fn = getattr(importlib.import_module(module), name)
opts = {k: meta.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in meta}
names = [p.name for p in fn.params if not p.is_constexpr]
sig = {n: (ptrs[i] if i < len(ptrs) else ("fp32" if n == "qk_scale" else "i32"))
       for i, n in enumerate(names)}
const = {p.name: meta.get(p.name, p.default) for p in fn.params if p.is_constexpr}
sig.update({k: "constexpr" for k in const})
div = [i for i, n in enumerate(sig) if sig[n].startswith("*") or n.startswith("stride")]
src = ASTSource(fn, sig, const, attrs={(i,): [["tt.divisibility", 16]] for i in div})
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
if len(sys.argv) > 5:
    open(sys.argv[5], "wb").write(k.asm["cubin"])
code = l2_hint.text_sections(k.asm["cubin"])[k.metadata.name]
dropped = getattr(k.metadata, l2_hint.DROPPED_KEY, 0) or 0
print(json.dumps({"shared": k.metadata.shared, "ptx": k.asm["ptx"], "hinted": l2_hint.hinted(k),
                  "ldgsts": l2_hint.ldgsts(code), "misencoded": l2_hint.misencoded(code),
                  "dropped": dropped}))
"""


def compile_sm90(
    where: str,
    meta: dict,
    ptrs: list[str],
    cache: Path,
    *,
    hint: bool = False,
    cubin: Path | None = None,
) -> dict:
    """``{"shared", "ptx", "hinted", "ldgsts", "misencoded", "dropped"}`` of kernel ``where``
    (``"module:function"``) compiled with ``meta`` (the cubin written to ``cubin`` if given);
    the child's stderr tail on failure."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    res = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(meta), where, json.dumps(ptrs),
         "1" if hint else "0", *([str(cubin)] if cubin is not None else [])],
        capture_output=True, text=True, env=env, timeout=900, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def cuobjdump() -> str | None:
    """Triton's bundled cuobjdump, or one on the PATH, or None."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(tool) if tool.exists() else shutil.which("cuobjdump")
