#!/usr/bin/env bash
# The GPU check, one prepared run (well within 8 minutes on an H200, 16 cores): builds ddtree._C
# with the CUDA kernels against the machine's own torch, runs the whole test suite (the CUDA
# tests run there instead of skipping) and the CUDA microbenchmarks. Results go to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export DDTREE_CUDA=1 MAX_JOBS=${MAX_JOBS:-16}
# Build for this GPU only (minutes saved): its compute capability, e.g. 9.0 on an H100 / H200.
CAP=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d ' ')
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$CAP}
export CMAKE_CUDA_ARCHITECTURES=${CMAKE_CUDA_ARCHITECTURES:-${CAP/./}}
status=0
if ! "$PY" -c "import transformers, accelerate, hypothesis, safetensors, pytest" 2>/dev/null ||
   ! command -v ninja > /dev/null; then
  if [ -d wheelhouse ]; then  # made by bench/make_wheelhouse.sh, carried to the device
    "$PY" -m pip install -q --no-index --find-links wheelhouse "transformers==5.18.0" \
      "accelerate==1.15.0" hypothesis safetensors pytest tqdm ninja > "$OUT/pip.log" 2>&1 || { tail -20 "$OUT/pip.log"; status=1; }
    export PATH="$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))'):$PATH"
  else
    echo "gpu_check: transformers / accelerate / hypothesis / safetensors / pytest / ninja missing, no wheelhouse/"
  fi
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/gpu.txt"
if ! "$PY" setup.py -q build_ext --inplace > "$OUT/build.log" 2>&1; then
  tail -40 "$OUT/build.log"
  exit 1
fi
# The CMake microbenchmarks build in the background while the suite runs (16 cores).
cmake_pid=
if command -v cmake > /dev/null; then
  ( cmake -S . -B build/cmake-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_CUDA_ARCHITECTURES="$CMAKE_CUDA_ARCHITECTURES" > "$OUT/cmake.log" 2>&1 &&
    cmake --build build/cmake-gpu -j 8 >> "$OUT/cmake.log" 2>&1 ) &
  cmake_pid=$!
else
  echo "gpu_check: no cmake on this machine: the C++ CUDA microbenchmarks are skipped"
fi
PYTHONPATH=python timeout 300 "$PY" -m pytest tests -q -rs --durations=5 > "$OUT/pytest.txt" 2>&1 || status=1
tail -25 "$OUT/pytest.txt"
if [ -z "$cmake_pid" ]; then
  :
elif wait "$cmake_pid"; then
  for b in bench_tree_visibility_cuda bench_tree_ops_cuda bench_attention_cuda; do
    timeout 120 build/cmake-gpu/$b | tee -a "$OUT/bench_cuda.txt" || status=1
  done
else
  tail -30 "$OUT/cmake.log"
  status=1
fi
PYTHONPATH=python timeout 180 "$PY" bench/bench_attention_gpu.py --json "$OUT/attention_gpu.json" \
  | tee "$OUT/attention_gpu.txt" || status=1
PYTHONPATH=python timeout 150 "$PY" bench/bench_loop_gpu.py --json "$OUT/loop_gpu.json" \
  | tee "$OUT/loop_gpu.txt" || status=1
DDTREE_CACHE_DIR="$OUT/cache" PYTHONPATH=python timeout 150 "$PY" bench/bench_concurrency.py \
  --batches 1 4 16 --requests 16 --new-tokens 64 --repeats 1 --json "$OUT/concurrency_gpu.json" \
  2> "$OUT/concurrency_gpu.log" | tee "$OUT/concurrency_gpu.txt" || status=1
echo "gpu_check: exit $status"
exit $status
