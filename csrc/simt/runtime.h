// SIMT emulator: runs the project's CUDA kernel sources on the host, so that every kernel is
// executed by the test suite on machines without a GPU.
//
// Model: a launch runs its blocks one after another; inside a block every CUDA thread is a
// fiber (ucontext, own stack) scheduled cooperatively on the calling OS thread. Fibers switch
// only at barriers (__syncthreads) and warp collectives (__syncwarp, shuffles, votes, mma.sync,
// ldmatrix), which is exactly where CUDA threads communicate. Static __shared__ variables are
// thread_local statics (one block is live per OS thread at a time); dynamic shared memory is
// one buffer per block with a guard zone that detects writes past its end.
//
// This header is the runtime API; emulator.h adds the CUDA spellings (macros) for kernel code.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace ddtree::simt {

struct dim3 {
  unsigned x, y, z;
  constexpr dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};

// Every emulator diagnostic (deadlock, shared-memory overflow, bad launch, bad warp call).
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  // Largest dynamic shared memory a block may request: 99 KiB, the opt-in maximum of sm_120
  // (RTX PRO 6000 Blackwell) and sm_86, the smallest among the architectures we build for.
  size_t max_dynamic_smem = 99 * 1024;
  size_t stack_bytes = 128 * 1024;  // per emulated CUDA thread
};
Options& options();

struct ThreadRegs {
  dim3 thread_idx, block_idx, block_dim, grid_dim;
};
ThreadRegs& regs();  // indices of the fiber that is running now

// Number of fiber switches since the process started (for tests and benchmarks of the emulator).
uint64_t context_switches();
// Number of grids run since the process started (kernel launches; for tests of launch counts).
uint64_t grids_run();

void syncthreads();
void syncwarp(unsigned mask = 0xffffffffu);
unsigned ballot_sync(unsigned mask, int predicate);
int any_sync(unsigned mask, int predicate);
int all_sync(unsigned mask, int predicate);
unsigned activemask();
void threadfence();
void* dynamic_smem();

// cp.async.cg.shared.global (16 bytes), cp.async.commit_group and cp.async.wait_group N: copies
// land in shared memory only when a wait retires their group (see emulator.cpp).
void cp_async_16(void* smem_dst, const void* global_src);
void cp_async_commit();
void cp_async_wait(int pending_groups);

enum class ShflMode : uint32_t { Idx = 0, Up = 1, Down = 2, Xor = 3 };
uint64_t shfl_bits(unsigned mask, uint64_t bits, int lane_arg, int width, ShflMode mode);

template <class T>
T shfl_any(unsigned mask, T value, int arg, int width, ShflMode mode) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value,
                "shuffles move values of at most 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &value, sizeof(T));
  bits = shfl_bits(mask, bits, arg, width, mode);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}
template <class T>
T shfl_sync(unsigned mask, T v, int src_lane, int width = 32) {
  return shfl_any(mask, v, src_lane, width, ShflMode::Idx);
}
template <class T>
T shfl_up_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return shfl_any(mask, v, static_cast<int>(delta), width, ShflMode::Up);
}
template <class T>
T shfl_down_sync(unsigned mask, T v, unsigned delta, int width = 32) {
  return shfl_any(mask, v, static_cast<int>(delta), width, ShflMode::Down);
}
template <class T>
T shfl_xor_sync(unsigned mask, T v, int lane_mask, int width = 32) {
  return shfl_any(mask, v, lane_mask, width, ShflMode::Xor);
}

// Warp-wide mma.sync.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32 with the PTX ISA fragment
// layouts; every lane passes its own fragments.
void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4],
                  bool bf16);
// ldmatrix.sync.aligned.m8n8.{x1,x2,x4}{.trans}.shared.b16: `row` is this lane's row address.
void ldmatrix(uint32_t* out, const void* row, int num, bool trans);

// Race-detector builds (make test-tsan: DDTREE_RACE_DETECTOR) tell ThreadSanitizer that an atomic
// orders the accesses of its address (acquire before, release after); no-ops otherwise.
void atomic_acquire(const void* addr);
void atomic_release(const void* addr);
#ifdef DDTREE_RACE_DETECTOR
struct AtomicScope {
  const void* addr;
  explicit AtomicScope(const void* a) : addr(a) { atomic_acquire(a); }
  ~AtomicScope() { atomic_release(addr); }
};
#else
struct AtomicScope {  // nothing to tell outside the race detector's build
  explicit AtomicScope(const void*) {}
};
#endif

// Atomics: fibers of a block never run concurrently, so plain read-modify-write is atomic.
template <class T>
T atomic_add(T* addr, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  *addr = old + v;
  return old;
}
template <class T>
T atomic_max(T* addr, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  if (v > old) *addr = v;
  return old;
}
template <class T>
T atomic_min(T* addr, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  if (v < old) *addr = v;
  return old;
}
template <class T>
T atomic_exch(T* addr, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  *addr = v;
  return old;
}
template <class T>
T atomic_cas(T* addr, T compare, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  if (old == compare) *addr = v;
  return old;
}
template <class T>
T atomic_or(T* addr, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  *addr = old | v;
  return old;
}
template <class T>
T atomic_and(T* addr, T v) {
  AtomicScope scope(addr);
  T old = *addr;
  *addr = old & v;
  return old;
}

// Runs `body` once per CUDA thread of every block of the grid.
void run_grid(dim3 grid, dim3 block, size_t dynamic_smem_bytes, const std::function<void()>& body);

template <class... P, class... A>
void launch(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem, A&&... args) {
  std::tuple<std::decay_t<P>...> params(std::forward<A>(args)...);
  run_grid(grid, block, smem, [&] { std::apply(kernel, params); });
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace ddtree::simt

