"""The SIMT emulator's primitives, each against values derived from the CUDA / PTX semantics.

The self-test kernels (csrc/kernels/simt_selftest.cu) run emulated on CPU tensors and on the GPU
for CUDA tensors, so the same expectations check both.
"""
import os

import pytest
import torch

import ddtree
from helpers import KERNEL_BACKENDS, kernel_device

selftest = torch.ops.ddtree_emu.simt_selftest
NONE = [torch.empty(0, dtype=torch.int32)]  # picks the CPU (emulated) implementation


def _to_i32(v: int) -> int:
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def expected_warp_ops(x):
    out = []
    for tid, v in enumerate(x):
        w, lane = divmod(tid, 32)
        base = w * 32

        def at(l):
            return x[base + l]

        ballot = sum(1 << l for l in range(32) if at(l) & 1)
        row = [
            at(31 - lane),
            at((lane & ~7) + 3),
            at(lane - 1) if lane >= 1 else v,
            at(lane + 3) if lane + 3 < 32 else v,
            at(lane ^ 5),
            at(lane - 16) if lane >= 16 else v,  # xor 16 at width 16: only earlier segments
            _to_i32(ballot),
            int(any(at(l) > 1000 for l in range(32))),
            int(all(at(l) >= 0 for l in range(32))),
            at(lane ^ 2),
            (at(lane + 1) if lane + 1 < 16 else v) if lane < 16 else (at(lane - 2) if lane >= 18 else v),
        ]
        out.append(row)
    return torch.tensor(out, dtype=torch.int32)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("threads", [32, 96])
def test_warp_shuffles_votes_and_syncwarp(backend, threads):
    g = torch.Generator().manual_seed(threads)
    x = torch.randint(0, 2000, (threads,), generator=g, dtype=torch.int32)
    got = selftest("warp_ops", [x.to(kernel_device(backend))], [threads]).cpu()
    torch.testing.assert_close(got, expected_warp_ops(x.tolist()), rtol=0, atol=0)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("threads", [32, 128, 256])
