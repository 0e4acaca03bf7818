"""tree_topk over a vocabulary split into shards (a tensor-parallel LM head): tree_topk_shard on each
shard + tree_topk_merge of the stacked parts = tree_topk of the whole vocabulary (reference.py),
for 1 / 2 / 4 / 8 shards, uneven and empty shards, NaN / +-inf, ties across shard borders; the
parts themselves against reference.tree_topk_shard; CPU, emulated kernels, CUDA; bad input."""
import math

import pytest
import torch

from ddtree.ops import reference
from helpers import KERNEL_BACKENDS, kernel_device

ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def ops_of(backend):
    return torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree


def shard_columns(vocab, shards):
    """torch.chunk's split (the one DTensor's Shard(0) uses): ceil(V / S) columns a shard, the
    last ones shorter or empty."""
    size = -(-vocab // shards)
    return [(min(j * size, vocab), min((j + 1) * size, vocab)) for j in range(shards)]


def sharded_topk(backend, logits, k, shards, columns=None):
    ops = ops_of(backend)
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    vocab = logits.shape[-1]
    columns = columns or shard_columns(vocab, shards)
    parts = [ops.tree_topk_shard(logits[..., a:b].contiguous().to(dev), k, a, vocab)
             for a, b in columns]
    lp, ids = ops.tree_topk_merge(torch.stack(parts))
    return lp.cpu(), ids.cpu(), [p.cpu() for p in parts], columns


def check_against_full_vocabulary(backend, logits, k, shards, columns=None):
    lp, ids, parts, columns = sharded_topk(backend, logits, k, shards, columns)
    ref_lp, ref_ids = reference.tree_topk(logits, k)
    assert torch.equal(ids, ref_ids)
    finite = ref_lp[torch.isfinite(ref_lp)]
    scale = 1 + (finite.abs().max().item() if finite.numel() else 0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6 * scale, equal_nan=True)
    # Each part against the reference part: the same keys, the same max; sums to rounding.
    for part, (a, b) in zip(parts, columns):
        want = reference.tree_topk_shard(logits[..., a:b], k, a, logits.shape[-1])
        assert torch.equal(part[..., :k], want[..., :k])
        assert torch.equal(part[..., k] >> 32, want[..., k] >> 32)
        got_s = (part[..., k] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        want_s = (want[..., k] & 0xFFFFFFFF).to(torch.int32).view(torch.float32)
        torch.testing.assert_close(got_s, want_s, rtol=2e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("shards", [1, 2, 4, 8])
@pytest.mark.parametrize("shape", [(2, 3, 1000, 16), (1, 4, 3001, 64), (1, 2, 40, 40),
                                   (1, 1, 5000, 300)], ids=lambda s: "x".join(map(str, s)))
def test_merge_equals_tree_topk_on_the_whole_vocabulary(backend, shards, shape):
    b, l, v, k = shape
    g = torch.Generator().manual_seed(v + shards)
    check_against_full_vocabulary(backend, torch.randn(b, l, v, generator=g) * 3, k, shards)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_logits(backend, dtype):
    g = torch.Generator().manual_seed(3)
    logits = (torch.randn(2, 3, 2000, generator=g) * 3).to(dtype)
    check_against_full_vocabulary(backend, logits, 32, 4)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_special_values_and_ties_across_shards(backend):
    g = torch.Generator().manual_seed(5)
    V = 1200
    logits = torch.randn(1, 7, V, generator=g).round()    # exact ties, across shard borders
    logits[0, 0, 7] = math.nan                             # NaN in one shard: the row is NaN
    logits[0, 1, :] = -math.inf
    logits[0, 1, 1000:1010] = 2.0                          # few real values, all in the last shard
    logits[0, 2, 650] = math.inf                           # +inf in one shard
    logits[0, 3, :] = 4.0                                  # every value equal: ids decide
    logits[0, 4, 299:301] = 30.0                           # the max on a shard border
    logits[0, 5, 900:] = math.nan                          # a shard (and more) of NaN
    logits[0, 6, ::2] = -math.inf
    for shards in (2, 4):
        check_against_full_vocabulary(backend, logits, 10, shards)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_uneven_and_empty_shards(backend):
    """Shards of different sizes, one empty (more shards than a chunking fills), k above a
    shard's size (its part is 0-padded)."""
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(2, 2, 100, generator=g) * 2
    columns = [(0, 3), (3, 3), (3, 70), (70, 100)]
    check_against_full_vocabulary(backend, logits, 20, 4, columns)
    lp, ids, parts, _ = sharded_topk(backend, logits, 20, 4, columns)
    assert torch.equal(parts[0][..., 3:20], torch.zeros(2, 2, 17, dtype=torch.long))
    assert torch.equal(parts[1][..., :20], torch.zeros(2, 2, 20, dtype=torch.long))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_many_shards_times_k_beyond_one_buffer(backend):
    """S * k keys larger than the merge kernel's buffer: merged a few parts at a time."""
    g = torch.Generator().manual_seed(11)
    check_against_full_vocabulary(backend, torch.randn(1, 2, 9000, generator=g), 1024, 8)


def test_merge_reference_agrees_with_the_op():
    """reference.tree_topk_merge (decoding keys and accumulators) against the op on the same
    parts, including parts of mixed-up order (any permutation of shards merges the same)."""
    g = torch.Generator().manual_seed(13)
    logits = torch.randn(2, 3, 777, generator=g) * 4
    _, _, parts, _ = sharded_topk("cpu", logits, 12, 3)
    stacked = torch.stack(parts[::-1])
    lp, ids = torch.ops.ddtree.tree_topk_merge(stacked)
    ref_lp, ref_ids = reference.tree_topk_merge(stacked)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-5)


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    ops = getattr(torch.ops, namespace)
    logits = torch.randn(2, 3, 100)
    torch.library.opcheck(ops.tree_topk_shard.default, (logits, 7, 100, 400))
    parts = torch.stack([ops.tree_topk_shard(logits, 7, 0, 200),
                         ops.tree_topk_shard(logits * 2, 7, 100, 200)])
    torch.library.opcheck(ops.tree_topk_merge.default, (parts,))


def test_empty_batches():
    assert torch.ops.ddtree.tree_topk_shard(torch.randn(0, 3, 10), 4, 0, 10).shape == (0, 3, 5)
    lp, ids = torch.ops.ddtree_emu.tree_topk_merge(torch.zeros(2, 0, 3, 5, dtype=torch.long))
    assert lp.shape == (0, 3, 4) and ids.shape == (0, 3, 4)


def test_bad_input():
    x = torch.randn(2, 3, 100)
    with pytest.raises(RuntimeError, match=r"tree_topk_shard: logits must be a 3-D tensor"):
        torch.ops.ddtree.tree_topk_shard(x[0], 5, 0, 100)
    with pytest.raises(RuntimeError, match=r"columns \[150, 250\) .* vocab_size = 200"):
        torch.ops.ddtree.tree_topk_shard(x, 5, 150, 200)
    with pytest.raises(RuntimeError, match=r"columns \[-1, 99\)"):
        torch.ops.ddtree.tree_topk_shard(x, 5, -1, 200)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, min\(1024, vocab_size = 200\)\], got 0"):
        torch.ops.ddtree.tree_topk_shard(x, 0, 0, 200)
    with pytest.raises(RuntimeError, match=r"k must be in \[1, min\(1024, vocab_size = 100\)\], got 101"):
        torch.ops.ddtree.tree_topk_shard(x, 101, 0, 100)
    with pytest.raises(RuntimeError, match=r"vocab_size must be in \[1, 2\^31\)"):
        torch.ops.ddtree.tree_topk_shard(x, 5, 0, 2 ** 31)
    with pytest.raises(RuntimeError, match=r"parts must be an int64 tensor \[S, B, L, k \+ 1\]"):
        torch.ops.ddtree.tree_topk_merge(torch.zeros(2, 3, 6, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"parts must be an int64 tensor"):
        torch.ops.ddtree.tree_topk_merge(torch.zeros(2, 1, 3, 6))
    with pytest.raises(RuntimeError, match=r"S >= 1 shards and k in \[1, 1024\]"):
        torch.ops.ddtree.tree_topk_merge(torch.zeros(0, 1, 3, 6, dtype=torch.long))
    with pytest.raises(RuntimeError, match=r"S >= 1 shards and k in \[1, 1024\]"):
        torch.ops.ddtree.tree_topk_merge(torch.zeros(2, 1, 3, 1, dtype=torch.long))
