// CUDA microbenchmarks of tree_attention and draft_attention (bf16, mma.sync kernels): each
// configuration is checked against the CPU implementation (small contexts), then timed with CUDA
// events with one split and with the automatic split over keys. FLOPs count 4 * rows * keys * D
// per head (QK^T and PV over every key, masked or not); bytes are K + V read once per KV head.
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>

#include "bench/bench_common.h"
#include "bench/bench_cuda_common.h"
#include "cpu/draft_attention.h"
#include "cpu/tree_attention.h"
#include "kernels/launchers.h"

using namespace ddtree;
using namespace ddtree::bench;

namespace {

std::vector<uint16_t> random_bf16(size_t n, Rng& rng) {
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = float_to_bf16_bits(static_cast<float>(rng.below(2001) - 1000) / 500.f);
  return v;
}

// Max |a - b| / max |b| over two bf16 outputs.
double rel_diff(const std::vector<uint16_t>& a, const std::vector<uint16_t>& b) {
  double diff = 0, scale = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = bf16_bits_to_float(a[i]), y = bf16_bits_to_float(b[i]);
    diff = std::max(diff, std::fabs(x - y));
    scale = std::max(scale, std::fabs(y));
  }
  return diff / scale;
}

int sm_count() {
  int dev = 0, count = 1;
  cudaGetDevice(&dev);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, dev);
  return count;
}

// Split plan + fp32 workspace on the device (the op adapters do the same with torch tensors).
AttentionSplits device_splits(int64_t requested, int64_t batch, int64_t rows, int64_t hq,
                              int64_t hkv, int64_t d, int64_t max_keys) {
  AttentionSplits s;
  s.splits = choose_attention_splits(requested, batch, attention_blocks_per_request(rows, hq, hkv),
                                     max_keys, sm_count());
  if (s.splits > 1) {
    cudaMalloc(&s.part_o, s.splits * batch * hq * rows * d * sizeof(float));
    cudaMalloc(&s.part_lse, s.splits * batch * hq * rows * sizeof(float));
  }
  return s;
}

void free_splits(AttentionSplits& s) {
  cudaFree(s.part_o);
  cudaFree(s.part_lse);
}

// Checks the kernel with one split and with `autos` against `want` (CPU output; empty: no check),
// times both, prints one table row. Returns nonzero on a mismatch or a launch failure.
template <class Params, class Launch>
int check_time_print(const char* name, Params g, const AttentionSplits& autos, const uint16_t* d_out,
                     const std::vector<uint16_t>& want, int64_t batch, int64_t context,
                     double flops, double bytes, Launch launch) {
  const AttentionSplits one;
  for (const AttentionSplits& s : {one, autos}) {
    if (want.empty()) break;
    g.split = s;
    if (launch(g) != 0) return fail(name);
    if (rel_diff(download(d_out, want.size()), want) > 2e-2) return fail(name);
  }
  g.split = one;
  const double t1 = time_us([&] { launch(g); }, 20);
  g.split = autos;
  const double ta = time_us([&] { launch(g); }, 20);
  const double best = std::min(t1, ta);
  std::printf("%3lld %6lld %6s | %9.1f %9.1f %9lld | %7.2f %8.1f %8.0f\n",
              static_cast<long long>(batch), static_cast<long long>(context),
              want.empty() ? "-" : "ok", t1, ta, static_cast<long long>(autos.splits), t1 / ta,
              flops / best / 1e6, bytes / best / 1e3);
  return 0;
}

int bench_tree_attention() {
  std::printf("\n== tree_attention (bf16, Hq 32, Hkv 8, D 128, N = budget + 1 = 65) ==\n"
              "%3s %6s %6s | %9s %9s %9s | %7s %8s %8s\n", "B", "past", "check", "us split1",
              "us auto", "splits", "speedup", "TFLOP/s", "GB/s");
  const int64_t hq = 32, hkv = 8, d = 128, n = 65;
  for (int64_t batch : {1, 8}) {
    for (int64_t past : {512, 4096, 32768}) {
      Rng rng(static_cast<uint64_t>(batch * 100003 + past));
      const int64_t s_max = past + n, words = (n + 31) / 32;
      const auto q = random_bf16(batch * n * hq * d, rng);
      const auto k = random_bf16(batch * hkv * s_max * d, rng);
      const auto v = random_bf16(batch * hkv * s_max * d, rng);
      const TreeBatch trees = random_trees(batch, n, static_cast<uint64_t>(past));
      std::vector<uint32_t> packed(batch * n * words, 0u);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < n; ++i) {
          uint32_t* row = packed.data() + (b * n + i) * words;
          const int64_t p = i < trees.num_nodes[b] ? trees.parents[b * n + i] : -1;
          if (p >= 0) std::memcpy(row, packed.data() + (b * n + p) * words, words * 4);
          row[i / 32] |= 1u << (i % 32);
        }
      const std::vector<int64_t> past_len(batch, past);
      TreeAttentionParams h;
      h.q = q.data();
      h.q_stride_b = n * hq * d;
      h.q_stride_n = hq * d;
      h.q_stride_h = d;
      h.k = k.data();
      h.v = v.data();
      h.kv_stride_b = hkv * s_max * d;
      h.kv_stride_h = s_max * d;
      h.kv_stride_s = d;
      h.dtype = ElemDtype::kBFloat16;
      h.past_len = past_len.data();
      h.packed = packed.data();
      h.words = words;
      h.batch = batch;
      h.n = n;
      h.hq = hq;
      h.hkv = hkv;
      h.d = d;
      h.s_max = s_max;
      h.scale = 1.f / std::sqrt(static_cast<float>(d));
      TreeAttentionParams g = h;
      g.q = upload(q);
      g.k = upload(k);
      g.v = upload(v);
      g.past_len = upload(past_len);
      g.packed = upload(packed);
      uint16_t* d_out = nullptr;
      cudaMalloc(&d_out, q.size() * 2);
      g.out = d_out;
      AttentionSplits autos = device_splits(0, batch, n, hq, hkv, d, s_max);
      const bool checked = batch * past <= 4096;  // the CPU check is single-threaded
      std::vector<uint16_t> want(checked ? q.size() : 0);
      if (checked) {
        h.out = want.data();
        cpu::tree_attention_rows(h, 0, batch * hkv);
      }
      if (check_time_print("tree_attention", g, autos, d_out, want, batch, past,
                           4.0 * batch * hq * n * (past + n) * d, 4.0 * batch * hkv * (past + n) * d,
                           [](const TreeAttentionParams& x) { return gpu::launch_tree_attention(x, nullptr); }))
        return 1;
      free_splits(autos);
      for (const void* ptr : {g.q, g.k, g.v, static_cast<const void*>(g.past_len),
                              static_cast<const void*>(g.packed)})
        cudaFree(const_cast<void*>(ptr));
      cudaFree(d_out);
    }
  }
  return 0;
}