def test_block_reduction_static_and_dynamic_shared_memory(backend, threads):
    g = torch.Generator().manual_seed(threads)
    x = torch.randn(5, 1000, generator=g)
    got = selftest("block_reduce", [x.to(kernel_device(backend))], [threads]).cpu()
    torch.testing.assert_close(got, x.double().sum(1).float(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_atomics(backend):
    g = torch.Generator().manual_seed(3)
    v = torch.randint(0, 10000, (1000,), generator=g, dtype=torch.int32)
    bins = 7
    got = selftest("atomics", [v.to(kernel_device(backend))], [bins, 128]).cpu()
    vals = v.tolist()
    hist = torch.bincount(v.long() % bins, minlength=bins).tolist()
    bits = 0
    for a in vals:
        bits |= 1 << (a % 31)
    expected = hist + [max(vals), min(vals), _to_i32(bits), sum(vals)]
    assert got.tolist() == expected


def _tiles(dtype, tiles, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(tiles, 16, 16, generator=g).to(dtype)
    b = torch.randn(tiles, 16, 8, generator=g).to(dtype)
    c = torch.randn(tiles, 16, 8, generator=g)
    return a, b, c


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["mma", "ldmatrix_mma"])
def test_mma_m16n8k16_matches_matmul(backend, dtype, name):
    a, b, c = _tiles(dtype, 6, seed=11)
    dev = kernel_device(backend)
    got = selftest(name, [a.to(dev), b.to(dev), c.to(dev)], []).cpu()
    expected = torch.bmm(a.double(), b.double()) + c.double()
    # Products of 16-bit inputs are exact in fp32; only the fp32 accumulation order differs.
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("num", [1, 2, 4])
@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_fragment_layout(backend, num, trans):
    g = torch.Generator().manual_seed(num * 2 + trans)
    m = torch.randint(0, 1 << 16, (32, 8), generator=g, dtype=torch.int64)
    got = selftest("ldmatrix", [m.to(torch.int16).to(kernel_device(backend))], [num, int(trans)])
    got = got.cpu().tolist()
    for lane in range(32):
        grp, t = divmod(lane, 4)
        for k in range(4):
            if k >= num:
                assert got[lane][k] == 0
                continue
            if trans:  # rows 2t, 2t+1 of column g
                lo, hi = m[k * 8 + 2 * t, grp], m[k * 8 + 2 * t + 1, grp]
            else:  # row g, columns 2t, 2t+1
                lo, hi = m[k * 8 + grp, 2 * t], m[k * 8 + grp, 2 * t + 1]
            assert got[lane][k] == _to_i32(int(lo) | (int(hi) << 16)), (lane, k)


def test_syncthreads_not_reached_by_all_threads_is_reported():
    switches = ddtree._C.emulator_context_switches()
    with pytest.raises(RuntimeError, match=r"deadlock .*__syncthreads\(\) reached by 40 threads, "
                                           r"24 threads exited"):
        selftest("barrier_deadlock", NONE, [64, 40])
    assert ddtree._C.emulator_context_switches() > switches
    # Every thread reaching the barrier is fine.
    assert selftest("barrier_deadlock", NONE, [64, 64]).tolist() == [1] * 64


def test_lane_exiting_during_warp_collective_is_reported():
    with pytest.raises(RuntimeError, match="exited while lanes .* __shfl_xor_sync"):
        selftest("warp_exit", NONE, [32, 16])
    got = selftest("warp_exit", NONE, [32, 32]).tolist()
    assert got == [lane ^ 1 for lane in range(32)]


def test_dynamic_shared_memory_overflow_is_reported():
    assert selftest("smem_overflow", NONE, [32, 64, 256]).tolist() == [0]
    with pytest.raises(RuntimeError, match="wrote past the end of its 256 bytes of dynamic shared"):
        selftest("smem_overflow", NONE, [32, 65, 256])


def test_dynamic_shared_memory_request_above_limit_is_rejected():
    limit = ddtree._C.emulator_max_dynamic_smem()
    assert limit == 99 * 1024
    with pytest.raises(RuntimeError, match=f"above the {limit}-byte per-block limit"):
        selftest("smem_overflow", NONE, [32, 1, limit + 16])


def test_invalid_block_shape_is_rejected():
    with pytest.raises(RuntimeError, match="invalid block"):
        selftest("warp_ops", [torch.zeros(2048, dtype=torch.int32)], [2048])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("threads", [32, 96])
def test_cp_async_groups_land_after_wait(backend, threads):
    x = torch.arange(8 * threads, dtype=torch.int32) * 7 + 3
    got = selftest("cp_async", [x.to(kernel_device(backend))], [threads, 0]).cpu()
    first = x[: 4 * threads].view(threads, 4)
    second = x[4 * threads:].view(threads, 4)
    assert torch.equal(got[:, 4:8], first)  # own group 0 after wait_group 1
    assert torch.equal(got[:, 8:12], second.roll(-1, 0))  # neighbour's group 1 after wait + barrier
    if backend == "emulated":
        # The emulator delays copies to the wait, so a read before it sees the old contents: a
        # kernel that forgets the wait fails its tests here instead of racing on a GPU.
        assert torch.equal(got[:, :4], torch.full((threads, 4), -1, dtype=torch.int32))


def test_cp_async_misuse_is_reported():
    x = torch.zeros(8 * 32, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="exited with cp.async copies it never waited for"):
        selftest("cp_async", [x], [32, 1])
    with pytest.raises(RuntimeError, match="16-byte aligned"):
        selftest("cp_async", [x], [32, 2])


def test_shared_race_kernel_with_a_barrier_reads_its_neighbour():
    out = selftest("shared_race", NONE, [64, 1])
    assert out.tolist() == [t ^ 1 for t in range(64)]


RACE_PROBE = """
import torch
import ddtree  # registers the ops
out = torch.ops.ddtree_emu.simt_selftest("shared_race", [torch.empty(0, dtype=torch.int32)],
                                         [64, {barrier}])
print("values", out.tolist() == [t ^ 1 for t in range(64)])
"""


@pytest.mark.skipif(os.environ.get("DDTREE_RACE_DETECTOR") != "1",
                    reason="runs under make test-tsan (the race detector's build)")
@pytest.mark.parametrize("barrier", [0, 1])
def test_race_detector_reports_a_planted_shared_memory_race(barrier):
    """The emulator's race detector (make test-tsan) on a planted race: thread t writes shared slot
    t and reads slot t ^ 1 with no barrier between -> a ThreadSanitizer data race naming the
    kernel's lines; the same kernel with __syncthreads between -> no report."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", RACE_PROBE.format(barrier=barrier)],
                         capture_output=True, text=True, env=dict(os.environ), timeout=300)
    if barrier:
        assert run.returncode == 0 and "values True" in run.stdout, run.stderr[-2000:]
        assert "data race" not in run.stderr
    else:
        assert run.returncode != 0
        assert "WARNING: ThreadSanitizer: data race" in run.stderr
        assert "shared_race_kernel" in run.stderr and "simt_selftest.cu" in run.stderr
