// The ddtree._C Python module: build facts and global switches. Ops are reached through
// torch.ops.ddtree.* (registered in registration.cpp and ops/).
#include <torch/extension.h>

#include "core/tree_sample.h"
#include "cpu/vector_math.h"
#include "kernels/launchers.h"
#include "ops/common.h"
#include "simt/runtime.h"

#ifndef DDTREE_TORCH_VERSION
#define DDTREE_TORCH_VERSION "unknown"
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ddtree native extension";
  m.def("has_cuda_kernels", [] {
#ifdef DDTREE_WITH_CUDA
    return true;
#else
    return false;
#endif
  });
  m.def("built_with_torch", [] { return std::string(DDTREE_TORCH_VERSION); });
  m.def("cpu_isa", [] {
    switch (ddtree::cpu::cpu_isa()) {
      case ddtree::cpu::CpuIsa::kAvx512:
        return std::string("avx512");
      case ddtree::cpu::CpuIsa::kAvx2:
        return std::string("avx2");
      default:
        return std::string("baseline");
    }
  }, "The instruction set the CPU ops' hot loops run on (avx512, avx2 or baseline)");
  m.def("cuda_arch_list", [] {
#ifdef DDTREE_CUDA_ARCH_LIST
    return std::string(DDTREE_CUDA_ARCH_LIST);
#else
    return std::string();
#endif
  }, "TORCH_CUDA_ARCH_LIST the CUDA kernels were compiled for (empty in a CPU-only build)");
  m.def("set_validation", &ddtree::set_validation, "Turn value checks of op inputs on or off");
  m.def("validation_enabled", &ddtree::validation_enabled);
  m.def("mma_attention_supports", &ddtree::mma_attention_supports,
        "Whether the CUDA attention kernels take this dtype and head_dim");
  m.def("emulator_context_switches", &ddtree::simt::context_switches);
  m.def("emulator_grids_run", &ddtree::simt::grids_run);
  m.def("set_emulator_max_dynamic_smem",
        [](size_t bytes) { ddtree::simt::options().max_dynamic_smem = bytes; });
  m.def("emulator_max_dynamic_smem", [] { return ddtree::simt::options().max_dynamic_smem; });
  m.def("quantise_weight", &ddtree::quantise_weight,
        "verify_sample's token weight round(e * 2^44) of e = exp(z - max) in [0, 1]");
  m.def("sample_exp", &ddtree::sample_exp, "verify_sample's e^x (x <= 0), the same bits in every build");
  m.def("scaled_logit_fma", [](float x, float t) {
    return ddtree::scaled_logit_fma(x, ddtree::temperature_scale(t));
  }, "x / T as the GPU computes it (reciprocal + fma), on the host");
  m.def("kernel_shapes", [] {
    std::vector<std::tuple<std::string, int, size_t, std::string>> rows;
    for (const auto& s : ddtree::emulated::kernel_shapes())
      rows.emplace_back(s.kernel, s.threads, s.dynamic_smem, s.at);
    return rows;
  }, "(kernel, threads per block, dynamic shared memory bytes, problem size) of every CUDA launch");
  m.def("attention_splits",
        [](int64_t requested, int64_t batch, int64_t rows, int64_t hq, int64_t hkv, int64_t max_keys,
           int64_t sm_count) {
          return ddtree::choose_attention_splits(
              requested, batch, ddtree::attention_blocks_per_request(rows, hq, hkv), max_keys,
              sm_count);
        },
        "Key splits the attention kernels use (requested 0 = automatic) for a launch shape");
}
