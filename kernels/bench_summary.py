"""The kernel benchmark's summary (kernels/bench.py): the issue's floors and goals, and each
summary key's figure, ``pass`` or ``miss``, over the decode and prefill tables."""

from __future__ import annotations

from typing import Any

from . import decode_persist
from .decode_plan import FUSED_DEFAULT

FLOORS = {
    "decode_bw_ratio": 0.80,
    "decode_bw_ratio_graph": 0.90,
    "decode_host_us": 10.0,
    "fp8_speedup": 1.5,
    "prefill_vs_sdpa_flash": 1.05,
    "prefill_vs_sdpa_cudnn": 0.90,
}
GOALS = {
    "decode_bw_ratio": 0.90,
    "decode_bw_ratio_graph": 0.95,
    "fp8_speedup": 1.7,
    "prefill_vs_sdpa_cudnn": 1.0,
}
# Keys whose floor is an upper bound (less is better); every other floor is a lower bound.
AT_MOST = {"decode_host_us"}
LONG_CONTEXT = 16384  # decode shapes with context >= this count as long-context
CUDNN_MIN_SEQ = 4096  # prefill shapes with S >= this decide prefill_vs_sdpa_cudnn


def summarize(decode: list[dict], prefill: list[dict]) -> dict[str, Any]:
    decode = [r for r in decode if "error" not in r]
    prefill = [r for r in prefill if "error" not in r]
    long_rows = [r for r in decode if r["long_context"]]

    def lowest(vals):
        vals = [v for v in vals if v is not None]
        return min(vals) if vals else None

    flash = [r.get("vs_sdpa_flash") for r in prefill if r["seq"] >= 2048]
    cudnn = [r.get("vs_sdpa_cudnn") for r in prefill if r["seq"] >= CUDNN_MIN_SEQ]
    hosts = [r[t].get("host_us_nosync") for r in decode for t in ("bf16", "fp8")]
    hosts = [h for h in hosts if h is not None]
    calls = [r[t].get("host_us_call") for r in decode for t in ("bf16", "fp8")]
    calls = [h for h in calls if h is not None]
    s: dict[str, Any] = {
        "decode_bw_ratio": lowest(r["bf16"]["bw_ratio"] for r in long_rows),
        "decode_bw_ratio_graph": lowest(r["bf16"]["bw_ratio_graph"] for r in long_rows),
        "decode_bw_ratio_readflush": lowest(r["bf16"]["bw_ratio_readflush"] for r in long_rows),
        "decode_bw_ratio_fp8": lowest(r["fp8"]["bw_ratio"] for r in long_rows),
        "decode_host_us": max(hosts) if hosts else None,
        "decode_host_us_call": max(calls) if calls else None,
        "prefill_vs_sdpa_flash": lowest(flash),
        "prefill_vs_sdpa_cudnn": lowest(cudnn),
        "fp8_speedup": lowest(r["fp8_speedup"] for r in long_rows),
        "fp8_speedup_graph": lowest(r["fp8_speedup_graph"] for r in long_rows),
        "floors": FLOORS,
        "floors_at_most": sorted(AT_MOST),
        "goals": GOALS,
        "definitions": {
            "decode_bw_ratio": "lowest (KV bytes needed + Q + O) / time / copy bandwidth over "
            f"decode shapes with context >= {LONG_CONTEXT}, bf16 KV, do_bench median of one "
            "DecodePlan.run (fp8 KV, whose bytes are half, is judged by fp8_speedup; its ratio "
            "is decode_bw_ratio_fp8)",
            "decode_bw_ratio_graph": "the same, timed by replaying the run from a CUDA graph "
            "(do_bench_cudagraph median)",
            "decode_host_us": "highest host us per DecodePlan.run over every decode shape and KV "
            "dtype: a CPU timer over 100 calls in a row without synchronisation (median of 7)",
            "decode_host_us_call": "the same shapes with each call timed: the highest median "
            "call (a diagnostic: a run's mean also carries its slow calls, which a serving loop "
            "pays too)",
            "prefill_vs_sdpa_flash": "lowest SDPA-FLASH time / our time over prefill shapes "
            "with S >= 2048",
            "prefill_vs_sdpa_cudnn": "lowest SDPA-cuDNN time (sdpa_kernel(SDPBackend."
            f"CUDNN_ATTENTION)) / our time over prefill shapes with S >= {CUDNN_MIN_SEQ}",
            "fp8_speedup": f"lowest bf16 time / fp8 time over decode shapes with context >= "
            f"{LONG_CONTEXT}, do_bench (fp8_speedup_graph: the same from CUDA-graph replays)",
        },
    }
    s["default_path"] = (
        "per batch (decode_plan.fused_pays)"
        if FUSED_DEFAULT == "auto"
        else ("fused" if FUSED_DEFAULT else "two_launch")
    )
    if FUSED_DEFAULT == "auto" and decode_persist.PERSISTENT_DEFAULT:
        s["default_path"] += ", persistent where it says two launches"
    names = ("two_launch", "fused", "persistent")
    s["by_path"] = {name: path_summary(decode, name, lowest) for name in names}
    s["status"] = {k: floor_status(k, s[k]) for k in FLOORS}
    s["met"] = {k: v == "pass" for k, v in s["status"].items()}
    s["short_by"] = {
        k: abs(s[k] - FLOORS[k]) for k, v in s["status"].items() if v == "miss" and s[k] is not None
    }
    return s


def path_summary(decode: list[dict], name: str, lowest) -> dict[str, Any]:
    """The decode summary keys for one launch path (rows timed with both, see decode_row)."""

    # a row timed before this path was (an older result file) has no entry for it
    def timed(r: dict) -> bool:
        return all(t in r.get("paths", {}).get(name, {}) for t in ("bf16", "fp8"))

    rows = [r["paths"][name] for r in decode if timed(r)]
    long_rows = [r["paths"][name] for r in decode if timed(r) and r["long_context"]]
    hosts = [p[t].get("host_us_nosync") for p in rows for t in ("bf16", "fp8")]
    hosts = [h for h in hosts if h is not None]
    out = {
        "decode_host_us": max(hosts) if hosts else None,
        "decode_bw_ratio": lowest(p["bf16"].get("bw_ratio") for p in long_rows),
        "decode_bw_ratio_graph": lowest(p["bf16"].get("bw_ratio_graph") for p in long_rows),
        "decode_bw_ratio_fp8": lowest(p["fp8"].get("bw_ratio") for p in long_rows),
        "fp8_speedup": lowest(p.get("fp8_speedup") for p in long_rows),
        "fp8_speedup_graph": lowest(p.get("fp8_speedup_graph") for p in long_rows),
        "failed": sum(1 for p in rows for t in ("bf16", "fp8") if "error" in p[t]),
        # rows this path was timed on (with --default-path-only, only where it is the default)
        "shapes": f"{len(rows)} of {len(decode)}",
    }
    out["status"] = {k: floor_status(k, v) for k, v in out.items() if k in FLOORS}
    return out


def floor_status(key: str, value: float | None) -> str:
    """``pass`` or ``miss`` of one summary figure against its floor (``miss`` when absent)."""
    if value is None:
        return "miss"
    ok = value <= FLOORS[key] if key in AT_MOST else value >= FLOORS[key]
    return "pass" if ok else "miss"
