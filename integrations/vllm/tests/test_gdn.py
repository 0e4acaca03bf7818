"""The GDN layers' tree verify and commit (ddtree.integrations.vllm.gdn) against vLLM's own CPU GDN
chain path (model_executor/layers/mamba/ops/cpu/gdn_attention.py `_spec_forward`): every tree node's
output is what vLLM's chain kernel gives along the node's root path, and after the commit the
cache holds, at column accept_len - 1, the window and state vLLM's chain leaves after the accepted
path (spec: a node's state is its root path's chain state)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
from vllm.model_executor.layers.mamba.ops.cpu import gdn_attention as vllm_gdn

from ddtree.integrations.vllm import gdn

HK, HV, D, W, S = 2, 4, 64, 4, 12   # key / value heads, head dim, conv width, speculative tokens
C = 2 * HK * D + HV * D
STATE_LEN = W - 1 + S


class Layer:
    """The attributes vLLM's CPU GDN core reads from its layer (QwenGatedDeltaNetAttention)."""
    rearrange_mixed_qkv = QwenGatedDeltaNetAttention.rearrange_mixed_qkv

    def __init__(self, slots: int, gen: torch.Generator, state_len: int = STATE_LEN):
        self.key_dim, self.value_dim, self.tp_size = HK * D, HV * D, 1
        self.head_k_dim = self.head_v_dim = D
        self.activation = "silu"
        self.conv1d = torch.nn.Module()
        self.conv1d.weight = torch.nn.Parameter(
            (torch.randn(C, 1, W, generator=gen) * 0.5).bfloat16(), requires_grad=False)
        self.conv1d.bias = torch.nn.Parameter(
            (torch.randn(C, generator=gen) * 0.1).bfloat16(), requires_grad=False)
        # as vLLM's loader leaves it: on CPUs with AVX-512 BF16 / AMX the weight packed in place
        # for its C++ conv kernels, the plain [C, W] copy stashed beside it
        dispatch_cpu_unquantized_gemm(self.conv1d, remove_weight=False)
        self.A_log = torch.randn(HV, generator=gen) * 0.5
        self.dt_bias = torch.randn(HV, generator=gen).bfloat16()
        conv = (torch.randn(slots, C, state_len, generator=gen)).bfloat16()
        if not vllm_gdn.is_conv_state_dim_first():
            conv = conv.transpose(1, 2).contiguous()
        ssm = torch.randn(slots, HV, D, D, generator=gen) * 0.1
        self.kv_cache = [conv, ssm]

    def clone(self) -> "Layer":
        other = object.__new__(Layer)
        other.__dict__.update(self.__dict__)
        other.kv_cache = [t.clone() for t in self.kv_cache]
        return other

    def narrowed(self) -> "Layer":
        """A copy whose conv buffer is the committed window alone, [C, W - 1] (a ddtree engine's)."""
        other = self.clone()
        window = vllm_gdn._conv_buffer_view(self)[:, :, :W - 1].clone()
        if not vllm_gdn.is_conv_state_dim_first():
            window = window.transpose(1, 2).contiguous()
        other.kv_cache[0] = window
        return other


def metadata(slots, lengths, accepted):
    """GDN metadata of speculative rows: slots [R] (each request's one state block)."""
    qsl = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(lengths).cumsum(0)
    return SimpleNamespace(num_spec_decodes=len(lengths),
                           spec_state_indices_tensor=torch.tensor(slots, dtype=torch.int32)[:, None],
                           spec_query_start_loc=qsl,
                           num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32))


SCRATCH = list(range(100, 100 + S))   # vLLM's own chain writes the state after draft t in slot t


def vllm_chain(layer, slot, x, b, a):
    """vLLM's own `_spec_forward` over one request's chain x [T, C] as a first speculative step
    (window at columns 0 .. W - 2, state in `slot`, accept length 1), on a copy of the caches:
    (outputs [T, Hv, D], the state after the chain)."""
    layer = layer.clone()
    slots = [slot] + SCRATCH
    md = SimpleNamespace(num_spec_decodes=1,
                         spec_state_indices_tensor=torch.tensor([slots], dtype=torch.int32),
                         spec_query_start_loc=torch.tensor([0, x.shape[0]], dtype=torch.int32),
                         num_accepted_tokens=torch.tensor([1], dtype=torch.int32))
    original = getattr(vllm_gdn._spec_forward, "original", vllm_gdn._spec_forward)
    out = original(layer, md, x, b, a, vllm_gdn._conv_buffer_view(layer),
                   vllm_gdn._ssm_state_view(layer), W, STATE_LEN)
    return out, vllm_gdn._ssm_state_view(layer)[slots[x.shape[0] - 1]]


