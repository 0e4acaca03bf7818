// CPU implementation of verify_sample over a range of requests (integer-exact, see
// core/tree_sample.h: it returns the same tokens as the emulated CUDA kernel).
#pragma once

#include "core/tree_sample.h"

namespace ddtree::cpu {

void verify_sample_requests(const VerifySampleParams& p, int64_t b_begin, int64_t b_end);

}  // namespace ddtree::cpu
