"""The one-launch decode's L2 prefetch of each split's first tiles (decode_fused.WARM_TILES).

A prefetch changes no value, so what can go wrong is where it reads, when it goes out, and what
it costs the kernel: the switch must reach one-launch bf16 plans only, the compiled kernel must
issue the prefetches before its first copy and keep its registers (its residency sets the split
count), and on a GPU a warm plan must give the cold plan's output bit for bit, eager and
replayed from a CUDA graph after the lengths it was planned for have changed (the split it
guessed is then not the one it runs). Triton's real compiler runs for sm_90 in a child process
(no GPU needed); the ``gpu`` test needs CUDA.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # must precede the first triton import

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parent))
import decode_cases  # noqa: E402
from kdash.kernels import bench_configs, decode_fused  # noqa: E402
from kdash.kernels.decode_attention import DEFAULT_FP8_CONFIG, DecodeConfig  # noqa: E402
from sm90_compile import compile_sm90  # noqa: E402
from test_kernels_fused_publish import PTRS, WHERE, _registers  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available(),
    reason="needs CUDA and TRITON_INTERPRET=0",
)


def _meta(fused: bool, fp8: bool = False, head_dim: int = 128) -> dict:
    case = decode_cases.make_case([1000], 32, 8, head_dim, 16, fp8, device="cpu")
    q, kc, _, pt, sl, sc = case
    cfg = DEFAULT_FP8_CONFIG if fp8 else DecodeConfig()
    plan = decode_cases.plan_for(
        pt, sl, q, kc, config=cfg, fused=fused, max_seq_len=1000, **sc
    )  # fmt: skip
    return plan._meta1


def _per_sm(registers: int, meta: dict) -> int:
    """Programs an SM the registers allow: 64k an SM, a thread's rounded up to 8."""
    return 65536 // (-(-registers // 8) * 8 * meta["num_warps"] * 32)


def test_the_switch_reaches_one_launch_bf16_plans_only(monkeypatch) -> None:
    """Two tiles by default: one-launch bf16 plans carry the tile count and the 128-byte lines
    a token's head row spans (2 at head size 128, 1 at 64); at 0 they carry nothing; two-launch
    and fp8 pair plans never carry it. The bench's ``--warm-tiles`` sets it, leaves it alone
    when not given, and the bench refuses a negative count in one line (flag_error)."""
    assert decode_fused.WARM_TILES == 2
    got = _meta(True)
    assert (got["WARM"], got["WARM_LINES"]) == (2, 2)
    assert _meta(True, head_dim=64)["WARM_LINES"] == 1
    assert "WARM" not in _meta(False) and "WARM" not in _meta(True, fp8=True)
    assert decode_fused.WARM_TILES_FP8 == 0  # fp8 pairs: their own switch, off by default
    monkeypatch.setattr(decode_fused, "WARM_TILES_FP8", 3)
    monkeypatch.setattr(decode_fused, "WARM_TILES", 0)
    got = _meta(True, fp8=True)
    assert (got["WARM"], got["WARM_LINES"]) == (3, 1)  # 128 one-byte dims: one line a row
    assert "WARM" not in _meta(False, fp8=True)
    assert "WARM" not in _meta(True)
    ap = argparse.ArgumentParser()
    bench_configs.add_switches(ap)
    bench_configs.apply_switches(ap.parse_args(["--warm-tiles", "1", "--warm-tiles-fp8", "2"]))
    assert (decode_fused.WARM_TILES, decode_fused.WARM_TILES_FP8) == (1, 2)
    bench_configs.apply_switches(ap.parse_args([]))
    assert decode_fused.WARM_TILES == 1 and bench_configs.switches()["WARM_TILES"] == 1
    assert bench_configs.switches()["WARM_TILES_FP8"] == 2
    for flag in ("--max-resident", "--max-registers"):  # the decode flags flag_error reads
        ap.add_argument(flag, type=int)
    ap.add_argument("--decode-tma", action="store_true")
    assert bench_configs.flag_error(ap.parse_args(["--warm-tiles", "-1"])) == (
        "--warm-tiles must be 0 or more"
    )
    assert bench_configs.flag_error(ap.parse_args(["--warm-tiles-fp8", "-2"])) == (
        "--warm-tiles-fp8 must be 0 or more"
    )
    assert bench_configs.flag_error(ap.parse_args(["--warm-tiles", "0"])) is None


