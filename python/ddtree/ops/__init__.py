"""ddtree.ops: the typed wrappers over ``torch.ops.ddtree.*``, their fake kernels and the
pure-PyTorch reference written from docs/spec.md (``ddtree.ops.reference``, the test oracle).
Imports nothing of ddtree but the native extension ``ddtree._C``."""
from . import fake  # noqa: F401  (registers the fake kernels)
from .attention import attention_op_supports, draft_attention, tree_attention, tree_attention_mask
from .recurrent import (commit_recurrent_, commit_recurrent_layers_, tree_causal_conv1d,
                        tree_gated_delta_rule)
from .tree import (DraftTree, GreedyVerdict, TreeVisibility, Verdict, build_tree, chain_to_tree,
                   chain_tree, commit_kv_, commit_kv_layers_, draft_to_tree, draft_tree,
                   expected_accepts, first_nodes, gather_accepted, tree_topk, tree_topk_merge,
                   tree_topk_shard, tree_visibility, verify_greedy, verify_sample)
from .validation import set_validation, validation, validation_enabled

__all__ = [
    "DraftTree", "GreedyVerdict", "TreeVisibility", "Verdict", "attention_op_supports",
    "build_tree", "chain_to_tree", "chain_tree", "commit_kv_", "commit_kv_layers_",
    "commit_recurrent_", "commit_recurrent_layers_", "draft_attention", "draft_to_tree",
    "draft_tree", "expected_accepts", "first_nodes", "gather_accepted", "set_validation",
    "tree_attention", "tree_attention_mask", "tree_causal_conv1d", "tree_gated_delta_rule",
    "tree_topk", "tree_topk_merge", "tree_topk_shard", "tree_visibility", "validation",
    "validation_enabled", "verify_greedy", "verify_sample",
]
