#include "cpu/tree_sample.h"

#include <algorithm>
#include <functional>
#include <utility>
#include <vector>

namespace ddtree::cpu {
namespace {

struct Scratch {
  std::vector<float> z;
  std::vector<uint32_t> keys;
  std::vector<std::pair<uint32_t, uint64_t>> by_key;
};

int64_t argmax_token(const VerifySampleParams& p, int64_t b, int64_t node) {
  uint64_t best = 0;
  for (int64_t v = 0; v < p.vocab; ++v) best = std::max(best, topk_key(sample_logit(p, b, node, v), v));
  return topk_key_id(best);
}

int64_t sample_node(const VerifySampleParams& p, int64_t b, int64_t node, Scratch& s) {
  const float t = p.temperature[b];
  if (!(t > 0.f)) return argmax_token(p, b, node);
  const int64_t V = p.vocab;
  const TemperatureScale scale = temperature_scale(t);
  s.z.resize(V);
  s.keys.resize(V);
  float m = -__builtin_inff();
  for (int64_t v = 0; v < V; ++v) {
    s.z[v] = sample_scaled(p, b, node, v, scale);
    s.keys[v] = sample_value_key(s.z[v]);
    if (s.z[v] > m) m = s.z[v];
  }
  uint32_t keep = 0;
  const int64_t top_k = p.top_k[b];
  if (top_k > 0 && top_k < V) {  // value key of the k-th largest (ties counted)
    std::vector<uint32_t> sorted = s.keys;
    std::nth_element(sorted.begin(), sorted.begin() + (top_k - 1), sorted.end(), std::greater<>());
    keep = sorted[top_k - 1];
  }
  uint64_t total = 0;
  for (int64_t v = 0; v < V; ++v)
    if (s.keys[v] >= keep) total += sample_weight(s.z[v], m);
  if (total > 0 && p.top_p[b] < 1.f) {
    const uint64_t drop = top_p_drop_mass(p.top_p[b], total);
    s.by_key.clear();
    for (int64_t v = 0; v < V; ++v)
      if (s.keys[v] >= keep) s.by_key.emplace_back(s.keys[v], sample_weight(s.z[v], m));
    std::sort(s.by_key.begin(), s.by_key.end());
    uint64_t below = 0;
    for (size_t i = 0; i < s.by_key.size();) {  // whole groups of equal value
      size_t j = i;
      uint64_t group = 0;
      while (j < s.by_key.size() && s.by_key[j].first == s.by_key[i].first) group += s.by_key[j++].second;
      if (below + group > drop) {
        keep = s.by_key[i].first;
        break;
      }
      below += group;
      i = j;
    }
    total -= below;
  }
  if (total == 0) return argmax_token(p, b, node);
  const uint64_t target = mulhi64(sample_random64(p.seed[b], p.offset[b], b, node), total);
  uint64_t cum = 0;
  for (int64_t v = 0; v < V; ++v) {
    if (s.keys[v] < keep) continue;
    cum += sample_weight(s.z[v], m);
    if (cum > target) return v;
  }
  return argmax_token(p, b, node);  // unreachable: target < total
}

}  // namespace

void verify_sample_requests(const VerifySampleParams& p, int64_t b_begin, int64_t b_end) {
  Scratch scratch;
  for (int64_t b = b_begin; b < b_end; ++b)
    walk_tree(p.walk, b, true, [&](int64_t node) { return sample_node(p, b, node, scratch); });
}

}  // namespace ddtree::cpu
