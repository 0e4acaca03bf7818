"""tree_attention against SDPA with an explicit dense mask (reference.py), with FlashAttention's
rule: error <= 2 x (PyTorch's own error at the same precision) + a rounding floor; the mma.sync
CUDA kernel emulated; awkward sizes; opcheck; bad input."""
import pytest
import torch

from ddtree.ops import reference
from helpers import KERNEL_BACKENDS, kernel_device

ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def random_tree(g, n):
    parents = torch.tensor([[-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)]])
    return parents


def case(seed, batch=2, n=20, hq=4, hkv=2, d=64, past=(37, 0), dtype=torch.bfloat16, extra=3):
    g = torch.Generator().manual_seed(seed)
    parents = torch.cat([random_tree(g, n) for _ in range(batch)])
    counts = torch.full((batch,), n)
    vis = torch.ops.ddtree.tree_visibility(parents, counts, torch.zeros(batch, dtype=torch.long))
    s = max(past) + n + extra
    q = torch.randn(batch, n, hq, d, generator=g)
    k = torch.randn(batch, hkv, s, d, generator=g)
    v = torch.randn(batch, hkv, s, d, generator=g)
    return [t.to(dtype) for t in (q, k, v)] + [torch.tensor(past), vis[1], vis[0]]


def same_skew(x, dev):
    """x on `dev` with its storage offset modulo 16 bytes and its strides kept."""
    if x.device == torch.device(dev):
        return x
    skew = (x.data_ptr() % 16) // x.element_size()
    flat = torch.empty(x.untyped_storage().nbytes() // x.element_size() + 16, dtype=x.dtype, device=dev)
    out = flat[skew:].as_strided(x.shape, x.stride())
    return out.copy_(x)


def check(backend, c, scale=None, num_splits=None):
    q, k, v, past, packed, visible = c
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    ops = torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree
    got = ops.tree_attention(q.to(dev), same_skew(k, dev), same_skew(v, dev), past.to(dev),
                             packed.to(dev), scale, None, num_splits).cpu()
    truth = reference.tree_attention(q.double(), k.double(), v.double(), past, visible, scale)
    torch_own = reference.tree_attention(q, k, v, past, visible, scale)
    torch_err = (torch_own.double() - truth).abs().max().item()
    floor = 2 * torch.finfo(q.dtype).eps * truth.abs().max().item()
    err = (got.double() - truth).abs().max().item()
    assert got.dtype == q.dtype and got.shape == q.shape
    assert err <= 2 * torch_err + floor, (err, torch_err, floor)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_dense_mask_sdpa(backend, dtype):
    check(backend, case(0, dtype=dtype))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("shape", [dict(n=1, past=(5, 9)), dict(n=17, hq=2, hkv=2), dict(n=33, past=(0, 0)),
                                   dict(n=16, d=128, hq=2, hkv=1), dict(n=5, d=256, hq=1, hkv=1, past=(16, 1))],
                         ids=["N1", "N17-MHA", "N33-past0", "D128", "D256"])
def test_awkward_sizes(backend, shape):
    check(backend, case(1, **shape))


def test_cpu_float32_and_long_context():
    check("cpu", case(2, dtype=torch.float32, d=48))  # the CPU path takes any D and fp32
    check("cpu", case(3, n=24, past=(3000, 1500), hq=8, hkv=2))
    check("cpu", case(4, n=12), scale=0.3)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_emulated_long_prefix_many_chunks(backend):
    check(backend, case(5, batch=1, n=9, hq=2, hkv=1, past=(190,)))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("splits", [2, 3, 7, 64])
def test_split_over_keys(backend, splits):
    """Key ranges computed by separate blocks and merged by log-sum-exp (flash-decoding): ranges
    cutting the prefix, the tree block and padding; more splits than key chunks (empty splits);
    requests of different lengths in one launch."""
    check(backend, case(10, batch=2, n=20, hq=4, hkv=2, past=(150, 9)), num_splits=splits)


def misaligned(t):
    """The same values in storage starting 2 bytes past a 16-byte boundary (no cp.async)."""
    flat = torch.empty(t.numel() + 8, dtype=t.dtype)
    out = flat[1: 1 + t.numel()].view(t.shape)
    out.copy_(t)
    assert out.data_ptr() % 16 != 0
    return out


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_misaligned_or_strided_kv_takes_the_synchronous_copy_path(backend):
    q, k, v, past, packed, visible = case(12, n=18, past=(40, 3))
    check(backend, [q, misaligned(k), misaligned(v), past, packed, visible], num_splits=2)
    # K / V as views whose token stride is not a multiple of 8 elements (still D-contiguous).
    wide_k = torch.zeros(*k.shape[:3], k.shape[3] + 4, dtype=k.dtype)
    wide_v = torch.zeros_like(wide_k)
    wide_k[..., : k.shape[3]] = k
    wide_v[..., : k.shape[3]] = v
    check(backend, [q, wide_k[..., : k.shape[3]], wide_v[..., : k.shape[3]], past, packed, visible])


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_long_context_batch1_splits_automatically(backend):
    # One block of work per request: the automatic plan splits the 700 keys (>= 256 per split).
    check(backend, case(11, batch=1, n=7, hq=2, hkv=1, past=(700,), dtype=torch.float16))


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    q, k, v, past, packed, _ = case(6, n=5)
    op = getattr(torch.ops, namespace).tree_attention.default
    torch.library.opcheck(op, (q, k, v, past, packed, None))
    torch.library.opcheck(op, (q, k, v, past, packed, None, None, 3))


def test_bad_input():
    q, k, v, past, packed, _ = case(7)
    op = torch.ops.ddtree.tree_attention
    with pytest.raises(RuntimeError, match="must be a multiple of the KV heads Hkv = 3"):
        op(q, k.repeat(1, 2, 1, 1)[:, :3], v.repeat(1, 2, 1, 1)[:, :3], past, packed)
    with pytest.raises(RuntimeError, match=r"past_len \+ N must fit the cache"):
        op(q, k, v, past + 10, packed)
    with pytest.raises(RuntimeError, match=r"packed must be int32 \[B, N, ceil\(N/32\)\]"):
        op(q, k, v, past, packed.long())
    with pytest.raises(RuntimeError, match="must share one dtype"):
        op(q, k.half(), v, past, packed)
    with pytest.raises(RuntimeError, match=r"q must be a 4-D tensor \[B, N, Hq, D\]"):
        op(q[0], k, v, past, packed)
    emu = torch.ops.ddtree_emu.tree_attention
    with pytest.raises(RuntimeError, match="head_dim D = 48 is not supported by the CUDA kernel"):
        c = case(8, d=48)
        emu(*c[:5])
    with pytest.raises(RuntimeError, match="takes bfloat16 or float16"):
        emu(q.float(), k.float(), v.float(), past, packed)
    for bad in (0, 65):
        with pytest.raises(RuntimeError, match=r"num_splits must be in \[1, 64\]"):
            emu(q, k, v, past, packed, None, None, bad)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("past,prefix", [((30, 30), (30, 12)), ((300, 300), (3, 290))],
                         ids=["short", "whole-padding-blocks"])
def test_per_request_prefix_length(backend, past, prefix):
    """Rows between a request's valid prefix and the shared tree start are invisible (the CPU
    path skips key blocks made only of such rows)."""
    q, k, v, past, packed, visible = case(9, past=past)
    prefix = torch.tensor(prefix)
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    ops = torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree
    got = ops.tree_attention(q.to(dev), k.to(dev), v.to(dev), past.to(dev), packed.to(dev), None,
                             prefix.to(dev)).cpu()
    truth = reference.tree_attention(q.double(), k.double(), v.double(), past, visible, None, prefix)
    own = reference.tree_attention(q, k, v, past, visible, None, prefix)
    floor = 2 * torch.finfo(q.dtype).eps * truth.abs().max().item()
    assert (got.double() - truth).abs().max() <= 2 * (own.double() - truth).abs().max() + floor


def test_automatic_split_plan():
    """The documented rule (core/tree_attention.h): two blocks per SM, no split under 256 keys,
    at most 64, gridDim.z = B * splits <= 65535; an explicit num_splits is kept (capped)."""
    import ddtree

    plan = ddtree._C.attention_splits
    # (requested, B, rows, Hq, Hkv, max keys, SMs)
    assert plan(0, 1, 7, 2, 1, 710, 8) == 2      # the emulated batch-1 test above: 16 by fill, 2 by keys
    assert plan(0, 1, 65, 32, 8, 32833, 132) == 7  # H200, budget 64: 40 blocks -> ceil(264 / 40)
    assert plan(0, 64, 65, 32, 8, 32833, 132) == 1  # the batch fills the GPU already
    assert plan(0, 1, 65, 32, 8, 300, 132) == 1     # too few keys to split
    assert plan(0, 1, 16, 1, 1, 10 ** 6, 132) == 64  # capped
    assert plan(5, 1, 16, 1, 1, 100, 132) == 5      # explicit
    assert plan(64, 2000, 16, 1, 1, 10 ** 6, 132) == 32  # 2000 * 32 <= 65535
