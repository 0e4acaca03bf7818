#include "ops/common.h"

#include <atomic>
#include <stdexcept>

#ifdef DDTREE_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#endif

namespace ddtree {
namespace {
std::atomic<bool> g_validation{true};
}

bool validation_enabled() { return g_validation.load(); }
void set_validation(bool on) { g_validation.store(on); }

bool should_validate_values(const at::Tensor& t) {
  if (!validation_enabled()) return false;
#ifdef DDTREE_WITH_CUDA
  if (t.is_cuda() &&
      c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None)
    return false;
#endif
  return true;
}

at::Tensor host_view(const at::Tensor& t) { return t.is_cpu() ? t.contiguous() : t.cpu(); }

void check_index_tensor(const char* op, const char* name, const at::Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kInt || t.scalar_type() == at::kLong, op, ": ", name,
              " must be int32 or int64, got ", t.scalar_type());
}

void check_same_device(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& like) {
  TORCH_CHECK(t.device() == like.device(), op, ": ", name, " must be on ", like.device(),
              " like the other inputs, got ", t.device());
}

int launch_on_device(const char* op, Backend backend, const at::Tensor& on,
                     const std::function<int(void*)>& launch) {
  if (backend == Backend::kEmulated) {
    TORCH_CHECK(on.is_cpu(), op, ": the emulated kernel runs on CPU tensors, got ", on.device());
    try {
      return launch(nullptr);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, op, ": emulated CUDA kernel failed: ", e.what());
    }
  }
#ifdef DDTREE_WITH_CUDA
  TORCH_CHECK(on.is_cuda(), op, ": expected CUDA tensors, got ", on.device());
  c10::cuda::CUDAGuard guard(on.device());
  const int rc = launch(c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(rc == 0, op, ": CUDA kernel launch failed: ",
              cudaGetErrorString(static_cast<cudaError_t>(rc)));
  return rc;
#else
  TORCH_CHECK(false, op, ": ddtree was built without CUDA kernels (CPU-only build)");
#endif
}

}  // namespace ddtree
