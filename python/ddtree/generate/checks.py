"""The API boundary's checks of a generation request (the rounds run the ops with their value
checks off): prompts, budgets, sampling settings, the target's architecture and the drafter."""
from __future__ import annotations

import math
import numbers

import torch

from ..budget import BUCKETS
from ..models import gated_delta
from ..models.common import text_config

SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama", "mistral")
HYBRID_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
MODES = ("tree", "chain", "autoregressive")


def check_target(target) -> bool:
    """True for a hybrid target (Gated DeltaNet layers, run over the tree by models.gated_delta)."""
    model_type = getattr(target.config, "model_type", None)
    if model_type in HYBRID_MODEL_TYPES:
        if not gated_delta.gated_delta_layers(target):
            raise ValueError(f"generate: hybrid target '{model_type}' has no Gated DeltaNet layers "
                             "that ddtree recognises")
        return True
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"generate: unsupported target architecture '{model_type}'; supported: "
                         f"{', '.join(SUPPORTED_MODEL_TYPES + HYBRID_MODEL_TYPES)}")
    return False


MAX_SEED = 2**43  # request b's Philox key is seed * 1000003 + b (int64)


def is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def as_token_ids(name: str, value) -> torch.Tensor:
    """A prompt as an int64 tensor; a clear error for anything that is not integer token ids."""
    try:
        t = torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError) as e:
        raise TypeError(f"generate: {name} must be token ids (a list of ints or an integer tensor): "
                        f"{e}") from None
    if t.numel() > 0 and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise TypeError(f"generate: {name} must hold integer token ids, got dtype {t.dtype}")
    return t.long()


def check_request(target, drafter, prompts, max_new_tokens, mode, budget, temperature, top_k,
                   top_p, seed, stop_token_ids):
    """The API boundary's checks (the rounds run the ops without value checks); returns (prompts
    as 1-D long tensors, budgets, is_hybrid, stop token ids)."""
    if mode not in MODES:
        raise ValueError(f"generate: mode must be one of {MODES}, got {mode!r}")
    if not is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
    if not is_int(top_k) or not all(isinstance(x, numbers.Real) and not isinstance(x, bool)
                                     for x in (temperature, top_p)):
        raise ValueError(f"generate: temperature and top_p must be numbers and top_k an integer; got "
                         f"temperature={temperature!r}, top_k={top_k!r}, top_p={top_p!r}")
    if not math.isfinite(temperature) or top_k < 0 or not 0.0 < top_p <= 1.0:
        raise ValueError(f"generate: sampling needs a finite temperature (<= 0: greedy), top_k >= 0 "
                         f"and 0 < top_p <= 1; got temperature={temperature}, top_k={top_k}, "
                         f"top_p={top_p}")
    if isinstance(prompts, torch.Tensor) or not isinstance(prompts, (list, tuple)):
        raise TypeError(f"generate_batch: prompts must be a list of prompts (token lists or 1-D "
                        f"tensors), got {type(prompts).__name__}")
    prompts = [as_token_ids(f"prompt {i}", p).reshape(-1) for i, p in enumerate(prompts)]
    if not prompts or any(p.numel() == 0 for p in prompts):
        raise ValueError("generate: every prompt must be non-empty")
    if budget == "auto":
        if mode != "tree":
            raise ValueError(f"generate: budget='auto' chooses tree sizes; it needs mode='tree', got "
                             f"mode={mode!r}")
        budgets = [max(BUCKETS)] * len(prompts)
    else:
        budgets = [budget] * len(prompts) if is_int(budget) else \
            list(budget) if isinstance(budget, (list, tuple)) else None
        if budgets is None or len(budgets) != len(prompts) or \
                not all(is_int(b) and b >= 0 for b in budgets):
            raise ValueError(f"generate: budget must be an integer >= 0, a list of one per prompt "
                             f"({len(prompts)}) or 'auto', got {budget!r}")
        budgets = [int(b) for b in budgets]
    if not is_int(seed) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"generate: seed must be an integer in [0, {MAX_SEED}], got {seed!r}")
    stops = list(stop_token_ids)
    if not all(is_int(t) for t in stops):
        raise ValueError(f"generate: stop_token_ids must be integers, got {stops!r}")
    is_hybrid = check_target(target)
    vocab = target.get_input_embeddings().num_embeddings
    for i, p in enumerate(prompts):
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"generate: prompt {i} holds token ids outside the target's vocabulary "
                             f"[0, {vocab}): min {int(p.min())}, max {int(p.max())}")
    cfg = text_config(target.config)
    limit = getattr(cfg, "max_position_embeddings", None)
    longest = max(p.numel() for p in prompts)
    if limit is not None and longest + max_new_tokens > limit:
        raise ValueError(f"generate: the longest prompt ({longest} tokens) + max_new_tokens "
                         f"({max_new_tokens}) exceeds the target's max_position_embeddings ({limit})")
    if mode != "autoregressive":
        if drafter is None:
            raise ValueError(f"generate: mode '{mode}' needs a drafter")
        missing = [a for a in ("block_size", "check_target", "begin") if not hasattr(drafter, a)]
        if missing:
            raise TypeError(f"generate: the drafter must follow the ddtree.generate.Drafter "
                            f"protocol (block_size, check_target, begin); "
                            f"{type(drafter).__name__} lacks {', '.join(missing)}")
        drafter.check_target(target)
    return prompts, budgets, is_hybrid, stops
