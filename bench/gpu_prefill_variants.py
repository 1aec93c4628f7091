"""The prefill default and the Hopper variants (kernels/prefill_hopper.py) against SDPA.

For the bench's prefill shapes with S >= 4096 (those that decide ``prefill_vs_sdpa_cudnn``:
hidden 2048 at D=64 and 128, causal and not, S 4k/8k/16k, and GQA 32/8/128 at 8k; 16k tokens a
launch, no prefix), times by ``do_bench`` (median, L2 flushed, as kernels/bench.py) the default
path (``extend_attention`` without a config: prefill_hopper's kernel at the H200's pick per
class), the pointer kernel it replaced (kernels/prefill_attention.py at its H200 configs, the
fallback), each variant at a few configs, and SDPA's FLASH_ATTENTION and CUDNN_ATTENTION
backends. Correctness first: the default, the pointer kernel and every variant config pass the
prefill error gate
(fp32 reference, bf16 SDPA baseline: tests/test_kernels_prefill.py's) on a ragged batch of its
class at S=4096 before it is timed; one that fails or does not compile is recorded and skipped.
Every timed output is also compared with the default path's (``max_abs_diff_vs_default``).

Per variant and class (head dim x causality) the config with the best geometric-mean time over
the class's shapes is chosen (no per-shape oracle); the summary gives each variant's
``prefill_vs_sdpa_cudnn`` / ``prefill_vs_sdpa_flash`` (lowest SDPA time / ours over these shapes;
note the bench's flash key also counts S=2048) and names the best variant.

Writes ``$OUT/prefill-variants-h200.json`` after every shape (a timeout keeps what is done).
Run: python bench/gpu_prefill_variants.py [--out PATH] [--rep MS]   (kdash importable, one GPU)
``--smoke`` (CPU, TRITON_INTERPRET=1) runs the same steps on tiny shapes with a wall-clock
timer, to check the wiring without a GPU; its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
import triton
from kdash.kernels import bench
from kdash.kernels.bench import prefill_config_json
from kdash.kernels.prefill_attention import PrefillConfig, chosen_config, default_config
from kdash.kernels.prefill_hopper import (
    VARIANTS,
    HopperConfig,
    extend_attention_hopper,
    plan_path,
    variant_config,
)
from kdash.kernels.reference import baseline_for, error_gate, extend_reference

# Shortest sequences first (the lowest ratios have been at S=4096, D=128), GQA last: a run cut
# short by its budget or timeout keeps the shapes that decide the summary.
SHAPES = [
    (f"h2048 d{d}", hq, hq, d, causal, s)
    for s in (4096, 8192, 16384)
    for d, hq in ((128, 16), (64, 32))
    for causal in (False, True)
]
SHAPES += [("gqa 32/8/128", 32, 8, 128, causal, 8192) for causal in (False, True)]
DEV = "cuda"  # --smoke: "cpu"
GATE_LENS = [4096, 4089]  # --smoke: [40, 33]


def candidates(name: str, d: int, causal: bool) -> list[HopperConfig]:
    """The variant's own config first, then a few neighbours (tiles, stages)."""
    base = variant_config(name, d, causal)
    alts: list[HopperConfig] = []
    if name == "tma":
        alts = [HopperConfig(128, 64, 8, 4), HopperConfig(128, 128, 8, 2)]
    else:
        alts = [HopperConfig(128, 64, 8, 3, descriptors="none")]
    out = [base]
    for c in alts:
        if c not in out:
            out.append(c)
    return out[:3]


def cfg_id(cfg: HopperConfig) -> str:
    return f"{cfg.block_m}x{cfg.block_n}/{cfg.num_warps}w/{cfg.num_stages}s/{cfg.descriptors}"


def class_key(d: int, causal: bool) -> str:
    return f"d{d}-{'causal' if causal else 'full'}"


