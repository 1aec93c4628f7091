#!/usr/bin/env bash
# Session 25's second device call: the Gluon TMA stage 1 at 1, 2 and 4 warps a program
# (bench/gpu_decode_gluon_w.py: gates, then timings beside the Triton plan and TMA's copies).
# Files: $OUT/gluon-w-<card>-s25.jsonl, s25b.log.
# Before the call: rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .   (carry .whl)
set -uo pipefail
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 PYTHONPATH=/tmp/site PYTHONSAFEPATH=1
bash bench/device_setup.sh > /dev/null || exit 1
name=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
case $name in *H200*) card=h200 ;; *H100*) card=h100 ;; *) card=gpu ;; esac
{
  echo "$name $(date +%T)"
  timeout -k 5 ${LIMIT:-540} python3 bench/gpu_decode_gluon_w.py --out "$OUT/gluon-w-$card-s25.jsonl" "$@" \
    2>&1 | grep -v Warning | cut -c1-400
  echo "rc=$? $(date +%T)"
} 2>&1 | tee "$OUT/s25b.log"
