#!/usr/bin/env bash
# Session 30's device calls: the split tail's A/B call by call (bench/gpu_prefill_tail_ab.py),
# then BENCHES=N whole benches (on any card; BENCH=1, the default, runs one first on an H200).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s30
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  [[ $card == h200 && ${BENCH:-1} == 1 ]] && bench "full-${CALLN:-1}-0"
  if [[ ${TAIL_AB:-1} == 1 ]]; then
    timeout -k 5 "${ALIMIT:-200}" python3 bench/gpu_prefill_tail_ab.py --iters "${ITERS:-40}" \
      --out "$OUT/prefill-tail-ab-$card-$SESSION-${CALLN:-1}.json" 2>&1 | grep -v Warning \
      | python3 -c 'import sys, json
for line in sys.stdin:
    try:
        r = json.loads(line)
    except ValueError:
        print(line.rstrip()[:300]); continue
    m = {k: round(r[k]["median"], 1) for k in ("split", "whole", "cudnn")}
    print(r["heads"], r["seq"], "x%d" % r["batch"], m, "whole/split %.3f cudnn/split %.3f cudnn/whole %.3f"
          % (r["whole_over_split"], r["cudnn_over_split"], r["cudnn_over_whole"]), r.get("kernels"))'
    echo "tail ab rc=$? $(date +%T)"
  fi
  for n in $(seq 1 "${BENCHES:-0}"); do bench "full-${CALLN:-1}-$n"; done
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
