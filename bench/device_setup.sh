#!/usr/bin/env bash
# On the GPU machine (device tool): install the carried wheels into /tmp/site, since nothing can
# be fetched there: textual and its small deps (platformdirs, mdit-py-plugins, linkify-it-py,
# uc-micro-py), ijson, tomlkit, demangle, prometheus-client and cupti-python 13.0.1, downloaded as
# the device README says (`pip download --no-deps -d .whl NAME`). Every runtime dependency the
# kdash wheel declares is then imported: one the machine lacks is named on stderr (without
# demangle the recorder stops, and the demo shows no kernels).
# The kdash wheel itself is built here first, from the current tree:
#   rm -f .whl/kdash-*.whl && pip wheel -q --no-deps -w .whl .
# Use: `bash bench/device_setup.sh && export PYTHONPATH=/tmp/site PYTHONSAFEPATH=1`.
set -euo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl
# PYTHONSAFEPATH: from the checkout's root, `python -c` would import its ./kdash core folder
# (no collectors/ inside) before the installed package.
PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site python3 -c "import kdash, textual, kdash.collectors.nvml; print('kdash', kdash.__version__, 'textual', textual.__version__)"
PYTHONSAFEPATH=1 PYTHONPATH=/tmp/site python3 - <<'PY' >&2
import importlib, importlib.metadata as md, re
# distribution name -> module, where they differ
module = {"nvidia-ml-py": "pynvml", "prometheus-client": "prometheus_client"}
missing = []
for req in md.requires("kdash") or []:
    if "extra ==" in req:
        continue
    dist = re.split(r"[<>=!~ ;\[]", req, maxsplit=1)[0]
    try:
        importlib.import_module(module.get(dist, dist))
    except ImportError:
        missing.append(dist)
if missing:
    print("device_setup: missing on this machine (carry their wheels in .whl):", ", ".join(missing))
PY
