"""The tree ops: visibility, top-k, construction, verification walks, KV commit (spec §3-§6).
Typed wrappers over ``torch.ops.ddtree.*``; the schemas live in csrc/registration.cpp."""
from __future__ import annotations

import numbers
from typing import NamedTuple, Optional, Sequence, Union

import torch


class TreeVisibility(NamedTuple):
    visible: torch.Tensor    # bool [B, N, N]: visible[b, i, j] = j is i or an ancestor of i
    packed: torch.Tensor     # int32 [B, N, ceil(N/32)]: bit j of row i (little-endian words)
    positions: torch.Tensor  # int64 [B, N]: start[b] + depth


def _start_tensor(start: Union[int, torch.Tensor], parents: torch.Tensor) -> torch.Tensor:
    if isinstance(start, torch.Tensor):
        return start
    return torch.full((parents.shape[0],), int(start), dtype=torch.int64, device=parents.device)


def tree_visibility(
    parents: torch.Tensor, num_nodes: torch.Tensor, start: Union[int, torch.Tensor] = 0
) -> TreeVisibility:
    """Ancestor-or-self visibility of a padded batch of trees (spec §4).

    parents: int32/int64 [B, N], parent index (< own index) or -1 for the root and padding rows.
    num_nodes: int [B], real rows per tree (root included); rows beyond are padding and see only
    themselves. start: position of each root (int or int [B]).
    """
    visible, packed, positions = torch.ops.ddtree.tree_visibility(
        parents, num_nodes, _start_tensor(start, parents)
    )
    return TreeVisibility(visible, packed, positions)


class DraftTree(NamedTuple):
    """A padded batch of draft trees, [B, N] per field (N = budget + 1), nodes in pop order:
    row 0 is the root (the bonus token), parent < child, padding rows hold token 0 and -1 links."""

    node_tokens: torch.Tensor   # int64 [B, N]
    parents: torch.Tensor       # int64 [B, N], -1 for the root and padding
    depths: torch.Tensor        # int64 [B, N], 0 for the root
    first_child: torch.Tensor   # int64 [B, N], -1 = none (children in index order)
    next_sibling: torch.Tensor  # int64 [B, N], -1 = none
    num_nodes: torch.Tensor     # int64 [B], root included
    # float32 [B, N]: each node's path log-probability under the drafter (root 0, padding -inf),
    # non-increasing along the rows (build_tree only; None for chain trees). See expected_accepts.
    path_logprobs: Optional[torch.Tensor] = None


class Verdict(NamedTuple):
    """The walk's result, greedy or sampling: the accepted path and the bonus token."""

    accepted: torch.Tensor    # int64 [B, max_depth + 1] accepted node indices, root first, -1 pad
    accept_len: torch.Tensor  # int64 [B] >= 1
    bonus: torch.Tensor       # int64 [B] target token after the accepted path


GreedyVerdict = Verdict  # the greedy walk's verdict: the same tuple as sampling's


def build_tree(
    logprobs: torch.Tensor,
    ids: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    budgets: Optional[torch.Tensor] = None,
) -> DraftTree:
    """The `budget` highest-scoring draft prefixes as a tree (spec §3), bit-exact with the
    published reference. logprobs float32 [B, L, K] sorted non-increasing along K (top-k
    log-softmax values), ids [B, L, K], root_tokens [B]; budgets [B] (<= budget) per request."""
    return DraftTree(*torch.ops.ddtree.build_tree(logprobs, ids, root_tokens, int(budget), budgets))


def expected_accepts(tree: DraftTree) -> torch.Tensor:
    """float32 [B, N]: entry n is the expected number of accepted draft nodes of the tree's first
    n nodes (rows 1..n: the best n-node tree, rows being in pop order) if the target followed the
    drafter's distribution — the prefix sum of exp(path_logprobs) (spec §3's objective); entry 0
    is 0 (the root alone). Padding rows add 0. Device ops only (no host read)."""
    if tree.path_logprobs is None:
        raise ValueError("expected_accepts: the tree has no path_logprobs (build_tree trees have)")
    return tree.path_logprobs.exp().cumsum(1) - 1.0  # the root row's exp(0) = 1 taken off


