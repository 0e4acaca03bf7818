// SIMT emulator runtime (see emulator.h for the model).
#include "simt/runtime.h"

#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <memory>
#include <sstream>
#include <vector>

// Race detection (make test-tsan): this file is compiled without instrumentation and tells
// ThreadSanitizer that every emulated thread is a fiber of its own (switches carry no ordering),
// that __syncthreads / warp collectives order the accesses of the threads they join, and that
// kernel launches order everything (host -> grid -> host; the blocks of a grid are ordered too).
// The kernels, compiled with -fsanitize=thread, then report any shared- or global-memory access
// pair of two threads, one a write, with no barrier between them.
#ifdef DDTREE_RACE_DETECTOR
extern "C" {
void* __tsan_get_current_fiber(void);
void* __tsan_create_fiber(unsigned flags);
void __tsan_destroy_fiber(void* fiber);
void __tsan_switch_to_fiber(void* fiber, unsigned flags);
void __tsan_acquire(void* addr);
void __tsan_release(void* addr);
void __tsan_ignore_thread_begin(void);
void __tsan_ignore_thread_end(void);
}
#endif

namespace ddtree::simt {
namespace {

enum class State : uint8_t { Runnable, AtBlockBarrier, AtWarpCollective, Done };

// Warp collective operations; lanes of one collective must all use the same op and mask.
enum Op : int {
  kSyncwarp = 0,
  kBallot,
  kAny,
  kAll,
  kShflIdx,
  kShflUp,
  kShflDown,
  kShflXor,
  kMmaBf16,
  kMmaF16,
  kLdmatrix,  // + 2 * log2(num) + trans
  kNumOps = kLdmatrix + 6
};

const char* op_name(int op) {
  static const char* names[] = {"__syncwarp", "__ballot_sync", "__any_sync", "__all_sync",
                                "__shfl_sync", "__shfl_up_sync", "__shfl_down_sync",
                                "__shfl_xor_sync", "mma.sync (bf16)", "mma.sync (f16)",
                                "ldmatrix.x1", "ldmatrix.x1.trans", "ldmatrix.x2",
                                "ldmatrix.x2.trans", "ldmatrix.x4", "ldmatrix.x4.trans"};
  return (op >= 0 && op < kNumOps) ? names[op] : "?";
}

constexpr int kSlotWords = 12;

struct LaneSlot {
  uint32_t in[kSlotWords];
  uint32_t out[kSlotWords];
};

// A warp collective in progress. Several may be pending in one warp (divergent lanes); a lane
// waits in at most one.
struct Collective {
  uint32_t mask = 0, arrived = 0;
  int op = -1;
};

struct Warp {
  char sync = 0;  // the race detector's synchronisation address of the warp's collectives
  int first_thread = 0;
  int size = 0;  // lanes that exist (the last warp of a block may be partial)
  std::vector<Collective> pending;
  LaneSlot slot[32];
};

struct Stack {
  void* base = nullptr;
  size_t bytes = 0;
  Stack() = default;
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;
  ~Stack() {
    if (base) munmap(base, bytes);
  }
  void allocate(size_t usable) {
    size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    bytes = ((usable + page - 1) / page + 1) * page;  // + one guard page below the stack
    base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                -1, 0);
    if (base == MAP_FAILED) {
      base = nullptr;
      throw Error("SIMT emulator: cannot allocate a fiber stack");
    }
    mprotect(base, page, PROT_NONE);  // stack overflow faults instead of corrupting memory
  }
};

// A cp.async copy in flight: the source bytes are read at issue, the shared-memory destination
// is written only when a cp.async.wait_group retires its group, so a kernel that reads the
// buffer before waiting sees stale data in the emulator too.
struct AsyncCopy {
  void* dst;
  unsigned char bytes[16];
};

struct Fiber {
  ucontext_t ctx;
  void* race_fiber = nullptr;  // ThreadSanitizer's fiber (race-detector builds)
  State state = State::Done;
  dim3 tid;
  std::vector<AsyncCopy> open_group;               // issued, not yet committed
  std::vector<std::vector<AsyncCopy>> committed;   // oldest first
};

constexpr size_t kSmemGuard = 256;
constexpr unsigned char kGuardByte = 0xA5;

struct Block {
  std::vector<Fiber> fibers;
  std::vector<Stack*> stacks;
  std::vector<Warp> warps;
  ucontext_t scheduler;
  void* race_scheduler = nullptr;
  char barrier_sync = 0;  // the race detector's synchronisation address of __syncthreads
  int current = -1;
  bool failed = false;
  std::string error;
  unsigned char* smem = nullptr;
  size_t smem_bytes = 0;
  const std::function<void()>* body = nullptr;
  dim3 block_idx, block_dim, grid_dim;
};

thread_local Block* tl_block = nullptr;
thread_local std::vector<std::unique_ptr<Stack>> tl_stack_pool;  // reused across launches
thread_local ThreadRegs tl_regs;
uint64_t g_switches = 0;
uint64_t g_grids = 0;
// Race-detector synchronisation addresses: the host releases g_launch_sync before each block and
// every thread acquires it when it starts; threads release g_exit_sync when they end and the
// host acquires it before the next block and after the grid. So launches (and blocks) are
// ordered, while the threads of one block are ordered only by their barriers and collectives.
char g_launch_sync = 0, g_exit_sync = 0;

#ifdef DDTREE_RACE_DETECTOR
void race_acquire(void* addr) { __tsan_acquire(addr); }
void race_release(void* addr) { __tsan_release(addr); }
void race_switch(void* fiber) { __tsan_switch_to_fiber(fiber, 1); }  // 1: no synchronisation
void* race_current() { return __tsan_get_current_fiber(); }
void* race_create() { return __tsan_create_fiber(0); }
void race_destroy(void* fiber) { __tsan_destroy_fiber(fiber); }
// The emulator's own bookkeeping done on a thread's behalf (collective slots, cp.async queues)
// is not the kernel's memory traffic: the race detector does not watch it.
struct RaceIgnore {
  RaceIgnore() { __tsan_ignore_thread_begin(); }
  ~RaceIgnore() { __tsan_ignore_thread_end(); }
};
#else
struct RaceIgnore {
  RaceIgnore() {}  // user-provided: a scope guard, not an unused variable
};
void race_acquire(void*) {}
void race_release(void*) {}
void race_switch(void*) {}
void* race_current() { return nullptr; }
void* race_create() { return nullptr; }
void race_destroy(void*) {}
#endif

std::string dim_str(dim3 d) {
  std::ostringstream s;
  s << "(" << d.x << "," << d.y << "," << d.z << ")";
  return s.str();
}

Block& current_block(const char* what) {
  if (!tl_block) throw Error(std::string("SIMT emulator: ") + what + " called outside a kernel");
  return *tl_block;
}

void switch_to_scheduler(Block& b) {
  ++g_switches;
  race_switch(b.race_scheduler);
  swapcontext(&b.fibers[b.current].ctx, &b.scheduler);
}

// Records an error raised inside a kernel and leaves the fiber for good.
[[noreturn]] void fail(Block& b, const std::string& msg) {
  std::ostringstream s;
  Fiber& f = b.fibers[b.current];
  s << "SIMT emulator: block " << dim_str(b.block_idx) << " thread " << dim_str(f.tid) << ": "
    << msg;
  b.failed = true;
  b.error = s.str();
  f.state = State::Done;
  race_release(&g_exit_sync);  // the host reads the error
  switch_to_scheduler(b);
  std::abort();  // never resumed
}

std::string hex(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

void fiber_entry() {
  Block& b = *tl_block;
  race_acquire(&g_launch_sync);
  try {
    (*b.body)();
  } catch (const std::exception& e) {
    fail(b, std::string("kernel threw: ") + e.what());
  }
  int t = b.current;
  const Warp& w = b.warps[t / 32];
  const uint32_t bit = 1u << (t % 32);
  for (const Collective& c : w.pending)
    if (c.mask & bit)
      fail(b, std::string("exited while lanes ") + hex(c.arrived) + " of its warp wait for it in " +
                  op_name(c.op) + " with mask " + hex(c.mask));
  if (!b.fibers[t].open_group.empty() || !b.fibers[t].committed.empty())
    fail(b, "exited with cp.async copies it never waited for (cp.async.wait_group)");
  race_release(&g_exit_sync);
  b.fibers[t].state = State::Done;
  switch_to_scheduler(b);
  std::abort();
}

float half_to_float(uint16_t h) {
  uint32_t sign = (h >> 15) & 1, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  float v;
  if (exp == 0) {
    v = std::ldexp(static_cast<float>(man), -24);
  } else if (exp == 31) {
    v = man ? NAN : INFINITY;
  } else {
    v = std::ldexp(static_cast<float>(man | 0x400), static_cast<int>(exp) - 25);
  }
  return sign ? -v : v;
}

float b16_to_float(uint16_t h, bool bf16) {
  return bf16 ? bits_to_float(static_cast<uint32_t>(h) << 16) : half_to_float(h);
}

uint16_t lo16(uint32_t r) { return static_cast<uint16_t>(r & 0xffff); }
uint16_t hi16(uint32_t r) { return static_cast<uint16_t>(r >> 16); }

// Computes every lane's result once all lanes of the collective have arrived.
void combine(Block& b, Warp& w, const Collective& coll) {
  const uint32_t mask = coll.mask;
  auto lanes = [&](auto fn) {
    for (int l = 0; l < 32; ++l)
      if (mask & (1u << l)) fn(l);
  };
  switch (coll.op) {
    case kSyncwarp:
      return;
    case kBallot:
    case kAny:
    case kAll: {
      uint32_t votes = 0;
      lanes([&](int l) {
        if (w.slot[l].in[0]) votes |= 1u << l;
      });
      lanes([&](int l) { w.slot[l].out[0] = votes; });
      return;
    }
    case kShflIdx:
    case kShflUp:
    case kShflDown:
    case kShflXor: {
      int mode = coll.op - kShflIdx;
      std::vector<uint32_t> res_lo(32), res_hi(32);
      bool bad = false;
      std::string why;
      lanes([&](int l) {
        int arg = static_cast<int32_t>(w.slot[l].in[2]);
        int width = static_cast<int32_t>(w.slot[l].in[3]);
        if (width < 1 || width > 32 || (width & (width - 1))) {
          bad = true;
          why = "width " + std::to_string(width) + " is not a power of two in [1, 32]";
          return;
        }
        int seg = l & ~(width - 1);
        int src = l;
        switch (mode) {
          case 0: src = seg + (arg & (width - 1)); break;
          case 1: src = (l - arg >= seg) ? l - arg : l; break;
          case 2: src = (l + arg < seg + width) ? l + arg : l; break;
          case 3: {
            int x = l ^ (arg & 31);
            src = ((x & ~(width - 1)) > seg) ? l : x;
            break;
          }
        }
        if (!(mask & (1u << src))) {
          bad = true;
          why = "lane " + std::to_string(l) + " reads lane " + std::to_string(src) +
                ", which is not in the mask " + hex(mask);
          return;
        }
        res_lo[l] = w.slot[src].in[0];
        res_hi[l] = w.slot[src].in[1];
      });
      if (bad) fail(b, std::string(op_name(coll.op)) + ": " + why);
      lanes([&](int l) {
        w.slot[l].out[0] = res_lo[l];
        w.slot[l].out[1] = res_hi[l];
      });
      return;
    }
    case kMmaBf16:
    case kMmaF16: {
      if (mask != 0xffffffffu) fail(b, "mma.sync needs all 32 lanes (mask " + hex(mask) + ")");
      const bool bf16 = coll.op == kMmaBf16;
      float A[16][16], B[16][8], C[16][8];
      for (int l = 0; l < 32; ++l) {
        const uint32_t* in = w.slot[l].in;
        int g = l >> 2, t = l & 3;
        // A (row-major 16x16): a0a1 row g, a2a3 row g+8, a4a5 row g col+8, a6a7 row g+8 col+8.
        for (int r = 0; r < 4; ++r) {
          int row = g + ((r & 1) ? 8 : 0);
          int col = t * 2 + ((r & 2) ? 8 : 0);
          A[row][col] = b16_to_float(lo16(in[r]), bf16);
          A[row][col + 1] = b16_to_float(hi16(in[r]), bf16);
        }
        // B (16x8, "col"): b0b1 rows 2t,2t+1 col g; b2b3 rows 2t+8, 2t+9.
        for (int r = 0; r < 2; ++r) {
          int k = t * 2 + r * 8;
          B[k][g] = b16_to_float(lo16(in[4 + r]), bf16);
          B[k + 1][g] = b16_to_float(hi16(in[4 + r]), bf16);
        }
        // C/D (16x8 f32): c0c1 row g cols 2t,2t+1; c2c3 row g+8.
        for (int r = 0; r < 4; ++r) C[g + ((r & 2) ? 8 : 0)][t * 2 + (r & 1)] = bits_to_float(in[6 + r]);
      }
      for (int l = 0; l < 32; ++l) {
        int g = l >> 2, t = l & 3;
        for (int r = 0; r < 4; ++r) {
          int row = g + ((r & 2) ? 8 : 0), col = t * 2 + (r & 1);
          double acc = C[row][col];
          for (int k = 0; k < 16; ++k) acc += static_cast<double>(A[row][k]) * B[k][col];
          w.slot[l].out[r] = float_to_bits(static_cast<float>(acc));
        }
      }
      return;
    }
    default: {
      int code = coll.op - kLdmatrix;
      int num = 1 << (code / 2);
      bool trans = code & 1;
      if (mask != 0xffffffffu) fail(b, std::string(op_name(coll.op)) + " needs all 32 lanes");
      // Thread 8m+r gives the address of row r of matrix m; each row is 8 b16 values.
      const uint16_t* rows[32];
      for (int l = 0; l < 8 * num; ++l) {
        uint64_t addr = w.slot[l].in[0] | (static_cast<uint64_t>(w.slot[l].in[1]) << 32);
        if (addr % 16) fail(b, std::string(op_name(coll.op)) + ": row address of lane " +
                                   std::to_string(l) + " is not 16-byte aligned");
        rows[l] = reinterpret_cast<const uint16_t*>(addr);
      }
      for (int l = 0; l < 32; ++l) {
        int g = l >> 2, t = l & 3;
        for (int m = 0; m < num; ++m) {
          uint16_t e0, e1;
          if (!trans) {  // row g, columns 2t, 2t+1
            e0 = rows[m * 8 + g][2 * t];
            e1 = rows[m * 8 + g][2 * t + 1];
          } else {  // transposed: rows 2t, 2t+1 of column g
            e0 = rows[m * 8 + 2 * t][g];
            e1 = rows[m * 8 + 2 * t + 1][g];
          }
          w.slot[l].out[m] = static_cast<uint32_t>(e0) | (static_cast<uint32_t>(e1) << 16);
        }
      }
      return;
    }
  }
}

// One lane's part of a warp collective: deposit `in`, wait for the lanes of `mask`, read `out`.
void warp_collective(unsigned mask, int op, const uint32_t* in, int n_in, uint32_t* out,
                     int n_out) {
  Block& b = current_block(op_name(op));
  const int t = b.current;
  const int lane = t % 32;
  Warp& w = b.warps[t / 32];
  if (!(mask & (1u << lane)))
    fail(b, std::string(op_name(op)) + " with mask " + hex(mask) +
                " that does not include the calling lane " + std::to_string(lane));
  if (w.size < 32 && (mask >> w.size))
    fail(b, std::string(op_name(op)) + " with mask " + hex(mask) + " naming lanes that do not " +
                "exist (the warp has " + std::to_string(w.size) + " threads)");
  // Join the pending collective of the same mask and op; lanes of overlapping masks may wait in
  // different collectives (independent thread scheduling) — if they never meet, the scheduler
  // reports the deadlock.
  Collective* coll = nullptr;
  {
    RaceIgnore ignore;
    for (Collective& c : w.pending)
      if (c.mask == mask && c.op == op) coll = &c;
    if (!coll) {
      w.pending.push_back(Collective{mask, 0u, op});
      coll = &w.pending.back();
    }
    std::memcpy(w.slot[lane].in, in, sizeof(uint32_t) * n_in);
  }
  race_release(&w.sync);
  coll->arrived |= 1u << lane;
  if (coll->arrived == mask) {
    const Collective done = *coll;
    {
      RaceIgnore ignore;
      w.pending.erase(w.pending.begin() + (coll - w.pending.data()));
    }
    combine(b, w, done);
    for (int l = 0; l < 32; ++l)
      if (l != lane && (mask & (1u << l))) b.fibers[w.first_thread + l].state = State::Runnable;
  } else {
    b.fibers[t].state = State::AtWarpCollective;
    switch_to_scheduler(b);
  }
  race_acquire(&w.sync);
  RaceIgnore ignore;
  std::memcpy(out, w.slot[lane].out, sizeof(uint32_t) * n_out);
}

std::string deadlock_report(Block& b) {
  int at_barrier = 0, at_warp = 0, done = 0;
  int first_done = -1;
  for (size_t i = 0; i < b.fibers.size(); ++i) {
    switch (b.fibers[i].state) {
      case State::AtBlockBarrier: ++at_barrier; break;
      case State::AtWarpCollective: ++at_warp; break;
      case State::Done:
        ++done;
        if (first_done < 0) first_done = static_cast<int>(i);
        break;
      default: break;
    }
  }
  std::ostringstream s;
  s << "SIMT emulator: deadlock in block " << dim_str(b.block_idx) << " of " << b.fibers.size()
    << " threads: __syncthreads() reached by " << at_barrier << " threads, " << done
    << " threads exited without reaching it";
  if (first_done >= 0) s << " (first: thread " << dim_str(b.fibers[first_done].tid) << ")";
  if (at_warp) {
    s << ", " << at_warp << " threads wait in warp collectives";
    for (size_t wi = 0; wi < b.warps.size(); ++wi) {
      for (const Collective& c : b.warps[wi].pending)
        s << "; warp " << wi << ": " << op_name(c.op) << " mask " << hex(c.mask) << " arrived "
          << hex(c.arrived);
    }
  }
  return s.str();
}

void run_block(Block& b) {
  const int n = static_cast<int>(b.fibers.size());
  for (int i = 0; i < n; ++i) {
    Fiber& f = b.fibers[i];
    f.state = State::Runnable;
    f.open_group.clear();
    f.committed.clear();
    f.tid = dim3(i % b.block_dim.x, (i / b.block_dim.x) % b.block_dim.y,
                 i / (b.block_dim.x * b.block_dim.y));
    getcontext(&f.ctx);
    f.ctx.uc_stack.ss_sp = b.stacks[i]->base;
    f.ctx.uc_stack.ss_size = b.stacks[i]->bytes;
    f.ctx.uc_link = nullptr;
    makecontext(&f.ctx, fiber_entry, 0);
    f.race_fiber = race_create();
  }
  b.race_scheduler = race_current();
  race_acquire(&g_exit_sync);  // earlier blocks and the host's writes come before this block
  race_release(&g_launch_sync);
  struct RaceFibers {  // destroyed however the block ends (errors included)
    Block& b;
    ~RaceFibers() {
      // Threads a failed block left waiting end here: what they did comes before the host's
      // next steps too (their stacks and the host's are reused).
      for (Fiber& f : b.fibers)
        if (f.state != State::Done) {
          race_switch(f.race_fiber);
          race_release(&g_exit_sync);
        }
      race_switch(b.race_scheduler);
      race_acquire(&g_exit_sync);  // the host after the block's threads
      for (Fiber& f : b.fibers) race_destroy(f.race_fiber);
    }
  } race_fibers{b};
  for (Warp& w : b.warps) w.pending.clear();
  tl_regs.block_idx = b.block_idx;
  tl_regs.block_dim = b.block_dim;
  tl_regs.grid_dim = b.grid_dim;
  for (;;) {
    bool ran = false;
    for (int i = 0; i < n; ++i) {
      if (b.fibers[i].state != State::Runnable) continue;
      b.current = i;
      tl_regs.thread_idx = b.fibers[i].tid;
      ++g_switches;
      race_switch(b.fibers[i].race_fiber);
      swapcontext(&b.scheduler, &b.fibers[i].ctx);
      race_acquire(&g_exit_sync);  // what ended (or failed) is seen by the scheduler
      ran = true;
      if (b.failed) throw Error(b.error);
    }
    if (ran) continue;
    int at_barrier = 0, done = 0;
    for (const Fiber& f : b.fibers) {
      at_barrier += f.state == State::AtBlockBarrier;
      done += f.state == State::Done;
    }
    if (done == n) return;
    if (at_barrier == n) {
      for (Fiber& f : b.fibers) f.state = State::Runnable;
      continue;
    }
    throw Error(deadlock_report(b));
  }
}

}  // namespace

Options& options() {
  static Options o;
  return o;
}

ThreadRegs& regs() { return tl_regs; }

uint64_t context_switches() { return g_switches; }

uint64_t grids_run() { return g_grids; }

void atomic_acquire(const void* addr) { race_acquire(const_cast<void*>(addr)); }
void atomic_release(const void* addr) { race_release(const_cast<void*>(addr)); }

void syncthreads() {
  Block& b = current_block("__syncthreads");
  b.fibers[b.current].state = State::AtBlockBarrier;
  race_release(&b.barrier_sync);
  switch_to_scheduler(b);
  race_acquire(&b.barrier_sync);
}

void syncwarp(unsigned mask) {
  uint32_t none = 0;
  warp_collective(mask, kSyncwarp, &none, 0, &none, 0);
}

unsigned ballot_sync(unsigned mask, int predicate) {
  uint32_t in = predicate != 0, out = 0;
  warp_collective(mask, kBallot, &in, 1, &out, 1);
  return out;
}

int any_sync(unsigned mask, int predicate) {
  uint32_t in = predicate != 0, out = 0;
  warp_collective(mask, kAny, &in, 1, &out, 1);
  return out != 0;
}

int all_sync(unsigned mask, int predicate) {
  uint32_t in = predicate != 0, out = 0;
  warp_collective(mask, kAll, &in, 1, &out, 1);
  return out == mask;
}

unsigned activemask() {
  Block& b = current_block("__activemask");
  const Warp& w = b.warps[b.current / 32];
  unsigned m = 0;
  for (int l = 0; l < w.size; ++l)
    if (b.fibers[w.first_thread + l].state != State::Done) m |= 1u << l;
  return m;
}

void threadfence() {}

void cp_async_16(void* smem_dst, const void* global_src) {
  Block& b = current_block("cp.async");
  if (reinterpret_cast<uintptr_t>(smem_dst) % 16 || reinterpret_cast<uintptr_t>(global_src) % 16)
    fail(b, "cp.async of 16 bytes needs 16-byte aligned source and destination addresses");
  AsyncCopy c;
  c.dst = smem_dst;
  std::memcpy(c.bytes, global_src, 16);
  RaceIgnore ignore;
  b.fibers[b.current].open_group.push_back(c);
}

void cp_async_commit() {
  Fiber& f = current_block("cp.async.commit_group").fibers[tl_block->current];
  RaceIgnore ignore;
  f.committed.push_back(std::move(f.open_group));
  f.open_group.clear();
}

void cp_async_wait(int pending_groups) {
  Fiber& f = current_block("cp.async.wait_group").fibers[tl_block->current];
  const size_t keep = static_cast<size_t>(std::max(pending_groups, 0));
  while (f.committed.size() > keep) {
    for (const AsyncCopy& c : f.committed.front()) std::memcpy(c.dst, c.bytes, 16);
    RaceIgnore ignore;
    f.committed.erase(f.committed.begin());
  }
}

void* dynamic_smem() { return current_block("dynamic shared memory").smem; }

uint64_t shfl_bits(unsigned mask, uint64_t bits, int lane_arg, int width, ShflMode mode) {
  uint32_t in[4] = {static_cast<uint32_t>(bits), static_cast<uint32_t>(bits >> 32),
                    static_cast<uint32_t>(lane_arg), static_cast<uint32_t>(width)};
  uint32_t out[2] = {0, 0};
  warp_collective(mask, kShflIdx + static_cast<int>(mode), in, 4, out, 2);
  return out[0] | (static_cast<uint64_t>(out[1]) << 32);
}

void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4],
                  bool bf16) {
  uint32_t in[10];
  std::memcpy(in, a, 16);
  std::memcpy(in + 4, b, 8);
  std::memcpy(in + 6, c, 16);
  uint32_t out[4];
  warp_collective(0xffffffffu, bf16 ? kMmaBf16 : kMmaF16, in, 10, out, 4);
  std::memcpy(d, out, 16);
}

