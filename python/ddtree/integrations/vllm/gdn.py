"""Hybrid targets inside vLLM: the Gated DeltaNet layers verify trees, and only the accepted path
enters their state.

vLLM's CPU GDN (model_executor/layers/mamba/ops/cpu/gdn_attention.py) gives each speculating
request a conv buffer [C, W - 1 + S] (S = num_speculative_tokens) in the request's first mamba
block, and by default S + 1 SSM state blocks: its `_spec_forward` advances both along the
scheduled tokens as a chain, stores the state after draft t in block t, resumes from block
num_accepted - 1 and rolls the buffer as if every request had S drafts. In a ddtree engine:
- `tree_spec_forward` replaces `_spec_forward`: every node's conv and recurrence from its parent
  (ddtree's tree_causal_conv1d / tree_gated_delta_rule), the root's from the committed window
  (buffer columns 0 .. W - 2) and state (the request's first block), nothing written;
- `commit_` (after verification) moves window and state along the accepted path
  (ddtree's commit_recurrent_layers_) and writes them back to the same places;
- so the committed state always sits where vLLM's prefill leaves it and its one-token decode
  reads it, and a request needs one state block, not S + 1: `spec_without_draft_blocks` gives
  the GDN layers' KV-cache spec num_speculative_blocks = 0;
- and the conv buffer needs no rolling history: `narrow_state_shape` allocates it as [C, W - 1],
  vLLM's CPU GDN then takes its plain (non-speculative) path, and `nonspec_or_trees` sends only
  the steps with speculative rows on to the speculative path (trees for those rows, vLLM's own
  subset path for the prefill / decode rows beside them). Steps where no request drafts (auto's
  no-draft steps, prefill) run exactly the kernels of an engine without speculation.
Rejected nodes leave nothing behind; any tree and any number of drafts per request (0 included).
"""
from __future__ import annotations

from typing import List, NamedTuple, Optional

import torch

from ...ops import commit_recurrent_layers_, tree_causal_conv1d, tree_gated_delta_rule
from .options import active_options


class SpecTrees(NamedTuple):
    """The speculating requests of the target forward in flight, in vLLM's GDN order (the batch
    rows whose num_decode_draft_tokens >= 0, in batch order)."""
    rows: List[int]          # their indices in the step plan (StepPlan.trees)
    parents: torch.Tensor    # [R, N] int64, -1 root / padding
    num_nodes: torch.Tensor  # [R] int64 (scheduled tokens: 1 + drafts)
    max_depth: int


class LayerStep(NamedTuple):
    """What one GDN layer's commit needs from its verify pass."""
    layer: object
    conv_x: torch.Tensor      # [R, N, C] conv inputs, per node
    k: torch.Tensor           # [R, N, Hk, Dk] after the conv
    v: torch.Tensor           # [R, N, Hv, Dv]
    g: torch.Tensor           # [R, N, Hv] log decay
    beta: torch.Tensor        # [R, N, Hv]
    conv_slot: torch.Tensor   # [R] the request's first mamba block: conv buffer and SSM state


class ActiveTrees:
    """Set around a ddtree verify forward (hooks.py); the layers' records wait for the commit."""
    current: Optional[SpecTrees] = None
    steps: List[LayerStep] = []


def chains(attn_metadata) -> SpecTrees:
    """The speculative rows as chains (a forward without a ddtree verify: the runner's dummy and
    profiling runs)."""
    r = int(attn_metadata.num_spec_decodes)
    lengths = attn_metadata.spec_query_start_loc[:r + 1].long().diff()
    n = int(lengths.max()) if r else 1
    node = torch.arange(n)
    parents = torch.where(node[None] < lengths[:, None], node[None] - 1, -1).expand(r, n)
    return SpecTrees(list(range(r)), parents.contiguous(), lengths, max(n - 1, 0))


