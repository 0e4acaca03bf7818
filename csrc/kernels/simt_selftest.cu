// Self-test kernels for the SIMT primitives (see core/simt_selftest.h). The same source runs on
// a GPU and in the emulator; tests compare both with values computed from the CUDA / PTX specs.
#include "core/simt_selftest.h"
#include "kernels/launch.cuh"
#include "kernels/launchers.h"
#include "kernels/warp_mma.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {
namespace {

constexpr unsigned kFull = 0xffffffffu;
constexpr int kWarpOpsOut = 11;

__global__ void warp_ops_kernel(const SelftestParams p) {
  const int* in = static_cast<const int*>(p.in0);
  int* out = static_cast<int*>(p.out) + threadIdx.x * kWarpOpsOut;
  const int lane = threadIdx.x % 32;
  const int x = in[threadIdx.x];
  out[0] = __shfl_sync(kFull, x, 31 - lane);
  out[1] = __shfl_sync(kFull, x, 3, 8);
  out[2] = __shfl_up_sync(kFull, x, 1);
  out[3] = __shfl_down_sync(kFull, x, 3);
  out[4] = __shfl_xor_sync(kFull, x, 5);
  out[5] = __shfl_xor_sync(kFull, x, 16, 16);
  out[6] = static_cast<int>(__ballot_sync(kFull, x & 1));
  out[7] = __any_sync(kFull, x > 1000);
  out[8] = __all_sync(kFull, x >= 0);
  const long long wide = (static_cast<long long>(x) << 32) | lane;
  out[9] = static_cast<int>(__shfl_xor_sync(kFull, wide, 2) >> 32);
  int v = -1;
  if (lane < 16) v = __shfl_down_sync(0x0000ffffu, x, 1, 16);
  __syncwarp();
  if (lane >= 16) v = __shfl_up_sync(0xffff0000u, x, 2, 16);
  out[10] = v;
}

__global__ void block_reduce_kernel(const SelftestParams p) {
  DDTREE_DYNAMIC_SMEM(float, partial);  // [threads]
  __shared__ float total;
  const float* row = static_cast<const float*>(p.in0) + blockIdx.x * p.m;
  const int tid = threadIdx.x, nt = blockDim.x;
  float acc = 0.f;
  for (int64_t k = tid; k < p.m; k += nt) acc += row[k];
  partial[tid] = acc;
  __syncthreads();
  for (int s = nt / 2; s >= 32; s >>= 1) {
    if (tid < s) partial[tid] += partial[tid + s];
    __syncthreads();
  }
  if (tid < 32) {
    float v = partial[tid];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(kFull, v, off);
    if (tid == 0) total = v;
  }
  __syncthreads();
  if (tid == nt - 1) static_cast<float*>(p.out)[blockIdx.x] = total;
}

__global__ void atomics_kernel(const SelftestParams p) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.n) return;
  const int v = static_cast<const int*>(p.in0)[i];
  int* out = static_cast<int*>(p.out);
  atomicAdd(&out[v % p.m], 1);
  atomicMax(&out[p.m], v);
  atomicMin(&out[p.m + 1], v);
  atomicOr(&out[p.m + 2], 1 << (v % 31));
  int* sum = &out[p.m + 3];
  int old = atomicAdd(sum, 0), assumed;  // an atomic read: a plain one races with the CAS
  do {
    assumed = old;
    old = atomicCAS(sum, assumed, assumed + v);
  } while (assumed != old);
}

__device__ __forceinline__ uint32_t pack2(const uint16_t* lo) {
  return static_cast<uint32_t>(lo[0]) | (static_cast<uint32_t>(lo[1]) << 16);
}

__device__ void store_tile(const SelftestParams& p, const float (&d)[4]) {
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  float* out = static_cast<float*>(p.out) + blockIdx.x * 128;
  for (int r = 0; r < 4; ++r) out[(g + 8 * (r >> 1)) * 8 + 2 * t + (r & 1)] = d[r];
}

