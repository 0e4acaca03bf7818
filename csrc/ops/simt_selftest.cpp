// ddtree_emu::simt_selftest: runs one SIMT self-test kernel (kernels/simt_selftest.cu), emulated
// for CPU tensors and on the GPU for CUDA tensors. Test-only; see tests/test_ops_simt_emulator.py.
#include <torch/library.h>

#include <climits>
#include <string>
#include <vector>

#include "kernels/launchers.h"
#include "ops/common.h"

namespace ddtree {
namespace {

using at::Tensor;

int64_t arg(const std::vector<int64_t>& args, size_t i, const std::string& name) {
  TORCH_CHECK(args.size() > i, "simt_selftest(", name, "): missing integer argument ", i);
  return args[i];
}

const Tensor& input(const std::vector<Tensor>& inputs, size_t i, const std::string& name) {
  TORCH_CHECK(inputs.size() > i, "simt_selftest(", name, "): missing input tensor ", i);
  return inputs[i];
}

Tensor simt_selftest(const std::string& name, const std::vector<Tensor>& inputs_in,
                     const std::vector<int64_t>& args, Backend backend) {
  std::vector<Tensor> inputs;
  for (const Tensor& t : inputs_in) inputs.push_back(t.contiguous());
  TORCH_CHECK(!inputs.empty() || !args.empty(), "simt_selftest: needs inputs or arguments");
  const at::TensorOptions opts =
      inputs.empty() ? at::TensorOptions(backend == Backend::kCuda ? at::kCUDA : at::kCPU)
                     : inputs[0].options();
  SelftestParams p;
  Tensor out;
  if (name == "warp_ops") {
    p.kind = static_cast<int>(SelftestKind::kWarpOps);
    p.threads = static_cast<int>(arg(args, 0, name));
    out = at::zeros({p.threads, 11}, opts.dtype(at::kInt));
  } else if (name == "block_reduce") {
    p.kind = static_cast<int>(SelftestKind::kBlockReduce);
    p.threads = static_cast<int>(arg(args, 0, name));
    p.n = input(inputs, 0, name).size(0);
    p.m = inputs[0].size(1);
    out = at::zeros({p.n}, opts.dtype(at::kFloat));
  } else if (name == "atomics") {
    p.kind = static_cast<int>(SelftestKind::kAtomics);
    p.m = arg(args, 0, name);
    p.threads = static_cast<int>(arg(args, 1, name));
    p.n = input(inputs, 0, name).numel();
    out = at::zeros({p.m + 4}, opts.dtype(at::kInt));
    out[p.m] = INT_MIN;
    out[p.m + 1] = INT_MAX;
  } else if (name == "mma" || name == "ldmatrix_mma") {
    p.kind = static_cast<int>(name == "mma" ? SelftestKind::kMma : SelftestKind::kLdmatrixMma);
    const Tensor& a = input(inputs, 0, name);
    TORCH_CHECK(a.scalar_type() == at::kBFloat16 || a.scalar_type() == at::kHalf,
                "simt_selftest(mma): A must be bf16 or fp16");
    p.bf16 = a.scalar_type() == at::kBFloat16;
    p.n = a.size(0);
    p.in1 = input(inputs, 1, name).data_ptr();
    p.in2 = input(inputs, 2, name).data_ptr();
    out = at::zeros({p.n, 16, 8}, opts.dtype(at::kFloat));
  } else if (name == "ldmatrix") {
    p.kind = static_cast<int>(SelftestKind::kLdmatrix);
    p.num = static_cast<int>(arg(args, 0, name));
    p.trans = arg(args, 1, name) != 0;
    TORCH_CHECK(p.num == 1 || p.num == 2 || p.num == 4, "simt_selftest(ldmatrix): num is 1, 2, 4");
    out = at::zeros({32, 4}, opts.dtype(at::kInt));
  } else if (name == "barrier_deadlock" || name == "warp_exit" || name == "shared_race") {
    p.kind = static_cast<int>(name == "barrier_deadlock" ? SelftestKind::kBarrierDeadlock
                              : name == "warp_exit"      ? SelftestKind::kWarpExit
                                                         : SelftestKind::kSharedRace);
    p.threads = static_cast<int>(arg(args, 0, name));
    p.n = arg(args, 1, name);
    out = at::zeros({p.threads}, opts.dtype(at::kInt));
  } else if (name == "cp_async") {
    p.kind = static_cast<int>(SelftestKind::kCpAsync);
    p.threads = static_cast<int>(arg(args, 0, name));
    p.n = arg(args, 1, name);
    TORCH_CHECK(input(inputs, 0, name).numel() == 8 * p.threads &&
                    inputs[0].scalar_type() == at::kInt,
                "simt_selftest(cp_async): input must be int32 with 8 * threads elements");
    out = at::zeros({p.threads, 12}, opts.dtype(at::kInt));
  } else if (name == "smem_overflow") {
    p.kind = static_cast<int>(SelftestKind::kSmemOverflow);
    p.threads = static_cast<int>(arg(args, 0, name));
    p.n = arg(args, 1, name);
    p.smem_bytes = arg(args, 2, name);
    out = at::zeros({1}, opts.dtype(at::kInt));
  } else {
    TORCH_CHECK(false, "simt_selftest: unknown test '", name, "'");
  }
  if (!inputs.empty()) p.in0 = inputs[0].data_ptr();
  p.out = out.data_ptr();
  const std::string op = "simt_selftest(" + name + ")";
  auto gpu = DDTREE_GPU_LAUNCHER(launch_simt_selftest);
  launch_on_device(op.c_str(), backend, out, [&](void* stream) {
    return backend == Backend::kEmulated ? emulated::launch_simt_selftest(p, stream)
                                         : gpu(p, stream);
  });
  return out;
}

Tensor simt_selftest_emulated(c10::string_view name, const std::vector<Tensor>& inputs,
                              c10::IntArrayRef args) {
  return simt_selftest(std::string(name), inputs, args.vec(), Backend::kEmulated);
}

#ifdef DDTREE_WITH_CUDA
Tensor simt_selftest_cuda(c10::string_view name, const std::vector<Tensor>& inputs,
                          c10::IntArrayRef args) {
  return simt_selftest(std::string(name), inputs, args.vec(), Backend::kCuda);
}
#endif

}  // namespace

TORCH_LIBRARY_IMPL(ddtree_emu, CPU, m) { m.impl("simt_selftest", &simt_selftest_emulated); }

#ifdef DDTREE_WITH_CUDA
TORCH_LIBRARY_IMPL(ddtree_emu, CUDA, m) { m.impl("simt_selftest", &simt_selftest_cuda); }
#endif

}  // namespace ddtree