def verify_greedy(tree: DraftTree, target_tokens: torch.Tensor, max_depth: int) -> Verdict:
    """Greedy walk (spec §5): follow the child whose token equals the target's token at the
    current node. target_tokens int [B, N] (the target's argmax per tree row)."""
    return Verdict(
        *torch.ops.ddtree.verify_greedy(
            tree.node_tokens, tree.first_child, tree.next_sibling, tree.num_nodes, target_tokens,
            int(max_depth),
        )
    )


def _per_request(value, batch: int, dtype: torch.dtype, device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype).expand(batch).contiguous() if value.dim() == 0 \
            else value.to(device=device, dtype=dtype)
    return torch.full((batch,), value, dtype=dtype, device=device)


def verify_sample(
    tree: DraftTree,
    target_logits: torch.Tensor,
    max_depth: int,
    temperature: Union[float, torch.Tensor] = 1.0,
    top_k: Union[int, torch.Tensor] = 0,
    top_p: Union[float, torch.Tensor] = 1.0,
    seed: Union[int, torch.Tensor] = 0,
    offset: Union[int, torch.Tensor] = 0,
) -> Verdict:
    """Lossless sampling walk (spec §5): at each node draw y from the target's filtered
    distribution (temperature, then top-k, then top-p, as Hugging Face samples); follow the child
    carrying y, else stop with bonus y. Randomness: Philox keyed by (seed, offset, request, node),
    so equal inputs give equal outputs and a CUDA graph can replay it (pass tensors for the
    per-request settings and bump `offset` each round). temperature <= 0 means greedy."""
    b, device = tree.node_tokens.shape[0], tree.node_tokens.device
    return Verdict(
        *torch.ops.ddtree.verify_sample(
            tree.node_tokens, tree.first_child, tree.next_sibling, tree.num_nodes, target_logits,
            _per_request(temperature, b, torch.float32, device),
            _per_request(top_k, b, torch.int64, device),
            _per_request(top_p, b, torch.float32, device),
            _per_request(seed, b, torch.int64, device),
            _per_request(offset, b, torch.int64, device),
            int(max_depth),
        )
    )


def commit_kv_(
    cache: torch.Tensor,
    past_len: torch.Tensor,
    accepted: torch.Tensor,
    accept_len: torch.Tensor,
    layout: str = "BHSD",
    committed_len: Optional[torch.Tensor] = None,
) -> None:
    """In place (spec §6): cache rows past + accepted[j] move to dst + j for j < accept_len
    (dst = committed_len[b] when given, else past_len[b]). layout "BHSD" ([B, H, S, D]) or "BSHD"; the
    caller then sets each request's length to dst + accept_len."""
    torch.ops.ddtree.commit_kv_(cache, past_len, accepted, accept_len, layout, committed_len)


def commit_kv_layers_(
    caches: Sequence[torch.Tensor],
    past_len: torch.Tensor,
    accepted: torch.Tensor,
    accept_len: torch.Tensor,
    layout: str = "BHSD",
    committed_len: Optional[torch.Tensor] = None,
) -> None:
    """commit_kv_ on many caches of one shape, dtype and strides (the K and V of every attention
    layer) in one op call and one launch per 128 caches."""
    torch.ops.ddtree.commit_kv_layers_(list(caches), past_len, accepted, accept_len, layout,
                                       committed_len)


def tree_topk(logits: torch.Tensor, k: int):
    """(logprobs float32 [B, L, k], ids int64 [B, L, k]): log-softmax over the full vocabulary
    and the k best tokens per row, descending, ties to the lower id (NaN ranks below -inf)."""
    return torch.ops.ddtree.tree_topk(logits, int(k))


def tree_topk_shard(logits: torch.Tensor, k: int, vocab_offset: int, vocab_size: int) -> torch.Tensor:
    """One vocabulary shard's part of tree_topk: logits [B, L, V_shard] are columns
    [vocab_offset, vocab_offset + V_shard) of a vocabulary of vocab_size tokens. Returns parts
    int64 [B, L, k + 1]: the shard's k best candidates as selection keys (logit order, then lower
    global id; descending, 0-padded) and one word packing the shard's log-sum-exp accumulator
    (max, sum of exp(x - max)). Stack the shards' parts (an all-gather) for tree_topk_merge."""
    return torch.ops.ddtree.tree_topk_shard(logits, int(k), int(vocab_offset), int(vocab_size))


