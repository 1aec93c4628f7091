#!/usr/bin/env bash
# Session 28's device call: the Gluon prefill's look-ahead schedule (kernels/prefill_gluon.py,
# GluonConfig.lookahead) gated at full size and timed against the default schedule and SDPA in
# turns, then the whole bench with look-ahead 4 as the D=128 default, then the whole bench as it
# stands (the table of record, and the run-to-run spread beside the first).
#   AHEAD: the group sizes to gate and time (default 2,3,4).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s28
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  timeout -k 5 "${PLIMIT:-240}" python3 bench/gpu_prefill_gluon.py --dims 128 \
    --lookahead "${AHEAD:-2,3,4}" --budget-s 200 --out "$OUT/prefill-ahead-$card-s28.json" 2>&1 \
    | grep -v Warning | cut -c1-400
  echo "prefill rc=$? $(date +%T)"
  echo "== bench ahead4-1 (look-ahead 4 as the D=128 default)"
  timeout -k 5 240 python3 bench/kernels_lookahead.py 4 --sweep none --default-path-only \
    --out "$OUT/kernels-$card-s28-ahead4-1.json" > /tmp/ahead4-1.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "summary|Error|error" /tmp/ahead4-1.log | cut -c1-300
  bench full-1
} 2>&1 | tee "$OUT/s28-call1.log"