def run_fn(case: bench.PrefillCase, cfg: HopperConfig):
    def run():
        extend_attention_hopper(
            case.q,
            case.k,
            case.v,
            None,
            None,
            None,
            None,
            case.cu,
            case.seq,
            causal=case.causal,
            config=cfg,
            out=case.out,
        )

    return run


class GateCase:
    """A ragged batch (4096 and 4089 new tokens) of one class, with its fp32 reference and bf16
    SDPA baseline computed once: the prefill error gate of tests/test_kernels_prefill.py."""

    def __init__(self, d: int, hq: int, hkv: int, causal: bool):
        g = torch.Generator(device=DEV).manual_seed(0)
        news = GATE_LENS
        t = sum(news)
        self.causal, self.max_len = causal, max(news)
        self.q = torch.randn(t, hq, d, generator=g, device=DEV).bfloat16()
        self.k = torch.randn(t, hkv, d, generator=g, device=DEV).bfloat16()
        self.v = torch.randn(t, hkv, d, generator=g, device=DEV).bfloat16()
        self.cu = torch.tensor([0, news[0], t], dtype=torch.int32, device=DEV)
        empty = torch.empty((1, 16, hkv, d), device=DEV)
        pt = torch.zeros((2, 1), dtype=torch.int32, device=DEV)
        pl = torch.zeros(2, dtype=torch.int32, device=DEV)
        args = (self.q, self.k, self.v, empty, empty, pt, pl, self.cu)
        self.ref = extend_reference(*args, causal=causal)
        self.base = extend_reference(*args, causal=causal, fn=baseline_for(self.q.device))

    def check(self, cfg: HopperConfig | PrefillConfig | None) -> tuple[bool, str]:
        """A variant config, the pointer kernel at a :class:`PrefillConfig`, or the default path
        when ``cfg`` is None."""
        from kdash.kernels.prefill_attention import extend_attention

        c = (self.q, self.k, self.v, None, None, None, None, self.cu, self.max_len)
        out = torch.full_like(self.q, float("nan"))
        extend_attention(*c, causal=self.causal, config=cfg, out=out)
        return error_gate(out, self.ref, self.base, max_factor=2.0)


def time_ms(fn, rep: int) -> float:
    fn()
    if DEV == "cpu":  # --smoke: one wall-clock run
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    torch.cuda.synchronize()
    return bench.bench_ms(fn, rep=rep)


def summarize(rows: list[dict], chosen: dict[str, dict[str, str]]) -> dict[str, Any]:
    out: dict[str, Any] = {"variants": {}}

    def lowest(vals):
        vals = [x for x in vals if x is not None and math.isfinite(x)]
        return min(vals) if vals else None

    def ratios(key_ms):
        cud = [r["sdpa_cudnn_ms"] / key_ms(r) for r in rows if key_ms(r) and r.get("sdpa_cudnn_ms")]
        fla = [r["sdpa_flash_ms"] / key_ms(r) for r in rows if key_ms(r) and r.get("sdpa_flash_ms")]
        return {"prefill_vs_sdpa_cudnn": lowest(cud), "prefill_vs_sdpa_flash": lowest(fla)}

    out["default"] = ratios(lambda r: r.get("default_ms"))
    out["pointer"] = ratios(lambda r: r.get("pointer_ms"))
    for name in VARIANTS:

        def ms(r, name=name):
            cid = chosen.get(name, {}).get(r["class"])
            return r["variants"].get(name, {}).get(cid, {}).get("ms") if cid else None

        complete = all(ms(r) for r in rows)
        out["variants"][name] = {
            **ratios(ms),
            "configs": chosen.get(name, {}),
            "complete": complete,
        }
    scored = [
        (v["prefill_vs_sdpa_cudnn"], n)
        for n, v in out["variants"].items()
        if v["prefill_vs_sdpa_cudnn"] is not None and v["complete"]
    ]
    if scored:
        best = max(scored)[1]
        out["best_variant"] = best
        out["prefill_vs_sdpa_cudnn"] = out["variants"][best]["prefill_vs_sdpa_cudnn"]
        out["prefill_vs_sdpa_flash"] = out["variants"][best]["prefill_vs_sdpa_flash"]
    out["floors"] = {"prefill_vs_sdpa_cudnn": 0.90, "prefill_vs_sdpa_flash": 1.05}
    out["goal"] = {"prefill_vs_sdpa_cudnn": 1.0}
    out["definition"] = (
        "lowest SDPA-backend time / our time over the S >= 4096 shapes here (do_bench median); "
        "a variant's config per class is its best geometric mean over the class's shapes"
    )
    return out


