// Shared pieces of the ATen adapters: backends, argument checks, kernel launch + error mapping.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include <functional>

namespace ddtree {

// Where an op's work runs. kEmulated runs the CUDA kernel source on the CPU through the SIMT
// emulator (the ddtree_emu library's CPU implementations).
enum class Backend { kCpu, kCuda, kEmulated };

// Value checks that need the data (e.g. parent < own index) cost a device-to-host copy on CUDA:
// they run when validation is on (the default) and the current stream is not being captured
// into a CUDA graph.
bool validation_enabled();
void set_validation(bool on);
bool should_validate_values(const at::Tensor& t);

// Host copy for value checks (no-op on CPU).
at::Tensor host_view(const at::Tensor& t);

void check_index_tensor(const char* op, const char* name, const at::Tensor& t);
void check_same_device(const char* op, const char* name, const at::Tensor& t,
                       const at::Tensor& like);

template <class Params>
using Launcher = int (*)(const Params&, void*);

// Launches a kernel on `on`'s device: real CUDA (current stream) or the emulator.
int launch_on_device(const char* op, Backend backend, const at::Tensor& on,
                     const std::function<int(void*)>& launch);

}  // namespace ddtree

#ifdef DDTREE_WITH_CUDA
#define DDTREE_GPU_LAUNCH(fn, params, stream) ::ddtree::gpu::fn(params, stream)
#else
#define DDTREE_GPU_LAUNCH(fn, params, stream) ((void)(params), (void)(stream), -1)
#endif