def test_the_prefetches_go_out_before_the_first_copy_and_cost_no_registers(tmp_path) -> None:
    """Compiled for sm_90 at 64/8 (the shape that sets the do_bench key) with the plan's own
    values (two tiles): two predicated ``prefetch.global.L2`` for K and two for V a thread
    (128 tokens x 2 lines over 128 threads), all ahead of the first ``cp.async``; the
    page-table read they need does not wait on the lengths' read (no ``ld.global`` between them
    uses the lengths); no fewer programs an SM than the cold kernel (the split count follows
    the residency; Triton 3.6 without kdash's L2 hook spends 118 -> 124 registers a thread, four
    an SM either way, and with it 124 -> 118)."""
    q, kc, _, pt, sl, _ = decode_cases.make_case([1000], 64, 8, 128, 16, device="cpu")
    plan = decode_cases.plan_for(pt, sl, q, kc, config=DecodeConfig(), fused=True, max_seq_len=1000)
    warm_meta = {k: v for k, v in plan._meta1.items() if k != "EVICT"}
    warm_meta.update(UPCAST=False, EVICT="")
    assert (warm_meta["WARM"], warm_meta["WARM_LINES"]) == (2, 2)
    meta = {k: v for k, v in warm_meta.items() if k not in ("WARM", "WARM_LINES")}
    cold = compile_sm90(WHERE, meta, PTRS, tmp_path / "a", cubin=tmp_path / "cold.cubin")["ptx"]
    warm = compile_sm90(WHERE, warm_meta, PTRS, tmp_path / "b", cubin=tmp_path / "warm.cubin")
    ptx = warm["ptx"]
    assert "prefetch" not in cold
    fetches = [m.start() for m in re.finditer(r"@p prefetch\.global\.L2 \[", ptx)]
    assert len(fetches) == 4
    assert max(fetches) < ptx.index("cp.async")
    # the two loads before the first prefetch: the lengths, then the page table, whose address
    # is not computed from the lengths (their register is not read in between)
    loads = list(re.finditer(r"ld\.global\.b32 \{ (%r\d+) \}", ptx[: fetches[0]]))
    assert len(loads) == 2
    between = ptx[loads[0].end() : loads[1].start()]
    assert not re.search(re.escape(loads[0].group(1)) + r"\b", between)
    regs_warm, regs_cold = _registers(tmp_path / "warm.cubin"), _registers(tmp_path / "cold.cubin")
    if regs_warm is None:
        pytest.skip("no cuobjdump to read the registers with (the PTX checks above passed)")
    assert _per_sm(regs_warm, warm_meta) >= _per_sm(regs_cold, warm_meta)


