"""Model-side pieces of the speculative loop: the DFlash drafter."""
from .dflash import DFlashDrafter, DraftCache, default_target_layer_ids, dflash_config

__all__ = ["DFlashDrafter", "DraftCache", "default_target_layer_ids", "dflash_config"]
