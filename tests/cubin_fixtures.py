"""Real cubins of the project's own Triton kernels, compiled here for sm_90 without a GPU.

`triton.compile` runs the whole pipeline (Triton IR -> PTX -> ptxas from Triton's bundled
toolkit) on the CPU; the cubin is the same kind of file the H200 loads, with Triton's line info
pointing at kernels/decode_attention.py. Compiled once per test session, into a private Triton
cache so the user's cache is neither read nor written.

The PC samples made from these cubins (`fixture_samples`) are a FIXTURE: counts drawn with a
fixed seed over the cubin's real PC offsets, with real H200 stall-reason names. No sample
recorded on a GPU exists in the repository yet (issue 5 asks for them); when one does, tests
should move to it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd

STAGE2_SIG = {
    "OP": "*fp32",
    "LSEP": "*fp32",
    "Out": "*bf16",
    "LSE": "*fp32",
    "num_splits": "i32",
    "stride_outb": "i32",
    "stride_outh": "i32",
    "HEAD_DIM": "constexpr",
    "BLOCK_S": "constexpr",
    "EMULATE_RTNE": "constexpr",
}
STAGE2_CONST = {"HEAD_DIM": 128, "BLOCK_S": 16, "EMULATE_RTNE": False}

STAGE1_SIG = {
    "Q": "*bf16",
    "K": "*bf16",
    "V": "*bf16",
    "PT": "*i32",
    "LENS": "*i32",
    "KS": "*i32",
    "VS": "*i32",
    "OP": "*fp32",
    "LSEP": "*fp32",
    "qk_scale": "fp32",
    "num_splits": "i32",
    "split_len_hint": "i32",
    "capacity": "i32",
    **{
        s: "i32"
        for s in (
            "stride_qb",
            "stride_qh",
            "stride_kp",
            "stride_ks",
            "stride_kh",
            "stride_vp",
            "stride_vs",
            "stride_vh",
            "stride_ptb",
        )
    },
    **{
        c: "constexpr"
        for c in (
            "GROUP",
            "BLOCK_H",
            "HEAD_DIM",
            "BLOCK_N",
            "PAGE",
            "IS_FP8",
            "FP8_FP16",
            "EVICT",
            "UPCAST",
            "PREFETCH",
            "DEVICE_PLAN",
            "TARGET_VARLEN",
            "MIN_SPLIT",
            "BLOCK_B",
            "MAX_SPLITS",
            "MERGE",
            "SEARCH",
            "OPAQUE_HEADS",
            "TAGGED",
        )
    },
}
STAGE1_CONST = {
    "GROUP": 8,
    "BLOCK_H": 16,
    "HEAD_DIM": 128,
    "BLOCK_N": 64,
    "PAGE": 16,
    "IS_FP8": False,
    "FP8_FP16": True,
    "EVICT": "",
    "UPCAST": False,
    "PREFETCH": False,
    "DEVICE_PLAN": False,
    "TARGET_VARLEN": 1,
    "MIN_SPLIT": 256,
    "BLOCK_B": 16,
    "MAX_SPLITS": 256,
    "MERGE": 16,
    "SEARCH": 256,
    "OPAQUE_HEADS": False,
    "TAGGED": False,
}

# Real H200 reason names (CUPTI's), weighted roughly as a memory-bound decode kernel shows them;
# the `_not_issued` row is there so tests prove it is never added in.
REASONS = [
    ("smsp__pcsamp_warps_issue_stalled_long_scoreboard", 0.45),
    ("smsp__pcsamp_warps_issue_stalled_wait", 0.15),
    ("smsp__pcsamp_warps_issue_stalled_short_scoreboard", 0.1),
    ("smsp__pcsamp_warps_issue_stalled_selected", 0.1),
    ("smsp__pcsamp_warps_issue_stalled_barrier", 0.1),
    ("smsp__pcsamp_warps_issue_stalled_math_pipe_throttle", 0.1),
]


def _compile_here(name: str, line_info: bool) -> bytes:
    """In a process where triton was imported without TRITON_INTERPRET (see compile_kernels)."""
    import triton
    from kdash.kernels import decode_attention as da
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if hasattr(triton, "knobs"):  # Triton >= 3.4
        triton.knobs.compilation.disable_line_info = not line_info
    else:  # older Triton reads the environment at compile time
        os.environ["TRITON_DISABLE_LINE_INFO"] = "0" if line_info else "1"
    if name == "_decode_stage2":
        src = ASTSource(da._decode_stage2, STAGE2_SIG, STAGE2_CONST)
    else:
        src = ASTSource(da._decode_stage1, STAGE1_SIG, STAGE1_CONST)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    return bytes(k.asm["cubin"])


def compile_kernels(specs: list[tuple[str, bool]], cache_dir: Path) -> list[bytes]:
    """sm_90 cubins of `(kernel name, line info?)` pairs, compiled on the CPU.

    In a child process: the kernel tests set TRITON_INTERPRET=1 before triton is first imported,
    which turns every `@triton.jit` function of this pytest process into an interpreted one
    (not compilable), and compiling here could leave state behind for them. The child gets the
    environment without TRITON_INTERPRET and a private TRITON_CACHE_DIR.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache_dir)
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    # The child must compile the same copy of the kernels this process imports: the checkout
    # (`python -m pytest` from its root puts it first) or the installed package.
    import kdash

    here = str(Path(kdash.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
    outs = [Path(cache_dir) / f"out-{i}.cubin" for i in range(len(specs))]
    args = [x for (n, li), o in zip(specs, outs, strict=True) for x in (n, str(int(li)), str(o))]
    subprocess.run(
        [sys.executable, __file__, *args], env=env, check=True, capture_output=True, timeout=600
    )
    return [o.read_bytes() for o in outs]


def compile_kernel(name: str, cache_dir: Path, *, line_info: bool = True) -> bytes:
    """The sm_90 cubin of `_decode_stage1` or `_decode_stage2` (see `compile_kernels`)."""
    return compile_kernels([(name, line_info)], cache_dir)[0]


if __name__ == "__main__":
    argv = sys.argv[1:]
    for i in range(0, len(argv), 3):
        Path(argv[i + 2]).write_bytes(_compile_here(argv[i], argv[i + 1] == "1"))


def fixture_samples(
    pcs: list[int], kernel: str, crc: int, *, seed: int = 5, n: int = 4000, t0: int = 0
) -> pd.DataFrame:
    """`pc_samples` rows over real PC offsets with seeded counts (a fixture, not a recording).

    A few PCs get most samples (as in real decode kernels, where the loads' consumers dominate).
    """
    rng = np.random.default_rng(seed)
    pcs = np.asarray(pcs, dtype=np.int64)
    weights = rng.pareto(1.2, size=len(pcs)) + 1e-3
    weights /= weights.sum()
    rows = []
    hits = rng.choice(len(pcs), size=n, p=weights)
    names = [r for r, _ in REASONS]
    probs = np.array([p for _, p in REASONS])
    reasons = rng.choice(len(names), size=n, p=probs / probs.sum())
    df = pd.DataFrame({"pc": pcs[hits], "reason": np.array(names)[reasons]})
    counts = df.groupby(["pc", "reason"]).size().reset_index(name="count")
    for i, r in enumerate(counts.itertuples(index=False)):
        rows.append(
            {
                "t_ns": t0 + i,
                "kernel": kernel,
                "cubin_crc": crc,
                "pc_offset": int(r.pc),
                "stall_reason": str(r.reason),
                "count": int(r.count),
            }
        )
        if r.reason.endswith("long_scoreboard"):
            rows.append({**rows[-1], "stall_reason": str(r.reason) + "_not_issued"})
    return pd.DataFrame(rows)
