"""ddtree.models: what the loop runs on transformers models: the DFlash drafter, the target's tree
attention and Gated DeltaNet layers over trees, packed linears, loading. Imports ddtree.ops and
ddtree.parallel only."""
from .attention import TreeBatch, use_tree_attention, uses_tree_attention
from .dflash import DFlashDrafter, DraftCache
from .dflash_config import default_target_layer_ids, dflash_config
from .loading import load_drafter, load_target, load_tokenizer
from .packed_linear import PackedLinear, lm_head, use_packed_linears, use_packed_lm_head

__all__ = ["DFlashDrafter", "DraftCache", "PackedLinear", "TreeBatch", "default_target_layer_ids",
           "dflash_config", "lm_head", "load_drafter", "load_target", "load_tokenizer",
           "use_packed_linears", "use_packed_lm_head", "use_tree_attention", "uses_tree_attention"]
