#!/usr/bin/env bash
# One device-tool call for the fp8 decode stage 1 (kernels/decode_fp8.py, the default) and its
# launch configs on the H200 machine
# (bench/device_setup.sh has run, or runs here when /tmp/site lacks kdash; build the wheel from
# the tree first: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .):
#   1. the GPU gates (pytest -m gpu tests/test_kernels_fp8_variants.py): the PTX conversion for
#      all 65536 byte pairs, the default plan's kernel, each config at 1x64k p1 and 8x16k, both
#      launch paths;
#   2. bench/gpu_fp8_variants.py: bf16, the default, the integer-op kernel and a few configs on the
#      fp8_speedup shapes (+ the lognormal batch), do_bench and graph replay, a reference gate
#      per variant -> $OUT/fp8-variants-h200.json (rewritten after every variant).
# Worst case (both timeouts hit) ~4.7 min with setup; typical ~4.
# Run: bash bench/device_fp8.sh   (results under $OUT; the log is $OUT/fp8-variants.log)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0
[ -d /tmp/site/kdash ] || bash bench/device_setup.sh || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
log=$OUT/fp8-variants.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "== fp8 gates (pytest -m gpu)"
  timeout 90 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels_fp8_variants.py --junitxml="$OUT/fp8-gates.xml" > "$OUT/fp8-gates.log" 2>&1
  echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/fp8-gates.log" | tail -12
  echo "== fp8 variants timed (budget 130 s for starting a variant)"
  timeout 170 python3 bench/gpu_fp8_variants.py --budget 130 \
    --out "$OUT/fp8-variants-h200.json" > "$OUT/fp8-variants-run.log" 2>&1
  echo "rc=$?"; grep -E "gate|summary|skipped|wrote|Error" "$OUT/fp8-variants-run.log" | cut -c1-300
} 2>&1 | tee "$log"
