// CUDA microbenchmarks of tree_topk (whole rows, split rows, a vocabulary shard + the merge), chain_tree, build_tree, verify_greedy, verify_sample and commit_kv_:
// each kernel's output is compared with the CPU implementation, then timed with CUDA events.
#include <cuda_runtime.h>

#include <cstring>

#include "bench/bench_cuda_common.h"
#include "bench/bench_tree_ops_inputs.h"
#include "cpu/recurrent.h"
#include "cpu/tree_ops.h"
#include "cpu/tree_sample.h"
#include "cpu/tree_topk.h"
#include "kernels/launchers.h"

using namespace ddtree;
using namespace ddtree::bench;

int main() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || count == 0) {
    std::printf("bench_tree_ops_cuda: no CUDA device; nothing to time\n");
    return 0;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s\n\n== tree_topk (L = 15, k = 64; fp32 logits) ==\n%5s %7s | %9s %9s\n", prop.name,
              "B", "V", "us", "GB/s");
  for (int64_t batch : {1, 16, 64}) {
    for (int64_t vocab : {32000, 151936}) {
      const int64_t rows = batch * 15, k = 64;
      std::vector<float> x = random_logits(rows, vocab, vocab + batch);
      float* dx = upload(x);
      float* dlp = nullptr;
      int64_t* dids = nullptr;
      cudaMalloc(&dlp, rows * k * 4);
      cudaMalloc(&dids, rows * k * 8);
      TreeTopkParams p;
      p.logits = dx;
      p.rows = rows;
      p.vocab = vocab;
      p.k = k;
      p.logprobs = dlp;
      p.ids = dids;
      if (gpu::launch_tree_topk(p, nullptr) != 0) return fail("tree_topk launch");
      const std::vector<int64_t> ids = download(dids, rows * k);
      if (!topk_ids_match(x, vocab, rows, k, ids, 5)) return fail("tree_topk");
      const double us = time_us([&] { gpu::launch_tree_topk(p, nullptr); });
      // The split form the op uses for few rows: parts blocks per row + a merge launch.
      const int64_t parts = std::min<int64_t>(
          {(2 * prop.multiProcessorCount + rows - 1) / rows, vocab / 4096, 64});
      double us_split = us;
      if (parts > 1) {
        TreeTopkParams q = p;
        q.parts = parts;
        q.part_row_stride = parts;
        cudaMalloc(&q.part_keys, rows * parts * (k + 1) * 8);
        cudaMemset(dids, 0, rows * k * 8);
        if (gpu::launch_tree_topk(q, nullptr) != 0) return fail("tree_topk split launch");
        const std::vector<int64_t> split_ids = download(dids, rows * k);
        if (split_ids != ids) return fail("tree_topk split");
        us_split = time_us([&] { gpu::launch_tree_topk(q, nullptr); });
        cudaFree(q.part_keys);
      }
      // The vocabulary-sharded top-k as tree_topk_shard / tree_topk_merge run it: 8 shards of
      // V / 8 columns, each rank's part (the first shard's timed), then the merge of the 8 parts.
      const int64_t shards = 8, width = (vocab + shards - 1) / shards;
      int64_t* dparts = nullptr;
      cudaMalloc(&dparts, shards * rows * (k + 1) * 8);
      double us_shard = 0;
      for (int64_t j = 0; j < shards; ++j) {
        const int64_t begin = j * width, cols = std::min(vocab, begin + width) - begin;
        std::vector<float> shard_x(rows * cols);
        for (int64_t r = 0; r < rows; ++r)
          std::copy(x.begin() + r * vocab + begin, x.begin() + r * vocab + begin + cols,
                    shard_x.begin() + r * cols);
        float* dshard = upload(shard_x);
        TreeTopkParams sh = p;
        sh.logits = dshard;
        sh.vocab = cols;
        sh.id_offset = begin;
        sh.part_keys = reinterpret_cast<uint64_t*>(dparts + j * rows * (k + 1));
        if (gpu::launch_tree_topk(sh, nullptr) != 0) return fail("tree_topk_shard launch");
        if (j == 0) us_shard = time_us([&] { gpu::launch_tree_topk(sh, nullptr); });
        cudaDeviceSynchronize();
        cudaFree(dshard);
      }
      TreeTopkParams mg = p;
      mg.parts = shards;
      mg.part_stride = rows;
      mg.part_keys = reinterpret_cast<uint64_t*>(dparts);
      cudaMemset(dids, 0, rows * k * 8);
      if (gpu::launch_tree_topk_merge(mg, nullptr) != 0) return fail("tree_topk_merge launch");
      if (!topk_ids_match(x, vocab, rows, k, download(dids, rows * k), 5))
        return fail("tree_topk_shard + tree_topk_merge");
      const double us_merge = time_us([&] { gpu::launch_tree_topk_merge(mg, nullptr); });
      cudaFree(dparts);
      std::printf("%5lld %7lld | %9.1f %9.0f | split %2lld: %7.1f us %6.0f GB/s | 1/8 shard %6.1f us, "
                  "merge of 8 %6.1f us\n",
                  static_cast<long long>(batch), static_cast<long long>(vocab), us,
                  rows * vocab * 4.0 / us / 1e3, static_cast<long long>(parts), us_split,
                  rows * vocab * 4.0 / us_split / 1e3, us_shard, us_merge);
      // chain_tree on the same logits: the argmax chain without the log-softmax.
      ChainTreeParams c;
      c.logits = dx;
      c.batch = batch;
      c.levels = 15;
      c.vocab = vocab;
      c.parts = std::max<int64_t>(1, std::min<int64_t>((2 * prop.multiProcessorCount + rows - 1) / rows,
                                                      vocab / 4096));
      int64_t* droots = nullptr;
      cudaMalloc(&droots, batch * 8);
      cudaMemset(droots, 0, batch * 8);
      c.root_tokens = droots;
      cudaMalloc(&c.best, rows * c.parts * 8);
      cudaMalloc(&c.nan, rows * c.parts * 4);
      int64_t* tree_out = nullptr;
      cudaMalloc(&tree_out, 5 * batch * 16 * 8 + batch * 8);
      c.node_tokens = tree_out;
      c.parents = tree_out + batch * 16;
      c.depths = tree_out + 2 * batch * 16;
      c.first_child = tree_out + 3 * batch * 16;
      c.next_sibling = tree_out + 4 * batch * 16;
      c.num_nodes = tree_out + 5 * batch * 16;
      if (gpu::launch_chain_tree(c, nullptr) != 0) return fail("chain_tree launch");
      const std::vector<int64_t> chain = download(tree_out, batch * 16);
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t d = 1; d <= 15; ++d)
          if (chain[b * 16 + d] != ids[(b * 15 + d - 1) * k]) return fail("chain_tree");
      const double us_chain = time_us([&] { gpu::launch_chain_tree(c, nullptr); });
      std::printf("%5s %7s | chain_tree (%lld parts): %7.1f us %6.0f GB/s\n", "", "",
                  static_cast<long long>(c.parts), us_chain, rows * vocab * 4.0 / us_chain / 1e3);
      cudaFree(droots);
      cudaFree(c.best);
      cudaFree(c.nan);
      cudaFree(tree_out);
      cudaFree(dx);
      cudaFree(dlp);
      cudaFree(dids);
    }
  }

  std::printf("\n== build_tree (L = 15) ==\n%5s %7s | %9s\n", "B", "budget", "us");
  for (int64_t batch : {1, 64, 256}) {
    for (int64_t budget : {64, 256, 1024}) {
      const int64_t n = budget + 1;
      DraftTopk d = random_topk(batch, 15, std::min<int64_t>(budget, 1024), budget * 3 + batch);
      TreeOutputs host(batch, n);
      BuildTreeParams p = build_params(d, budget, host);
      cpu::build_tree_requests(p, 0, batch);
      int64_t* dev[6];
      for (int i = 0; i < 6; ++i) dev[i] = upload(host.fields()[i]);
      BuildTreeParams g = p;
      g.logq = upload(d.logq);
      g.ids = upload(d.ids);
      g.root_tokens = upload(d.roots);
      g.node_tokens = dev[0];
      g.parents = dev[1];
      g.depths = dev[2];
      g.first_child = dev[3];
      g.next_sibling = dev[4];
      g.num_nodes = dev[5];
      if (gpu::launch_build_tree(g, nullptr) != 0) return fail("build_tree launch");
      for (int i = 0; i < 6; ++i)
        if (download(dev[i], host.fields()[i].size()) != host.fields()[i]) return fail("build_tree");
      const double us = time_us([&] { gpu::launch_build_tree(g, nullptr); }, 20);
      std::printf("%5lld %7lld | %9.1f\n", static_cast<long long>(batch),
                  static_cast<long long>(budget), us);
      for (int i = 0; i < 6; ++i) cudaFree(dev[i]);
    }
  }

  std::printf("\n== verify_greedy (B = 256) / verify_sample (B = 16, V = 32000), budget 64 ==\n");
  {
    const int64_t batch = 256, vocab = 32000, sb = 16, width = 16;
    VerifySetup s;
    verify_setup(s, batch, width);
    const int64_t n = s.n;
    const TreeOutputs& tree = s.tree;
    const std::vector<int64_t>& target = s.target;
    const std::vector<int64_t>& accepted = s.accepted;
    const std::vector<int64_t>& len = s.len;
    const std::vector<int64_t>& bonus = s.bonus;
    int64_t* d_acc = upload(accepted);
    int64_t* d_len = upload(len);
    int64_t* d_bonus = upload(bonus);
    VerifyGreedyParams g;
    g.walk = walk_params(upload(tree.tokens), upload(tree.first_child), upload(tree.next_sibling),
                         upload(tree.num_nodes), batch, n, width, d_acc, d_len, d_bonus);
    g.target_tokens = upload(target);
    if (gpu::launch_verify_greedy(g, nullptr) != 0) return fail("verify_greedy launch");
    if (download(d_acc, accepted.size()) != accepted || download(d_bonus, bonus.size()) != bonus)
      return fail("verify_greedy");
    std::printf("verify_greedy: %8.2f us\n", time_us([&] { gpu::launch_verify_greedy(g, nullptr); }));

    std::vector<float> logits = random_logits(sb * n, vocab, 77);
    std::vector<float> temperature(sb, 0.8f), top_p(sb, 0.9f);
    std::vector<int64_t> top_k(sb, 50), seed(sb, 1), offset(sb, 0);
    VerifySampleParams sp;
    sp.walk = g.walk;
    sp.walk.batch = sb;
    sp.logits = upload(logits);
    sp.vocab = vocab;
    sp.temperature = upload(temperature);
    sp.top_k = upload(top_k);
    sp.top_p = upload(top_p);
    sp.seed = upload(seed);
    sp.offset = upload(offset);
    if (gpu::launch_verify_sample(sp, nullptr) != 0) return fail("verify_sample launch");
    if (!check_path(tree, n, download(d_acc, sb * width), download(d_len, sb), width))
      return fail("verify_sample");
    std::printf("verify_sample (T=0.8, top-k 50, top-p 0.9), block per request walks: %8.1f us\n",
                time_us([&] { gpu::launch_verify_sample(sp, nullptr); }, 10));
    // The launcher's small-batch mode: every row drawn by its own block, then the walks. Same
    // tokens as the walk above (each row's draw depends only on its counters).
    const std::vector<int64_t> walked_acc = download(d_acc, sb * width), walked_bonus = download(d_bonus, sb);
    std::vector<int64_t> rows(sb * n, 0);
    sp.row_tokens = upload(rows);
    if (gpu::launch_verify_sample(sp, nullptr) != 0) return fail("verify_sample (rows) launch");
    if (download(d_acc, sb * width) != walked_acc || download(d_bonus, sb) != walked_bonus)
      return fail("verify_sample (rows) differs from the walk");
    std::printf("verify_sample, every row drawn by its own block + walk:           %8.1f us\n",
                time_us([&] { gpu::launch_verify_sample(sp, nullptr); }, 10));
    sp.walk.batch = 1;
    std::printf("verify_sample B = 1, rows at once:                                 %8.1f us\n",
                time_us([&] { gpu::launch_verify_sample(sp, nullptr); }, 10));
    sp.row_tokens = nullptr;
    std::printf("verify_sample B = 1, block walks:                                  %8.1f us\n",
                time_us([&] { gpu::launch_verify_sample(sp, nullptr); }, 10));
  }

  std::printf("\n== commit_kv_ (bf16 [16, 8, 4096, 128], 16 accepted rows) ==\n");
  {
    const int64_t B = 16, H = 8, S = 4096, D = 128, A = 16;
    std::vector<uint16_t> cache(B * H * S * D);
    for (size_t i = 0; i < cache.size(); ++i) cache[i] = static_cast<uint16_t>(i * 2654435761u >> 16);
    std::vector<int64_t> past(B, 2000), accepted(B * A), len(B, A);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t j = 0; j < A; ++j) accepted[b * A + j] = j == 0 ? 0 : j * 3 + b % 3;
    CommitKvParams g = commit_params(B, H, S, D, A);
    g.caches[0] = upload(cache);
    g.past_len = upload(past);
    g.accepted = upload(accepted);
    g.accept_len = upload(len);
    CommitKvParams p = commit_params(B, H, S, D, A);
    p.caches[0] = cache.data();
    p.past_len = past.data();
    p.accepted = accepted.data();
    p.accept_len = len.data();
    cpu::commit_kv_slices(p, 0, B * H);
    if (gpu::launch_commit_kv(g, nullptr) != 0) return fail("commit_kv launch");
    if (download(static_cast<uint16_t*>(g.caches[0]), cache.size()) != cache) return fail("commit_kv_");
    std::printf("commit_kv_: %8.2f us\n", time_us([&] { gpu::launch_commit_kv(g, nullptr); }));
    // commit_kv_layers_: the K and V of 32 layers (64 caches of [16, 8, 512, 128]) in one launch
    // against 64 launches of commit_kv_.
    CommitKvParams many = commit_params(B, H, 512, D, A), one = many;
    std::vector<int64_t> past_small(B, 300);
    many.past_len = one.past_len = upload(past_small);
    many.accepted = one.accepted = g.accepted;
    many.accept_len = one.accept_len = g.accept_len;
    many.num_caches = 64;
    for (int i = 0; i < 64; ++i) cudaMalloc(&many.caches[i], B * H * 512 * D * 2);
    const double t_many = time_us([&] { gpu::launch_commit_kv(many, nullptr); });
    const double t_each = time_us([&] {
      for (int i = 0; i < 64; ++i) {
        one.caches[0] = many.caches[i];
        gpu::launch_commit_kv(one, nullptr);
      }
    });
    std::printf("64 caches: one launch %8.2f us, 64 launches %8.2f us\n", t_many, t_each);
    for (int i = 0; i < 64; ++i) cudaFree(many.caches[i]);
  }
  std::printf("\n== tree_gated_delta_rule / tree_causal_conv1d (budget 64, Dk = Dv = 128, W = 4) ==\n");
  {
    RecurrentInputs r = recurrent_inputs(32, 8192);
    TreeGdnParams p = gdn_params(r);
    cpu::tree_gdn_heads(p, 0, r.hv);
    TreeGdnParams g = p;
    g.q = upload(r.q);
    g.k = upload(r.k);
    g.v = upload(r.v);
    g.g = upload(r.g);
    g.beta = upload(r.beta);
    g.state_pool = upload(r.state);
    g.slots = upload(r.slots);
    g.parents = upload(r.tree.parents);
    g.num_nodes = upload(r.tree.num_nodes);
    g.scratch = upload(r.scratch);
    float* d_out = upload(r.out);
    g.out = d_out;
    if (gpu::launch_tree_gdn(g, nullptr) != 0) return fail("tree_gdn launch");
    const std::vector<float> out = download(d_out, r.out.size());
    for (size_t i = 0; i < out.size(); ++i)
      if (std::fabs(out[i] - r.out[i]) > 1e-3f * (1.f + std::fabs(r.out[i]))) return fail("tree_gated_delta_rule");
    const double us = time_us([&] { gpu::launch_tree_gdn(g, nullptr); }, 20);
    std::printf("tree_gated_delta_rule Hv=32: %8.1f us (%.1f GB/s state traffic)\n", us,
                2.0 * r.n * r.hv * r.dk * r.dv * 4 / us / 1e3);
    TreeConvParams c = conv_params(r);
    cpu::tree_conv_rows(c, 0, r.n);
    TreeConvParams gc = c;
    gc.x = upload(r.x);
    gc.weight = upload(r.weight);
    gc.conv_pool = upload(r.conv_pool);
    gc.slots = g.slots;
    gc.parents = g.parents;
    gc.num_nodes = g.num_nodes;
    float* d_y = upload(r.y);
    gc.y = d_y;
    if (gpu::launch_tree_conv(gc, nullptr) != 0) return fail("tree_conv launch");
    const std::vector<float> y = download(d_y, r.y.size());
    for (size_t i = 0; i < y.size(); ++i)
      if (std::fabs(y[i] - r.y[i]) > 1e-4f * (1.f + std::fabs(r.y[i]))) return fail("tree_causal_conv1d");
    std::printf("tree_causal_conv1d C=8192: %8.1f us\n", time_us([&] { gpu::launch_tree_conv(gc, nullptr); }));
  }
  return 0;
}
