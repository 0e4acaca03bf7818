// Helpers shared by the C++ microbenchmarks: deterministic random trees, an independent
// visibility check written from spec §4, and "verify, then time" timing.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

namespace ddtree::bench {

struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  int64_t below(int64_t n) { return static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
};

// Draft-tree-like shapes: each node hangs under one of the few most recent nodes, depth <= 15
// (DDTree's L = 15), so trees are both deep and bushy.
struct TreeBatch {
  int64_t batch, n;
  std::vector<int64_t> parents, num_nodes, start;
};

inline TreeBatch random_trees(int64_t batch, int64_t n, uint64_t seed) {
  TreeBatch t{batch, n, std::vector<int64_t>(batch * n, -1), std::vector<int64_t>(batch, n),
              std::vector<int64_t>(batch)};
  Rng rng(seed);
  for (int64_t b = 0; b < batch; ++b) {
    t.num_nodes[b] = n - rng.below(std::max<int64_t>(1, n / 8));
    t.start[b] = rng.below(4096);
    std::vector<int64_t> depth(n, 0);
    for (int64_t i = 1; i < t.num_nodes[b]; ++i) {
      int64_t p = i - 1 - rng.below(std::min<int64_t>(i, 4));
      while (depth[p] >= 15) p = t.parents[b * n + p];
      t.parents[b * n + i] = p;
      depth[i] = depth[p] + 1;
    }
  }
  return t;
}

// vis[i, :i] = vis[parent[i], :i] row by row, packed; returns false on the first mismatch.
inline bool check_packed(const TreeBatch& t, const std::vector<uint32_t>& packed,
                         const std::vector<int64_t>& positions) {
  const int64_t words = (t.n + 31) / 32;
  std::vector<uint32_t> rows(t.n * words);
  std::vector<int64_t> depth(t.n);
  for (int64_t b = 0; b < t.batch; ++b) {
    std::fill(rows.begin(), rows.end(), 0u);
    for (int64_t i = 0; i < t.n; ++i) {
      const int64_t p = i < t.num_nodes[b] ? t.parents[b * t.n + i] : -1;
      if (p >= 0) {
        std::copy(rows.begin() + p * words, rows.begin() + (p + 1) * words, rows.begin() + i * words);
        depth[i] = depth[p] + 1;
      } else {
        depth[i] = 0;
      }
      rows[i * words + i / 32] |= 1u << (i % 32);
      if (positions[b * t.n + i] != t.start[b] + depth[i]) return false;
    }
    if (!std::equal(rows.begin(), rows.end(), packed.begin() + b * t.n * words)) return false;
  }
  return true;
}

// Median wall time of `fn` in microseconds over `reps` runs (after one warm-up).
inline double median_us(const std::function<void()>& fn, int reps) {
  fn();
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    fn();
    auto t1 = std::chrono::steady_clock::now();
    times.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

struct Shape {
  int64_t batch, n;
};

inline const std::vector<Shape>& shapes() {
  static const std::vector<Shape> s = {{1, 65}, {16, 65}, {64, 257}, {256, 1025}};
  return s;
}

}  // namespace ddtree::bench
