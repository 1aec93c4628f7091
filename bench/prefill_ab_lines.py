"""bench/gpu_prefill_gluon.py's JSON lines (on stdin) as one short line each for a device log:
a gate's name, heads, mask, verdict and error; a timed shape's rounds (us) per contender, the
Gluon configs numbered in the order timed (their full names are in the JSON the script wrote).

Use: python3 bench/gpu_prefill_gluon.py ... | python3 bench/prefill_ab_lines.py
"""

from __future__ import annotations

import json
import sys


def short(row: dict) -> str | None:
    if "gate" in row:
        verdict = "passed" if row["passed"] else "FAILED"
        return (
            f"gate {row['gate']} {row['heads']} {row['causal']} {verdict} {row['max_abs_err']:.5f}"
        )
    if "rounds_us" in row:
        names, n = {}, 0
        for key in row["rounds_us"]:
            if key.startswith("gluon"):
                n += 1
                names[key] = f"gluon{n}"
            else:
                names[key] = key[:8]
        rounds = {
            names[k]: [round(x) for x in v] if isinstance(v, list) else str(v)[:80]
            for k, v in row["rounds_us"].items()
        }
        mask = "causal" if row["causal"] else "full"
        return f"{row['heads']} {mask} {row['seq']} {rounds}"
    return None


def main() -> int:
    for line in sys.stdin:
        if "Warning" in line:
            continue
        try:
            row = json.loads(line)
        except ValueError:
            if line.strip():
                print(line.rstrip()[:300])
            continue
        text = short(row) if isinstance(row, dict) else None
        print(text if text is not None else line.rstrip()[:300], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