def spec_forward(original):
    """vLLM's `_spec_forward`, replaced in ddtree engines (vLLM's own kernel would read the S + 1
    state blocks a ddtree engine does not allocate). Outside a verify pass nothing is committed."""
    def forward(layer, attn_metadata, *args):
        trees = ActiveTrees.current
        if trees is not None:
            return tree_spec_forward(layer, attn_metadata, *args, trees=trees)
        out = tree_spec_forward(layer, attn_metadata, *args, trees=chains(attn_metadata))
        ActiveTrees.steps = []
        return out

    forward._ddtree = True
    forward.original = original
    return forward


def narrow_state_shape(original):
    """MambaStateShapeCalculator.gated_delta_net_state_shape with num_spec = 0 in ddtree engines:
    the conv buffer is the committed window [C, W - 1] alone (tree verify never rolls it), so
    vLLM's CPU GDN takes its plain path (packed C++ conv) wherever no request speculates."""
    import inspect

    signature = inspect.signature(original)

    def shape(cls, *args, **kwargs):
        if active_options() is None:
            return original(cls, *args, **kwargs)
        bound = signature.bind(cls, *args, **kwargs)
        bound.arguments["num_spec"] = 0
        return original(*bound.args, **bound.kwargs)

    shape._ddtree = True
    return shape


def nonspec_or_trees(original, gdn_attention):
    """vLLM's `_cpu_gdn_attention_nonspec`, chosen by the conv buffer's width alone (narrow in
    ddtree engines): a step with speculative rows goes to the speculative path (trees through
    `_spec_forward`, the other rows through vLLM's subset path), a step without to vLLM's."""
    def forward(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out):
        if attn_metadata_i.spec_sequence_masks is None:
            return original(layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out)
        width = layer.conv1d.weight.size(-1)
        return gdn_attention._cpu_gdn_attention_spec_aware(
            layer, attn_metadata_i, mixed_qkv, b, a, core_attn_out, width, width - 1)

    forward._ddtree = True
    return forward


def spec_without_draft_blocks(spec):
    """A GDN layer's MambaSpec with num_speculative_blocks = 0 (one state block per request)."""
    import dataclasses

    if spec is None or not getattr(spec, "num_speculative_blocks", 0):
        return spec
    return dataclasses.replace(spec, num_speculative_blocks=0)


def spec_trees(trees, spec_mask) -> Optional[SpecTrees]:
    """SpecTrees of the step's request trees (runner.RequestTree, batch order) with
    spec_mask[row] (vLLM's speculative rows); None when there are none."""
    rows = [i for i, t in enumerate(trees) if bool(spec_mask[t.row])]
    if not rows:
        return None
    n_max = max(len(trees[i].parents) for i in rows)
    parents = torch.full((len(rows), n_max), -1, dtype=torch.int64)
    for j, i in enumerate(rows):
        parents[j, :len(trees[i].parents)] = torch.tensor(trees[i].parents)
    num_nodes = torch.tensor([len(trees[i].parents) for i in rows], dtype=torch.int64)
    max_depth = max(max(trees[i].depths) for i in rows)
    return SpecTrees(rows, parents, num_nodes, int(max_depth))


def _windows(conv_buf, conv_slot, width):
    """[R, C, W] (ddtree's conv pool rows): column 0 zero (never read), then the committed
    window, buffer columns 0 .. W - 2."""
    window = conv_buf[conv_slot, :, :width - 1]                          # [R, C, W - 1]
    zero = window.new_zeros(window.shape[0], window.shape[1], 1)
    return torch.cat([zero, window], 2).contiguous()