def root_path(parents, i):
    path = [i]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def random_tree(n, gen):
    return [-1] + [int(torch.randint(max(0, i - 3), i, (1,), generator=gen)) for i in range(1, n)]


def run_step(layer, slots, trees, accepted, gen, state_len=STATE_LEN):
    """One verify pass over requests with these trees; (x, b, a, outputs, SpecTrees)."""
    sizes = [len(p) for p in trees]
    t = sum(sizes)
    x = torch.randn(t, C, generator=gen).bfloat16()
    b = torch.randn(t, HV, generator=gen).bfloat16()
    a = torch.randn(t, HV, generator=gen).bfloat16()
    parents = torch.full((len(trees), max(sizes)), -1, dtype=torch.int64)
    for r, p in enumerate(trees):
        parents[r, :len(p)] = torch.tensor(p)
    depth = max(len(root_path(p, i)) - 1 for p in trees for i in range(len(p)))
    spec = gdn.SpecTrees(list(range(len(trees))), parents, torch.tensor(sizes), depth)
    gdn.ActiveTrees.steps = []
    out = gdn.tree_spec_forward(layer, metadata(slots, sizes, accepted), x, b, a,
                                vllm_gdn._conv_buffer_view(layer),
                                vllm_gdn._ssm_state_view(layer), W, state_len, spec)
    return x, b, a, out, spec


def test_tree_nodes_and_commit_match_vllms_chain_path():
    gen = torch.Generator().manual_seed(0)
    trees = [random_tree(9, gen), [-1], random_tree(13, gen), [-1, 0, 1, 2]]  # S + 1 = 13 nodes
    slots = [7, 3, 12, 0]
    layer = Layer(slots=100 + S, gen=gen)
    before = layer.clone()
    x, b, a, out, spec = run_step(layer, slots, trees, [1, 3, 2, 4], gen)
    assert all(torch.equal(u, v) for u, v in zip(layer.kv_cache, before.kv_cache)), \
        "the verify pass must not write the cache"
    starts = [sum(len(p) for p in trees[:r]) for r in range(len(trees))]
    for r, p in enumerate(trees):
        for i in range(len(p)):
            rows = [starts[r] + j for j in root_path(p, i)]
            ref, _ = vllm_chain(before, slots[r], x[rows], b[rows], a[rows])
            torch.testing.assert_close(out[starts[r] + i].float(), ref[-1].float(),
                                       atol=2e-2, rtol=2e-2)

    # accept: a deep path in the branching trees, the root alone, the chain's first two nodes
    paths = [max((root_path(trees[0], i) for i in range(9)), key=len), [0],
             max((root_path(trees[2], i) for i in range(13)), key=len), [0, 1]]
    accepted = torch.full((len(trees), max(map(len, paths))), -1, dtype=torch.int64)
    for r, p in enumerate(paths):
        accepted[r, :len(p)] = torch.tensor(p)
    gdn.commit_(spec, accepted, torch.tensor([len(p) for p in paths]))
    assert gdn.ActiveTrees.steps == []
    conv_buf, ssm = vllm_gdn._conv_buffer_view(layer), vllm_gdn._ssm_state_view(layer)
    old_buf = vllm_gdn._conv_buffer_view(before)
    for r, p in enumerate(paths):
        rows = [starts[r] + j for j in p]
        _, state = vllm_chain(before, slots[r], x[rows], b[rows], a[rows])
        # vLLM's kernel and ddtree's round the recurrence differently, by about one bf16 step
        torch.testing.assert_close(ssm[slots[r]].float(), state.float(), atol=1e-2, rtol=1e-2)
        seq = torch.cat([old_buf[slots[r], :, :W - 1], x[rows].t()], 1)
        assert torch.equal(conv_buf[slots[r], :, :W - 1], seq[:, -(W - 1):])


