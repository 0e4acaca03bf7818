"""DFlash block-diffusion drafter (spec §2), reading and writing the published checkpoint format.

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
    rotate_half,
)

from .dflash_config import CONFIG_NAME, WEIGHTS_NAME, checkpoint_files, dflash_config
from .dflash_state import DFlashDraftState
from .draft_rows import ContextRows, StepRows, write_rows
from .common import atomic_path, text_config

class RMSNorm(Qwen3RMSNorm):
    """Qwen3's RMSNorm (same parameters and checkpoint names) computed by torch's one
    `rms_norm` op instead of six elementwise ones: a draft step runs ten of them on a few rows,
    where the op count, not the arithmetic, is the cost. Inputs of another dtype than the weight
    keep Qwen3's order (normalise in fp32, cast, then scale)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype == torch.float32:
            return nn.functional.rms_norm(x, self.weight.shape, self.weight, self.variance_epsilon)
        return super().forward(x)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding of x [B, heads, S, D] at cos / sin [B, S, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def forward(self, x, ctx, rope_q, rope_kv, cache_kv, step: "StepRows"):
        """x [B, S, H] (normed block rows), ctx [B, C, H] new context rows (request b's first
        step.rows.new_t[b] valid, the rest padding); rope_q / rope_kv = (cos, sin) of the block
        rows / of [ctx; block]; cache_kv = (K, V) [B, Hkv, capacity, D], request b's first
        step.rows.committed_len[b] rows committed. Appends the valid context rows to the cache and
        returns the attention output [B, S, H]. Fused (step.fused): one draft_attention launch;
        else projections, norm, RoPE, the context and block rows written into the cache where
        `step` says, and SDPA over the cache's first key_rows rows with step.mask (the reference
        path)."""
        b, s, _ = x.shape
        c = ctx.shape[1]
        q, k, v = self.project(x, ctx)
        rows = step.rows
        if step.fused:
            from ..ops.attention import draft_attention

            out = draft_attention(q, k, v, cache_kv[0], cache_kv[1], rows.committed_len,
                                  self.q_norm.weight, self.k_norm.weight, rope_kv[0], rope_kv[1], c,
                                  self.q_norm.variance_epsilon, context_len=rows.new_t)
            return self.o_proj(out.reshape(b, s, self.num_heads * self.head_dim))
        q, k, v = self.norm_rope(q, k, v, rope_q, rope_kv)
        write_rows(cache_kv, step.at, k, v)
        return self.attend(q, cache_kv[0][:, :, : rows.key_rows], cache_kv[1][:, :, : rows.key_rows],
                           step.mask)

    def project(self, x, ctx):
        """q [B, S, Hq, D] of the block rows x [B, S, H]; k, v [B, C + S, Hkv, D] of [ctx; x]."""
        b, s, _ = x.shape
        kv_in = torch.cat([ctx, x], 1)
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(kv_in).view(b, kv_in.shape[1], self.num_kv_heads, self.head_dim)
        v = self.v_proj(kv_in).view(b, kv_in.shape[1], self.num_kv_heads, self.head_dim)
        return q, k, v

    def norm_rope(self, q, k, v, rope_q, rope_kv):
        """q/k RMSNorm + RoPE; returns q [B, Hq, S, D], k, v [B, Hkv, C + S, D]."""
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k).transpose(1, 2)
        return apply_rope(q, *rope_q), apply_rope(k, *rope_kv), v.transpose(1, 2)

    def context_kv(self, ctx, rope):
        """Keys / values [B, Hkv, C, D] of context rows alone (k-norm + RoPE at `rope`'s
        positions): what the forward caches for them, without a block."""
        b, c, _ = ctx.shape
        k = self.k_norm(self.k_proj(ctx).view(b, c, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        k = apply_rope(k, *rope)
        return k, self.v_proj(ctx).view(b, c, self.num_kv_heads, self.head_dim).transpose(1, 2)

    def attend(self, q, keys, values, mask):
        """SDPA (GQA: each K/V head serves its group of query heads, no copies; mask True =
        visible, non-causal) + o_proj: q [B, Hq, S, D], keys / values [B, Hkv, K, D] -> [B, S, H]."""
        b, _, s, _ = q.shape
        attn = torch.nn.functional.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(attn.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class DFlashLayer(nn.Module):
    def __init__(self, cfg: Qwen3Config):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = DFlashAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = Qwen3MLP(cfg)

    def forward(self, x, ctx, rope_q, rope_kv, cache_kv, step: StepRows):
        """A drafting step's layer: block rows x [B, S, H] attend to the cached context, the new
        context rows ctx (appended to the cache) and their block (DFlashAttention.forward)."""
        return self._residual(x, lambda h: self.self_attn(h, ctx, rope_q, rope_kv, cache_kv, step))

    def forward_blocks(self, x, ctx, rope_q, rope_kv, mask):
        """Training's layer, no cache: rows x [B, R, H] (many blocks) attend to the keys of
        [ctx; x] where mask [B, 1, R, C + R] (True = visible) allows."""
        attn = self.self_attn
        return self._residual(x, lambda h: attn.attend(
            *attn.norm_rope(*attn.project(h, ctx), rope_q, rope_kv), mask))

    def _residual(self, x, attention):
        x = x + attention(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class DraftCache:
    """The drafter's context K/V for a batch: per draft layer (K, V) [B, Hkv, capacity, D],
    preallocated and grown by doubling; request b's context is rows [0, lengths[b]) (positions
    0..lengths[b]-1). fused: steps run the draft_attention op."""
    layers: List[Optional[tuple]] = field(default_factory=list)
    lengths: List[int] = field(default_factory=lambda: [0])
    fused: bool = False

    @property
    def length(self) -> int:
        """The context length of a one-request cache."""
        if len(self.lengths) != 1:
            raise ValueError("DraftCache.length: the cache holds several requests; use lengths")
        return self.lengths[0]

    @property
    def capacity(self) -> int:
        return 0 if self.layers[0] is None else self.layers[0][0].shape[2]

    def reserve(self, rows: int, make) -> None:
        """Grows every layer to at least `rows` rows (capacity doubles), keeping the contents;
        make(capacity) allocates one empty [B, Hkv, capacity, D] tensor."""
        if self.capacity >= rows:
            return
        capacity = max(2 * self.capacity, rows + 64)
        for i, kv in enumerate(self.layers):
            grown = (make(capacity), make(capacity))
            if kv is not None:
                for old, new in zip(kv, grown):
                    new[:, :, : old.shape[2]] = old
            self.layers[i] = grown


class DFlashDrafter(nn.Module):
    """The DFlash drafter. A step (`draft_block`; driven across rounds by DFlashDraftState) turns
    the bonus token + new target features into per-depth draft logits [B, block_size - 1, V]
    using the target's embedding and LM head."""

    def __init__(self, config: Qwen3Config):
        super().__init__()
        self.config = config
        self.block_size = config.block_size
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        self.target_layer_ids = [int(i) for i in config.dflash_config["target_layer_ids"]]
        h = config.hidden_size
        self.layers = nn.ModuleList([DFlashLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        # "auto": the fused draft_attention op on CUDA when its kernel covers dtype and head_dim,
        # on CPU for generations whose attention is small (CPU_FUSED_MAX_WORK); True / False
        # force it on / off (False: projections, norms, RoPE, cache scatter and SDPA as separate
        # torch ops).
        self.fused_attention = "auto"

    @property
    def depth(self) -> int:
        return self.block_size - 1

    # ---- checkpoint format ----

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> "DFlashDrafter":
        """Reads `path`/config.json and the weights the checkpoint declares: model.safetensors,
        or the shards listed by model.safetensors.index.json (other files are ignored)."""
        from safetensors.torch import load_file

        if not os.path.isdir(path):
            raise FileNotFoundError(f"DFlashDrafter.from_pretrained: {path!r} is not a directory")
        config_path = os.path.join(path, CONFIG_NAME)
        try:
            with open(config_path, encoding="utf-8") as f:
                raw = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"DFlashDrafter.from_pretrained: no {CONFIG_NAME} in {path}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{config_path}: not valid JSON ({e})") from None
        model = cls(dflash_config(raw, config_path))
        state = {}
        for name in checkpoint_files(path):
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
        """config.json + model.safetensors, each written to a temporary file and renamed into
        place (a crash leaves the old file or the new one, never half of one)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        config = self.config.to_dict()
        config.update(architectures=["DFlashDraftModel"], block_size=self.block_size,
                      num_target_layers=self.config.num_target_layers,
                      dflash_config=dict(self.config.dflash_config))
        state = {k: v.contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("rotary_emb.")}
        with atomic_path(os.path.join(path, WEIGHTS_NAME)) as tmp:
            save_file(state, tmp)
        with atomic_path(os.path.join(path, CONFIG_NAME)) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(config, f, indent=1, default=str)

    def check_target(self, target) -> None:
        """Clear errors when this drafter does not belong to `target`."""
        tcfg = text_config(target.config)
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

    # On CPU the draft_attention loops beat the separate torch ops where a step's attention is
    # small and the ops' own dispatch dominates (4 query heads of 64, 300 context rows: 1.3x),
    # and lose to SDPA's kernels on long contexts and wide heads (the same heads over 2,000 rows:
    # 0.45x; 32 heads of 128 over 300 rows: 0.56x; bench/bench_attention.py, 2 threads):
    # "auto" fuses on CPU up to this many query heads x head_dim x context rows.
    CPU_FUSED_MAX_WORK = 4 * 64 * 600

    def uses_fused_attention(self, capacity: int = 0) -> bool:
        """Whether steps over a context cache of `capacity` rows run the fused draft_attention
        op (fused_attention: "auto" = on CUDA where the kernel covers dtype and head_dim, on CPU
        when query heads x head_dim x capacity <= CPU_FUSED_MAX_WORK; capacity 0: a cache that
        grows, unfused on CPU)."""
        if self.fused_attention != "auto":
            return bool(self.fused_attention)
        from ..ops.attention import attention_op_supports

        w, attn = self.fc.weight, self.layers[0].self_attn
        if not attention_op_supports(w.device, w.dtype, attn.head_dim):
            return False
        return w.is_cuda or 0 < attn.num_heads * attn.head_dim * capacity <= self.CPU_FUSED_MAX_WORK

    def new_cache(self, batch: int = 1, capacity: int = 0) -> DraftCache:
        """An empty context cache for `batch` requests, preallocated to `capacity` rows if > 0."""
        cache = DraftCache([None] * len(self.layers), [0] * batch,
                           self.uses_fused_attention(capacity))
        if capacity > 0:
            self.reserve(cache, batch, capacity)
        return cache

    @torch.no_grad()
    def begin(self, target, prompt_hidden_states, capacity: int, cuda_graph: bool = False):
        """The drafter's side of generate_batch (ddtree.generate.Drafter): a DFlashDraftState
        for the requests whose prompt hidden states (one tuple per request) are given, with a
        context cache of `capacity` rows."""
        return DFlashDraftState(self, target, prompt_hidden_states, capacity, cuda_graph)

    def reserve(self, cache: DraftCache, batch: int, rows: int) -> None:
        """Grows the context cache to at least `rows` rows (see DraftCache.reserve)."""
        attn = self.layers[0].self_attn
        cache.reserve(rows, lambda cap: self.fc.weight.new_zeros(batch, attn.num_kv_heads, cap,
                                                                 attn.head_dim))

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """Context rows [..., H] of target features [..., n*H] (fc + hidden norm)."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def block_embeddings(self, target, first: torch.Tensor,
                         block_rows: Optional[int] = None) -> torch.Tensor:
        """Embeddings [..., R, H] of blocks of R rows (block_rows, default block_size) starting
        with `first` [...] (the bonus token) followed by mask tokens, in the target's
        embedding."""
        block = first.new_full((*first.shape, block_rows or self.block_size), self.mask_token_id)
        block[..., 0] = first
        return target.get_input_embeddings()(block)

    def block_logits(self, target, x: torch.Tensor, vocab_shard=None) -> torch.Tensor:
        """Logits [..., V] of block rows x [..., H] after the last layer (final norm, the
        target's LM head; this rank's columns with vocab_shard)."""
        hidden = self.norm(x)
        if vocab_shard is not None:
            return vocab_shard.logits(hidden)
        head = target.get_output_embeddings()
        return head(hidden.to(head.weight.dtype))

    def rope_table(self, rows: int, device) -> tuple:
        """(cos, sin) [rows, D] of positions 0 .. rows - 1, the values rotary_emb computes for
        them: a step gathers its rows' instead of computing them anew."""
        like = self.fc.weight.new_empty(0)
        cos, sin = self.rotary_emb(like, torch.arange(rows, device=device)[None])
        return cos[0], sin[0]

    def rope_at(self, positions: torch.Tensor, like: torch.Tensor, table=None) -> tuple:
        """(cos, sin) [B, S, D] of positions [B, S]: rows of `table` (rope_table) or computed."""
        if table is None:
            return self.rotary_emb(like, positions)
        return table[0][positions], table[1][positions]

    def draft_block(self, target, bonus: torch.Tensor, ctx_in: torch.Tensor, rows: ContextRows,
                    cache: DraftCache, vocab_shard=None, rope_table=None,
                    block_rows: Optional[int] = None) -> torch.Tensor:
        """The device part of a drafter step (no host reads, fixed shapes): ctx_in [B, C, n*H]
        padded new feature rows, rows.committed_len / rows.new_t [B] context lengths and valid new
        rows, the cache at least max(committed_len) + C + block_size rows long and key_rows
        covering every request's context and block (unfused; padding rows land past the
        block). Writes the new rows into the cache;
        returns the logits [B, R - 1, V] of a block of R = block_rows rows (2 .. block_size,
        default block_size: a tree that goes no deeper than R - 1 needs no more; the block's
        rows attend to each other, so a shorter block drafts slightly different logits) — with
        vocab_shard (a tensor-parallel target, ddtree.parallel) only this rank's columns
        [B, R - 1, V_local]; RoPE from rope_table's rows when given (every position < its
        length). Graph-capturable on static buffers."""
        block_rows = block_rows or self.block_size
        if not 2 <= block_rows <= self.block_size:
            raise ValueError(f"draft_block: block_rows must be in 2..{self.block_size} (the "
                             f"drafter's block_size), got {block_rows}")
        ctx = self.context(ctx_in)
        c = ctx.shape[1]
        x = self.block_embeddings(target, bonus, block_rows).to(ctx.dtype)
        step = rows.step(c, block_rows, cache.fused)
        rope_kv = self.rope_at(step.positions, x, rope_table)
        rope_q = tuple(r[:, c:] for r in rope_kv)  # the block rows' positions are its tail
        for i, layer in enumerate(self.layers):
            x = layer(x, ctx, rope_q, rope_kv, cache.layers[i], step)
        return self.block_logits(target, x[:, 1:], vocab_shard)
