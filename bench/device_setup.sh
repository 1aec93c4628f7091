#!/usr/bin/env bash
# On the GPU machine (device tool): install the carried wheels into /tmp/site, since nothing can
# be fetched there: textual and its small deps (platformdirs, mdit-py-plugins, linkify-it-py,
# uc-micro-py), ijson, tomlkit and cupti-python 13.0.1, downloaded as the device README says.
# The kdash wheel itself is built here first, from the current tree:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Use: `bash bench/device_setup.sh && export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1`.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
# PYTHONSAFEPATH: from the checkout's root, `python -c` would import its ./kdash core folder
# (no collectors/ inside) before the installed package.
PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site python3 -c "import kdash, textual, kdash.collectors.nvml; print('kdash', kdash.__version__, 'textual', textual.__version__)"
