"""Training a DFlash drafter for a transformers causal-LM target (`ddtree train-drafter`).

DFlash recipe (arXiv 2602.06036): the target is frozen and supplies the
context features (hidden states of `target_layer_ids`) and the shared embedding / LM head; each
training sequence gets random anchor positions; the block after an anchor is
`[anchor token, MASK x (block_size - 1)]` at positions anchor .. anchor + block_size - 1, its
queries see the context features of positions < anchor and their own block (non-causal, as at
inference); block row k (1-based) predicts the token k places after the anchor in the target's
own greedy continuation (or in the data, `labels="data"`), with loss weight exp(-(k - 1) / gamma).
Many anchors of one sequence share one forward pass through a block-diagonal mask.
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import List, Optional

import torch
import torch.nn.functional as F

from ..models.common import atomic_path, text_config
from .corpus import random_windows
from .optimise import Run, optimise

# ---- the drafter ----

@dataclass
class DrafterRecipe:
    steps: int = 1500
    batch: int = 16            # sequences per step
    anchors: int = 8           # blocks per sequence
    sequences: int = 1536      # training sequences (prompt + greedy continuation)
    prompt_len: int = 64
    gen_len: int = 96
    labels: str = "greedy"     # "greedy": the target's own continuation; "data": the corpus
    gamma: float = 7.0         # loss weight exp(-(k - 1) / gamma) on block row k
    lr: float = 2e-3
    warmup: int = 60
    seed: int = 0

    def check(self) -> None:
        """ValueError naming the first setting out of range (CLI flag names)."""
        for name in ("steps", "batch", "anchors", "sequences", "prompt_len", "gen_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"train-drafter: --{name.replace('_', '-')} must be an integer "
                                 f">= 1, got {value!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"train-drafter: warmup must be an integer >= 0, got {self.warmup!r}")
        for name in ("gamma", "lr"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"train-drafter: --{name} must be a finite number > 0, got {value!r}")
        if self.labels not in ("greedy", "data"):
            raise ValueError(f"train-drafter: --labels must be 'greedy' or 'data', got {self.labels!r}")


@torch.no_grad()
def greedy_sequences(target, prompts: torch.Tensor, gen_len: int, batch: int = 64,
                     quiet: bool = False) -> torch.Tensor:
    """prompts [N, P] followed by the target's greedy continuation of gen_len tokens: [N, P + gen_len]
    (transformers' generate; end-of-text is not a stop here: the continuation just goes on)."""
    from tqdm import tqdm

    device = target.get_input_embeddings().weight.device
    out = []
    for i in tqdm(range(0, prompts.shape[0], batch), desc="greedy data", disable=quiet):
        x = prompts[i:i + batch].to(device)
        seq = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_len,
                              min_new_tokens=gen_len, do_sample=False, eos_token_id=None,
                              pad_token_id=0)
        out.append(seq.cpu())
    return torch.cat(out)


@torch.no_grad()
def target_features(target, drafter, tokens: torch.Tensor, batch: int = 32) -> torch.Tensor:
    """The drafter's context features of every position: [N, T, n * H] (the target's dtype)."""
    device = target.get_input_embeddings().weight.device
    feats = []
    for i in range(0, tokens.shape[0], batch):
        out = target(input_ids=tokens[i:i + batch].to(device), output_hidden_states=True)
        feats.append(drafter.target_features(out.hidden_states).cpu())
    return torch.cat(feats)


def block_logits(drafter, target, features: torch.Tensor, tokens: torch.Tensor,
                 anchors: torch.Tensor) -> torch.Tensor:
    """Training forward of many blocks at once. features [B, T, n*H] (target features of every
    position), tokens [B, T], anchors [B, M] (block m starts at anchors[:, m] and sees the context
    of positions < anchors[:, m] and its own block). Returns logits [B, M, block_size - 1, V] of
    block rows 1.. — the same numbers a drafter step gives for that context and bonus token
    (tests/test_train_drafter.py)."""
    b, t = tokens.shape
    m, s = anchors.shape[1], drafter.block_size
    device = tokens.device
    ctx = drafter.context(features)
    x = drafter.block_embeddings(target, tokens.gather(1, anchors)).view(b, m * s, -1).to(ctx.dtype)
    pos_q = (anchors[:, :, None] + torch.arange(s, device=device)).view(b, m * s)
    pos_kv = torch.cat([torch.arange(t, device=device).expand(b, t), pos_q], 1)
    rope_q, rope_kv = drafter.rotary_emb(x, pos_q), drafter.rotary_emb(x, pos_kv)
    sees_ctx = (torch.arange(t, device=device) < anchors[:, :, None]).repeat_interleave(s, 1)
    which = torch.arange(m, device=device).repeat_interleave(s)
    sees_block = (which[:, None] == which[None, :]).expand(b, -1, -1)
    mask = torch.cat([sees_ctx, sees_block], 2)[:, None]  # [B, 1, M*S, T + M*S]
    for layer in drafter.layers:
        x = layer.forward_blocks(x, ctx, rope_q, rope_kv, mask)
    return drafter.block_logits(target, x.view(b, m, s, -1)[:, :, 1:])