template <bool kBf16>
__global__ void mma_kernel(const SelftestParams p) {
  const uint16_t* A = static_cast<const uint16_t*>(p.in0) + blockIdx.x * 256;  // [16, 16]
  const uint16_t* B = static_cast<const uint16_t*>(p.in1) + blockIdx.x * 128;  // [16 k, 8 n]
  const float* C = static_cast<const float*>(p.in2) + blockIdx.x * 128;        // [16, 8]
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  uint32_t a[4], b[2];
  float c[4], d[4];
  for (int r = 0; r < 4; ++r) a[r] = pack2(A + (g + 8 * (r & 1)) * 16 + 2 * t + 8 * (r >> 1));
  for (int r = 0; r < 2; ++r) {
    const int k = 2 * t + 8 * r;
    b[r] = static_cast<uint32_t>(B[k * 8 + g]) | (static_cast<uint32_t>(B[(k + 1) * 8 + g]) << 16);
  }
  for (int r = 0; r < 4; ++r) c[r] = C[(g + 8 * (r >> 1)) * 8 + 2 * t + (r & 1)];
  mma_m16n8k16<kBf16>(d, a, b, c);
  store_tile(p, d);
}

template <bool kBf16>
__global__ void ldmatrix_mma_kernel(const SelftestParams p) {
  __shared__ __align__(16) uint16_t sa[16 * 16];
  __shared__ __align__(16) uint16_t sb[16 * 8];
  const uint16_t* A = static_cast<const uint16_t*>(p.in0) + blockIdx.x * 256;
  const uint16_t* B = static_cast<const uint16_t*>(p.in1) + blockIdx.x * 128;
  const float* C = static_cast<const float*>(p.in2) + blockIdx.x * 128;
  const int lane = threadIdx.x, g = lane >> 2, t = lane & 3;
  for (int k = lane; k < 256; k += 32) sa[k] = A[k];
  for (int k = lane; k < 128; k += 32) sb[k] = B[k];
  __syncwarp();
  // Matrix m of the x4 load: rows 8*(m&1).., columns 8*(m>>1).. — the order of a[0..3].
  const int m = lane >> 3, r = lane & 7;
  uint32_t a[4], b[2];
  ldmatrix<4, false>(a, sa + (r + 8 * (m & 1)) * 16 + 8 * (m >> 1));
  ldmatrix<2, true>(b, sb + (lane & 15) * 8);  // B rows k = 0..15, transposed into "col" frags
  float c[4], d[4];
  for (int q = 0; q < 4; ++q) c[q] = C[(g + 8 * (q >> 1)) * 8 + 2 * t + (q & 1)];
  mma_m16n8k16<kBf16>(d, a, b, c);
  store_tile(p, d);
}

template <int kNum, bool kTrans>
__global__ void ldmatrix_kernel(const SelftestParams p) {
  __shared__ __align__(16) uint16_t s[32 * 8];  // four 8x8 matrices, rows of 8 b16
  const uint16_t* in = static_cast<const uint16_t*>(p.in0);
  const int lane = threadIdx.x;
  for (int k = lane; k < 256; k += 32) s[k] = in[k];
  __syncwarp();
  uint32_t r[kNum];
  ldmatrix<kNum, kTrans>(r, s + (lane % (8 * kNum)) * 8);
  int* out = static_cast<int*>(p.out) + lane * 4;
  for (int q = 0; q < kNum; ++q) out[q] = static_cast<int>(r[q]);
}

__global__ void barrier_deadlock_kernel(const SelftestParams p) {
  if (threadIdx.x >= p.n) return;
  __syncthreads();
  static_cast<int*>(p.out)[threadIdx.x] = 1;
}

__global__ void smem_overflow_kernel(const SelftestParams p) {
  DDTREE_DYNAMIC_SMEM(int, buf);
  for (int64_t k = threadIdx.x; k < p.n; k += blockDim.x) buf[k] = static_cast<int>(k);
  __syncthreads();
  if (threadIdx.x == 0) static_cast<int*>(p.out)[0] = buf[0];
}

// Thread t writes slot t and reads slot t ^ 1 (written by its neighbour): a data race unless a
// barrier separates the write from the read (p.n = 1). The race detector's planted case.
__global__ void shared_race_kernel(const SelftestParams p) {
  __shared__ int slots[1024];
  slots[threadIdx.x] = static_cast<int>(threadIdx.x);
  if (p.n) __syncthreads();
  static_cast<int*>(p.out)[threadIdx.x] = slots[threadIdx.x ^ 1];
}