def choose(rows: list[dict]) -> dict[str, dict[str, str]]:
    """Per variant and class, the config with the lowest geometric-mean time over the class's
    shapes (only configs timed at every shape of the class)."""
    chosen: dict[str, dict[str, str]] = {}
    for name in VARIANTS:
        for cls in {r["class"] for r in rows}:
            crow = [r for r in rows if r["class"] == cls]
            ids = set.intersection(
                *[{c for c, v in r["variants"].get(name, {}).items() if "ms" in v} for r in crow]
            )
            if not ids:
                continue

            def geo(c, crow=crow, name=name):
                return sum(math.log(r["variants"][name][c]["ms"]) for r in crow)

            chosen.setdefault(name, {})[cls] = min(ids, key=geo)
    return chosen


def run_gate_jobs(jobs: list[dict], smoke: bool, progress: Path) -> None:
    """The child's side: gate each job in order, one JSON line before (``start``) and after
    (``done``) each, so the parent knows which job a hang is in."""
    cases: dict[tuple, GateCase] = {}
    with progress.open("a") as f:
        for i, job in enumerate(jobs):
            f.write(json.dumps({"i": i, "start": True}) + "\n")
            f.flush()
            key = (job["d"], job["hq"], job["causal"])
            if key not in cases:
                cases.clear()  # one class's tensors and references at a time
                heads = 2 if smoke else job["hq"]
                cases[key] = GateCase(job["d"], heads, heads, job["causal"])
            cfg = job_config(job)
            try:
                ok, msg = cases[key].check(cfg)
                if DEV == "cuda":
                    torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001 - a config that fails is kept in the JSON
                ok, msg = False, f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            f.write(json.dumps({"i": i, "done": True, "pass": ok, "msg": msg}) + "\n")
            f.flush()


def job_config(job: dict) -> HopperConfig | PrefillConfig | None:
    """A gate job's config: None for the default path, the pointer kernel's, or a variant's."""
    if not job["config"]:
        return None
    return (PrefillConfig if job["variant"] == "pointer" else HopperConfig)(**job["config"])


