#!/usr/bin/env bash
# Install SGLang's own Python code into kdash's venv for tests/test_sglang_real.py, without its
# GPU dependencies: the wheel with --no-deps (its full set pulls a CUDA torch and kernels of
# several GB), then the pure-Python packages that its HTTP server, server args, scheduler
# titles, profiler and metrics modules import. The CPU torch already in the venv is kept; the
# kernel packages (sgl_kernel, flashinfer, deep_gemm, ...) are stubbed by the tests.
#
#   bench/sglang_cpu_env.sh [VENV]   # default .venv; SGLANG_VERSION=0.5.10.post1
set -euo pipefail
venv="${1:-.venv}"
version="${SGLANG_VERSION:-0.5.10.post1}"
pip="$venv/bin/pip"
start=$(date +%s)
before=$(du -sm "$venv" | cut -f1)
"$pip" install -q --no-deps "sglang==$version"
# What `import sglang.srt.entrypoints.http_server` needs (found by importing it with the
# kernel packages stubbed); torch is not named, so pip leaves the CPU build alone.
"$pip" install -q fastapi uvicorn orjson pydantic python-multipart tqdm pybase64 requests \
  IPython aiohttp pillow safetensors openai partial_json_parser huggingface_hub transformers \
  pyzmq dill sentencepiece compressed_tensors gguf msgspec uvloop einops jsonschema pyyaml \
  2>&1 | grep -v -e "requires torch" -e "requires xgrammar" -e " which is not installed" \
  -e "dependency resolver" -e "^WARNING" || true
"$venv/bin/python" -c "import torch, sglang; print('sglang', sglang.__version__, 'torch', torch.__version__)"
after=$(du -sm "$venv" | cut -f1)
echo "installed in $(( $(date +%s) - start )) s, venv grew by $(( after - before )) MB"