def tree_spec_forward(layer, attn_metadata, mixed_qkv, b, a, conv_buf, ssm_state, width,
                      state_len, trees: SpecTrees):
    """vLLM's `_spec_forward` contract: the core attention output [T, Hv, Dv] of the speculative
    tokens (mixed_qkv [T, C], b / a [T, Hv], ordered by spec_query_start_loc); conv_buf
    [slots, C, state_len], ssm_state [slots, Hv, Dk, Dv] are read, not written. vLLM's
    num_accepted_tokens is not read: the committed window and state are always in place."""
    from vllm import _custom_ops as vllm_ops
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import _unpacked_conv_weight

    md = attn_metadata
    r = int(md.num_spec_decodes)
    qsl = md.spec_query_start_loc[:r + 1].long()
    num_nodes = trees.num_nodes
    if r != num_nodes.numel() or not torch.equal(qsl.diff(), num_nodes):
        raise RuntimeError(f"ddtree: vLLM's GDN speculative rows (lengths {qsl.diff().tolist()}) "
                           f"do not match the verified trees (nodes {num_nodes.tolist()})")
    n = trees.parents.shape[1]
    node = torch.arange(n)
    index = qsl[:-1, None] + torch.minimum(node[None], num_nodes[:, None] - 1)   # [R, N] tokens
    valid = node[None] < num_nodes[:, None]
    conv_x = mixed_qkv[index]                                                    # [R, N, C]
    conv_slot = md.spec_state_indices_tensor[:r, 0].long()
    slots = torch.arange(r)
    windows = _windows(conv_buf, conv_slot, width).to(conv_x.dtype)
    activation = "silu" if layer.activation in ("silu", "swish") else None
    conv = tree_causal_conv1d(conv_x, windows, slots, _unpacked_conv_weight(layer),
                              layer.conv1d.bias, trees.parents, num_nodes, activation)
    q, k, v = (t.reshape(r, n, t.shape[-2], t.shape[-1])
               for t in layer.rearrange_mixed_qkv(conv.reshape(r * n, -1)))
    g, beta = vllm_ops.fused_gdn_gating_cpu(A_log=layer.A_log, a=a, b=b, dt_bias=layer.dt_bias)
    hv = v.shape[2]
    g, beta = g.reshape(-1, hv).float()[index], beta.reshape(-1, hv).float()[index]
    init = ssm_state[conv_slot].float().contiguous()                           # [R, Hv, Dk, Dv]
    core = tree_gated_delta_rule(q, k, v, g, beta, init, slots, trees.parents, num_nodes,
                                 trees.max_depth)
    ActiveTrees.steps.append(LayerStep(layer, conv_x, k, v, g, beta, conv_slot))
    return core[valid].to(mixed_qkv.dtype)


def commit_(trees: SpecTrees, accepted: torch.Tensor, accept_len: torch.Tensor) -> None:
    """The verify pass's GDN layers: window and state along each request's accepted path
    (accepted / accept_len: the verdict's rows; node indices root first, lengths with the root;
    rows trees.rows are the speculative ones), written back in place."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import (_conv_buffer_view,
                                                                        _ssm_state_view)

    steps, ActiveTrees.steps = ActiveTrees.steps, []
    if not steps:
        return
    rows = torch.tensor(trees.rows, dtype=torch.int64)
    accepted, accept_len = accepted[rows].long(), accept_len[rows].long()
    first = steps[0]
    r = first.conv_x.shape[0]
    slots = torch.arange(r)
    states, windows, views = [], [], []
    for s in steps:
        conv_buf, ssm_state = _conv_buffer_view(s.layer), _ssm_state_view(s.layer)
        width = s.layer.conv1d.weight.shape[-1]
        states.append(ssm_state[s.conv_slot].float().contiguous())
        windows.append(_windows(conv_buf, s.conv_slot, width).to(s.conv_x.dtype))
        views.append((conv_buf, ssm_state, width))
    commit_recurrent_layers_(states, windows, slots, [s.k for s in steps], [s.v for s in steps],
                             [s.g for s in steps], [s.beta for s in steps],
                             [s.conv_x for s in steps], accepted, accept_len)
    for s, state, window, (conv_buf, ssm_state, width) in zip(steps, states, windows, views):
        ssm_state[s.conv_slot] = state.to(ssm_state.dtype)
        conv_buf[s.conv_slot, :, :width - 1] = window[:, :, 1:].to(conv_buf.dtype)
