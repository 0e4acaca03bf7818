// Parameters of the SIMT self-test kernels (kernels/simt_selftest.cu): small kernels that
// exercise one CUDA primitive each, so tests can check the emulator and a real GPU alike.
#pragma once

#include "core/common.h"

namespace ddtree {

enum class SelftestKind : int {
  kWarpOps = 0,      // shuffles (all modes, widths, 64-bit), votes, partial-mask syncwarp
  kBlockReduce,      // dynamic + static shared memory, __syncthreads, shuffle reduction
  kAtomics,          // atomicAdd / Max / Min / Or / CAS
  kMma,              // mma.sync from fragments loaded straight from global memory
  kLdmatrixMma,      // ldmatrix.x4 (A) + ldmatrix.x2.trans (B) + mma.sync
  kLdmatrix,         // raw ldmatrix registers, x1 / x2 / x4, optionally .trans
  kBarrierDeadlock,  // threads >= n exit before __syncthreads (undefined on a GPU)
  kSmemOverflow,     // writes n ints into dynamic shared memory of smem_bytes
  kWarpExit,         // lanes >= n exit while the rest shuffle with a full mask
  kCpAsync,          // cp.async in two groups, wait_group 1 / 0; n: 0 ok, 1 exit early, 2 misaligned
  kSharedRace,       // threads write and read a neighbour's shared slot; n: 1 barrier between, 0 none
};

struct SelftestParams {
  int kind = 0;
  const void* in0 = nullptr;
  const void* in1 = nullptr;
  const void* in2 = nullptr;
  void* out = nullptr;
  int64_t n = 0;        // elements / rows / tiles, per kind
  int64_t m = 0;        // second size, per kind
  int threads = 32;     // threads per block
  int num = 1;          // ldmatrix matrices
  bool trans = false;   // ldmatrix .trans
  bool bf16 = true;     // mma input type (else fp16)
  int64_t smem_bytes = 0;
};

}  // namespace ddtree
