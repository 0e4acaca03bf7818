"""DFlash block-diffusion drafter (SPEC §2), reading and writing the published checkpoint format.

Built from transformers' Qwen3 pieces (RMSNorm, MLP, rotary embedding); only the drafter's own
attention (block queries over cached context K/V + the block, non-causal) is written here. The
drafter has no embedding and no LM head: it uses the target's.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import List, Optional

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    apply_rotary_pos_emb,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """SPEC §2: round(1 + i * (T - 4) / (n - 1)) for i in 0..n-1; n = 1 -> [T // 2]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1))
            for i in range(num_draft_layers)]


def dflash_config(config: dict) -> Qwen3Config:
    """A Qwen3Config carrying the DFlash fields (block_size, num_target_layers, dflash_config)."""
    cfg = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map")})
    cfg.block_size = int(config.get("block_size", 16))
    cfg.num_target_layers = int(config["num_target_layers"])
    extra = dict(config.get("dflash_config") or {})
    if "mask_token_id" not in extra:
        raise ValueError("DFlash config: dflash_config.mask_token_id is required")
    if not extra.get("target_layer_ids"):
        extra["target_layer_ids"] = default_target_layer_ids(cfg.num_target_layers,
                                                             cfg.num_hidden_layers)
    cfg.dflash_config = extra
    return cfg


class DFlashAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, cache_kv, cache_len=0, fused=False):
        """x [B, S, H] (normed block rows), ctx [B, C, H] new context rows; rope_* = (cos, sin);
        cache_kv: (K, V) [B, Hkv, C_cached, D] or None. Returns (out [B, S, H], (K_ctx, V_ctx)
        with the new context rows appended). fused: one draft_attention launch on a preallocated
        cache (K, V) [B, Hkv, capacity, D] whose first cache_len rows are committed."""
        if fused:
            return self._forward_fused(x, ctx, rope_kv, cache_kv, cache_len)
        b, s, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, s, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([ctx, x], 1)
        t = kv_in.shape[1]
        k = self.k_norm(self.k_proj(kv_in).view(b, t, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q, _ = apply_rotary_pos_emb(q, q, *rope_q)
        k, _ = apply_rotary_pos_emb(k, k, *rope_kv)
        c = ctx.shape[1]
        k_ctx, v_ctx = k[:, :, :c], v[:, :, :c]
        if cache_kv is not None:
            k_ctx = torch.cat([cache_kv[0], k_ctx], 2)
            v_ctx = torch.cat([cache_kv[1], v_ctx], 2)
        keys = torch.cat([k_ctx, k[:, :, c:]], 2)
        values = torch.cat([v_ctx, v[:, :, c:]], 2)
        rep = self.num_heads // self.num_kv_heads
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, keys.repeat_interleave(rep, 1), values.repeat_interleave(rep, 1))  # non-causal
        out = self.o_proj(attn.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))
        return out, (k_ctx, v_ctx)


    def _forward_fused(self, x, ctx, rope_kv, cache_kv, cache_len):
        from ..ops import draft_attention

        b, s, _ = x.shape
        c = ctx.shape[1]
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        kv_in = torch.cat([ctx, x], 1)
        k = self.k_proj(kv_in).view(b, c + s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(kv_in).view(b, c + s, self.num_kv_heads, self.head_dim)
        if cache_kv is None or cache_kv[0].shape[2] < cache_len + c:
            capacity = max(2 * (cache_kv[0].shape[2] if cache_kv else 0), cache_len + c + 64)
            grown = tuple(x.new_zeros(b, self.num_kv_heads, capacity, self.head_dim) for _ in range(2))
            if cache_kv is not None:
                for old, new in zip(cache_kv, grown):
                    new[:, :, :cache_len] = old[:, :, :cache_len]
            cache_kv = grown
        lens = torch.full((b,), cache_len, dtype=torch.long, device=x.device)
        out = draft_attention(q, k, v, cache_kv[0], cache_kv[1], lens, self.q_norm.weight,
                              self.k_norm.weight, rope_kv[0], rope_kv[1], c,
                              self.q_norm.variance_epsilon)
        return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim)), cache_kv


class DFlashLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, ctx, rope_q, rope_kv, cache_kv, cache_len=0, fused=False):
        attn, cache_kv = self.self_attn(self.input_layernorm(x), ctx, rope_q, rope_kv, cache_kv,
                                        cache_len, fused)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x)), cache_kv


@dataclass
class DraftCache:
    """Context K/V per draft layer and the context length (positions 0..length-1). Unfused: K/V
    [B, Hkv, length, D]; fused (draft_attention): preallocated [B, Hkv, capacity, D]."""
    layers: List[Optional[tuple]] = field(default_factory=list)
    length: int = 0
    fused: bool = False