def tree_topk_merge(parts: torch.Tensor):
    """The shards' parts stacked [S, B, L, k + 1] -> tree_topk over the whole vocabulary:
    (logprobs float32 [B, L, k], ids int64 [B, L, k]), global ids, ties to the lower id."""
    return torch.ops.ddtree.tree_topk_merge(parts)


def draft_tree(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    budgets: Optional[torch.Tensor] = None,
    k: Optional[int] = None,
    vocab_shard=None,
) -> DraftTree:
    """Draft logits [B, L, V] -> the optimal DraftTree of `budget` nodes: tree_topk -> build_tree.
    K defaults to min(budget, V, 1024), which is sufficient for the optimal tree (spec §3). With
    vocab_shard (ddtree.parallel.VocabShard), the logits are this rank's vocabulary columns
    [B, L, V_local] and the top-k is the sharded one (the same result on every rank)."""
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise ValueError(f"draft_to_tree: budget must be an integer >= 0, got {budget!r}")
    vocab = draft_logits.shape[-1] if vocab_shard is None else vocab_shard.vocab_size
    k = min(int(budget), vocab, 1024) if k is None else int(k)
    topk = tree_topk if vocab_shard is None else vocab_shard.tree_topk
    logprobs, ids = topk(draft_logits, k)
    return build_tree(logprobs, ids, root_tokens, budget, budgets)


def draft_to_tree(
    draft_logits: torch.Tensor,
    root_tokens: torch.Tensor,
    budget: int,
    start: Union[int, torch.Tensor] = 0,
    budgets: Optional[torch.Tensor] = None,
    k: Optional[int] = None,
    vocab_shard=None,
):
    """Draft logits [B, L, V] -> (DraftTree, TreeVisibility): draft_tree, then tree_visibility;
    three launches."""
    tree = draft_tree(draft_logits, root_tokens, budget, budgets, k, vocab_shard)
    return tree, tree_visibility(tree.parents, tree.num_nodes, start)


def first_nodes(tree: DraftTree, budget: int) -> DraftTree:
    """The best `budget`-node tree inside a build_tree tree of more nodes: its first budget + 1
    rows (rows are in pop order and parents come first, so every prefix is a tree). Views, no
    copies; links to later rows are ignored by the walks (they stop at num_nodes)."""
    n = budget + 1
    return DraftTree(*(t if t is None else t[:, :n] if t.dim() == 2 else t.clamp(max=n)
                       for t in tree))


def chain_tree(draft_logits: torch.Tensor, root_tokens: torch.Tensor) -> DraftTree:
    """DFlash's chain as a DraftTree of N = L + 1 rows, straight from the draft logits [B, L, V]:
    node d is the argmax of depth d - 1 (ties -> lower id), up to the first depth whose top-1
    log-prob is not a real number (a NaN / +inf in the row, or all -inf). Equals
    build_tree(*tree_topk(draft_logits, 1), root_tokens, L) in one pass over the logits, without
    the log-softmax."""
    return DraftTree(*torch.ops.ddtree.chain_tree(draft_logits, root_tokens))


def chain_to_tree(draft_logits: torch.Tensor, root_tokens: torch.Tensor,
                  start: Union[int, torch.Tensor] = 0, vocab_shard=None):
    """The chain-mode counterpart of draft_to_tree: (chain_tree, tree_visibility), two launches.
    With vocab_shard: build_tree over the sharded top-1 (chain_tree's definition)."""
    if vocab_shard is None:
        tree = chain_tree(draft_logits, root_tokens)
    else:
        tree = build_tree(*vocab_shard.tree_topk(draft_logits, 1), root_tokens,
                          draft_logits.shape[1])
    return tree, tree_visibility(tree.parents, tree.num_nodes, start)


def gather_accepted(features: torch.Tensor, accepted: torch.Tensor,
                    accept_len: torch.Tensor) -> torch.Tensor:
    """Features of the accepted nodes in path order: [B, N, F] -> [B, A, F], rows at and beyond
    accept_len zeroed (fixed shape, no host sync) — the drafter's next context (spec §6)."""
    index = accepted.clamp(min=0)[..., None].expand(-1, -1, features.shape[-1])
    out = torch.gather(features, 1, index)
    valid = torch.arange(accepted.shape[1], device=accepted.device)[None, :] < accept_len[:, None]
    return torch.where(valid[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))
