// Helpers of the CUDA microbenchmarks: device upload / download and CUDA-event timing.
#pragma once

#include <cuda_runtime.h>

#include <cstdio>
#include <vector>

namespace ddtree::bench {

template <class T>
T* upload(const std::vector<T>& v) {
  T* d = nullptr;
  cudaMalloc(&d, v.size() * sizeof(T) + 16);
  cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice);
  return d;
}

template <class T>
std::vector<T> download(const T* d, size_t n) {
  std::vector<T> v(n);
  cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost);
  return v;
}

// Mean time of one launch in microseconds over `iters` launches after a warm-up.
template <class F>
double time_us(F&& launch, int iters = 50) {
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  launch();
  cudaEventRecord(a);
  for (int i = 0; i < iters; ++i) launch();
  cudaEventRecord(b);
  cudaEventSynchronize(b);
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 1000.0 * ms / iters;
}

inline int fail(const char* what) {
  std::printf("MISMATCH in %s\n", what);
  return 1;
}

}  // namespace ddtree::bench
