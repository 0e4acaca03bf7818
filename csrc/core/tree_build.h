// Optimal draft-tree construction (spec §3): best-first enumeration of the `budget` highest
// scoring prefixes, bit-exact with the published reference (float64 scores with the reference's
// update expressions; ties broken by the lexicographically smallest rank path).
#pragma once

#include "core/common.h"

namespace ddtree {

// Tree nodes of one request: node 0 is the root (the bonus token); node i > 0 has
// parent < i. Padded rows: token 0, parent / first_child / next_sibling -1, depth 0.
struct BuildTreeParams {
  const float* logq = nullptr;         // [B, L, K] log-probs, non-increasing along K
  const int64_t* ids = nullptr;        // [B, L, K] token ids matching logq
  const int64_t* root_tokens = nullptr;  // [B]
  const int64_t* budgets = nullptr;    // [B] per-request budgets (<= budget); null: all `budget`
  int64_t batch = 0, levels = 0, k = 0;  // levels: L draft depths
  int64_t budget = 0;                  // N = budget + 1 rows per request
  int64_t* node_tokens = nullptr;      // [B, N]
  int64_t* parents = nullptr;          // [B, N]
  int64_t* depths = nullptr;           // [B, N]
  int64_t* first_child = nullptr;      // [B, N]
  int64_t* next_sibling = nullptr;     // [B, N]
  int64_t* num_nodes = nullptr;        // [B] (root included)
  // [B, N] log of each node's path probability under the drafter (the root 0, padding -inf):
  // rows come in non-increasing order, so a prefix sum of exp() over rows 1..n is the expected
  // number of accepted draft nodes of the best n-node tree. May be null.
  float* path_logprobs = nullptr;
};

// A candidate prefix: the node it would become hangs under `parent` at `depth` with `rank`.
struct TreeCandidate {
  double score;
  int32_t parent;
  int16_t depth;
  int16_t rank;
};

// Per-request scratch: a heap of at most budget + 1 candidates, and each node's parent / rank
// (for rank-path tie-breaks). Sizes in elements for N = budget + 1.
struct TreeBuildScratch {
  TreeCandidate* heap;
  int32_t* node_parent;
  int16_t* node_rank;
};

// True when `a` pops before `b`: higher score, then lexicographically smaller rank path (a proper
// prefix is smaller). The rank path of a candidate is the ranks of the nodes root..parent, then its
// own. Compared without materialising the paths: the deeper candidate is lifted to the other's
// depth, then both walk up until they hang under the same node; the ranks there decide, and equal
// ranks (the same node) mean one path is a prefix of the other.
DDTREE_HOST_DEVICE bool candidate_before(const TreeBuildScratch& s, const TreeCandidate& a,
                                         const TreeCandidate& b) {
  if (a.score != b.score) return a.score > b.score;
  int32_t pa = a.parent, pb = b.parent;  // position on each path: (parent, rank) at depth d
  int16_t ra = a.rank, rb = b.rank;
  for (int d = a.depth; d > b.depth; --d) {
    ra = s.node_rank[pa];
    pa = s.node_parent[pa];
  }
  for (int d = b.depth; d > a.depth; --d) {
    rb = s.node_rank[pb];
    pb = s.node_parent[pb];
  }
  while (pa != pb) {
    ra = s.node_rank[pa];
    pa = s.node_parent[pa];
    rb = s.node_rank[pb];
    pb = s.node_parent[pb];
  }
  if (ra != rb) return ra < rb;
  return a.depth < b.depth;
}

// Places c at heap position i (the heap's new last entry) of a `arity`-ary heap in s.heap,
// moving the entries it pops before down.
DDTREE_HOST_DEVICE void heap_sift_up(const TreeBuildScratch& s, int64_t i, TreeCandidate c, int arity) {
  while (i > 0) {
    const int64_t up = (i - 1) / arity;
    if (!candidate_before(s, c, s.heap[up])) break;
    s.heap[i] = s.heap[up];
    i = up;
  }
  s.heap[i] = c;
}

// Binary heap of candidates in s.heap (the CPU's queue). candidate_before is a strict total order
// (two candidates are distinct prefixes), so every correct priority queue pops the same sequence:
// the CUDA kernel's 32-ary warp heap builds the same trees.
struct BinaryHeap {
  const TreeBuildScratch& s;
  int64_t size = 0;

  DDTREE_HOST_DEVICE void push(TreeCandidate c) { heap_sift_up(s, size++, c, 2); }

