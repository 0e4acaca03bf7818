"""The embedded pair shipped with the package: a small hybrid Qwen3.5-text target and its DFlash
drafter (docs/embedded-pair.md): where it lives, how to load it, and prompts from held-out files
of the corpus it was trained on. How it is built: ddtree.train.embedded_pair."""
from __future__ import annotations

from pathlib import Path
from typing import List

import torch

from .models.loading import load_drafter, load_target, load_tokenizer
from .train.corpus import read_texts, stdlib_files
from .train.embedded_pair import PAIR_DIR, drafter_dir, target_dir

__all__ = ["PAIR_DIR", "available", "drafter_dir", "heldout_prompts", "load", "target_dir"]


def available(root: Path = PAIR_DIR) -> bool:
    return (target_dir(root) / "config.json").exists() and (drafter_dir(root) / "config.json").exists()


def load(dtype: torch.dtype = torch.float32, device: str = "cpu", root: Path = PAIR_DIR):
    """(target, drafter, tokenizer) of the embedded pair."""
    if not available(root):
        raise FileNotFoundError(f"embedded pair not found in {root}; build it with "
                                "`make embedded-pair` (python -m ddtree.train.embedded_pair)")
    return (load_target(target_dir(root), dtype, device),
            load_drafter(drafter_dir(root), dtype, device),
            load_tokenizer(target_dir(root)))


def heldout_prompts(count: int = 8) -> List[str]:
    """Prompts from held-out stdlib files (never trained on): per file, the first function
    definition line with up to 3 lines before it, ending with the newline after the `def` line.
    Deterministic (files in path order)."""
    prompts = []
    for path in stdlib_files("heldout"):
        lines = read_texts([path])[0].split("\n")
        for i, line in enumerate(lines):
            stripped = line.lstrip()
            if stripped.startswith("def ") and line.rstrip().endswith(":") and i >= 3:
                prompts.append("\n".join(lines[i - 3:i + 1]) + "\n")
                break
        if len(prompts) == count:
            break
    return prompts


