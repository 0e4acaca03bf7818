#!/usr/bin/env bash
# Downloads (here, where the package registries are reachable) the wheels the test suite needs
# beyond torch and numpy — transformers 5.18 and its dependencies, hypothesis, safetensors, pytest
# — and ninja (the extension build), for CPython 3.10-3.12, into wheelhouse/ (~40 MB,
# git-ignored). The GPU machines reach nothing outside, so a device run carries the folder:
# run(..., carry=["wheelhouse"]); gpu_check.sh installs from it when transformers is not 5.18
# or a test dependency is missing there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
mkdir -p wheelhouse
for v in 3.10 3.11 3.12; do
  "$PY" -m pip download --disable-pip-version-check -q --dest wheelhouse --only-binary=:all: \
    --python-version "$v" --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 "transformers==5.18.0" "accelerate==1.15.0" hypothesis safetensors pytest tqdm ninja
done
rm -f wheelhouse/numpy-*.whl  # the GPU machines' torch comes with numpy
du -sh wheelhouse
