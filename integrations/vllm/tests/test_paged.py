"""ddtree's reads of vLLM's paged CPU cache against vLLM's own writer, and the paged tree attention
against the spec's reference (ddtree.ops.reference.tree_attention over the same K/V)."""
from __future__ import annotations

import pytest
import torch
from vllm import _custom_ops as ops

from ddtree.integrations.vllm import paged
from ddtree.ops import reference

BLOCK, HKV, HQ, D = 32, 2, 4, 64


def vllm_cache(num_blocks: int, dtype):
    return torch.zeros(num_blocks, HKV, BLOCK, 2 * D, dtype=dtype)


def vllm_write(kv_cache, key, value, slots):
    nb, h, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec",
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_read_slots_and_gather_return_what_vllm_wrote(dtype):
    torch.manual_seed(0)
    cache = vllm_cache(8, dtype)
    slots = torch.randperm(8 * BLOCK)[:150]
    key, value = torch.randn(150, HKV, D).to(dtype), torch.randn(150, HKV, D).to(dtype)
    vllm_write(cache, key, value, slots)
    k, v = paged.read_slots(cache, slots)
    assert torch.equal(k, key) and torch.equal(v, value)
    # one request's rows 0..69 in blocks [5, 2, 7]
    row = torch.tensor([5, 2, 7, 0])
    linear = torch.cat([b * BLOCK + torch.arange(BLOCK) for b in (5, 2, 7)])[:70]
    key2, value2 = torch.randn(70, HKV, D).to(dtype), torch.randn(70, HKV, D).to(dtype)
    vllm_write(cache, key2, value2, linear)
    k, v = paged.gather_kv(cache, row, 70)
    assert torch.equal(k, key2.transpose(0, 1)) and torch.equal(v, value2.transpose(0, 1))


def random_parents(n: int, gen: torch.Generator):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


def test_paged_tree_attention_matches_the_reference():
    gen = torch.Generator().manual_seed(1)
    num_blocks = 16
    cache = vllm_cache(num_blocks, torch.float32)
    block_table = torch.randperm(num_blocks, generator=gen).view(4, 4)   # 4 requests x 4 blocks
    pasts, sizes = [3, 40, 0, 77], [7, 12, 1, 5]
    starts, t = [], 0
    for n in sizes:
        starts.append(t)
        t += n
    query = torch.randn(t, HQ, D, generator=gen)
    ks, vs = [], []
    for r, (past, n) in enumerate(zip(pasts, sizes)):
        length = past + n
        k, v = torch.randn(length, HKV, D, generator=gen), torch.randn(length, HKV, D, generator=gen)
        slots = torch.stack([block_table[r, i // BLOCK] * BLOCK + i % BLOCK for i in range(length)])
        vllm_write(cache, k, v, slots)
        ks.append(k)
        vs.append(v)
    parents = [random_parents(n, gen) for n in sizes]
    branching = [0, 1, 3]                                   # request 2 is a lone root
    n_max = max(sizes[r] for r in branching)
    par = torch.full((len(branching), n_max), -1, dtype=torch.int64)
    for i, r in enumerate(branching):
        par[i, :sizes[r]] = torch.tensor(parents[r])
    num_nodes = torch.tensor([sizes[r] for r in branching])
    packed = reference.tree_visibility(par, num_nodes)[1]
    rows = paged.tree_rows(branching, [starts[r] for r in branching], num_nodes.tolist(),
                           torch.tensor([pasts[r] for r in branching]), packed)
    output = torch.full((t, HQ * D), 7.0)
    paged.paged_tree_attention(query, cache, block_table, rows, D ** -0.5, output)
    visible = reference.tree_visibility_bool(par, num_nodes)
    for i, r in enumerate(branching):
        n, past = sizes[r], pasts[r]
        q = torch.zeros(1, n_max, HQ, D)
        q[0, :n] = query[starts[r]:starts[r] + n]
        s = past + n_max
        k = torch.zeros(1, HKV, s, D)
        v = torch.zeros(1, HKV, s, D)
        k[0, :, :past + n] = ks[r].transpose(0, 1)
        v[0, :, :past + n] = vs[r].transpose(0, 1)
        want = reference.tree_attention(q, k, v, torch.tensor([past]), visible[i:i + 1])
        got = output[starts[r]:starts[r] + n].view(n, HQ, D)
        torch.testing.assert_close(got, want[0, :n], rtol=1e-5, atol=1e-5)
    # rows of non-branching requests are left as vLLM computed them
    assert torch.equal(output[starts[2]], torch.full((HQ * D,), 7.0))


def test_commit_path_moves_kv_to_the_chain_slots():
    torch.manual_seed(2)
    cache = vllm_cache(4, torch.float32)
    slots = torch.arange(10, 30)
    key, value = torch.randn(20, HKV, D), torch.randn(20, HKV, D)
    vllm_write(cache, key, value, slots)
    src, dst = torch.tensor([14, 19, 27]), torch.tensor([11, 12, 13])
    paged.commit_path(cache, src, dst, lambda k, v, s: vllm_write(cache, k, v, s))
    k, v = paged.read_slots(cache, dst)
    assert torch.equal(k, key[src - 10]) and torch.equal(v, value[src - 10])
    untouched = torch.tensor([10, 14, 19, 27])
    k, v = paged.read_slots(cache, untouched)
    assert torch.equal(k, key[untouched - 10])
