// CPU microbenchmark of tree_visibility (packed rows + positions, the speculative loop's path, and
// with the dense additive fp16 mask at past = 2048). Verifies against bench_common's check first.
#include "bench/bench_common.h"
#include "cpu/tree_visibility.h"

using namespace ddtree;

int main() {
  std::printf("tree_visibility CPU, one thread (the extension splits rows over at::parallel_for)\n");
  std::printf("%6s %6s | %12s %12s | %14s\n", "B", "N", "packed us", "Mrows/s", "+mask2048 us");
  for (const bench::Shape& s : bench::shapes()) {
    bench::TreeBatch t = bench::random_trees(s.batch, s.n, 1234 + s.n);
    const int64_t words = packed_words(s.n);
    std::vector<uint32_t> packed(s.batch * s.n * words);
    std::vector<int64_t> positions(s.batch * s.n);
    TreeVisibilityParams p;
    p.parents = t.parents.data();
    p.parents_int64 = true;
    p.parents_stride = s.n;
    p.num_nodes = t.num_nodes.data();
    p.start = t.start.data();
    p.batch = s.batch;
    p.n = s.n;
    p.packed = packed.data();
    p.positions = positions.data();
    auto run = [](const TreeVisibilityParams& q) { cpu::tree_visibility_rows(q, 0, q.batch * q.n); };
    run(p);
    if (!bench::check_packed(t, packed, positions)) {
      std::printf("MISMATCH at B=%lld N=%lld\n", static_cast<long long>(s.batch),
                  static_cast<long long>(s.n));
      return 1;
    }
    const double us = bench::median_us([&] { run(p); }, 21);
    std::vector<uint16_t> mask(s.batch * s.n * (2048 + s.n));
    TreeVisibilityParams pm = p;
    pm.mask = mask.data();
    pm.mask_elem_bytes = 2;
    pm.mask_blocked = 0xfbff;
    pm.past = 2048;
    pm.start = nullptr;  // the tree block right after the 2048 prefix columns
    const double us_mask = bench::median_us([&] { run(pm); }, 11);
    std::printf("%6lld %6lld | %12.1f %12.2f | %14.1f\n", static_cast<long long>(s.batch),
                static_cast<long long>(s.n), us, s.batch * s.n / us, us_mask);
  }
  return 0;
}
