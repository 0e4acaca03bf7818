// Tensor-core building blocks: mma.sync m16n8k16 (bf16/f16 in, f32 accumulate), ldmatrix and
// cp.async.
// Inline PTX under nvcc (sm_80+); the emulator implements the same PTX ISA fragment layouts.
//   A 16x16 row-major: a[r] holds row g + 8*(r&1), columns 2t + 8*(r>>1) + {0,1}
//   B 16x8 "col":      b[r] holds rows 2t + 8r + {0,1} of column g
//   C/D 16x8 f32:      c[r] is row g + 8*(r>>1), column 2t + (r&1)
// where g = lane / 4 and t = lane % 4; the lower 16 bits of a register hold the first element.
#pragma once

#include "kernels/launch.cuh"

namespace ddtree {
namespace DDTREE_KERNEL_NS {

template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2], const float (&c)[4]) {
#if defined(DDTREE_EMULATE)
  simt::mma_m16n8k16(d, a, b, c, kBf16);
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%10,%11,%12,%13};\n"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]),
          "f"(c[2]), "f"(c[3]));
  }
#endif
}

// Lane 8m + r passes the (16-byte aligned, shared-memory) address of row r of matrix m.
template <int kNum, bool kTrans>
__device__ __forceinline__ void ldmatrix(uint32_t (&r)[kNum], const void* smem_row) {
  static_assert(kNum == 1 || kNum == 2 || kNum == 4, "ldmatrix loads 1, 2 or 4 matrices");
#if defined(DDTREE_EMULATE)
  simt::ldmatrix(r, smem_row, kNum, kTrans);
#elif defined(__CUDA_ARCH__)
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_row));
  if constexpr (kNum == 1 && !kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.shared.b16 {%0}, [%1];\n" : "=r"(r[0]) : "r"(addr));
  } else if constexpr (kNum == 1 && kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x1.trans.shared.b16 {%0}, [%1];\n"
                 : "=r"(r[0]) : "r"(addr));
  } else if constexpr (kNum == 2 && !kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  } else if constexpr (kNum == 2 && kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
                 : "=r"(r[0]), "=r"(r[1]) : "r"(addr));
  } else if constexpr (kNum == 4 && !kTrans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  }
#endif
}

// Asynchronous global -> shared copies (sm_80+): cp.async.cg of 16 bytes (both addresses 16-byte
// aligned), grouped by commit; wait<N> returns once at most N of this thread's groups are pending.
// Other threads' copies are visible only after their wait and a barrier.
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* global_src) {
#if defined(DDTREE_EMULATE)
  simt::cp_async_16(smem_dst, global_src);
#elif defined(__CUDA_ARCH__)
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(global_src) : "memory");
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(DDTREE_EMULATE)
  simt::cp_async_commit();
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(DDTREE_EMULATE)
  simt::cp_async_wait(kPending);
#elif defined(__CUDA_ARCH__)
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

}  // namespace DDTREE_KERNEL_NS
}  // namespace ddtree
