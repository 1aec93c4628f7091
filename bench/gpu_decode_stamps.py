"""Where a one-launch decode step's time goes, read from the GPU's own clock. (GPU machine)

At 1 x 64k the default plan's time by do_bench is ~18 us more than its share of a longer
context's time (the slope between 64k and 128k), on the H100 and the H200 alike (bench/NOTES-
kernels.md, session 26): a cost paid once a call, not a reading rate. This splits it. The fused
kernel built with ``STAMP`` (kernels/decode_fused.py) has every program write its start, the end
of its stage 1 (or merge) and its finish on ``%globaltimer``, and its SM. Per launch, relative to
the first program's start: when the last stage-1 program started, the stage-1 ends (median,
90th percentile, last), the last publish, the last merge's end; the launch's event-timed length
beside the programs' span (the difference is the kernel's edges: launch, first program, drain);
stage-1 lengths by how many stage-1 programs shared their SM.

Modes: ``flush`` (do_bench's: a 256 MB memset before each launch, so ~L2's worth of dirty lines
are written back during it), ``readflush`` (the same bytes read instead: clean lines), ``warm``
(back to back, as a graph replays). The stamped kernel's output is checked against the plain
run's and its flags must be down after every launch. Medians over ``--reps`` launches; the plain
kernel's do_bench time beside the stamped one's shows what the stamps cost.

``--waves``: beside the default plan (one wave of stage-1 programs), plans cut into W waves: W
times the splits and the device-side split search told of W times the programs an SM holds, so
each program reads 1/W of the tokens and an SM that finishes early could take more of the next
wave (a check on whether the one wave's uneven finish is part of the fixed cost). Each plan is
also timed plain: do_bench, replayed from a CUDA graph, read-flushed.
``--raw FILE``: every program's own stamps (request, KV head, split, SM, start, stage-1 end and
finish, us from the launch's first start) of the last ``RAW_LAUNCHES`` launches of each mode, at
the default plan, so a slow program can be told apart by its SM, its SM's load, its split (its
part of the cache) or its KV head.
One JSON line a row to ``--out`` (appended).
Run: python bench/gpu_decode_stamps.py [--out FILE] [--reps N] [--waves 1,2] [--raw FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench's sibling scripts

from jsonl_rows import emit, start
from kdash.kernels import bench
from kdash.kernels.bench_timing import bench_graph_ms, bench_readflush_ms
from kdash.kernels.decode_attention import DecodeConfig

SHAPES = [([65536], 64, 8), ([65536], 32, 8), ([131072], 64, 8)]
MODES = ("flush", "readflush", "warm")
SPIN_CYCLES = 2_000_000  # ~1 ms at the H100's and H200's 1.98 GHz
RAW_LAUNCHES = 5


class Stamped:
    """The plan's fused launch with STAMP on, its flags in a buffer long enough for the
    stamps (4 int64 a program after the flags, rounded to 8 bytes)."""

    def __init__(self, plan, case: bench.DecodeCase) -> None:
        self.plan = plan
        n_flags = plan._flags.numel()
        self.first = 2 * ((n_flags + 1) // 2)
        g = plan._grid1
        self.programs = g[0] * g[1] * g[2]
        self.buf = torch.zeros(self.first + 8 * self.programs, dtype=torch.int32, device="cuda")
        rest = list(plan._rest1)
        at = [i for i, a in enumerate(rest) if a is plan._flags]
        assert len(at) == 1, "the plan's flags are not among its stage-1 arguments"
        rest[at[0]] = self.buf
        self.args = (case.q, case.k, case.v, plan.page_table, plan.seq_lens, plan._ks, plan._vs)
        self.args = (*self.args, *rest)
        s1 = plan._s1  # the plan's bound stage-1 launch: its kernel, grid and keywords
        self.launch = s1.fn[s1.grid]
        self.meta = dict(s1.meta, STAMP=True)
        # Triton's own launch path does not ask for the extra shared memory a plan may use to
        # cap its programs an SM; the row says when there was such a cap
        self.shared_cap = s1.shared

    def __call__(self) -> None:
        self.launch(*self.args, **self.meta)

    def read(self) -> dict:
        """The last launch's stamps as lists (ns), split into stage-1 and merge programs."""
        flags_left = int(self.buf[: self.first].abs().sum())
        st = self.buf[self.first :].view(torch.int64).view(-1, 4).cpu()
        g0, g1, g2 = self.plan._grid1
        z = torch.arange(g2).repeat(g0 * g1)
        s1 = z < self.plan.num_splits
        return {"s1": st[s1], "merge": st[~s1], "flags_left": flags_left, "all": st}

    def raw(self, st: torch.Tensor) -> list[list]:
        """``[b, kvh, z, sm, start, mid, end]`` a program (z past the splits: a merge program),
        times in us from the first start, in grid order."""
        g0, g1, g2 = self.plan._grid1
        t0 = int(st[:, 0].min())
        rows = []
        for i, (a, m, e, sm) in enumerate(st.tolist()):
            b, rest = divmod(i, g1 * g2)
            kvh, z = divmod(rest, g2)
            rows.append([b, kvh, z, sm, *(round((x - t0) / 1e3, 3) for x in (a, m, e))])
        return rows


