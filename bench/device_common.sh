# Sourced by the session device scripts (bench/device_s24.sh, device_s25.sh): the carried wheels
# installed, the card named (card=h200|h100|gpu, name=its full name), and bench STEM [FLAGS]:
# the whole kernel bench (default paths only) into $OUT/kernels-$card-$SESSION-STEM.json, its
# own summary lines printed; gates N: the decode GPU tests (OPAQUE=1: with the opaque head mask;
# WARM=N: with the one-launch kernel's prefetch of N tiles).
# Needs SESSION set first.
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
# a device script that runs another one (device_s33_h200.sh runs device_s32.sh) installs once
if [[ -z ${KDASH_DEVICE_SETUP:-} ]]; then
  bash bench/device_setup.sh > /dev/null || exit 1
  export KDASH_DEVICE_SETUP=1
fi
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $name in *H200*) card=h200 ;; *H100*) card=h100 ;; *) card=gpu ;; esac
bench() {  # $1: file stem, the rest: bench flags
  local stem=$1; shift
  echo "== bench $stem: $*"
  timeout -k 5 240 python3 -m kdash.kernels.bench --sweep none --default-path-only "$@" \
    --out "$OUT/kernels-$card-$SESSION-$stem.json" > "/tmp/$stem.log" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "summary|Error|error" "/tmp/$stem.log" | cut -c1-300
}
gates() {  # the decode GPU gates into $OUT/gpu-gates-decode-$card-$SESSION-$1.xml
  echo "== GPU gates: decode, plan, fused publish, graph launch, L2 hint, fp8 variants, persistent"
  # OPAQUE=1: with decode_fused.OPAQUE_HEADS on, as the bench's --opaque-heads runs it;
  # WARM=N: with decode_fused.WARM_TILES = N (--warm-tiles N; unset: the module's default)
  local run=(python3 -m pytest)
  if [[ ${OPAQUE:-0} == 1 || -n ${WARM:-} ]]; then
    run=(python3 -c "import sys, pytest, kdash.kernels.decode_fused as f
f.OPAQUE_HEADS = ${OPAQUE:-0} == 1
f.WARM_TILES = ${WARM:-f.WARM_TILES}
sys.exit(pytest.main(sys.argv[1:]))")
  fi
  timeout -k 5 300 "${run[@]}" -q -rs -m gpu -p no:cacheprovider \
    tests/test_kernels_plan.py tests/test_kernels_decode.py tests/test_kernels_fused_publish.py \
    tests/test_kernels_graph_launch.py tests/test_kernels_l2_hint.py \
    tests/test_kernels_fp8_variants.py tests/test_kernels_decode_persist.py \
    tests/test_kernels_decode_warm.py \
    --junitxml "$OUT/gpu-gates-decode-$card-$SESSION-$1.xml" > /tmp/gates.log 2>&1
  echo "rc=$? $(date +%T)"; grep -E "passed|failed|FAILED|Error" /tmp/gates.log | tail -8
}
