// CPU implementations of build_tree, verify_greedy and commit_kv_ over ranges of requests /
// (request, head) slices (framework-free; the op adapters parallelise them).
#pragma once

#include "core/kv_commit.h"
#include "core/tree_build.h"
#include "core/tree_verify.h"

namespace ddtree::cpu {

void build_tree_requests(const BuildTreeParams& p, int64_t b_begin, int64_t b_end);
void verify_greedy_requests(const VerifyGreedyParams& p, int64_t b_begin, int64_t b_end);
// Slices [begin, end) of the flattened [num_caches * B * H] (cache, request, head) space.
void commit_kv_slices(const CommitKvParams& p, int64_t begin, int64_t end);

}  // namespace ddtree::cpu