class DFlashDrafter(nn.Module):
    """The DFlash drafter. `propose` turns the bonus token + new target features into per-depth
    draft logits [B, block_size - 1, V] using the target's embedding and LM head."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        self.target_layer_ids = [int(i) for i in config.dflash_config["target_layer_ids"]]
        h = config.hidden_size
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = Qwen3RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # "auto": the fused draft_attention op on CUDA when its kernel covers dtype and head_dim;
        # True / False force it on / off (True also works on CPU, through the op's CPU path).
        self.fused_attention = "auto"

    @property
    def depth(self) -> int:
        return self.block_size - 1

    # ---- checkpoint format ----

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        from safetensors.torch import load_file

        with open(os.path.join(path, CONFIG_NAME)) as f:
            config = dflash_config(json.load(f))
        model = cls(config)
        files = sorted(n for n in os.listdir(path) if n.endswith(".safetensors"))
        if not files:
            raise FileNotFoundError(f"DFlashDrafter.from_pretrained: no .safetensors file in {path}")
        state = {}
        for name in files:
            for key, tensor in load_file(os.path.join(path, name)).items():
                state[key[len("model."):] if key.startswith("model.") else key] = tensor
        expected = {k for k in model.state_dict() if not k.startswith("rotary_emb.")}
        missing, unexpected = expected - state.keys(), state.keys() - expected
        if missing or unexpected:
            raise ValueError(f"DFlashDrafter.from_pretrained: checkpoint keys do not match the "
                             f"DFlash layout; missing {sorted(missing)[:5]}, unexpected "
                             f"{sorted(unexpected)[:5]}")
        model.load_state_dict(state, strict=False)
        return model.to(dtype).eval()

    def save_pretrained(self, path: str) -> None:
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        config = self.config.to_dict()
        config.update(architectures=["DFlashDraftModel"], block_size=self.block_size,
                      num_target_layers=self.config.num_target_layers,
                      dflash_config=dict(self.config.dflash_config))
        with open(os.path.join(path, CONFIG_NAME), "w") as f:
            json.dump(config, f, indent=1, default=str)
        state = {k: v.contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("rotary_emb.")}
        save_file(state, os.path.join(path, WEIGHTS_NAME))

    def check_target(self, target) -> None:
        """Clear errors when this drafter does not belong to `target`."""
        tcfg = target.config.get_text_config() if hasattr(target.config, "get_text_config") \
            else target.config
        if tcfg.hidden_size != self.config.hidden_size:
            raise ValueError(f"drafter hidden_size {self.config.hidden_size} != target hidden_size "
                             f"{tcfg.hidden_size}")
        vocab = target.get_input_embeddings().num_embeddings
        if not 0 <= self.mask_token_id < vocab:
            raise ValueError(f"drafter mask_token_id {self.mask_token_id} is outside the target "
                             f"vocabulary [0, {vocab})")
        layers = tcfg.num_hidden_layers
        if self.config.num_target_layers != layers or max(self.target_layer_ids) >= layers:
            raise ValueError(f"drafter expects a {self.config.num_target_layers}-layer target with "
                             f"feature layers {self.target_layer_ids}; target has {layers} layers")

    # ---- drafting ----

    def target_features(self, hidden_states) -> torch.Tensor:
        """concat_l hidden_states[l + 1] over target_layer_ids: [B, T, n * H]."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], -1)

    def _use_fused(self) -> bool:
        if self.fused_attention != "auto":
            return bool(self.fused_attention)
        from .. import has_cuda_kernels

        w = self.fc.weight
        head_dim = self.layers[0].self_attn.head_dim
        return (w.is_cuda and has_cuda_kernels() and w.dtype in (torch.bfloat16, torch.float16)
                and head_dim in (64, 128, 256))

    def new_cache(self) -> DraftCache:
        return DraftCache([None] * len(self.layers), 0, self._use_fused())

    @torch.no_grad()
    def propose(self, target, bonus: torch.Tensor, features: torch.Tensor,
                cache: DraftCache) -> torch.Tensor:
        """bonus [B] (the block's first token), features [B, C, n*H] of the target tokens not yet
        in the drafter's context (they sit at positions cache.length ..). Appends them to the
        context cache and returns draft logits [B, block_size - 1, V]."""
        b = bonus.shape[0]
        device = bonus.device
        ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))
        c = ctx.shape[1]
        start = cache.length + c
        block = torch.full((b, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
        block[:, 0] = bonus
        x = target.get_input_embeddings()(block).to(ctx.dtype)
        pos_q = torch.arange(start, start + self.block_size, device=device).expand(b, -1)
        pos_kv = torch.arange(cache.length, start + self.block_size, device=device).expand(b, -1)
        rope_q = self.rotary_emb(x, pos_q)
        rope_kv = self.rotary_emb(x, pos_kv)
        for i, layer in enumerate(self.layers):
            x, cache.layers[i] = layer(x, ctx, rope_q, rope_kv, cache.layers[i], cache.length,
                                       cache.fused)
        cache.length = start
        hidden = self.norm(x[:, 1:])
        return target.get_output_embeddings()(hidden.to(target.get_output_embeddings().weight.dtype))
