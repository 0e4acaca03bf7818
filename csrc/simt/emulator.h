// CUDA spellings (__global__, threadIdx, __shfl_sync, atomicAdd, ...) mapped onto the SIMT
// emulator runtime (runtime.h). Include only through csrc/kernels/launch.cuh with DDTREE_EMULATE
// defined: the macros would clash with real CUDA headers.
#pragma once

#include "simt/runtime.h"

// ---- CUDA spellings, mapped onto the emulator ----
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
// Shared memory: per OS thread (several threads may run emulated kernels at once). The race
// detector's build (one thread) uses plain statics: ThreadSanitizer does not watch thread-locals.
#ifdef DDTREE_RACE_DETECTOR
#define __shared__ static
#else
#define __shared__ static thread_local
#endif
#define __constant__ static
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))

#define threadIdx (::ddtree::simt::regs().thread_idx)
#define blockIdx (::ddtree::simt::regs().block_idx)
#define blockDim (::ddtree::simt::regs().block_dim)
#define gridDim (::ddtree::simt::regs().grid_dim)
#define warpSize 32

#define __syncthreads ::ddtree::simt::syncthreads
#define __syncwarp ::ddtree::simt::syncwarp
#define __shfl_sync ::ddtree::simt::shfl_sync
#define __shfl_up_sync ::ddtree::simt::shfl_up_sync
#define __shfl_down_sync ::ddtree::simt::shfl_down_sync
#define __shfl_xor_sync ::ddtree::simt::shfl_xor_sync
#define __ballot_sync ::ddtree::simt::ballot_sync
#define __any_sync ::ddtree::simt::any_sync
#define __all_sync ::ddtree::simt::all_sync
#define __activemask ::ddtree::simt::activemask
#define __threadfence ::ddtree::simt::threadfence
#define __threadfence_block ::ddtree::simt::threadfence
#define atomicAdd ::ddtree::simt::atomic_add
#define atomicMax ::ddtree::simt::atomic_max
#define atomicMin ::ddtree::simt::atomic_min
#define atomicExch ::ddtree::simt::atomic_exch
#define atomicCAS ::ddtree::simt::atomic_cas
#define atomicOr ::ddtree::simt::atomic_or
#define atomicAnd ::ddtree::simt::atomic_and
#define __ldg(p) (*(p))
#define __popc(x) __builtin_popcount(static_cast<unsigned>(x))
#define __ffs(x) __builtin_ffs(static_cast<int>(x))
#define __float_as_uint ::ddtree::simt::float_to_bits
#define __uint_as_float ::ddtree::simt::bits_to_float
#define __expf expf
#define __logf logf
