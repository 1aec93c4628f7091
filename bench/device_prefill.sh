#!/usr/bin/env bash
# One device-tool call for prefill on the H200 machine (the default path: kernels/prefill_hopper.py
# at the H200's pick per class; the pointer kernel of kernels/prefill_attention.py as fallback):
#   1. bench/gpu_prefill_variants.py: the default path, the pointer kernel and every variant
#      config through the prefill error gate, then all of them and SDPA flash / cuDNN timed at
#      the bench's S >= 4096 prefill shapes -> $OUT/prefill-variants-h200.json (saved after
#      every shape);
#   2. the prefill GPU gates (pytest -m gpu): the default path (and which path ran), the pointer
#      kernel and every variant.
# Worst case (both timeouts hit, a reinstall) ~4.8 min; typical ~3.5. Log: $OUT/prefill.log.
# The variants script starts no new shape after 190 s; shapes run S=4096 first.
# Before the call, rebuild the kdash wheel from the tree and carry `.whl`:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Run: bash bench/device_prefill.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
# Always (re)install the carried wheel: a warm machine may hold an older kdash in /tmp/site.
bash bench/device_setup.sh > /dev/null || exit 1
log=$OUT/prefill.log
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

  echo "== prefill variants vs default and SDPA (S >= 4096)"
  timeout -k 5 215 python3 bench/gpu_prefill_variants.py --budget-s 190 \
    --out "$OUT/prefill-variants-h200.json" > "$OUT/prefill-variants.log" 2>&1
  echo "rc=$?"
  grep -E "FAIL|^(h2048|gqa|summary|wrote|gates done)" "$OUT/prefill-variants.log" | cut -c1-400
  tail -3 "$OUT/prefill-variants.log" | cut -c1-400

  echo "== prefill GPU gates, every kernel (pytest -m gpu)"
  timeout -k 5 50 python3 -m pytest -q -rs -m gpu -p no:cacheprovider tests/test_kernels_prefill.py \
    > "$OUT/prefill-gates.log" 2>&1
  echo "rc=$?"; grep -E "passed|failed|FAILED|Error" "$OUT/prefill-gates.log" | tail -12
} 2>&1 | tee "$log"
