"""draft_attention (fused DFlash layer attention) against an explicit RMSNorm + RoPE + SDPA
reference in float64, the mma.sync CUDA kernel emulated, the cache append, awkward sizes, opcheck,
bad input. Error bound: 2 x (the exact result's own rounding to the dtype) + 4 ulp of the output
scale — tighter than FlashAttention's 2 x PyTorch-at-the-same-precision rule."""
import pytest
import torch

from ddtree.ops import reference
from helpers import KERNEL_BACKENDS, kernel_device

ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def case(seed, batch=2, lq=16, context=(5,), hq=4, hkv=2, d=64, cached=(7, 0), s=48,
         dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    c = context[0]
    t = c + lq
    q = torch.randn(batch, lq, hq, d, generator=g)
    k_new = torch.randn(batch, t, hkv, d, generator=g)
    v_new = torch.randn(batch, t, hkv, d, generator=g)
    k_cache = torch.randn(batch, hkv, s, d, generator=g)
    v_cache = torch.randn(batch, hkv, s, d, generator=g)
    pos = torch.tensor(cached, dtype=torch.long)[:, None] + torch.arange(t)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = pos[..., None].float() * inv
    emb = torch.cat([ang, ang], -1)
    qw = 1 + 0.1 * torch.randn(d, generator=g)
    kw = 1 + 0.1 * torch.randn(d, generator=g)
    tensors = [x.to(dtype) for x in (q, k_new, v_new, k_cache, v_cache)]
    return tensors + [torch.tensor(cached, dtype=torch.long), qw, kw, emb.cos(), emb.sin(), c, 1e-6]


def copy_to(x, dev):
    """A copy on `dev` that keeps the storage offset modulo 16 bytes (misaligned stays so)."""
    skew = (x.data_ptr() % 16) // x.element_size()
    flat = torch.empty(x.numel() + 16, dtype=x.dtype, device=dev)
    return flat[skew: skew + x.numel()].view(x.shape).copy_(x)


def run(backend, c, scale=None, num_splits=None, context_len=None):
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    ops = torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree
    args = [copy_to(x, dev) if isinstance(x, torch.Tensor) else x for x in c]
    lens = None if context_len is None else context_len.to(dev)
    out = ops.draft_attention(*args, scale, num_splits, lens)
    return out.cpu(), args[3].cpu(), args[4].cpu()


def max_abs(x):
    return x.abs().max().item() if x.numel() else 0.0  # an empty batch has no error


def check(backend, c, scale=None, num_splits=None, context_len=None, floor_ulps=4):
    out, k_cache, v_cache = run(backend, c, scale, num_splits, context_len)
    truth, new_k, new_v = reference.draft_attention(*c, scale, context_len)
    q = c[0]
    own = reference.draft_attention(*[x.float() if isinstance(x, torch.Tensor) and x.is_floating_point()
                                      else x for x in c[:5]], *c[5:], scale, context_len)[0]
    own_err = max_abs(own.to(q.dtype).double() - truth)
    floor = floor_ulps * torch.finfo(q.dtype).eps * max_abs(truth)
    err = max_abs(out.double() - truth)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert err <= 2 * own_err + floor, (err, own_err, floor)
    # The new context rows were appended at cache_len (K normed + roped); nothing else moved.
    cached = c[5]
    for b in range(q.shape[0]):
        at, ctx = int(cached[b]), c[10] if context_len is None else int(context_len[b])
        torch.testing.assert_close(k_cache[b, :, at: at + ctx].double(), new_k[b, :ctx].transpose(0, 1),
                                   rtol=2e-2, atol=2e-2)
        assert torch.equal(v_cache[b, :, at: at + ctx], new_v[b, :ctx].transpose(0, 1))
        keep = torch.ones(k_cache.shape[2], dtype=torch.bool)
        keep[at: at + ctx] = False
        assert torch.equal(k_cache[b][:, keep], c[3][b][:, keep])


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_reference(backend, dtype):
    check(backend, case(0, dtype=dtype))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("shape", [dict(lq=1, context=(0,)), dict(hq=2, hkv=2, cached=(0, 0)),
                                   dict(d=128, hq=2, hkv=1, lq=20, context=(3,)),
                                   dict(d=256, hq=1, hkv=1, lq=4, s=30),
                                   dict(batch=1, cached=(60,), s=90, context=(12,))],
                         ids=["Lq1", "MHA-empty-cache", "D128-Lq20", "D256", "long-context"])
def test_awkward_sizes(backend, shape):
    check(backend, case(1, **shape))


def test_cpu_float32_and_scale():
    check("cpu", case(2, dtype=torch.float32, d=40))
    check("cpu", case(3), scale=0.2)


def test_cpu_long_context_and_odd_head_dim():
    """Several key blocks (cached rows spanning blocks, the new rows straddling a block edge),
    a head group of 4 query heads per KV head, a head_dim that is no multiple of 8. fp32 sums
    over ~150 keys: 8 ulp of the output scale (the bf16 / fp16 cases' bound is dominated by
    their own rounding)."""
    check("cpu", case(11, batch=2, cached=(130, 61), s=200, context=(9,), hq=8, hkv=2,
                      dtype=torch.float32, d=36), context_len=torch.tensor([9, 4]), floor_ulps=8)


@pytest.mark.parametrize("isa", ["baseline", "avx2"])
def test_cpu_loops_of_every_instruction_set(isa):
    """The CPU attention and recurrent loops are compiled for AVX-512, AVX2 + FMA and the baseline
    instruction set, one picked at run time; DDTREE_CPU_ISA caps it. The default run covers the
    build this CPU picks; here the capped builds pass the same CPU tests (draft_attention,
    tree_attention, the recurrent ops against their references), in a fresh process."""
    import os
    import pathlib
    import subprocess
    import sys
    here = pathlib.Path(__file__).resolve().parent
    files = [str(here / f) for f in ("test_ops_draft_attention.py", "test_ops_tree_attention.py",
                                     "test_ops_recurrent.py")]
    env = dict(os.environ, DDTREE_CPU_ISA=isa)
    picked = subprocess.run([sys.executable, "-c", "import ddtree; print(ddtree._C.cpu_isa())"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert picked.stdout.strip().splitlines()[-1] in (isa, "baseline"), picked.stderr[-2000:]
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *files, "-k", "cpu and not instruction_set"], env=env,
                         capture_output=True, text=True, timeout=600, cwd=here.parent)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and " failed" not in out.stdout


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("splits", [2, 5, 64])
def test_split_over_keys(backend, splits):
    """Split key ranges that cut the cached rows, the new context rows (each appended to the cache
    exactly once, by the split that owns it) and the block rows; empty splits."""
    check(backend, case(7, batch=2, cached=(70, 3), s=120, context=(9,), lq=16), num_splits=splits)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_misaligned_cache_takes_the_synchronous_copy_path(backend):
    c = case(10, cached=(30, 12), s=64)
    for i in (3, 4):
        flat = torch.empty(c[i].numel() + 8, dtype=c[i].dtype)
        c[i] = flat[1: 1 + c[i].numel()].view(c[i].shape).copy_(c[i])
        assert c[i].data_ptr() % 16 != 0
    check(backend, c, num_splits=2)
    assert copy_to(c[3], "cpu").data_ptr() % 16 != 0


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_long_context_batch1_splits_automatically(backend):
    check(backend, case(8, batch=1, hq=2, hkv=1, cached=(600,), s=640, context=(6,), lq=8))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("splits", [None, 3])
def test_per_request_context_length(backend, splits):
    """A batch whose requests bring different numbers of new context rows: the padding rows are
    neither attended nor appended to the cache."""
    c = case(9, batch=3, cached=(20, 0, 33), s=60, context=(6,), lq=16)
    check(backend, c, num_splits=splits, context_len=torch.tensor([6, 0, 2]))


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    c = case(4, lq=3, context=(2,))
    torch.library.opcheck(getattr(torch.ops, namespace).draft_attention.default, (*c, None))
    torch.library.opcheck(getattr(torch.ops, namespace).draft_attention.default, (*c, None, 2))
    torch.library.opcheck(getattr(torch.ops, namespace).draft_attention.default,
                          (*c, None, None, torch.tensor([1, 2])))


def test_bad_input():
    c = case(5)
    op = torch.ops.ddtree.draft_attention
    with pytest.raises(RuntimeError, match=r"cache overflow"):
        op(*c[:5], c[5] + 40, *c[6:], None)
    with pytest.raises(RuntimeError, match="must hold num_context"):
        op(*c[:10], 4, c[11], None)
    with pytest.raises(RuntimeError, match="must be a multiple of the KV heads"):
        bad = case(5, hq=3, hkv=2)
        op(*bad, None)
    with pytest.raises(RuntimeError, match=r"cos and sin must be \[B, T, D\]"):
        op(*c[:8], c[8][:, :3], c[9], *c[10:], None)
    with pytest.raises(RuntimeError, match="head_dim D = 40 is not supported by the CUDA kernel"):
        torch.ops.ddtree_emu.draft_attention(*case(6, d=40), None)
    with pytest.raises(RuntimeError, match=r"num_splits must be in \[1, 64\]"):
        torch.ops.ddtree_emu.draft_attention(*c, None, 0)
    with pytest.raises(RuntimeError, match=r"context_len must be in \[0, num_context = 5\]"):
        op(*c, None, None, torch.tensor([6, 1]))
    with pytest.raises(RuntimeError, match=r"context_len must have shape \[B\]"):
        op(*c, None, None, torch.tensor([1]))
