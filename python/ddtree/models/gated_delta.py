"""Hybrid targets (Qwen3.5, Qwen3-Next: Gated DeltaNet + full attention) in the speculative loop.

During a verify pass each Gated DeltaNet module runs over the *tree*: its short convolution and
recurrence come from the ddtree ops (every node from its parent's state, the root from the cached
state) instead of the chain kernels, using the module's own projections, norm and parameters and
transformers' cache objects (`cache.layers[i].conv_states[0]` [B, C, W],
`.recurrent_states[0]` [B, Hv, Dk, Dv]). Nothing is written to the cache during the pass;
`commit` then moves each layer's conv window and recurrent state along the accepted path. The tree
comes with the call (transformers passes the forward's `ddtree_tree` keyword down to these
modules). `install_tree_dispatch` gives each Gated DeltaNet class, once per process, a forward
that takes the tree path when the keyword is there and otherwise calls the class's own forward
unchanged (prefill, plain decoding, other users of the model). Nothing is switched per
generation, so generations on one model may run in several threads at once.
"""
from __future__ import annotations

import functools
import threading
from typing import List

import torch
import torch.nn.functional as F

from .. import ops


def is_gated_delta_net(module) -> bool:
    return type(module).__name__.endswith("GatedDeltaNet") and (
        hasattr(module, "in_proj_qkv") or hasattr(module, "in_proj_qkvz"))


def _projections(module, hidden_states):
    """(conv inputs [B, N, C], z [B, N, Hv, Dv], b, a [B, N, Hv]) from the module's own
    projections: separate ones (Qwen3.5) or the fused qkvz / ba ones with the module's own
    reordering (Qwen3-Next)."""
    bsz, n = hidden_states.shape[:2]
    if hasattr(module, "in_proj_qkvz"):
        q, k, v, z, b, a = module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states),
                                                               module.in_proj_ba(hidden_states))
        mixed = torch.cat([x.reshape(bsz, n, -1) for x in (q, k, v)], -1)
        return mixed, z, b, a
    return (module.in_proj_qkv(hidden_states),
            module.in_proj_z(hidden_states).reshape(bsz, n, -1, module.head_v_dim),
            module.in_proj_b(hidden_states), module.in_proj_a(hidden_states))


def gated_delta_layers(model) -> List[torch.nn.Module]:
    return [m for m in model.modules() if is_gated_delta_net(m)]


def _tree_forward(module, hidden_states, cache_params, attention_mask=None, *, ddtree_tree,
                  **kwargs):
    """The module's forward inside a verify pass (a TreeBatch in `ddtree_tree`): the conv and the
    recurrence run over the tree from the committed states (not modified), and the tensors the
    commit needs are left in ddtree_tree.recurrent[layer index]."""
    tree = ddtree_tree
    b, n, _ = hidden_states.shape
    layer = cache_params.layers[module.layer_idx]
    conv_state, state = layer.conv_states[0], layer.recurrent_states[0]
    slots = torch.arange(b, device=hidden_states.device)
    mixed, z, b_proj, a_proj = _projections(module, hidden_states)  # mixed: conv inputs
    beta = b_proj.sigmoid()
    g = -module.A_log.float().exp() * F.softplus(a_proj.float() + module.dt_bias)
    conv = ops.tree_causal_conv1d(mixed, conv_state, slots, module.conv1d.weight.squeeze(1),
                                  module.conv1d.bias, tree.parents, tree.num_nodes,
                                  module.activation)
    q, k, v = torch.split(conv, [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    q = q.reshape(b, n, -1, module.head_k_dim)
    k = k.reshape(b, n, -1, module.head_k_dim)
    v = v.reshape(b, n, -1, module.head_v_dim)
    core = ops.tree_gated_delta_rule(q, k, v, g, beta, state, slots, tree.parents,
                                     tree.num_nodes, tree.max_depth).to(v.dtype)
    tree.recurrent[module.layer_idx] = (mixed, k, v, g, beta)
    core = module.norm(core.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(core.reshape(b, n, -1))


_INSTALL_LOCK = threading.Lock()


def _dispatching_forward(class_forward):
    @functools.wraps(class_forward)
    def forward(module, hidden_states, *args, ddtree_tree=None, **kwargs):
        if ddtree_tree is None:
            return class_forward(module, hidden_states, *args, **kwargs)
        return _tree_forward(module, hidden_states, *args, ddtree_tree=ddtree_tree, **kwargs)

    forward.ddtree_tree_dispatch = True
    return forward


def install_tree_dispatch(model) -> None:
    """Every Gated DeltaNet class of `model` takes the `ddtree_tree` keyword (see _tree_forward).
    Idempotent and thread-safe; installed once per class and never removed (without the keyword
    the class's forward runs as before)."""
    with _INSTALL_LOCK:
        for cls in {type(m) for m in gated_delta_layers(model)}:
            if not getattr(cls.forward, "ddtree_tree_dispatch", False):
                cls.forward = _dispatching_forward(cls.forward)


def commit(cache, tree, verdict: ops.Verdict) -> None:
    """Conv windows and recurrent states of every GDN layer move along the accepted path (one op
    call for all layers); tree: the pass's TreeBatch."""
    if not tree.recurrent:
        return
    idx = sorted(tree.recurrent)
    mixed, k, v, g, beta = (list(t) for t in zip(*(tree.recurrent[i] for i in idx)))
    slots = torch.arange(k[0].shape[0], device=k[0].device)
    ops.commit_recurrent_layers_([cache.layers[i].recurrent_states[0] for i in idx],
                                 [cache.layers[i].conv_states[0] for i in idx], slots, k, v, g, beta,
                                 mixed, verdict.accepted, verdict.accept_len)