def test_steps_of_trees_and_no_drafts_follow_the_accepted_chain():
    """Three verify steps of one request (a tree, no drafts, a tree), each committed: every node's
    output equals vLLM's chain kernel over all tokens accepted before it plus the node's root path
    (the window and state the next step reads are the accepted chain's)."""
    gen = torch.Generator().manual_seed(2)
    layer = Layer(slots=100 + S, gen=gen)
    before = layer.clone()
    steps = [([-1, 0, 0, 1, 3], [0, 1, 3]), ([-1], [0]), ([-1, 0, 1, 0, 2, 4], [0, 1, 2, 4])]
    history = []   # (x, b, a) rows accepted so far
    accept_len = 1
    for parents, path in steps:
        x, b, a, out, spec = run_step(layer, [5], [parents], [accept_len], gen)
        for i in range(len(parents)):
            rows = root_path(parents, i)
            seq = [torch.cat([h[k] for h in history] + [t[rows]]) for k, t in enumerate((x, b, a))]
            ref, _ = vllm_chain(before, 5, *seq)
            torch.testing.assert_close(out[i].float(), ref[-1].float(), atol=2e-2, rtol=2e-2)
        gdn.commit_(spec, torch.tensor([path]), torch.tensor([len(path)]))
        history.append((x[path], b[path], a[path]))
        accept_len = len(path)


def test_mismatched_rows_are_refused():
    gen = torch.Generator().manual_seed(1)
    layer = Layer(slots=S + 1, gen=gen)
    spec = gdn.SpecTrees([0], torch.tensor([[-1, 0, 0]]), torch.tensor([3]), 1)
    x = torch.randn(2, C).bfloat16()
    with pytest.raises(RuntimeError, match="do not match the verified trees"):
        gdn.tree_spec_forward(layer, metadata([0], [2], [1]), x, x[:, :HV], x[:, :HV],
                              vllm_gdn._conv_buffer_view(layer), vllm_gdn._ssm_state_view(layer),
                              W, STATE_LEN, spec)


def test_a_forward_outside_verify_runs_chains_and_commits_nothing():
    gen = torch.Generator().manual_seed(3)
    layer = Layer(slots=100 + S, gen=gen)
    before = layer.clone()
    x = torch.randn(5, C, generator=gen).bfloat16()
    b, a = torch.randn(5, HV, generator=gen).bfloat16(), torch.randn(5, HV, generator=gen).bfloat16()
    forward = gdn.spec_forward(None)
    gdn.ActiveTrees.current = None
    out = forward(layer, metadata([4, 9], [3, 2], [1, 1]), x, b, a,
                  vllm_gdn._conv_buffer_view(layer), vllm_gdn._ssm_state_view(layer), W, STATE_LEN)
    assert gdn.ActiveTrees.steps == []
    assert all(torch.equal(u, v) for u, v in zip(layer.kv_cache, before.kv_cache))
    ref0, _ = vllm_chain(before, 4, x[:3], b[:3], a[:3])
    ref1, _ = vllm_chain(before, 9, x[3:], b[3:], a[3:])
    torch.testing.assert_close(out.float(), torch.cat([ref0, ref1]).float(), atol=2e-2, rtol=2e-2)


def test_gdn_layers_ask_for_one_state_block_per_request():
    from vllm.v1.kv_cache_interface import MambaSpec

    spec = MambaSpec(shapes=((C, STATE_LEN), (HV, D, D)), dtypes=(torch.bfloat16, torch.float32),
                     block_size=16, num_speculative_blocks=S)
    assert gdn.spec_without_draft_blocks(spec).num_speculative_blocks == 0
    assert gdn.spec_without_draft_blocks(None) is None


def test_a_narrow_conv_buffer_verifies_and_commits_as_the_wide_one():
    """A ddtree engine's conv buffer holds the committed window alone ([C, W - 1]): the same trees
    give the same node outputs, and the commit the same window and state, as in vLLM's wide
    buffer [C, W - 1 + S]."""
    gen = torch.Generator().manual_seed(4)
    trees = [random_tree(9, gen), [-1], [-1, 0, 1, 1, 3]]
    paths = [[0], [0], [0, 1, 3]]
    paths[0] = max((root_path(trees[0], i) for i in range(9)), key=len)
    slots = [2, 8, 5]
    wide = Layer(slots=16, gen=gen)
    narrow = wide.narrowed()
    assert vllm_gdn._conv_buffer_view(narrow).shape[-1] == W - 1
    step = torch.Generator().manual_seed(5)
    *_, out_wide, spec_wide = run_step(wide, slots, trees, [1, 1, 1], step)
    gdn.ActiveTrees.steps, steps_wide = [], gdn.ActiveTrees.steps
    step = torch.Generator().manual_seed(5)
    *_, out_narrow, spec_narrow = run_step(narrow, slots, trees, [1, 1, 1], step, state_len=W - 1)
    assert torch.equal(out_narrow, out_wide)
    accepted = torch.full((3, max(map(len, paths))), -1, dtype=torch.int64)
    for r, p in enumerate(paths):
        accepted[r, :len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in paths])
    gdn.commit_(spec_narrow, accepted, lengths)
    gdn.ActiveTrees.steps = steps_wide
    gdn.commit_(spec_wide, accepted, lengths)
    assert torch.equal(vllm_gdn._conv_buffer_view(narrow),
                       vllm_gdn._conv_buffer_view(wide)[:, :, :W - 1])
    assert torch.equal(narrow.kv_cache[1], wide.kv_cache[1])