def gates_in_child(jobs: list[dict], smoke: bool, stall_s: float):
    """Yields ``(job, result)`` for every job, gated in a child process; a child that makes no
    progress for ``stall_s`` seconds is killed, its current job recorded as hung, and a new
    child takes the jobs after it."""
    import subprocess
    import tempfile

    todo = list(range(len(jobs)))
    while todo:
        with tempfile.TemporaryDirectory() as tmp:
            spec, progress = Path(tmp) / "jobs.json", Path(tmp) / "progress.jsonl"
            spec.write_text(json.dumps([jobs[i] for i in todo]))
            progress.touch()
            cmd = [sys.executable, str(Path(__file__).resolve()), "--gate-child", str(spec)]
            cmd += [str(progress)] + (["--smoke"] if smoke else [])
            child = subprocess.Popen(cmd)
            seen, current, last = 0, None, time.time()
            results: dict[int, dict] = {}
            while True:
                done = (
                    child.poll() is not None
                )  # before reading: a finished child's lines are all in
                lines = progress.read_text().splitlines()
                for line in lines[seen:]:
                    if not line.endswith("}"):
                        break  # a line still being written
                    rec = json.loads(line)
                    seen += 1
                    last = time.time()
                    if rec.get("start"):
                        current = rec["i"]
                    else:
                        results[rec["i"]] = {"pass": rec["pass"], "msg": rec["msg"]}
                        current = None
                if done or time.time() - last > stall_s:
                    break
                time.sleep(0.5)
            if not done:
                child.kill()
                child.wait()
        for i in sorted(results):
            yield jobs[todo[i]], results[i]
        handled = set(results)
        if current is not None:
            why = "child died" if done else f"hung: no progress for {stall_s:.0f} s, killed"
            yield jobs[todo[current]], {"pass": False, "msg": f"{why} (exit {child.returncode})"}
            handled.add(current)
        if not handled:  # the child failed before its first job (an import or CUDA failure)
            for i in todo:
                yield jobs[i], {"pass": False, "msg": f"gate child exit {child.returncode}"}
            return
        todo = [todo[i] for i in range(len(todo)) if i not in handled]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default_out = Path(os.environ.get("OUT", ".")) / "prefill-variants-h200.json"
    ap.add_argument("--out", type=Path, default=default_out)
    ap.add_argument("--rep", type=int, default=50, help="do_bench ms per measurement")
    ap.add_argument(
        "--budget-s", type=float, default=200.0, help="start no new shape after this many seconds"
    )
    ap.add_argument("--smoke", action="store_true", help="CPU wiring check (TRITON_INTERPRET=1)")
    ap.add_argument(
        "--stall-s", type=float, default=60.0, help="kill a gate child silent this long"
    )
    ap.add_argument("--gate-child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global SHAPES, DEV, GATE_LENS
    if args.smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            print("gpu_prefill_variants: --smoke needs TRITON_INTERPRET=1", file=sys.stderr)
            return 2
        DEV, GATE_LENS, bench.DEVICE, bench.PREFILL_TOKENS = "cpu", [40, 33], "cpu", 256
        SHAPES = [(n, 2, 1 if n.startswith("gqa") else 2, d, c, 128) for n, _, _, d, c, _ in SHAPES]
        SHAPES = [x for i, x in enumerate(SHAPES) if x not in SHAPES[:i]]
    elif not torch.cuda.is_available():
        print("gpu_prefill_variants: needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.gate_child:
        spec, progress = args.gate_child
        run_gate_jobs(json.loads(spec.read_text()), args.smoke, progress)
        return 0
    from torch.nn.attention import SDPBackend

    t0 = time.time()
    result: dict[str, Any] = {
        "command": " ".join(["python", *sys.argv]),
        "machine": {"smoke": "cpu"} if args.smoke else bench.machine(),
        "gates": {},
        "rows": [],
    }

    def save():
        chosen = choose(result["rows"]) if result["rows"] else {}
        result["summary"] = summarize(result["rows"], chosen) if result["rows"] else {}
        result["elapsed_s"] = round(time.time() - t0, 1)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))

    # 1) Gates: each variant config once per class, before any timing, in a child process: a
    # kernel that hangs is killed there and skipped, not the run.
    jobs = []
    for d, hq in ((64, 32), (128, 16)):
        for causal in (True, False):
            jobs.append({"d": d, "hq": hq, "causal": causal, "variant": "default", "config": None})
            pointer = asdict(default_config(d, causal, torch.device(DEV)))
            jobs.append(
                {"d": d, "hq": hq, "causal": causal, "variant": "pointer", "config": pointer}
            )
            for name in VARIANTS:
                for cfg in candidates(name, d, causal):
                    job = {"d": d, "hq": hq, "causal": causal, "variant": name}
                    jobs.append({**job, "config": asdict(cfg)})
    passed: dict[str, dict[str, list[HopperConfig]]] = {}
    for job, res in gates_in_child(jobs, args.smoke, args.stall_s):
        cls = class_key(job["d"], job["causal"])
        cfg = job_config(job)
        key = f"{job['variant']} {cls}" + (
            f" {cfg_id(cfg)}" if isinstance(cfg, HopperConfig) else ""
        )
        result["gates"][key] = {**res, "config": job["config"]}
        print(f"gate {key}: {'pass' if res['pass'] else 'FAIL'} {res['msg']}", flush=True)
        if res["pass"] and isinstance(cfg, HopperConfig):
            passed.setdefault(job["variant"], {}).setdefault(cls, []).append(cfg)
    save()
    print(f"gates done at {time.time() - t0:.0f}s", flush=True)

    # 2) Timing at the bench's S >= 4096 shapes.
    for shape, hq, hkv, d, causal, s in SHAPES:
        if time.time() - t0 > args.budget_s:
            result["cut_by_budget"] = f"stopped before {shape} S={s}"
            print(f"budget of {args.budget_s:.0f}s spent: stopped before {shape} S={s}", flush=True)
            break
        cls = class_key(d, causal)
        case = bench.PrefillCase(s, hq, hkv, d, causal)
        row: dict[str, Any] = {
            "shape": shape,
            "heads": f"{hq}/{hkv}/{d}",
            "causal": causal,
            "seq": s,
            "batch": case.batch,
            "class": cls,
            "variants": {},
        }
        pcfg = default_config(d, causal, torch.device(DEV))
        row["pointer_config"] = asdict(pcfg)
        row["pointer_ms"] = time_ms(case.ours(pcfg), args.rep)
        dcfg = chosen_config(d, causal, torch.device(DEV))
        row["default_config"] = prefill_config_json(dcfg)
        row["default_ms"] = time_ms(case.ours(dcfg), args.rep)
        ref_out = case.out.clone()
        for key, backend in (
            ("sdpa_flash", SDPBackend.FLASH_ATTENTION),
            ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION),
        ):
            try:
                row[f"{key}_ms"] = time_ms(case.sdpa(backend), args.rep)
            except Exception as e:  # noqa: BLE001 - a backend that fails is kept in the row
                row[f"{key}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        for name in VARIANTS:
            for cfg in passed.get(name, {}).get(cls, []):
                entry: dict[str, Any] = {"config": asdict(cfg)}
                path = plan_path(case.q, case.k, case.v, cfg)
                entry["path"] = path
                try:
                    case.out.fill_(float("nan"))
                    entry["ms"] = time_ms(run_fn(case, cfg), args.rep)
                    diff = (case.out.float() - ref_out.float()).abs()
                    entry["max_abs_diff_vs_default"] = float(diff.max())
                except Exception as e:  # noqa: BLE001 - a config that fails is kept in the row
                    entry["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                row["variants"].setdefault(name, {})[cfg_id(cfg)] = entry
        flops = case.flops()
        row["TFLOPs"] = {
            "default": flops / (row["default_ms"] * 1e-3) / 1e12,
            "pointer": flops / (row["pointer_ms"] * 1e-3) / 1e12,
        }
        for key in ("sdpa_flash", "sdpa_cudnn"):
            if f"{key}_ms" in row:
                row["TFLOPs"][key] = flops / (row[f"{key}_ms"] * 1e-3) / 1e12
        for name, per in row["variants"].items():
            good = {c: e["ms"] for c, e in per.items() if "ms" in e}
            if good:
                c = min(good, key=good.get)
                row["TFLOPs"][f"{name} best ({c})"] = flops / (good[c] * 1e-3) / 1e12
        result["rows"].append(row)
        del case
        if DEV == "cuda":
            torch.cuda.empty_cache()
        save()
        tf = " ".join(f"{k}={v:.0f}" for k, v in row["TFLOPs"].items())
        print(f"{shape} {'causal' if causal else 'full'} S={s}: TFLOP/s {tf}", flush=True)

    save()
    sm = result["summary"]
    print("summary", json.dumps({k: v for k, v in sm.items() if k != "definition"}), flush=True)
    print(f"wrote {args.out} in {time.time() - t0:.0f}s (triton {triton.__version__})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
