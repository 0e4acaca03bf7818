// CPU microbenchmarks of tree_topk (whole and vocabulary-sharded), chain_tree, build_tree, verify_greedy, verify_sample and commit_kv_
// (one thread: the functions the op adapters run under at::parallel_for). Each output is checked
// before timing.
#include <cstring>

#include "bench/bench_tree_ops_inputs.h"
#include "cpu/recurrent.h"
#include "cpu/tree_ops.h"
#include "cpu/tree_sample.h"
#include "cpu/tree_topk.h"

using namespace ddtree;
using namespace ddtree::bench;

namespace {

int fail(const char* what) {
  std::printf("MISMATCH in %s\n", what);
  return 1;
}

}  // namespace

int main() {
  std::printf("CPU, one thread\n\n== tree_topk (L = 15 rows per request, k = 64) ==\n");
  std::printf("%5s %7s | %10s %10s\n", "B", "V", "us", "ns/logit");
  for (int64_t batch : {1, 16}) {
    for (int64_t vocab : {32000, 151936}) {
      const int64_t rows = batch * 15, k = 64;
      std::vector<float> x = random_logits(rows, vocab, vocab + batch);
      std::vector<float> lp(rows * k);
      std::vector<int64_t> ids(rows * k);
      TreeTopkParams p;
      p.logits = x.data();
      p.rows = rows;
      p.vocab = vocab;
      p.k = k;
      p.logprobs = lp.data();
      p.ids = ids.data();
      cpu::tree_topk_rows(p, 0, rows);
      if (!topk_ids_match(x, vocab, rows, k, ids, 7)) return fail("tree_topk");
      const double us = median_us([&] { cpu::tree_topk_rows(p, 0, rows); }, 5);
      std::printf("%5lld %7lld | %10.1f %10.3f\n", static_cast<long long>(batch),
                  static_cast<long long>(vocab), us, 1e3 * us / (rows * vocab));
    }
  }

  std::printf("\n== tree_topk_shard / tree_topk_merge (V = 151936 over S shards, L = 15, k = 64) ==\n"
              "%3s %5s | %16s %14s\n", "S", "B", "shard (one rank)", "merge");
  for (int64_t shards : {2, 8}) {
    for (int64_t batch : {1, 16}) {
      const int64_t rows = batch * 15, k = 64, vocab = 151936, size = (vocab + shards - 1) / shards;
      std::vector<float> x = random_logits(rows, vocab, vocab + shards + batch);
      std::vector<float> local(rows * size);
      std::vector<int64_t> parts(shards * rows * (k + 1));
      TreeTopkParams p;
      p.rows = rows;
      p.k = k;
      double us_shard = 0;
      for (int64_t j = 0; j < shards; ++j) {
        const int64_t begin = j * size, width = std::min(vocab, begin + size) - begin;
        for (int64_t r = 0; r < rows; ++r)
          std::memcpy(&local[r * width], &x[r * vocab + begin], width * sizeof(float));
        p.logits = local.data();
        p.vocab = width;
        p.id_offset = begin;
        p.part_keys = reinterpret_cast<uint64_t*>(parts.data() + j * rows * (k + 1));
        cpu::tree_topk_part_items(p, 0, rows);
        if (j == 0) us_shard = median_us([&] { cpu::tree_topk_part_items(p, 0, rows); }, 5);
      }
      std::vector<float> lp(rows * k);
      std::vector<int64_t> ids(rows * k);
      TreeTopkParams m;
      m.rows = rows;
      m.k = k;
      m.parts = shards;
      m.part_stride = rows;
      m.part_keys = reinterpret_cast<uint64_t*>(parts.data());
      m.logprobs = lp.data();
      m.ids = ids.data();
      cpu::tree_topk_merge_parts(m, 0, rows);
      if (!topk_ids_match(x, vocab, rows, k, ids, 7))
        return fail("tree_topk_shard + tree_topk_merge");
      const double us_merge = median_us([&] { cpu::tree_topk_merge_parts(m, 0, rows); }, 11);
      std::printf("%3lld %5lld | %13.1f us %11.1f us\n", static_cast<long long>(shards),
                  static_cast<long long>(batch), us_shard, us_merge);
    }
  }

  std::printf("\n== chain_tree (L = 15: the argmax chain) ==\n%5s %7s | %10s %10s\n", "B", "V",
              "us", "ns/logit");
  for (int64_t batch : {1, 16}) {
    for (int64_t vocab : {32000, 151936}) {
      const int64_t rows = batch * 15;
      std::vector<float> x = random_logits(rows, vocab, vocab + batch + 1);
      std::vector<int64_t> roots(batch, 0), best(rows), out(5 * batch * 16 + batch);
      std::vector<int32_t> nan(rows);
      ChainTreeParams p;
      p.logits = x.data();
      p.batch = batch;
      p.levels = 15;
      p.vocab = vocab;
      p.root_tokens = roots.data();
      p.best = reinterpret_cast<uint64_t*>(best.data());
      p.nan = nan.data();
      p.node_tokens = out.data();
      p.parents = out.data() + batch * 16;
      p.depths = out.data() + 2 * batch * 16;
      p.first_child = out.data() + 3 * batch * 16;
      p.next_sibling = out.data() + 4 * batch * 16;
      p.num_nodes = out.data() + 5 * batch * 16;
      const auto run = [&] {
        cpu::chain_tree_scan(p, 0, rows);
        cpu::chain_tree_write(p, 0, batch);
      };
      run();
      for (int64_t r = 0; r < rows; r += 7)
        if (reference_topk_ids(x.data() + r * vocab, vocab, 1)[0] != out[(r / 15) * 16 + r % 15 + 1])
          return fail("chain_tree");
      const double us = median_us(run, 5);
      std::printf("%5lld %7lld | %10.1f %10.3f\n", static_cast<long long>(batch),
                  static_cast<long long>(vocab), us, 1e3 * us / (rows * vocab));
    }
  }

  std::printf("\n== build_tree (L = 15, K = min(budget, 1024)) ==\n%5s %7s | %10s %12s\n", "B",
              "budget", "us", "us/request");
  for (int64_t batch : {1, 64}) {
    for (int64_t budget : {64, 256, 1024}) {
      DraftTopk d = random_topk(batch, 15, std::min<int64_t>(budget, 1024), budget * 3 + batch);
      TreeOutputs out(batch, budget + 1);
      BuildTreeParams p = build_params(d, budget, out);
      cpu::build_tree_requests(p, 0, batch);
      if (!check_tree(d, budget, out.tokens, out.parents, out.depths, out.num_nodes))
        return fail("build_tree");
      const double us = median_us([&] { cpu::build_tree_requests(p, 0, batch); }, 9);
      std::printf("%5lld %7lld | %10.1f %12.2f\n", static_cast<long long>(batch),
                  static_cast<long long>(budget), us, us / batch);
    }
  }

  std::printf("\n== verify_greedy / verify_sample (budget 64, L = 15, V = 32000 for sampling) ==\n");
  {
    const int64_t batch = 64, vocab = 32000, width = 16;
    VerifySetup s;
    verify_setup(s, batch, width);
    const int64_t n = s.n;
    const TreeOutputs& tree = s.tree;
    const std::vector<int64_t>& target = s.target;
    std::vector<int64_t>& accepted = s.accepted;
    std::vector<int64_t>& len = s.len;
    std::vector<int64_t>& bonus = s.bonus;
    VerifyGreedyParams& vp = s.greedy;
    cpu::verify_greedy_requests(vp, 0, batch);
    if (!check_path(tree, n, accepted, len, width)) return fail("verify_greedy");
    for (int64_t b = 0; b < batch; ++b)
      if (bonus[b] != target[b * n + accepted[b * width + len[b] - 1]]) return fail("verify_greedy");
    const double us = median_us([&] { cpu::verify_greedy_requests(vp, 0, batch); }, 21);
    std::printf("verify_greedy  B=%lld: %8.2f us\n", static_cast<long long>(batch), us);

    const int64_t sb = 4;
    std::vector<float> logits = random_logits(sb * n, vocab, 77);
    std::vector<float> temperature(sb, 0.8f), top_p(sb, 0.9f);
    std::vector<int64_t> top_k(sb, 50), seed(sb, 1), offset(sb, 0);
    VerifySampleParams sp;
    sp.walk = vp.walk;
    sp.walk.batch = sb;
    sp.logits = logits.data();
    sp.vocab = vocab;
    sp.temperature = temperature.data();
    sp.top_k = top_k.data();
    sp.top_p = top_p.data();
    sp.seed = seed.data();
    sp.offset = offset.data();
    cpu::verify_sample_requests(sp, 0, sb);
    len.resize(sb);
    if (!check_path(tree, n, accepted, len, width)) return fail("verify_sample");
    const double us_s = median_us([&] { cpu::verify_sample_requests(sp, 0, sb); }, 5);
    std::printf("verify_sample  B=%lld (T=0.8, top-k 50, top-p 0.9): %8.1f us (%.1f us per request)\n",
                static_cast<long long>(sb), us_s, us_s / sb);
  }

  std::printf("\n== commit_kv_ (bf16 [B, H, S, D] = [16, 8, 4096, 128], 16 accepted rows) ==\n");
  {
    const int64_t B = 16, H = 8, S = 4096, D = 128, A = 16;
    std::vector<uint16_t> cache(B * H * S * D);
    for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<uint16_t>(i * 2654435761u >> 16);
    std::vector<int64_t> past(B, 2000), accepted(B * A), len(B, A);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < A; ++j) accepted[b * A + j] = j == 0 ? 0 : j * 3 + b % 3;
    CommitKvParams p = commit_params(B, H, S, D, A);
    p.caches[0] = cache.data();
    p.past_len = past.data();
    p.accepted = accepted.data();
    p.accept_len = len.data();
    const std::vector<uint16_t> before = cache;
    cpu::commit_kv_slices(p, 0, B * H);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < A; ++j)
        if (std::memcmp(&cache[kv_row_offset(p, b, 3, 2000 + j)],
                        &before[kv_row_offset(p, b, 3, 2000 + accepted[b * A + j])], D * 2))
          return fail("commit_kv_");
    const double us = median_us([&] { cpu::commit_kv_slices(p, 0, B * H); }, 21);
    std::printf("commit_kv_: %8.2f us (%.1f GB/s moved)\n", us, 2.0 * B * H * (A - 1) * D * 2 / us / 1e3);
  }
  std::printf("\n== tree_gated_delta_rule / tree_causal_conv1d (budget 64, Dk = Dv = 128, W = 4) ==\n");
  {
    RecurrentInputs r = recurrent_inputs(8, 8192);
    TreeGdnParams g = gdn_params(r);
    cpu::tree_gdn_heads(g, 0, r.hv);
    const std::vector<float> first = r.out;
    cpu::tree_gdn_heads(g, 0, r.hv);
    if (first != r.out) return fail("tree_gated_delta_rule (not deterministic)");
    const double us = median_us([&] { cpu::tree_gdn_heads(g, 0, r.hv); }, 5);
    std::printf("tree_gated_delta_rule Hv=%lld, %lld nodes (depth %lld): %9.1f us (%.2f GFLOP/s)\n",
                static_cast<long long>(r.hv), static_cast<long long>(r.n),
                static_cast<long long>(r.depth), us, 4.0 * r.n * r.hv * r.dk * r.dv / us / 1e3);
    TreeConvParams c = conv_params(r);
    cpu::tree_conv_rows(c, 0, r.n);
    const double us_c = median_us([&] { cpu::tree_conv_rows(c, 0, r.n); }, 11);
    std::printf("tree_causal_conv1d C=%lld: %9.1f us\n", static_cast<long long>(r.channels), us_c);
  }
  return 0;
}
