// CUDA microbenchmark of the tree_visibility kernel (packed rows + positions), timed with CUDA
// events after checking the output against bench_common's independent check.
#include <cuda_runtime.h>

#include "bench/bench_common.h"
#include "kernels/launchers.h"

using namespace ddtree;

#define CHECK_CUDA(x)                                                             \
  do {                                                                            \
    cudaError_t e_ = (x);                                                         \
    if (e_ != cudaSuccess) {                                                      \
      std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); \
      return 1;                                                                   \
    }                                                                             \
  } while (0)

template <class T>
T* to_device(const std::vector<T>& v) {
  T* d = nullptr;
  cudaMalloc(&d, v.size() * sizeof(T));
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

int main() {
  int dev_count = 0;
  if (cudaGetDeviceCount(&dev_count) != cudaSuccess || dev_count == 0) {
    std::printf("bench_tree_visibility_cuda: no CUDA device; nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop;
  CHECK_CUDA(cudaGetDeviceProperties(&prop, 0));
  std::printf("tree_visibility CUDA on %s\n%6s %6s | %10s %12s %10s\n", prop.name, "B", "N",
              "us", "Mrows/s", "GB/s");
  cudaEvent_t t0, t1;
  cudaEventCreate(&t0);
  cudaEventCreate(&t1);
  for (const bench::Shape& s : bench::shapes()) {
    bench::TreeBatch t = bench::random_trees(s.batch, s.n, 1234 + s.n);
    const int64_t words = packed_words(s.n);
    int64_t* d_parents = to_device(t.parents);
    int64_t* d_num = to_device(t.num_nodes);
    int64_t* d_start = to_device(t.start);
    uint32_t* d_packed = nullptr;
    int64_t* d_pos = nullptr;
    CHECK_CUDA(cudaMalloc(&d_packed, s.batch * s.n * words * 4));
    CHECK_CUDA(cudaMalloc(&d_pos, s.batch * s.n * 8));
    TreeVisibilityParams p;
    p.parents = d_parents;
    p.parents_int64 = true;
    p.parents_stride = s.n;
    p.num_nodes = d_num;
    p.start = d_start;
    p.batch = s.batch;
    p.n = s.n;
    p.packed = d_packed;
    p.positions = d_pos;
    CHECK_CUDA(static_cast<cudaError_t>(gpu::launch_tree_visibility(p, nullptr)));
    std::vector<uint32_t> packed(s.batch * s.n * words);
    std::vector<int64_t> positions(s.batch * s.n);
    CHECK_CUDA(cudaMemcpy(packed.data(), d_packed, packed.size() * 4, cudaMemcpyDeviceToHost));
    CHECK_CUDA(cudaMemcpy(positions.data(), d_pos, positions.size() * 8, cudaMemcpyDeviceToHost));
    if (!bench::check_packed(t, packed, positions)) {
      std::printf("MISMATCH at B=%lld N=%lld\n", static_cast<long long>(s.batch),
                  static_cast<long long>(s.n));
      return 1;
    }
    const int iters = 200;
    cudaEventRecord(t0);
    for (int k = 0; k < iters; ++k) gpu::launch_tree_visibility(p, nullptr);
    cudaEventRecord(t1);
    CHECK_CUDA(cudaEventSynchronize(t1));
    float ms = 0;
    cudaEventElapsedTime(&ms, t0, t1);
    const double us = 1000.0 * ms / iters;
    const double bytes = s.batch * s.n * (8.0 + words * 4.0 + 8.0);
    std::printf("%6lld %6lld | %10.2f %12.1f %10.1f\n", static_cast<long long>(s.batch),
                static_cast<long long>(s.n), us, s.batch * s.n / us, bytes / us / 1e3);
    cudaFree(d_parents);
    cudaFree(d_num);
    cudaFree(d_start);
    cudaFree(d_packed);
    cudaFree(d_pos);
  }
  return 0;
}
