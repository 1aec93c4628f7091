"""One summary over several interleaved A/B result files (bench/gpu_ab_cost.py `--interleaved`).

Each device call fits a few repeats; the issue's figures are medians over all of them. The
runs of every file are kept under keys made unique (`eager/default/0` of the second file
becomes `eager/default/1` when the first had one), the summary is recomputed with
gpu_ab_cost.target_summary (which also gives the rate after each of a run's two detaches).

    python3 bench/ab_merge.py OUT.json IN.json [IN.json ...]

Pure: reads JSON, writes JSON; runs on any machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_ab_cost import estimate_from, target_summary


def brief_of(run: dict) -> dict:
    """A run's per_run entry, for files written before gpu_ab_cost kept one."""
    brief = {k: run[k] for k in ("attached_pct", "after_pct", "before_spread_pct")}
    brief["estimate_pct"] = estimate_from(run["events"])
    return brief


def merge(files: list[dict]) -> dict:
    runs: dict[str, dict] = {}
    per_run: dict[str, dict] = {}
    for d in files:
        for key, run in d["runs"].items():
            mode, variant, _rep = key.split("/")
            n = sum(1 for k in runs if k.rsplit("/", 1)[0] == f"{mode}/{variant}")
            new = f"{mode}/{variant}/{n}"
            runs[new] = run
            per_run[new] = (d.get("per_run") or {}).get(key) or brief_of(run)
    modes = sorted({k.split("/")[0] for k in runs})
    summary: dict = {}
    for m in modes:
        summary.update(target_summary(m, runs, per_run))
    return {
        "command": [d.get("command") for d in files],
        "method": files[0].get("method"),
        "machine": files[0].get("machine"),
        "merged_from": len(files),
        "runs": runs,
        "per_run": per_run,
        "summary": summary,
    }


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: python3 bench/ab_merge.py OUT.json IN.json [IN.json ...]", file=sys.stderr)
        return 2
    out, ins = Path(argv[0]), [Path(p) for p in argv[1:]]
    try:
        files = [json.loads(p.read_text()) for p in ins]
        merged = merge(files)
    except (OSError, ValueError, KeyError) as e:
        print(f"ab_merge: cannot merge: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(merged, indent=1) + "\n")
    tmp.replace(out)
    for name, s in merged["summary"].items():
        print(name, {k: v for k, v in s.items() if not k.endswith("each_pct")})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
