#!/usr/bin/env bash
# Session 28's device call: the Gluon prefill with its softmax in FFMA form and P made bf16 in
# its own tile (kernels/prefill_gluon.py) gated at full size and timed in turns against the
# version before (prefill_gluon_s27.py, an untracked copy of session 27's module at the checkout's
# root: `git show 656567d:kernels/prefill_gluon.py > prefill_gluon_s27.py`) and SDPA, its GPU
# tests, then the whole bench twice (the table of record and its run-to-run spread).
#   TESTS=0 skips the GPU tests; BENCHES=1 runs the whole bench once; CALLN names the log.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
SESSION=s28
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
{
  echo "$name $(date +%T)"
  nvidia-smi --query-gpu=driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  timeout -k 5 "${PLIMIT:-200}" python3 bench/gpu_prefill_gluon.py --dims 128 \
    --against prefill_gluon_s27.py --seqs 4096,8192,16384 --budget-s 180 \
    --out "$OUT/prefill-ab-$card-s28.json" 2>&1 | grep -v Warning | grep -E '"gate"|rounds|summary|Error' \
    | python3 bench/prefill_ab_lines.py
  echo "prefill rc=$? $(date +%T)"
  [[ ${TESTS:-1} == 1 ]] && timeout -k 5 "${TLIMIT:-150}" python3 -m pytest -q -m gpu -p no:cacheprovider \
    tests/test_kernels_prefill.py tests/test_kernels_prefill_gluon.py \
    --junitxml "$OUT/gpu-gates-prefill-$card-s28.xml" 2>&1 | tail -3
  echo "tests rc=$? $(date +%T)"
  bench full-1
  [[ ${BENCHES:-2} -ge 2 ]] && bench full-2
} 2>&1 | tee "$OUT/s28-call${CALLN:-2}.log"
