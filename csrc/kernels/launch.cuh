// One kernel source, two compilers: nvcc builds it for the GPU (namespace ddtree::gpu); the host
// compiler builds it with DDTREE_EMULATE for the SIMT emulator (namespace ddtree::emulated).
// Kernel files put everything in `namespace ddtree { namespace DDTREE_KERNEL_NS {` and launch
// with launch_kernel(), never with <<<>>>.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "core/common.h"

#if defined(DDTREE_EMULATE)
#include "simt/emulator.h"
#define DDTREE_KERNEL_NS emulated
namespace ddtree::emulated {
using simt::dim3;
using cudaStream_t = void*;
using cudaError_t = int;
inline constexpr int cudaSuccess = 0;
}  // namespace ddtree::emulated
#else
#include <cuda_runtime.h>
#define DDTREE_KERNEL_NS gpu
#endif

// Dynamic shared memory of the running block, as `T* name`.
#if defined(DDTREE_EMULATE)
#define DDTREE_DYNAMIC_SMEM(T, name) T* name = static_cast<T*>(::ddtree::simt::dynamic_smem())
#else
#define DDTREE_DYNAMIC_SMEM(T, name)                                  \
  extern __shared__ __align__(16) unsigned char ddtree_dynamic_smem_[]; \
  T* name = reinterpret_cast<T*>(ddtree_dynamic_smem_)
#endif

namespace ddtree {
namespace DDTREE_KERNEL_NS {

#if !defined(DDTREE_EMULATE)
// Opts `kernel` in to `bytes` of dynamic shared memory (> 48 KiB) on the current device, once per
// (device, kernel, size): the attribute call is not repeated on every launch.
inline int allow_dynamic_smem(const void* kernel, size_t bytes) {
  static std::mutex mutex;
  static std::map<std::pair<int, const void*>, size_t> allowed;
  int device = 0;
  cudaError_t e = cudaGetDevice(&device);
  if (e != cudaSuccess) return static_cast<int>(e);
  std::lock_guard<std::mutex> lock(mutex);
  size_t& have = allowed[{device, kernel}];
  if (have >= bytes) return 0;
  e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (e != cudaSuccess) return static_cast<int>(e);
  have = bytes;
  return 0;
}
#endif

// Launches `kernel` on `stream` (ignored when emulated). Returns the launch status as an int
// (cudaError_t); the emulator reports problems by throwing simt::Error.
template <class... P, class... A>
inline int launch_kernel(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, void* stream,
                         A&&... args) {
#if defined(DDTREE_EMULATE)
  (void)stream;
  simt::launch(kernel, grid, block, smem, std::forward<A>(args)...);
  return 0;
#else
  std::tuple<P...> params(std::forward<A>(args)...);
  return std::apply(
      [&](auto&... p) {
        void* argv[] = {static_cast<void*>(&p)...};
        if (smem > 48 * 1024) {
          const int e = allow_dynamic_smem(reinterpret_cast<const void*>(kernel), smem);
          if (e != 0) return e;
        }
        return static_cast<int>(cudaLaunchKernel(reinterpret_cast<const void*>(kernel), grid,
                                                 block, argv, smem,
                                                 static_cast<cudaStream_t>(stream)));
      },
      params);
#endif
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