  DDTREE_HOST_DEVICE TreeCandidate pop() {
    const TreeCandidate top = s.heap[0];
    const TreeCandidate last = s.heap[--size];
    int64_t i = 0;
    for (;;) {
      int64_t child = 2 * i + 1;
      if (child >= size) break;
      if (child + 1 < size && candidate_before(s, s.heap[child + 1], s.heap[child])) ++child;
      if (!candidate_before(s, s.heap[child], last)) break;
      s.heap[i] = s.heap[child];
      i = child;
    }
    if (size > 0) s.heap[i] = last;
    return top;
  }
};

// Builds request b's tree (rows 0 .. num_nodes-1 and its child / sibling links); padding rows
// are left to fill_tree_padding. `queue` (push / pop / size) holds the candidates; every thread
// that shares the queue runs this with the same values, and only `writes` stores (the node table
// in `s` included: the queue makes the stores visible before it reads them).
template <class Queue>
DDTREE_HOST_DEVICE void build_tree_request(const BuildTreeParams& p, int64_t b,
                                           const TreeBuildScratch& s, Queue& queue, bool writes) {
  const int64_t n_rows = p.budget + 1;
  const int64_t L = p.levels, K = p.k;
  const float* logq = p.logq + b * L * K;
  const int64_t* ids = p.ids + b * L * K;
  int64_t* tokens = p.node_tokens + b * n_rows;
  int64_t* parents = p.parents + b * n_rows;
  int64_t* depths = p.depths + b * n_rows;
  const int64_t budget = p.budgets ? clamp_index(p.budgets[b], 0, p.budget) : p.budget;

  float* path_logprobs = p.path_logprobs ? p.path_logprobs + b * n_rows : nullptr;
  if (writes) {
    tokens[0] = p.root_tokens[b];
    parents[0] = -1;
    depths[0] = 0;
    if (path_logprobs) path_logprobs[0] = 0.f;
    s.node_parent[0] = -1;
    s.node_rank[0] = 0;
  }
  int64_t n = 0;  // nodes added below the root
  if (budget > 0 && L > 0 && K > 0 && is_candidate_logprob(logq[0]))
    queue.push(TreeCandidate{static_cast<double>(logq[0]), 0, 1, 0});
  while (queue.size > 0 && n < budget) {
    const TreeCandidate c = queue.pop();
    const int64_t node = ++n;
    const int64_t row = (c.depth - 1) * K;
    if (writes) {
      tokens[node] = ids[row + c.rank];
      parents[node] = c.parent;
      depths[node] = c.depth;
      if (path_logprobs) path_logprobs[node] = static_cast<float>(c.score);
      s.node_parent[node] = c.parent;
      s.node_rank[node] = c.rank;
    }
    if (c.rank + 1 < K && is_candidate_logprob(logq[row + c.rank + 1])) {
      const double sibling = c.score - static_cast<double>(logq[row + c.rank]) +
                             static_cast<double>(logq[row + c.rank + 1]);
      queue.push(TreeCandidate{sibling, c.parent, c.depth, static_cast<int16_t>(c.rank + 1)});
    }
    if (c.depth < L && is_candidate_logprob(logq[c.depth * K])) {
      const double child = c.score + static_cast<double>(logq[c.depth * K]);
      queue.push(TreeCandidate{child, static_cast<int32_t>(node), static_cast<int16_t>(c.depth + 1), 0});
    }
  }
  if (!writes) return;
  const int64_t count = n + 1;
  p.num_nodes[b] = count;
  // Children in index order: walk nodes backwards, prepending each to its parent's list.
  int64_t* first_child = p.first_child + b * n_rows;
  int64_t* next_sibling = p.next_sibling + b * n_rows;
  for (int64_t i = 0; i < count; ++i) first_child[i] = -1;
  next_sibling[0] = -1;
  for (int64_t i = count - 1; i >= 1; --i) {
    next_sibling[i] = first_child[parents[i]];
    first_child[parents[i]] = i;
  }
}

// Padding row i (>= num_nodes[b]) of request b.
DDTREE_HOST_DEVICE void fill_tree_padding(const BuildTreeParams& p, int64_t b, int64_t i) {
  const int64_t at = b * (p.budget + 1) + i;
  p.node_tokens[at] = 0;
  p.parents[at] = -1;
  p.depths[at] = 0;
  p.first_child[at] = -1;
  p.next_sibling[at] = -1;
  if (p.path_logprobs) p.path_logprobs[at] = float_from_bits(0xff800000u);  // -inf
}

}  // namespace ddtree
