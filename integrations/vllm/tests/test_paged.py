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


def vllm_write(kv_cache, key, value, slots, isa="vec"):
    nb, h, bs, _ = kv_cache.shape
    key_cache, value_cache = kv_cache.view(nb, h, 2 * bs, -1).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, isa,
                                   k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto")


# every layout ddtree reads, in the dtypes vLLM's CPU backend uses it for ("amx": bf16 only);
# vLLM's cache writer stores either layout on any x86 CPU (it only moves elements)
LAYOUT_CASES = [("vec", torch.float32), ("vec", torch.bfloat16), ("amx", torch.bfloat16)]


@pytest.mark.parametrize("isa,dtype", LAYOUT_CASES)
def test_read_slots_and_gather_return_what_vllm_wrote(isa, dtype):
    torch.manual_seed(0)
    cache = vllm_cache(8, dtype)
    slots = torch.randperm(8 * BLOCK)[:150]
    key, value = torch.randn(150, HKV, D).to(dtype), torch.randn(150, HKV, D).to(dtype)
    vllm_write(cache, key, value, slots, isa)
    k, v = paged.read_slots(cache, slots, isa)
    assert torch.equal(k, key) and torch.equal(v, value)
    # one request's rows 0..69 in blocks [5, 2, 7]
    row = torch.tensor([5, 2, 7, 0])
    linear = torch.cat([b * BLOCK + torch.arange(BLOCK) for b in (5, 2, 7)])[:70]
    key2, value2 = torch.randn(70, HKV, D).to(dtype), torch.randn(70, HKV, D).to(dtype)
    vllm_write(cache, key2, value2, linear, isa)
    k, v = paged.gather_kv(cache, row, 70, isa)
    assert torch.equal(k, key2.transpose(0, 1)) and torch.equal(v, value2.transpose(0, 1))


@pytest.mark.parametrize("block_size,head_size", [(32, 64), (64, 128), (128, 96), (96, 256)])
@pytest.mark.parametrize("isa", ["vec", "amx"])
def test_check_layout_accepts_vllms_writer_at_serving_shapes(isa, block_size, head_size):
    def write(key, value, kv_cache, slots):
        vllm_write(kv_cache, key, value, slots, isa)

    paged.check_layout(isa, torch.bfloat16, 4, block_size, head_size, write)


def test_check_layout_refuses_a_layout_ddtree_does_not_read():
    def transposed_vec(key, value, kv_cache, slots):   # "vec" with its keys token-major
        vllm_write(kv_cache, key, value, slots, "vec")
        nb, h, bs, two_d = kv_cache.shape
        key_cache = kv_cache.view(nb, h, 2 * bs, two_d // 2)[:, :, :bs]
        key_cache.copy_(key_cache.reshape(nb, h, two_d // 2, bs).transpose(-1, -2).clone())

    with pytest.raises(ValueError, match="'vec' stores the paged cache in a layout"):
        paged.check_layout("vec", torch.float32, 2, 32, 64, transposed_vec)
    with pytest.raises(ValueError, match="ISA 'vec16'"):
        paged.check_layout("vec16", torch.float32, 2, 32, 64, transposed_vec)


def random_parents(n: int, gen: torch.Generator):
    return [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]


@pytest.mark.parametrize("isa,dtype", LAYOUT_CASES)
def test_paged_tree_attention_matches_the_reference(isa, dtype):
    gen = torch.Generator().manual_seed(1)
    num_blocks = 16
    cache = vllm_cache(num_blocks, dtype)
    block_table = torch.randperm(num_blocks, generator=gen).view(4, 4)   # 4 requests x 4 blocks
    pasts, sizes = [3, 40, 0, 77], [7, 12, 1, 5]
    starts, t = [], 0
    for n in sizes:
        starts.append(t)
        t += n
    query = torch.randn(t, HQ, D, generator=gen).to(dtype)
    ks, vs = [], []
    for r, (past, n) in enumerate(zip(pasts, sizes)):
        length = past + n
        k = torch.randn(length, HKV, D, generator=gen).to(dtype)
        v = torch.randn(length, HKV, D, generator=gen).to(dtype)
        slots = torch.stack([block_table[r, i // BLOCK] * BLOCK + i % BLOCK for i in range(length)])
        vllm_write(cache, k, v, slots, isa)
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
    output = torch.full((t, HQ * D), 7.0, dtype=dtype)
    paged.paged_tree_attention(query, cache, block_table, rows, D ** -0.5, output, isa)
    visible = reference.tree_visibility_bool(par, num_nodes)
    for i, r in enumerate(branching):
        n, past = sizes[r], pasts[r]
        q = torch.zeros(1, n_max, HQ, D)
        q[0, :n] = query[starts[r]:starts[r] + n].float()
        s = past + n_max
        k = torch.zeros(1, HKV, s, D)
        v = torch.zeros(1, HKV, s, D)
        k[0, :, :past + n] = ks[r].transpose(0, 1)
        v[0, :, :past + n] = vs[r].transpose(0, 1)
        want = reference.tree_attention(q, k, v, torch.tensor([past]), visible[i:i + 1])
        got = output[starts[r]:starts[r] + n].view(n, HQ, D).float()
        tol = 1e-5 if dtype == torch.float32 else 2e-2     # bf16: the output's rounding
        torch.testing.assert_close(got, want[0, :n], rtol=tol, atol=tol)
    # rows of non-branching requests are left as vLLM computed them
    assert torch.equal(output[starts[2]], torch.full((HQ * D,), 7.0, dtype=dtype))


@pytest.mark.parametrize("isa,dtype", LAYOUT_CASES)
def test_commit_path_moves_kv_to_the_chain_slots(isa, dtype):
    torch.manual_seed(2)
    cache = vllm_cache(4, dtype)
    slots = torch.arange(10, 30)
    key, value = torch.randn(20, HKV, D).to(dtype), torch.randn(20, HKV, D).to(dtype)
    vllm_write(cache, key, value, slots, isa)
    src, dst = torch.tensor([14, 19, 27]), torch.tensor([11, 12, 13])
    paged.commit_path(cache, src, dst, lambda k, v, c, s: vllm_write(c, k, v, s, isa), isa)
    k, v = paged.read_slots(cache, dst, isa)
    assert torch.equal(k, key[src - 10]) and torch.equal(v, value[src - 10])
    untouched = torch.tensor([10, 14, 19, 27])
    k, v = paged.read_slots(cache, untouched, isa)
    assert torch.equal(k, key[untouched - 10])
