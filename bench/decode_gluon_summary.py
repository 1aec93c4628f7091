"""One line per timed shape of bench/gpu_decode_gluon.py's output (read from stdin): the Gluon
stage 1 + merge at each split count (splits, graph us, do_bench us, stage 1 alone graph us)
beside the plan's two launches, its stage 1 and its default path. Other lines pass through."""

import json
import sys

for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip())
        continue

    def f(x):
        return round(x, 1)

    if r.get("kv") == "fp8" and "triton_default" in r:
        d = r["triton_default"]
        t = {
            k[9:]: (v["splits"], v["per_sm"], f(v["us_graph"]), f(v["us"]), v["pass"])
            for k, v in r.items() if k.startswith("plan_tma_")
        }  # fmt: skip
        print("fp8", r["lens"], r["heads"], "tma", t, "| triton", f(d["us_graph"]), f(d["us"]))
        continue
    if not any(k.startswith("gluon_x") for k in r):
        print(line.rstrip())
        continue

    g = {
        k: (v["splits"], f(v["two_launch"]["us_graph"]), f(v["two_launch"]["us"]),
            f(v["stage1"]["us_graph"]))
        for k, v in r.items() if k.startswith("gluon_x")
    }  # fmt: skip
    p2, s1, d = r["plan_two_launch"], r["triton_stage1"], r["plan_default"]
    t = {
        k[9:]: (v["splits"], v["per_sm"], f(v["us_graph"]), f(v["us"]))
        for k, v in r.items() if k.startswith("plan_tma_") and "us" in v
    }  # fmt: skip
    head = (r["stages"], r["lens"], r["heads"], "gluon", g, "plan tma", t)
    plan = ("| plan two", f(p2["us_graph"]), f(p2["us"]), "s1", f(s1["us_graph"]))
    print(*head, *plan, "default", f(d["us_graph"]), f(d["us"]))
