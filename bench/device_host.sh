#!/usr/bin/env bash
# One device-tool call for the host side of the dashboard issue, on the H200 machine:
#   NVML collector check, the gpu-marked NVML test, and two real headless captures
#   (a plain matmul loop; the same loop with a busy neighbour pinned to its CPU).
# Run: bash bench/device_host.sh   (with .whl carried; results under $OUT)
set -uo pipefail
export PYTHONUNBUFFERED=1
bash bench/device_setup.sh || exit 1
export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
log=$OUT/host.log
{
  nvidia-smi --query-gpu=name,driver_version,pci.bus_id,clocks.max.sm,power.limit --format=csv
  bus=$(nvidia-smi --query-gpu=pci.bus_id --format=csv,noheader | head -1 | tr 'A-Z' 'a-z' | sed 's/^0000//')
  echo "local_cpulist: $(cat /sys/bus/pci/devices/$bus/local_cpulist 2>&1)"; nproc
  echo "== nvml check"; python3 bench/gpu_nvml_check.py --out $OUT/nvml-h200.json; echo "rc=$?"
  echo "== gpu tests"; python3 -m pytest -q -rs -m gpu tests/test_nvml.py -p no:cacheprovider; echo "rc=$?"
  echo "== capture: matmul"
  python3 bench/matmul_load.py --seconds 22 > $OUT/matmul-plain.txt & P=$!
  sleep 4
  python3 -m kdash.cli attach --pid $P --headless --duration 12 --output $OUT/h200-matmul.kdash; echo "rc=$?"
  wait $P
  echo "== capture: contended (launch thread and a busy neighbour pinned to CPU 3)"
  taskset -c 3 python3 -c 'while True: pass' & N=$!
  taskset -c 3 python3 bench/matmul_load.py --seconds 22 --n 2048 --sync-every 1 > $OUT/matmul-contended.txt & P=$!
  sleep 4
  python3 -m kdash.cli attach --pid $P --headless --duration 12 --output $OUT/h200-contended.kdash; echo "rc=$?"
  wait $P; kill $N
  for f in $OUT/h200-*.kdash; do echo "== report $f"; python3 -m kdash.cli report $f; done
} 2>&1 | tee $log