def drafter_loss(drafter, target, features, tokens, anchors, gamma: float) -> torch.Tensor:
    """Weighted cross-entropy of block rows k = 1..block_size-1 against tokens[anchor + k]
    (anchors <= T - block_size), weight exp(-(k - 1) / gamma), normalised by the weights."""
    s = drafter.block_size
    logits = block_logits(drafter, target, features, tokens, anchors).float()
    at = anchors[:, :, None] + torch.arange(1, s, device=tokens.device)
    labels = tokens.gather(1, at.flatten(1)).view_as(at)
    ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none").view_as(at)
    w = torch.exp(-torch.arange(s - 1, device=tokens.device, dtype=torch.float32) / gamma)
    return (ce * w).sum() / (w.sum() * at.shape[0] * at.shape[1])


def drafter_config_for(target, layers: int, mask_token_id: int, block_size: int = 16,
                       target_layer_ids: Optional[List[int]] = None):
    """A DFlash drafter config matching `target` (hidden size, heads, MLP width, RoPE)."""
    from ..models import dflash_config

    tcfg = text_config(target.config)
    heads = tcfg.num_attention_heads
    head_dim = getattr(tcfg, "head_dim", None) or tcfg.hidden_size // heads
    config = dict(vocab_size=target.get_input_embeddings().num_embeddings,
                  hidden_size=tcfg.hidden_size, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=tcfg.num_key_value_heads,
                  head_dim=head_dim, intermediate_size=tcfg.intermediate_size,
                  rms_norm_eps=tcfg.rms_norm_eps, max_position_embeddings=tcfg.max_position_embeddings,
                  block_size=block_size, num_target_layers=tcfg.num_hidden_layers,
                  dflash_config={"mask_token_id": int(mask_token_id)})
    if target_layer_ids:
        config["dflash_config"]["target_layer_ids"] = list(target_layer_ids)
    return dflash_config(config)


def drafter_sequences(target, stream: torch.Tensor, recipe: DrafterRecipe, quiet=False):
    """Training sequences [N, prompt_len + gen_len] and the first valid anchor: with greedy labels,
    corpus prompts + the target's greedy continuation (anchors from prompt_len - 1); with data
    labels, corpus windows (anchors from 1)."""
    g = torch.Generator().manual_seed(recipe.seed + 1)
    if recipe.labels == "greedy":
        prompts = random_windows(stream, recipe.sequences, recipe.prompt_len, g)
        return greedy_sequences(target, prompts, recipe.gen_len, quiet=quiet), recipe.prompt_len - 1
    if recipe.labels == "data":
        return random_windows(stream, recipe.sequences, recipe.prompt_len + recipe.gen_len, g), 1
    raise ValueError(f"train-drafter: labels must be 'greedy' or 'data', got {recipe.labels!r}")


def train_drafter(target, drafter, stream: torch.Tensor, recipe: DrafterRecipe, out: str,
                  resume=False, quiet=False, save_every=200) -> dict:
    """Trains `drafter` (in place) against the frozen `target`; saves it to `out` in the DFlash
    checkpoint format with the recipe. Returns timings."""
    recipe.check()
    target.eval().requires_grad_(False)
    drafter.check_target(target)
    t0 = time.perf_counter()
    tokens, first_anchor = drafter_sequences(target, stream, recipe, quiet)
    feats = target_features(target, drafter, tokens)
    t_data = time.perf_counter() - t0
    last_anchor = tokens.shape[1] - drafter.block_size
    if last_anchor < first_anchor:
        raise ValueError("train-drafter: sequences are shorter than one block after the first anchor")
    g = torch.Generator().manual_seed(recipe.seed)
    run = Run(out, "drafter", recipe.steps, quiet, asdict(recipe))
    drafter.train()

    def loss_fn():
        rows = torch.randint(0, tokens.shape[0], (recipe.batch,), generator=g)
        anchors = torch.randint(first_anchor, last_anchor + 1, (recipe.batch, recipe.anchors),
                                generator=g)
        device = drafter.fc.weight.device
        return drafter_loss(drafter, target, feats[rows].to(device), tokens[rows].to(device),
                            anchors.to(device), recipe.gamma)

    params = [p for p in drafter.parameters() if p.requires_grad]
    t_train = optimise(drafter, params, recipe.steps, recipe.lr, recipe.warmup, loss_fn, run, g,
                        resume, save_every)
    drafter.eval()
    drafter.save_pretrained(out)
    info = dict(recipe=asdict(recipe), data_seconds=round(t_data, 1),
                train_seconds=round(t_train, 1))
    with atomic_path(os.path.join(out, "training.json")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
    return info


# What `train-drafter` writes into --out (the drafter, its recipe, the resumable state, the loss
# log); temporary files are ".<name>.<pid>.<tag>.tmp".
DRAFTER_OUTPUTS = ("config.json", "model.safetensors", "training.json", "drafter_state.pt",
                   "drafter_log.jsonl")


def is_drafter_config(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "dflash_config" in config
