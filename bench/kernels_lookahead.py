"""The kernel bench (``python -m kdash.kernels.bench``) with the Gluon prefill's look-ahead
schedule as the D=128 default (``GluonConfig(lookahead=U)``, kernels/prefill_gluon.py): the
whole table under the schedule before it is made the default. The bench's JSON gets
``"gluon_lookahead": U`` beside its own command line.

Use: ``python bench/kernels_lookahead.py U [bench flags]``.
"""

from __future__ import annotations

import json
import sys
from dataclasses import replace


def main(argv: list[str]) -> int:
    if not argv or not argv[0].isdigit() or not 0 <= int(argv[0]) <= 4:
        print("usage: kernels_lookahead.py U [bench flags]  (U: group size, 0 to 4)")
        return 2
    group = int(argv[0])
    from kdash.kernels import bench, prefill_gluon

    prefill_gluon.GLUON_DEFAULTS[128] = replace(prefill_gluon.GLUON_DEFAULTS[128], lookahead=group)
    rc = bench.main(argv[1:])
    if "--out" in argv:
        out = argv[argv.index("--out") + 1]
        with open(out) as f:
            data = json.load(f)
        data["gluon_lookahead"] = group
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