def us(x) -> float:
    return float(x) / 1e3


def one_launch(stamps: dict, event_us: float) -> dict:
    s1, mg = stamps["s1"], stamps["merge"]
    t0 = int(s1[:, 0].min())
    rel1 = (s1[:, :3] - t0).double()
    ends = rel1[:, 1].sort().values
    n = len(ends)
    row = {
        "last_s1_start": us(rel1[:, 0].max()),
        "s1_end_p50": us(ends[n // 2]),
        "s1_end_p90": us(ends[min(n - 1, (9 * n) // 10)]),
        "s1_end_max": us(ends[-1]),
        "publish_max": us(rel1[:, 2].max()),
        "s1_len_p50": us((rel1[:, 1] - rel1[:, 0]).median()),
        "event_us": event_us,
    }
    if len(mg):
        relm = (mg[:, :3] - t0).double()
        row["merge_start_min"] = us(relm[:, 0].min())
        row["merge_end_max"] = us(relm[:, 2].max())
        row["merge_after_last_publish"] = row["merge_end_max"] - row["publish_max"]
    span = max(row["publish_max"], row.get("merge_end_max", 0.0))
    row["span"] = span
    row["edges"] = event_us - span
    # stage-1 lengths by how many stage-1 programs ran on the SM
    per_sm: dict[int, list[float]] = {}
    sm = s1[:, 3].tolist()
    load = {s: sm.count(s) for s in set(sm)}
    lens = (rel1[:, 1] - rel1[:, 0]).tolist()
    for s, ln in zip(sm, lens, strict=True):
        per_sm.setdefault(load[s], []).append(ln / 1e3)
    row["s1_len_by_sm_load"] = {k: statistics.median(v) for k, v in sorted(per_sm.items())}
    row["sms_by_load"] = {k: sum(1 for x in load.values() if x == k) for k in sorted(per_sm)}
    row["sms_used"] = len(load)
    diffs = sorted({int(x) for x in s1[:, 0].tolist()})
    steps = [b - a for a, b in zip(diffs, diffs[1:], strict=False) if b > a]
    row["clock_step_ns_min"] = min(steps) if steps else None
    return row


def median_rows(rows: list[dict]) -> dict:
    out: dict = {}
    for k, v in rows[0].items():
        if isinstance(v, dict):
            keys = set().union(*(r[k] for r in rows))
            out[k] = {kk: statistics.median(r[k][kk] for r in rows if kk in r[k]) for kk in keys}
        elif isinstance(v, int | float):
            vals = [r[k] for r in rows if r.get(k) is not None]
            out[k] = statistics.median(vals) if vals else None
    return out


def run_mode(stamped: Stamped, mode: str, reps: int) -> tuple[dict, int, list]:
    """The median row of ``reps`` launches, the flags left up, and the last launches' raw
    stamps (:meth:`Stamped.raw`)."""
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    rows, left, raw = [], 0, []
    for _ in range(reps):
        # The GPU spins first, so the flush, the events and the launch are all queued behind it
        # (as do_bench's are): else the launch, through Triton's Python path after a sync, can
        # reach the GPU after the flush is done, and the gap reads as the kernel's edges
        # (session 27: 10.8 us by this loop's events against 4.3 by do_bench).
        torch.cuda._sleep(SPIN_CYCLES)
        if mode == "flush":
            flush.zero_()
        elif mode == "readflush":
            flush.sum(dtype=torch.int32)
        else:
            stamped()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        stamped()
        b.record()
        torch.cuda.synchronize()
        got = stamped.read()
        left += got["flags_left"]
        rows.append(one_launch(got, a.elapsed_time(b) * 1e3))
        if len(rows) > reps - RAW_LAUNCHES:
            raw.append(
                {"event_us": round(rows[-1]["event_us"], 3), "programs": stamped.raw(got["all"])}
            )
    return median_rows(rows), left, raw


def in_waves(case: bench.DecodeCase, default, waves: int):
    """The one-launch plan at ``waves`` times the default plan's splits, its device-side split
    search given ``waves`` times the capacity (it cuts a wave of that many programs), before its
    first run binds the arguments."""
    if waves == 1:
        return default
    plan = case.plan(DecodeConfig(), fused=True, num_splits=waves * default.num_splits)
    plan.capacity *= waves
    return plan


def parse_waves(text: str) -> list[int] | None:
    try:
        got = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        return None
    return got if got and all(1 <= w <= 4 for w in got) else None


def one_plan(a, case: bench.DecodeCase, shape: str, plan, w: int, ref: torch.Tensor) -> bool:
    """Gate ``plan`` (its own run and its stamped launch against ``ref``, flags down), time it
    plain three ways, then read its stamps in every mode; False where the gate failed."""
    # its own run binds its arguments (which the stamped launch borrows) and is gated too
    plain_diff = float((plan.run(case.q, case.k, case.v).float() - ref).abs().max())
    stamped = Stamped(plan, case)
    plan.out.fill_(float("nan"))
    stamped()
    torch.cuda.synchronize()
    diff = float((plan.out.float() - ref).abs().max())
    check = stamped.read()
    good = max(diff, plain_diff) <= 1e-3 and check["flags_left"] == 0
    facts = {"shape": shape, "waves": w, "splits": plan.num_splits,
             "per_sm": plan.resident_per_sm, "capacity": plan.capacity,
             "programs": stamped.programs, "bytes": case.bytes_needed(),
             "shared_cap_not_applied": stamped.shared_cap}  # fmt: skip
    run = lambda p=plan, c=case: p.run(c.q, c.k, c.v)  # noqa: E731
    plain = {"plain_dobench_us": bench.bench_ms(run) * 1e3,
             "plain_graph_us": bench_graph_ms(run) * 1e3,
             "plain_readflush_us": bench_readflush_ms(run) * 1e3}  # fmt: skip
    emit(a.out, {**facts, "gate_max_abs_diff": diff, "gate_plain_max_abs_diff": plain_diff,
                 "gate_flags_left": check["flags_left"], "pass": good, **plain,
                 "stamped_dobench_us": bench.bench_ms(stamped) * 1e3})  # fmt: skip
    if good:
        for mode in MODES:
            got, left, raw = run_mode(stamped, mode, a.reps)
            emit(a.out, {**facts, "mode": mode, "reps": a.reps, "flags_left": left, **got})
            if a.raw is not None and w == 1:
                cols = ["b", "kvh", "z", "sm", "start", "mid", "end"]
                with a.raw.open("a") as fh:  # not printed: hundreds of programs a launch
                    fh.write(json.dumps({**facts, "mode": mode, "columns": cols, "launches": raw}))
                    fh.write("\n")
    return good


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")) / "stamps.jsonl")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--waves", default="1,2", help="waves of stage-1 programs, 1 to 4 (1: default)")
    ap.add_argument("--raw", type=Path, default=None, help="every program's stamps to this file")
    a = ap.parse_args(argv)
    if a.reps < 1:
        print("--reps must be at least 1", file=sys.stderr)
        return 2
    waves = parse_waves(a.waves)
    if waves is None:
        print(f"--waves wants a comma list of 1 to 4 (got {a.waves!r})", file=sys.stderr)
        return 2
    if not start(a.out, "gpu_decode_stamps.py", argv):
        return 2
    if a.raw is not None and not start(a.raw, "gpu_decode_stamps.py", argv):
        return 2
    ok = True
    for lens, hq, hkv in SHAPES:
        # one cache and reference a shape, whatever the waves
        case = bench.DecodeCase(lens, hq, hkv, 128, False)
        default = case.plan(DecodeConfig())
        shape = f"{len(lens)}x{lens[0]} {hq}/{hkv}"
        if not default.fused:
            emit(a.out, {"shape": shape, "skipped": f"the plan takes the {default.path} path"})
            continue
        ref = default.run(case.q, case.k, case.v).float().clone()
        for w in waves:
            ok = one_plan(a, case, shape, in_waves(case, default, w), w, ref) and ok
        torch.cuda.empty_cache()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