def test_fp8_pair_prefetches_go_out_before_the_first_copy(tmp_path, monkeypatch) -> None:
    """The fp8 pair kernel (the default ``cvt`` conversion) compiled for sm_90 at 64/8 with two
    tiles: the caches are read as int16 pairs, so the prefetch's rows are 64 pairs (one 128-byte
    line) apart as the tile loads' are: 256 tokens x 1 line x K and V over 128 threads is four
    predicated prefetches a thread, all before the first ``cp.async``; no fewer programs an SM
    than without (registers rounded to 8 a thread, 64k an SM: Triton 3.9 spends 143 -> 149,
    3.6 168 -> 166, three an SM either way)."""
    monkeypatch.setattr(decode_fused, "WARM_TILES_FP8", 2)
    q, kc, _, pt, sl, sc = decode_cases.make_case([1000], 64, 8, 128, 16, True, device="cpu")
    plan = decode_cases.plan_for(
        pt, sl, q, kc, config=DEFAULT_FP8_CONFIG, fused=True, max_seq_len=1000, **sc
    )  # fmt: skip
    assert plan.pairs and plan._meta1["CVT"]
    # as a GPU plans it: no upcast (the interpreter's), the inline-asm conversion
    warm_meta = dict(plan._meta1, UPCAST=False, ASM=True, EVICT="")
    cold_meta = {k: v for k, v in warm_meta.items() if k not in ("WARM", "WARM_LINES")}
    ptrs = ["*bf16", "*fp8e4nv", "*fp8e4nv"] + PTRS[3:]
    cold = compile_sm90(WHERE, cold_meta, ptrs, tmp_path / "a", cubin=tmp_path / "cold.cubin")
    warm = compile_sm90(WHERE, warm_meta, ptrs, tmp_path / "b", cubin=tmp_path / "warm.cubin")
    ptx = warm["ptx"]
    assert "prefetch" not in cold["ptx"]
    fetches = [m.start() for m in re.finditer(r"@p prefetch\.global\.L2 \[", ptx)]
    assert len(fetches) == 4
    assert max(fetches) < ptx.index("cp.async")
    regs_warm, regs_cold = _registers(tmp_path / "warm.cubin"), _registers(tmp_path / "cold.cubin")
    if regs_warm is None:
        pytest.skip("no cuobjdump to read the registers with (the PTX checks above passed)")
    assert _per_sm(regs_warm, warm_meta) >= _per_sm(regs_cold, warm_meta)


@gpu
@needs_cuda
@pytest.mark.parametrize(("fp8", "warm"), [(False, 1), (False, 2), (True, 1), (True, 2)])
def test_gpu_warm_runs_equal_cold_runs_bit_for_bit(fp8: bool, warm: int, monkeypatch) -> None:
    """One cold and one warm one-launch plan over the same cache (NaN in every slot no request
    owns), bf16 and fp8 pairs: equal outputs eager, and replayed from CUDA graphs after the
    lengths and pages were rewritten in place (the warm plan's guessed splits then start
    elsewhere, or past a length)."""
    lens = [32768, 1000, 5, 4000]
    q, kc, vc, pt, sl, sc = decode_cases.make_case(lens, 32, 8, 128, 16, fp8, seed=9)
    switch, cfg = ("WARM_TILES_FP8", DEFAULT_FP8_CONFIG) if fp8 else ("WARM_TILES", DecodeConfig())
    plans = {}
    for tiles in (0, warm):
        monkeypatch.setattr(decode_fused, switch, tiles)
        plans[tiles] = decode_cases.plan_for(
            pt, sl, q, kc, config=cfg, fused=True, max_seq_len=32768, **sc
        )  # fmt: skip
    assert plans[warm].pairs == fp8
    assert plans[warm]._meta1["WARM"] == warm and "WARM" not in plans[0]._meta1
    q_in, pt0 = q.clone(), pt.clone()
    graphs = {}
    for tiles, plan in plans.items():
        plan.run(q_in, kc, vc)  # compiles and arms outside the capture
        torch.cuda.synchronize()
        graphs[tiles] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[tiles]):
            plan.run(q_in, kc, vc)
    assert torch.equal(plans[0].out, plans[warm].out)
    decode_cases.check(plans[warm].out, q, kc, vc, pt, sl, sc)
    for new_lens, perm in (
        ([7, 20000, 999, 5], [3, 0, 1, 2]),
        ([32768, 1, 4000, 1000], [0, 2, 3, 1]),
    ):
        sl.copy_(torch.tensor(new_lens, dtype=torch.int32))
        pt.copy_(pt0[perm])  # new row i takes row perm[i]'s pages, which hold its length
        q_in.copy_(torch.randn_like(q.float()).bfloat16())
        for tiles, g in graphs.items():
            plans[tiles].out.fill_(float("nan"))
            g.replay()
        torch.cuda.synchronize()
        assert torch.equal(plans[0].out, plans[warm].out)
        decode_cases.check(plans[warm].out, q_in, kc, vc, pt, sl, sc)
        assert not plans[warm]._flags.any()
