"""bench/kernel_resources.py's pieces that do not need nvcc: the occupancy arithmetic against the
architectures' published limits, the kernel-name parsing, and the launch-shape registry against
the kernel sources. (The compiler check itself runs as `make kernel-resources` in CI.)"""
import re
import sys
from pathlib import Path

import pytest

from ddtree import _C

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import kernel_resources as kr  # noqa: E402


@pytest.mark.parametrize("arch, threads, regs, smem, blocks, warps, limiter", [
    # 64K registers per SM: 128 threads x 128 registers = 16K per block -> 4 blocks.
    (90, 128, 128, 0, 4, 16, "registers"),
    # 255 registers round up to 256 per thread: 8 warps per SM, whatever the block shape.
    (90, 128, 255, 0, 2, 8, "registers"),
    (120, 256, 255, 0, 1, 8, "registers"),
    # Warp limits: 64 warps per SM on sm_90, 48 on sm_120.
    (90, 256, 32, 0, 8, 64, "warps"),
    (120, 256, 32, 0, 6, 48, "warps"),
    # Shared memory: 228 KiB per SM on sm_90, 100 KiB on sm_120, plus 1 KiB per block.
    (90, 128, 32, 100 * 1024, 2, 8, "shared memory"),
    (120, 128, 32, 48 * 1024, 2, 8, "shared memory"),
    (120, 128, 32, 50 * 1024, 1, 4, "shared memory"),
    (120, 128, 32, 100 * 1024, 0, 0, "shared memory"),  # over the 99 KiB a block may have
    # 32 resident blocks at most.
    (90, 32, 16, 0, 32, 32, "blocks"),
])
def test_occupancy_follows_the_architecture_limits(arch, threads, regs, smem, blocks, warps, limiter):
    assert kr.occupancy(kr.ARCHS[arch], threads, regs, smem) == (blocks, warps, limiter)


def test_kernel_names_are_shortened_to_name_and_template_arguments():
    assert kr.short_name("void ddtree::gpu::(anonymous namespace)::tree_attention_kernel<128, false>"
                         "(ddtree::TreeAttentionParams)") == "tree_attention_kernel<128, false>"
    assert kr.short_name("ddtree::gpu::(anonymous namespace)::build_tree_kernel(ddtree::BuildTreeParams)") \
        == "build_tree_kernel"
    assert kr.short_name("void ddtree::gpu::(anonymous namespace)::commit_kv_kernel<unsigned short>"
                         "(ddtree::CommitKvParams)") == "commit_kv_kernel<unsigned short>"


def test_every_launch_shape_names_a_kernel_of_the_sources():
    sources = "".join(p.read_text() for p in (ROOT / "csrc" / "kernels").glob("*.cu"))
    defined = set(re.findall(r"__global__ void (?:__launch_bounds__\([^)]*\)\s*)?(\w+)\(", sources))
    shapes = _C.kernel_shapes()
    assert len(shapes) >= 30
    for kernel, threads, smem, _ in shapes:
        assert kernel.split("<")[0] in defined, kernel
        assert threads % 32 == 0 and 32 <= threads <= 1024, (kernel, threads)
        assert smem < 99 * 1024, (kernel, smem)  # fits an sm_120 block
    named = {k.split("<")[0] for k, *_ in shapes}
    launched = defined - {"warp_ops_kernel", "block_reduce_kernel", "atomics_kernel", "mma_kernel",
                          "ldmatrix_mma_kernel", "ldmatrix_kernel", "barrier_deadlock_kernel",
                          "smem_overflow_kernel", "shared_race_kernel", "warp_exit_kernel",
                          "cp_async_kernel"}  # the emulator's self-test kernels
    assert named == launched


def test_attention_tiles_fit_two_blocks_per_sm_on_sm120():
    """The shared-memory half of the occupancy floor, from the launchers' own sizes."""
    for kernel, threads, smem, _ in _C.kernel_shapes():
        if "attention_kernel<" in kernel:  # 1 register: only shared memory can limit
            blocks, _, _ = kr.occupancy(kr.ARCHS[120], threads, 1, smem)
            assert blocks >= 2, (kernel, smem)