__global__ void warp_exit_kernel(const SelftestParams p) {
  if (threadIdx.x >= p.n) return;
  static_cast<int*>(p.out)[threadIdx.x] = __shfl_xor_sync(kFull, static_cast<int>(threadIdx.x), 1);
}

// Every thread copies two 16-byte pieces (one per commit group) into shared memory. out[t] holds
// 12 ints: its own first piece read before any wait (stale in the emulator, racy on a GPU), the
// same after wait_group 1, and a neighbour's second piece after wait_group 0 + __syncthreads.
__global__ void cp_async_kernel(const SelftestParams p) {
  DDTREE_DYNAMIC_SMEM(int, buf);  // [2][threads][4]
  const int* in = static_cast<const int*>(p.in0);
  int* out = static_cast<int*>(p.out) + threadIdx.x * 12;
  const int t = threadIdx.x, nt = blockDim.x;
  for (int j = 0; j < 4; ++j) buf[t * 4 + j] = buf[(nt + t) * 4 + j] = -1;
  cp_async_16(buf + t * 4 + (p.n == 2 ? 1 : 0), in + t * 4);
  cp_async_commit();
  cp_async_16(buf + (nt + t) * 4, in + (nt + t) * 4);
  cp_async_commit();
  for (int j = 0; j < 4; ++j) out[j] = buf[t * 4 + j];
  if (p.n == 1) return;
  cp_async_wait<1>();
  for (int j = 0; j < 4; ++j) out[4 + j] = buf[t * 4 + j];
  cp_async_wait<0>();
  __syncthreads();
  const int u = (t + 1) % nt;
  for (int j = 0; j < 4; ++j) out[8 + j] = buf[(nt + u) * 4 + j];
}

template <int kNum>
int launch_ldmatrix(const SelftestParams& p, void* stream) {
  auto kernel = p.trans ? ldmatrix_kernel<kNum, true> : ldmatrix_kernel<kNum, false>;
  return launch_kernel(kernel, dim3(1), dim3(32), 0, stream, p);
}

}  // namespace

int launch_simt_selftest(const SelftestParams& p, void* stream) {
  const dim3 block(p.threads);
  switch (static_cast<SelftestKind>(p.kind)) {
    case SelftestKind::kWarpOps:
      return launch_kernel(warp_ops_kernel, dim3(1), block, 0, stream, p);
    case SelftestKind::kBlockReduce:
      return launch_kernel(block_reduce_kernel, dim3(p.n), block, p.threads * sizeof(float),
                           stream, p);
    case SelftestKind::kAtomics:
      return launch_kernel(atomics_kernel, dim3(ceil_div(p.n, p.threads)), block, 0, stream, p);
    case SelftestKind::kMma:
      return launch_kernel(p.bf16 ? mma_kernel<true> : mma_kernel<false>, dim3(p.n), dim3(32), 0,
                           stream, p);
    case SelftestKind::kLdmatrixMma:
      return launch_kernel(p.bf16 ? ldmatrix_mma_kernel<true> : ldmatrix_mma_kernel<false>,
                           dim3(p.n), dim3(32), 0, stream, p);
    case SelftestKind::kLdmatrix:
      return p.num == 1 ? launch_ldmatrix<1>(p, stream)
             : p.num == 2 ? launch_ldmatrix<2>(p, stream)
                          : launch_ldmatrix<4>(p, stream);
    case SelftestKind::kBarrierDeadlock:
      return launch_kernel(barrier_deadlock_kernel, dim3(1), block, 0, stream, p);
    case SelftestKind::kSmemOverflow:
      return launch_kernel(smem_overflow_kernel, dim3(1), block, p.smem_bytes, stream, p);
    case SelftestKind::kWarpExit:
      return launch_kernel(warp_exit_kernel, dim3(1), block, 0, stream, p);
    case SelftestKind::kSharedRace:
      return launch_kernel(shared_race_kernel, dim3(1), block, 0, stream, p);
    case SelftestKind::kCpAsync:
      return launch_kernel(cp_async_kernel, dim3(1), block, 2 * 4 * p.threads * sizeof(int),
                           stream, p);
  }
  return 1;  // cudaErrorInvalidValue
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