void ldmatrix(uint32_t* out, const void* row, int num, bool trans) {
  int code = (num == 1 ? 0 : num == 2 ? 1 : num == 4 ? 2 : -1);
  if (code < 0) throw Error("SIMT emulator: ldmatrix loads 1, 2 or 4 matrices");
  uint64_t addr = reinterpret_cast<uint64_t>(row);
  uint32_t in[2] = {static_cast<uint32_t>(addr), static_cast<uint32_t>(addr >> 32)};
  warp_collective(0xffffffffu, kLdmatrix + 2 * code + (trans ? 1 : 0), in, 2, out, num);
}

void run_grid(dim3 grid, dim3 block, size_t smem_bytes, const std::function<void()>& body) {
  ++g_grids;
  struct GridEnd {  // the host sees the grid's writes
    ~GridEnd() { race_acquire(&g_exit_sync); }
  } grid_end;
  if (tl_block) throw Error("SIMT emulator: kernel launched from inside a kernel");
  const uint64_t threads = static_cast<uint64_t>(block.x) * block.y * block.z;
  if (threads == 0 || threads > 1024 || block.z > 64)
    throw Error("SIMT emulator: invalid block " + dim_str(block) +
                " (CUDA allows 1..1024 threads per block, z <= 64)");
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535)
    throw Error("SIMT emulator: invalid grid " + dim_str(grid));
  if (smem_bytes > options().max_dynamic_smem)
    throw Error("SIMT emulator: launch asks for " + std::to_string(smem_bytes) +
                " bytes of dynamic shared memory, above the " +
                std::to_string(options().max_dynamic_smem) + "-byte per-block limit");

  Block b;
  const int n = static_cast<int>(threads);
  b.fibers.resize(n);
  if (!tl_stack_pool.empty() && tl_stack_pool.front()->bytes < options().stack_bytes)
    tl_stack_pool.clear();
  while (static_cast<int>(tl_stack_pool.size()) < n) {
    tl_stack_pool.push_back(std::make_unique<Stack>());
    tl_stack_pool.back()->allocate(options().stack_bytes);
  }
  for (int i = 0; i < n; ++i) b.stacks.push_back(tl_stack_pool[i].get());
  b.warps.resize((n + 31) / 32);
  for (int w = 0; w < static_cast<int>(b.warps.size()); ++w) {
    b.warps[w].first_thread = w * 32;
    b.warps[w].size = std::min(32, n - w * 32);
  }
  std::vector<unsigned char> smem_buffer(smem_bytes + kSmemGuard + 128);
  unsigned char* smem = smem_buffer.data();
  smem += (128 - reinterpret_cast<uintptr_t>(smem) % 128) % 128;
  b.smem = smem;
  b.smem_bytes = smem_bytes;
  b.body = &body;
  b.block_dim = block;
  b.grid_dim = grid;

  struct Scope {
    Block* b;
    explicit Scope(Block* blk) : b(blk) { tl_block = blk; }
    ~Scope() { tl_block = nullptr; }
  } scope(&b);

  for (unsigned z = 0; z < grid.z; ++z)
    for (unsigned y = 0; y < grid.y; ++y)
      for (unsigned x = 0; x < grid.x; ++x) {
        b.block_idx = dim3(x, y, z);
        std::memset(smem + smem_bytes, kGuardByte, kSmemGuard);
        run_block(b);
        for (size_t i = 0; i < kSmemGuard; ++i) {
          if (smem[smem_bytes + i] != kGuardByte)
            throw Error("SIMT emulator: block " + dim_str(b.block_idx) +
                        " wrote past the end of its " + std::to_string(smem_bytes) +
                        " bytes of dynamic shared memory (at byte offset " +
                        std::to_string(smem_bytes + i) + ")");
        }
      }
}

}  // namespace ddtree::simt
