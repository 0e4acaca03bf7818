"""ddtree.train: training DFlash drafters (the DFlash recipe), the corpus and tokenizer, and the
recipe that builds the embedded pair. Imports ddtree.models."""
from .corpus import corpus_texts, stdlib_files, token_stream, train_tokenizer
from .drafter import DrafterRecipe, drafter_config_for, train_drafter
from .optimise import TargetRecipe, train_target

__all__ = ["DrafterRecipe", "TargetRecipe", "corpus_texts", "drafter_config_for", "stdlib_files",
           "token_stream", "train_drafter", "train_target", "train_tokenizer"]
