"""The recurrent ops of hybrid targets over a tree: the short causal convolution and the Gated
DeltaNet recurrence, and the commit of their states along the accepted path (spec §6, §7)."""
from __future__ import annotations

from typing import Optional

import torch


def tree_causal_conv1d(x, conv_state, slots, weight, bias, parents, num_nodes,
                       activation: Optional[str] = "silu") -> torch.Tensor:
    """Depthwise causal conv over a tree (spec §7): node i convolves [anc_{W-1}, ..., parent, x_i],
    reading the committed window conv_state[slots[b]] ([P, C, W] pool) above the root.
    x [B, N, C], weight [C, W], bias [C] or None; returns [B, N, C]."""
    return torch.ops.ddtree.tree_causal_conv1d(x, conv_state, slots, weight, bias, parents,
                                               num_nodes, activation)


def tree_gated_delta_rule(q, k, v, g, beta, state, slots, parents, num_nodes,
                          max_depth: int) -> torch.Tensor:
    """Gated DeltaNet over a tree (spec §7): each node from its parent's state, the root from the
    committed state[slots[b]] ([P, Hv, Dk, Dv] fp32 pool, not modified); q/k l2-normalised in the
    kernel, GQA (Hv a multiple of Hk). q, k [B, N, Hk, Dk], v [B, N, Hv, Dv], g (log decay) and
    beta [B, N, Hv]; returns [B, N, Hv, Dv]. Scratch: max_depth + 1 states per (request, head)."""
    return torch.ops.ddtree.tree_gated_delta_rule(q, k, v, g, beta, state, slots, parents,
                                                  num_nodes, int(max_depth))


def commit_recurrent_(state, conv_state, slots, k, v, g, beta, conv_x, accepted,
                      accept_len) -> None:
    """In place (spec §6): state[slots[b]] becomes the state after the accepted leaf (the path
    recomputed from the committed state) and conv_state[slots[b]] the last W conv inputs along
    [committed window, accepted path]."""
    torch.ops.ddtree.commit_recurrent_(state, conv_state, slots, k, v, g, beta, conv_x, accepted,
                                       accept_len)


def commit_recurrent_layers_(states, conv_states, slots, k, v, g, beta, conv_x, accepted,
                             accept_len) -> None:
    """commit_recurrent_ for many GDN layers in one op call: every argument but slots, accepted and
    accept_len is a list with one entry per layer."""
    torch.ops.ddtree.commit_recurrent_layers_(list(states), list(conv_states), slots, list(k),
                                              list(v), list(g), list(beta), list(conv_x), accepted,
                                              accept_len)