def test_ddtree_engines_allocate_the_narrow_conv_buffer(monkeypatch):
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator as Shapes

    from ddtree.integrations.vllm.options import ENV, DDTreeOptions

    original = getattr(Shapes.gated_delta_net_state_shape, "__func__")
    shape = gdn.narrow_state_shape(original)
    dims = (1, HK, HV, D, D, W)
    monkeypatch.delenv(ENV, raising=False)
    assert shape(Shapes, *dims, S) == original(Shapes, *dims, S) != original(Shapes, *dims, 0)
    monkeypatch.setenv(ENV, DDTreeOptions(budget=16, max_budget=16, draft_len=S).to_json())
    assert shape(Shapes, *dims, S) == original(Shapes, *dims, 0)
    assert shape(Shapes, *dims, num_spec=S) == original(Shapes, *dims, 0)


def test_steps_without_speculative_rows_take_vllms_plain_path():
    """With the narrow buffer vLLM's CPU GDN always calls `_cpu_gdn_attention_nonspec`: a step with
    speculative rows is sent on to the speculative path (state length W - 1), one without stays."""
    calls = []
    plain = lambda *args: calls.append(("plain", args[1]))             # noqa: E731
    spec_aware = lambda *args: calls.append(("spec", args[1], args[6:]))  # noqa: E731
    forward = gdn.nonspec_or_trees(plain, SimpleNamespace(_cpu_gdn_attention_spec_aware=spec_aware))
    layer = SimpleNamespace(conv1d=SimpleNamespace(weight=torch.zeros(C, 1, W)))
    no_spec = SimpleNamespace(spec_sequence_masks=None)
    with_spec = SimpleNamespace(spec_sequence_masks=torch.tensor([True, False]))
    forward(layer, no_spec, None, None, None, None)
    forward(layer, with_spec, None, None, None, None)
    assert calls == [("plain", no_spec), ("spec", with_spec, (W, W - 1))]


def test_tree_conv_is_the_correctly_rounded_chain_conv():
    """ddtree's tree conv along a chain against the fp64 conv rounded once to bf16; on CPUs with
    AMX also vLLM's packed C++ conv (its decode and speculative kernel there), for comparison."""
    from ddtree.ops import tree_causal_conv1d

    gen = torch.Generator().manual_seed(5)
    layer, n, slot = Layer(8, gen), 6, 3
    conv_buf = vllm_gdn._conv_buffer_view(layer)
    x = torch.randn(n, C, generator=gen).bfloat16()
    weight, bias = vllm_gdn._unpacked_conv_weight(layer), layer.conv1d.bias
    window = conv_buf[slot, :, :W - 1]                                     # [C, W - 1]
    seq = torch.cat([window.double(), x.t().double()], -1)                # [C, W - 1 + n]
    exact = torch.stack([(seq[:, i:i + W] * weight.double()).sum(-1) + bias.double()
                         for i in range(n)])
    want = torch.nn.functional.silu(exact).bfloat16()                     # [n, C]
    parents = torch.tensor([[-1] + list(range(n - 1))])
    windows = gdn._windows(conv_buf, torch.tensor([slot]), W).to(x.dtype)
    got = tree_causal_conv1d(x[None], windows, torch.tensor([0]), weight, bias, parents,
                             torch.tensor([n]), "silu")[0]
    ours = (got == want).float().mean().item()
    line = f"tree conv = correctly rounded on {ours:.4f} of {want.numel()} elements"
    if torch.cpu._is_amx_tile_supported():
        native = vllm_gdn._causal_conv1d_update_cpu(
            x=x.view(1, n, C), conv_states=conv_buf.clone(), weight=layer.conv1d.weight, bias=bias,
            silu_activation=True, conv_state_indices=torch.tensor([slot], dtype=torch.int32),
            is_weight_packed=True, num_accepted_tokens=torch.tensor([1], dtype=torch.int32))
        theirs = (native.view(n, C) == want).float().mean().item()
        line += f"; vLLM's packed conv on {theirs:.4f}"
        assert ours >= theirs
    print(line)
    assert ours >= 0.999
    # elsewhere at most one bf16 step off
    one_step = torch.finfo(torch.bfloat16).eps * want.float().abs() + 1e-6
    assert bool(((got.float() - want.float()).abs() <= one_step).all())
