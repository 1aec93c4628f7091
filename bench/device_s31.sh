#!/usr/bin/env bash
# Session 31's device calls: the decode GPU gates (the tree as it is), then the
# whole bench NEW times on the new tree, each followed by the decode table of the tree before
# its change (.whl_old: the wheel built at commit 5554f7b, installed apart in /tmp/site_old); on an
# H200 one more whole bench at the end (the table of record: three runs).
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   and the old
# wheel in .whl_old (carry both). GATES=0 skips the gates. (The PDL call of this session ran this script at e8e9c35, the
# token-even cut's at d4979d5.)
set -uo pipefail
SESSION=s31
# shellcheck source=bench/device_common.sh
source bench/device_common.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_old \
  .whl_old/kdash-*.whl > /dev/null || exit 1
{
  echo "$name $(date +%T)"
  if [[ ${GATES:-1} == 1 ]]; then
    echo "== GPU gates: decode, plan, fused publish, graph launch, L2 hint, fp8 variants, persistent"
    timeout -k 5 300 python3 -m pytest -q -rs -m gpu -p no:cacheprovider \
      tests/test_kernels_plan.py tests/test_kernels_decode.py tests/test_kernels_fused_publish.py \
      tests/test_kernels_graph_launch.py tests/test_kernels_l2_hint.py \
      tests/test_kernels_fp8_variants.py tests/test_kernels_decode_persist.py \
      --junitxml "$OUT/gpu-gates-decode-$card-$SESSION-${CALLN:-1}.xml" > /tmp/gates.log 2>&1
    echo "rc=$? $(date +%T)"; grep -E "passed|failed|FAILED|Error" /tmp/gates.log | tail -8
  fi
  for n in $(seq 1 "${NEW:-2}"); do
    bench "full-${CALLN:-1}-$n-new"
    PYTHONPATH=/tmp/site_old:/tmp/site bench "${CALLN:-1}-$n-old" --only decode
  done
  [[ $card == h200 ]] && bench "full-${CALLN:-1}-3-new"
} 2>&1 | tee "$OUT/$SESSION-call${CALLN:-1}.log"
