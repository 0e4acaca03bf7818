#!/usr/bin/env bash
# The GPU check, one prepared run inside a fixed wall-clock budget (GPU_CHECK_SECONDS, default 480;
# H200, 16 cores): builds ddtree._C with the CUDA kernels for this GPU against the machine's own
# torch, runs the CUDA tests, the concurrency benchmark (budget="auto" against the fixed modes),
# the loop and attention benchmarks and the CMake CUDA microbenchmarks, most valuable first; each
# step gets at most what is left of the budget. Results go to $OUT (default bench/results/gpu).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
START=$(date +%s)
BUDGET=${GPU_CHECK_SECONDS:-480}
# left CAP: seconds for the next step, CAP at most, what the budget has left at least 1.
left() {
  local l=$(( START + BUDGET - $(date +%s) ))
  (( l < 1 )) && l=1
  (( $1 < l )) && l=$1
  echo "$l"
}
stamp() { echo "gpu_check: $1 at $(( $(date +%s) - START )) s"; }
export DDTREE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16} PYTHONUNBUFFERED=1 PYTHONPATH=python
# Build for this GPU only (minutes saved): its compute capability, e.g. 9.0 on an H100 / H200.
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$CAP}
export CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-${CAP/./}}
status=0
# The loop needs transformers 5.18; wheelhouse/ (bench/make_wheelhouse.sh) travels with the run.
if ! "$PY" -c "import transformers as t, sys; sys.exit(t.__version__ != '5.18.0')" 2>/dev/null ||
   ! "$PY" -c "import hypothesis, safetensors, pytest" 2>/dev/null; then
  if [ -d wheelhouse ]; then
    "$PY" -m pip install -q --no-index --no-deps --find-links wheelhouse "transformers==5.18.0" \
      hypothesis safetensors pytest > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; status=1; }
  else
    echo "gpu_check: transformers 5.18 / hypothesis / safetensors / pytest missing, no wheelhouse/"
  fi
fi
scripts=$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')
command -v ninja > /dev/null || export PATH="$scripts:$PATH"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, transformers as t; print('torch', torch.__version__, 'cuda',
  torch.version.cuda, 'transformers', t.__version__)" | tee -a "$OUT/gpu.txt"
if ! timeout "$(left 300)" "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
stamp "built"
# The CMake microbenchmarks build in the background while the tests run (16 cores).
cmake_pid=
if command -v cmake > /dev/null; then
  ( cmake -S . -B build/cmake-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="$CMAKE_CUDA_ARCHITECTURES" > "$OUT/cmake.log" 2>&1 &&
    nice cmake --build build/cmake-gpu -j 4 >> "$OUT/cmake.log" 2>&1 ) &
  cmake_pid=$!
fi
# Every test whose id names the GPU: the kernel backends' "cuda" cases, the CUDA-graph loop.
timeout "$(left 150)" "$PY" -m pytest tests -q -rs -k "cuda or gpu or graph" -p no:cacheprovider \
  --durations=5 > "$OUT/pytest_cuda.txt" 2>&1 || status=1
tail -15 "$OUT/pytest_cuda.txt"
stamp "CUDA tests done"
DDTREE_CACHE_DIR="$OUT/cache" timeout "$(left 170)" "$PY" bench/bench_concurrency.py \
  --batches 1 4 16 --requests 8 --new-tokens 64 --repeats 1 --json "$OUT/concurrency_gpu.json" \
  2> "$OUT/concurrency_gpu.log" | tee "$OUT/concurrency_gpu.txt" || status=1
stamp "concurrency done"
timeout "$(left 90)" "$PY" bench/bench_loop_gpu.py --json "$OUT/loop_gpu.json" \
  | tee "$OUT/loop_gpu.txt" || status=1
stamp "loop done"
timeout "$(left 60)" "$PY" bench/bench_attention_gpu.py --json "$OUT/attention_gpu.json" \
  | tee "$OUT/attention_gpu.txt" || status=1
stamp "attention done"
if [ -n "$cmake_pid" ] && wait "$cmake_pid"; then
  for b in bench_tree_visibility_cuda bench_tree_ops_cuda bench_attention_cuda; do
    timeout "$(left 30)" build/cmake-gpu/$b | tee -a "$OUT/bench_cuda.txt" || status=1
  done
else
  echo "gpu_check: no CMake microbenchmarks (no cmake, or its build failed: $OUT/cmake.log)"
  status=1
fi
stamp "finished"
echo "gpu_check: exit $status"
exit $status
