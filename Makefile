# `make test` / `make demo` do all set-up on a fresh machine: a project-local virtualenv with
# torch pinned, the extension build (CUDA kernels when nvcc + a CUDA torch exist), then the run.
# Repeated runs reuse the venv and rebuild incrementally (ninja).
PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.14.1
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
STAMP := $(VENV)/.ddtree-deps
CMAKE_BUILD ?= build/cmake
CUDA_HOME ?= $(shell test -x /usr/local/cuda/bin/nvcc && echo /usr/local/cuda)

.PHONY: all build test demo embedded-pair bench-cpp bench-cpu clean

all: build

$(STAMP): requirements.txt
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --disable-pip-version-check "$(TORCH_SPEC)" -r requirements.txt
	touch $@

build: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" MAX_JOBS=$(JOBS) $(VPY) setup.py -q build_ext --inplace

test: build
	PYTHONPATH=python $(VPY) -m pytest tests -q

demo: build
	PYTHONPATH=python $(VPY) -m ddtree.demo

# Retrains the embedded target + DFlash drafter (python/ddtree/embedded_pair; ~35 min on 2 cores).
embedded-pair: $(STAMP)
	PYTHONPATH=python $(VPY) -m ddtree.embedded

# C++ microbenchmarks (no libtorch): CPU targets always, CUDA targets when CMake finds nvcc.
bench-cpp: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" cmake -S . -B $(CMAKE_BUILD) -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release $(if $(CUDA_HOME),-DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc)
	PATH="$(abspath $(VENV))/bin:$$PATH" cmake --build $(CMAKE_BUILD) -j $(JOBS)

bench-cpu: bench-cpp
	$(CMAKE_BUILD)/bench_tree_visibility
	$(CMAKE_BUILD)/bench_tree_ops

clean:
	rm -rf build python/ddtree/_C*.so python/ddtree/_build_info.py
