"""The build itself: CUDA kernels compiled in when asked for, version and error surfaces."""
import os
import shutil

import torch

import ddtree


def test_version_and_build_info():
    from ddtree import _build_info

    assert ddtree.__version__ == "0.1.0"
    assert _build_info.TORCH_VERSION == torch.__version__
    assert ddtree._C.built_with_torch() == torch.__version__
    assert _build_info.WITH_CUDA == ddtree.has_cuda_kernels()


def _cuda_build_expected() -> bool:
    mode = os.environ.get("DDTREE_CUDA", "auto")
    nvcc = shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc")
    return mode == "1" or (mode == "auto" and torch.version.cuda is not None and bool(nvcc))


def test_cuda_kernels_compiled_in_when_possible():
    """`make test` builds the CUDA kernels whenever nvcc and a CUDA torch exist (CI forces it with
    DDTREE_CUDA=1), for sm_80, sm_90, sm_100 and sm_120."""
    from ddtree import _build_info

    assert ddtree.has_cuda_kernels() == _cuda_build_expected()
    if ddtree.has_cuda_kernels() and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        assert _build_info.CUDA_ARCH_LIST == "8.0;9.0;10.0;12.0+PTX"


def test_cuda_implementations_registered_exactly_in_cuda_builds():
    for op in ("ddtree::tree_visibility", "ddtree::tree_attention_mask"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
        assert (
            torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") == ddtree.has_cuda_kernels()
        )
