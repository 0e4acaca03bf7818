// Launchers of every kernel, in both builds of the kernel sources: ddtree::gpu (nvcc, real CUDA)
// and ddtree::emulated (host compiler + SIMT emulator). `stream` is a cudaStream_t (ignored when
// emulated). They return the cudaError_t of the launch as an int (0 = success); the emulated
// ones throw simt::Error on a kernel fault.
#pragma once

#include "core/simt_selftest.h"
#include "core/tree_visibility.h"

#define DDTREE_DECLARE_LAUNCHERS                                                 \
  int launch_tree_visibility(const ::ddtree::TreeVisibilityParams& p, void* stream); \
  int launch_simt_selftest(const ::ddtree::SelftestParams& p, void* stream);

namespace ddtree {
namespace gpu {
DDTREE_DECLARE_LAUNCHERS
}
namespace emulated {
DDTREE_DECLARE_LAUNCHERS
}
}  // namespace ddtree
