#!/usr/bin/env bash
# One device-tool call (H200), session 6's last: with the kdash wheel in .whl (carried),
#   1. the decode kernel gates (pytest -m gpu: plan/run, decode) after the wave-aware planner;
#   2. the kernel bench's decode sweep -> $OUT/kernels-h200.json;
#   3. `kdash demo --headless` for 12 s with the trimming agent: kernel records longer than
#      1 ms and the agent's trimmed/dropped counters (expected: none longer than a window);
#   4. `kdash attach --pid --pc-sampling --headless --duration 8` on bench/compile_target.py
#      (torch.compile, eager): pc_samples rows, hot_lines[0], the PC status line.
# Run: bash bench/device_s6_final.sh   (results under $OUT; ~6 min)
set -uo pipefail
bash bench/device_setup.sh > /dev/null || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
echo "== gates"
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_plan.py \
  tests/test_kernels_decode.py > "$OUT/gates.log" 2>&1
echo "rc=$?"; tail -4 "$OUT/gates.log"; grep -E "^(FAILED|ERROR)" "$OUT/gates.log" | head
cd /tmp || exit 1
echo "== bench"
timeout 170 python3 -m kdash.kernels.bench --sweep decode --out "$OUT/kernels-h200.json" \
  > "$OUT/bench.log" 2>&1
echo "rc=$?"; grep -E "^summary" "$OUT/bench.log"
python3 - "$OUT/kernels-h200.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["decode"]:
    b, f = r["bf16"], r["fp8"]
    print(r["heads"], r["batch"], str(r["context"])[:12], "bf16 %.2f/%.2f s=%s w=%.2f" % (
        b.get("bw_ratio", 0), b.get("bw_ratio_graph", 0), b["splits"], b["stage1"].get("waves", 0)),
        "host %.1f" % b["host_us_nosync"], "| fp8 x%.2f s=%s" % (r["fp8_speedup"], f["splits"]))
PY
echo "== demo headless 12 s (trimming agent)"
timeout 90 python3 -m kdash demo --headless --duration 12 -o "$OUT/demo-trim.kdash" 2>&1 | tail -1 | cut -c1-300
python3 - "$OUT/demo-trim.kdash" <<'PY'
import sys, kdash
t = kdash.read_capture(sys.argv[1])
k = t["kernels"]; d = k.end_ns - k.start_ns
m = t["markers"]; w = m[m["name"] == "activity on"]
print("kernels", len(k), "longer than 1 ms:", int((d > 1e6).sum()), "max ms %.3f" % (d.max() / 1e6),
      "windows", len(w), "longest window ms %.1f" % ((w.end_ns - w.start_ns).max() / 1e6))
PY
echo "== PC sampling on a torch.compile target"
python3 "$OLDPWD/bench/compile_target.py" 80 > /tmp/ct.log 2>&1 &
CT=$!
for _ in $(seq 1 120); do grep -q ready /tmp/ct.log && break; sleep 1; done
timeout 60 python3 -m kdash attach --pid $CT --pc-sampling --headless --duration 8 \
  -o "$OUT/compile-pcs.kdash" 2>&1 | tail -1 | cut -c1-400
python3 -m kdash report --json "$OUT/compile-pcs.kdash" > /tmp/r.json 2>/dev/null
python3 - <<'PY'
import json
r = json.load(open("/tmp/r.json"))
print("pc_samples", r["tables"].get("pc_samples"), "sources", r["sources"].get("pc sampling"))
print("hot_lines[0]", json.dumps((r.get("hot_lines") or [None])[0])[:300])
print("top", [(k["name"][:40], round(k["pct"], 1), k.get("has_source")) for k in r["top_kernels"][:4]])
PY
kill $CT 2> /dev/null
ls "$OUT"
