# Sourced by the session device scripts (bench/device_s24.sh, device_s25.sh): the carried wheels
# installed, the card named (card=h200|h100|gpu, name=its full name), and bench STEM [FLAGS]:
# the whole kernel bench (default paths only) into $OUT/kernels-$card-$SESSION-STEM.json, its
# own summary lines printed. Needs SESSION set first.
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $name in *H200*) card=h200 ;; *H100*) card=h100 ;; *) card=gpu ;; esac
bench() {  # $1: file stem, the rest: bench flags
  local stem=$1; shift
  echo "== bench $stem: $*"
  timeout -k 5 240 python3 -m kdash.kernels.bench --sweep none --default-path-only "$@" \
    --out "$OUT/kernels-$card-$SESSION-$stem.json" > "/tmp/$stem.log" 2>&1
  echo "rc=$? $(date +%T)"; grep -E "summary|Error|error" "/tmp/$stem.log" | cut -c1-300
}
