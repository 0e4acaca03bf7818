"""The build itself: CUDA kernels compiled in when asked for, version and error surfaces."""
import os
import sys
from pathlib import Path

import torch

import ddtree

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from cuda_toolkit import find_cuda_home  # noqa: E402


def test_build_facts_come_from_the_extension():
    assert ddtree.__version__ == "0.1.0"
    assert (ddtree._C.cuda_arch_list() != "") == ddtree.has_cuda_kernels()
    root = Path(ddtree.__file__).parent
    assert not (root / "_build_info.py").exists(), "setup.py must not write into the source tree"


def _cuda_build_expected() -> bool:
    mode = os.environ.get("DDTREE_CUDA", "auto")
    return mode == "1" or (mode == "auto" and torch.version.cuda is not None and find_cuda_home() is not None)


def test_cuda_kernels_compiled_in_when_possible():
    """`make test` builds the CUDA kernels whenever nvcc and a CUDA torch exist (CI forces it with
    DDTREE_CUDA=1), for sm_80, sm_90, sm_100 and sm_120."""
    assert ddtree.has_cuda_kernels() == _cuda_build_expected()
    if ddtree.has_cuda_kernels() and "TORCH_CUDA_ARCH_LIST" not in os.environ:
        assert ddtree._C.cuda_arch_list() == "8.0;9.0;10.0;12.0+PTX"


def test_cuda_implementations_registered_exactly_in_cuda_builds():
    for op in ("ddtree::tree_visibility", "ddtree::tree_attention_mask"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CPU")
        assert (
            torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") == ddtree.has_cuda_kernels()
        )