int bench_draft_attention() {
  std::printf("\n== draft_attention (bf16, Lq 16, 16 new context rows, Hq 32, Hkv 8, D 128) ==\n"
              "%3s %6s %6s | %9s %9s %9s | %7s %8s %8s\n", "B", "cached", "check", "us split1",
              "us auto", "splits", "speedup", "TFLOP/s", "GB/s");
  const int64_t hq = 32, hkv = 8, d = 128, lq = 16, ctx = 16, t = ctx + lq;
  for (int64_t batch : {1, 8}) {
    for (int64_t cached : {512, 4096, 32768}) {
      Rng rng(static_cast<uint64_t>(batch * 7919 + cached));
      const int64_t s_max = cached + ctx;
      const auto q = random_bf16(batch * lq * hq * d, rng);
      const auto k_new = random_bf16(batch * t * hkv * d, rng);
      const auto v_new = random_bf16(batch * t * hkv * d, rng);
      auto k_cache = random_bf16(batch * hkv * s_max * d, rng);
      auto v_cache = random_bf16(batch * hkv * s_max * d, rng);
      std::vector<float> cos(batch * t * d), sin(batch * t * d), ones(d, 1.f);
      for (int64_t r = 0; r < batch * t; ++r)
        for (int64_t j = 0; j < d; ++j) {
          const double ang = static_cast<double>(cached + r % t) /
                             std::pow(10000.0, static_cast<double>(2 * (j % (d / 2))) / d);
          cos[r * d + j] = static_cast<float>(std::cos(ang));
          sin[r * d + j] = static_cast<float>(std::sin(ang));
        }
      const std::vector<int64_t> cache_len(batch, cached);
      DraftAttentionParams h;
      h.q = q.data();
      h.k_new = k_new.data();
      h.v_new = v_new.data();
      h.k_cache = k_cache.data();
      h.v_cache = v_cache.data();
      h.cache_len = cache_len.data();
      h.q_norm = ones.data();
      h.k_norm = ones.data();
      h.cos = cos.data();
      h.sin = sin.data();
      h.dtype = ElemDtype::kBFloat16;
      h.batch = batch;
      h.lq = lq;
      h.t = t;
      h.context = ctx;
      h.hq = hq;
      h.hkv = hkv;
      h.d = d;
      h.s_max = s_max;
      h.scale = 1.f / std::sqrt(static_cast<float>(d));
      DraftAttentionParams g = h;
      g.q = upload(q);
      g.k_new = upload(k_new);
      g.v_new = upload(v_new);
      g.k_cache = upload(k_cache);
      g.v_cache = upload(v_cache);
      g.cache_len = upload(cache_len);
      g.q_norm = upload(ones);
      g.k_norm = g.q_norm;
      g.cos = upload(cos);
      g.sin = upload(sin);
      uint16_t* d_out = nullptr;
      cudaMalloc(&d_out, q.size() * 2);
      g.out = d_out;
      AttentionSplits autos = device_splits(0, batch, lq, hq, hkv, d, s_max + t);
      const bool checked = batch * cached <= 4096;
      std::vector<uint16_t> want(checked ? q.size() : 0);
      if (checked) {
        h.out = want.data();
        cpu::draft_attention_items(h, 0, batch * hkv);
      }
      if (check_time_print("draft_attention", g, autos, d_out, want, batch, cached,
                           4.0 * batch * hq * lq * (cached + t) * d, 4.0 * batch * hkv * (cached + t) * d,
                           [](const DraftAttentionParams& x) { return gpu::launch_draft_attention(x, nullptr); }))
        return 1;
      free_splits(autos);
      for (const void* ptr : {g.q, g.k_new, g.v_new, static_cast<const void*>(g.k_cache),
                              static_cast<const void*>(g.v_cache), static_cast<const void*>(g.cache_len),
                              static_cast<const void*>(g.q_norm), static_cast<const void*>(g.cos),
                              static_cast<const void*>(g.sin)})
        cudaFree(const_cast<void*>(ptr));
      cudaFree(d_out);
    }
  }
  return 0;
}

}  // namespace

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_attention_cuda: no CUDA device; nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs\n", prop.name, prop.multiProcessorCount);
  if (int rc = bench_tree_attention()) return rc;
  if (int rc = bench_draft_attention()) return rc;
  const cudaError_t e = cudaDeviceSynchronize();
  if (e != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(e));
    return 1;
  }
  return 0;
}
