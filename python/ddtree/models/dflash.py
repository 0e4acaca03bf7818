"""DFlash block-diffusion drafter (spec §2), reading and writing the published checkpoint format.

Built from transformers' Qwen3 pieces (RMSNorm, MLP, rotary embedding); only the drafter's own
attention (block queries over cached context K/V + the block, non-causal) is written here. The
drafter has no embedding and no LM head: it uses the target's.
"""
from __future__ import annotations

import contextlib
import json
import os
import uuid
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

from ..loading import text_config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> List[int]:
    """spec §2: round(1 + i * (T - 4) / (n - 1)) for i in 0..n-1; n = 1 -> [T // 2]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    return [round(1 + i * (num_target_layers - 4) / (num_draft_layers - 1))
            for i in range(num_draft_layers)]


MAX_BLOCK_SIZE = 33  # the root + 32 draft depths (build_tree's deepest tree)


def _positive_int(config: dict, field: str, where: str, minimum: int = 1) -> int:
    value = config.get(field)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{where}: field '{field}' must be an integer >= {minimum}, got {value!r}")
    return value


def dflash_config(config: dict, where: str = "DFlash config") -> Qwen3Config:
    """A Qwen3Config carrying the DFlash fields (block_size, num_target_layers, dflash_config),
    checked: errors name `where` (e.g. the config file) and the field."""
    if not isinstance(config, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(config).__name__}")
    for field in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if field in config:
            _positive_int(config, field, where)
    num_target_layers = _positive_int(config, "num_target_layers", where)
    block_size = _positive_int({"block_size": config.get("block_size", 16)}, "block_size", where, 2)
    if block_size > MAX_BLOCK_SIZE:
        raise ValueError(f"{where}: field 'block_size' = {block_size} exceeds {MAX_BLOCK_SIZE} (the "
                         f"root + at most {MAX_BLOCK_SIZE - 1} draft depths)")
    extra = config.get("dflash_config") or {}
    if not isinstance(extra, dict):
        raise ValueError(f"{where}: field 'dflash_config' must be an object, got {extra!r}")
    extra = dict(extra)
    if "mask_token_id" not in extra:
        raise ValueError(f"{where}: field 'dflash_config.mask_token_id' is required")
    _positive_int(extra, "mask_token_id", where + " dflash_config", 0)
    cfg = Qwen3Config(**{k: v for k, v in config.items() if k not in ("architectures", "auto_map")})
    cfg.block_size = block_size
    cfg.num_target_layers = num_target_layers
    if not extra.get("target_layer_ids"):
        extra["target_layer_ids"] = default_target_layer_ids(cfg.num_target_layers,
                                                             cfg.num_hidden_layers)
    ids = extra["target_layer_ids"]
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool)
                                            and 0 <= i < num_target_layers for i in ids):
        raise ValueError(f"{where}: field 'dflash_config.target_layer_ids' must list layer indices "
                         f"in [0, num_target_layers = {num_target_layers}), got {ids!r}")
    cfg.dflash_config = extra
    return cfg


def checkpoint_files(path: str) -> List[str]:
    """The weight files a checkpoint directory declares: the shards named by
    model.safetensors.index.json when it exists, else model.safetensors."""
    index = os.path.join(path, WEIGHTS_NAME + ".index.json")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index}: not a safetensors index (needs a 'weight_map' object of "
                             f"tensor name -> file; {type(e).__name__}: {e})") from None
        for name in files:
            if not isinstance(name, str) or os.path.basename(name) != name or \
                    not os.path.isfile(os.path.join(path, name)):
                raise FileNotFoundError(f"{index}: weight_map names {name!r}, which is not a file "
                                        f"in {path}")
        return files
    if not os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
        raise FileNotFoundError(f"DFlashDrafter.from_pretrained: no {WEIGHTS_NAME} (or "
                                f"{WEIGHTS_NAME}.index.json) in {path}")
    return [WEIGHTS_NAME]


@contextlib.contextmanager
def atomic_path(final: str):
    """A temporary path next to `final` to write; renamed onto `final` when the block succeeds,
    removed when it fails."""
    directory, name = os.path.split(os.path.abspath(final))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


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
            from ..ops import draft_attention

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


def rows_at(start: torch.Tensor, count: int) -> torch.Tensor:
    """[B, 1, count, 1] cache rows start[b] + j: a scatter index for K / V [B, Hkv, S, D]."""
    return (start[:, None] + torch.arange(count, device=start.device))[:, None, :, None]


def write_rows(cache_kv, at: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows k / v [B, Hkv, R, D] into the cache (K, V) [B, Hkv, S, D] at rows `at` [B, 1, R, 1]
    (rows_at)."""
    for cache, new in zip(cache_kv, (k, v)):
        cache.scatter_(2, at.expand(-1, cache.shape[1], -1, cache.shape[3]), new.to(cache.dtype))


class ContextRows:
    """Where a drafter step's new context rows go (device tensors [B]): request b has
    committed_len[b] rows in the cache and brings new_t[b] valid rows (the rest of the C rows is
    padding). The unfused path attends to the first key_rows cache rows (a host int: the loop's
    capacity), masked per request; the cache holds block_size rows more (padding rows land
    there)."""

    def __init__(self, committed_len: torch.Tensor, new_t: torch.Tensor, key_rows: int):
        self.committed_len, self.new_t, self.key_rows = committed_len, new_t, key_rows
        self.layouts: dict = {}
        self.cols: Optional[torch.Tensor] = None

    def step(self, context_rows: int, block_rows: int, fused: bool) -> "StepRows":
        """The step's layout, made once for every layer (unfused): one scatter index for the C
        context rows and the block's rows, all distinct: valid context row j at committed_len +
        j, the block's row i at committed_len + new_t + i, padding row j past the block (at
        committed_len + j + block_rows) — so request b's keys are its first committed_len +
        new_t + block_rows cache rows; the next step's context rows overwrite the block."""
        start, new = self.committed_len[:, None], self.new_t[:, None]
        j, offset, in_block = self._layout(context_rows, block_rows, start.device)
        positions = start + offset + in_block * new  # context row j: + j; block row i: + new + i
        if fused:
            return StepRows(self, True, positions)
        at = positions + (j >= new) * (1 - in_block) * block_rows  # padding: past the block
        mask = (self._cols(start.device) < start + new + block_rows)[:, None, None]
        return StepRows(self, False, positions, at[:, None, :, None], mask)

    def _layout(self, context_rows: int, block_rows: int, device):
        """Constants of a step's rows, made once per shape: j = 0 .. C + S - 1; the offset of
        row j from the request's first new row (j; block row C + i: i); 1 on block rows."""
        key = (context_rows, block_rows)
        if key not in self.layouts:
            j = torch.arange(context_rows + block_rows, device=device)
            in_block = (j >= context_rows).long()
            self.layouts[key] = (j, j - in_block * context_rows, in_block)
        return self.layouts[key]

    def _cols(self, device) -> torch.Tensor:
        """0 .. key_rows - 1 (made once)."""
        if self.cols is None or self.cols.numel() != self.key_rows:
            self.cols = torch.arange(self.key_rows, device=device)[None]
        return self.cols


@dataclass
class StepRows:
    """One drafter step's rows (ContextRows.step): the context lengths, whether the fused op
    runs, the positions [B, C + S] of the context and block rows, and for the unfused path their
    cache rows [B, 1, C + S, 1] (a scatter index, rows_at's layout) and the key mask
    [B, 1, 1, key_rows] (True = visible)."""
    rows: ContextRows
    fused: bool
    positions: torch.Tensor
    at: Optional[torch.Tensor] = None
    mask: Optional[torch.Tensor] = None


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
        from ..ops import attention_op_supports

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
        vocab_shard (a tensor-parallel target, ddtree.distributed) only this rank's columns
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


class DFlashDraftState:
    """The DFlash drafter across the rounds of one generation, on fixed shapes: a context cache of
    `capacity` rows, the accepted rows' target features [B, block_size, n*H] and their count per
    request as device buffers (gather_accepted: no host lists). The first step brings the
    prompts' features (padded to the longest prompt) and runs eagerly; every later step has the
    same shapes and, with cuda_graph, is captured once (capture: before the rounds) and
    replayed."""

    DEFER_ROWS = 64  # deferred root rows written to the context cache in one pass

    def __init__(self, drafter: DFlashDrafter, target, prompt_hidden_states, capacity: int,
                 cuda_graph: bool):
        from ..distributed import vocab_shard

        self.drafter, self.target, self.capacity = drafter, target, capacity
        self.vocab_shard = vocab_shard(target)  # tensor-parallel target: logits of local columns
        feats = [drafter.target_features(h)[0] for h in prompt_hidden_states]  # [P_b, n*H]
        batch, device = len(feats), drafter.fc.weight.device
        self.cache = drafter.new_cache(batch, capacity + drafter.block_size)
        self.prompt = torch.nn.utils.rnn.pad_sequence(feats, batch_first=True)
        self.rows = ContextRows(torch.zeros(batch, dtype=torch.long, device=device),
                                torch.tensor([f.shape[0] for f in feats], device=device), capacity)
        self.feats = self.prompt.new_zeros(batch, drafter.block_size, self.prompt.shape[-1])
        self.bonus = torch.zeros(batch, dtype=torch.long, device=device)
        self.use_graph = cuda_graph
        # RoPE of every position a step can reach (context + a block past it).
        self.rope_table = drafter.rope_table(capacity + drafter.block_size, device)
        # Eager steps bring only as many context rows as the last verdict accepted at most, when
        # the loop says so (known_new_rows, from its host read); graphs keep all block_size.
        self.new_rows: Optional[int] = None
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.logits = None
        # Autoregressive rounds of budget="auto" (defer): whether the last drafted round's
        # accepted rows (feats, new_t) are still to reach the cache; the context rows deferred
        # since, per request deferred_count[b] of them packed at the front of deferred_feats
        # [B, DEFER_ROWS + block_size, n*H]; `deferred` (host) bounds every request's count.
        self.block_pending = False
        self.deferred, self.deferred_feats = 0, None
        self.deferred_count = torch.zeros(batch, dtype=torch.long, device=device)

    def select(self, index: torch.Tensor) -> None:
        """Keeps the batch rows `index` [B'] (finished requests leave): context caches, context
        lengths, pending features; a CUDA graph is captured anew at the new batch size."""
        self.cache.layers = [kv if kv is None else tuple(t[index] for t in kv)
                             for kv in self.cache.layers]
        self.rows.committed_len, self.rows.new_t = self.rows.committed_len[index], \
            self.rows.new_t[index]
        self.feats, self.bonus = self.feats[index], self.bonus[index]
        if self.prompt is not None:
            self.prompt = self.prompt[index]
        if self.deferred_feats is not None:
            self.deferred_feats = self.deferred_feats[index]
        self.deferred_count = self.deferred_count[index]
        self.graph = self.logits = None

    def capture(self) -> None:
        """With cuda_graph: captures the step now, before the rounds that replay it (again after
        select). Its passes run with no new context rows (new_t zeroed meanwhile, the graph
        reads it at each replay): they write only block rows from each request's committed
        rows on, which the next step (the prompt pass, or a replay) writes again before any
        read. Eager steps: nothing to capture."""
        if not self.use_graph or self.graph is not None:
            return
        from ..verify import capture_graph

        pending = self.rows.new_t.clone()
        self.rows.new_t.zero_()
        self.graph, self.logits = capture_graph(self._step)
        self.rows.new_t.copy_(pending)

    def _step(self, block_rows: Optional[int] = None):
        feats = self.feats if self.use_graph or self.new_rows is None else \
            self.feats[:, : max(1, self.new_rows)]
        return self.drafter.draft_block(self.target, self.bonus, feats, self.rows, self.cache,
                                        self.vocab_shard, self.rope_table, block_rows)

    def known_new_rows(self, rows: int) -> None:
        """The loop's host read of the verdict just committed: no request accepted more than
        `rows` rows (its accept_len), so an eager step reads only that many feature rows."""
        self.new_rows = rows

    def step(self, bonus: torch.Tensor, depth: Optional[int] = None) -> torch.Tensor:
        """Draft logits [B, L, V] of the blocks starting with `bonus` [B] (this rank's vocabulary
        columns when the target's LM head is sharded): L = block_size - 1, or `depth` when the
        round's tree goes no deeper (eager steps draft a block of depth + 1 rows, cheaper; a
        captured graph keeps its full block)."""
        self.bonus.copy_(bonus)
        self._take_deferred()
        self.block_pending = False
        block_rows = None if depth is None or depth + 1 >= self.drafter.block_size else \
            max(2, depth + 1)
        if self.prompt is not None:
            logits = self.drafter.draft_block(self.target, self.bonus, self.prompt, self.rows,
                                              self.cache, self.vocab_shard, self.rope_table,
                                              block_rows)
            self.prompt = None
        elif not self.use_graph:
            logits = self._step(block_rows)
        else:
            self.capture()  # a no-op when the loop captured it before the round
            self.graph.replay()
            logits = self.logits
        self.rows.committed_len += self.rows.new_t
        return logits

    def _write_context(self, feats: torch.Tensor, rows) -> None:
        """Context rows straight into the cache, without drafting a block: the context keys /
        values of every draft layer depend only on the target features (k / v projections,
        k-norm, RoPE at the rows' positions). feats [B, C, n*H] land at rows committed_len + j;
        `rows` ([B] tensor or int) of them are real and committed_len advances by it."""
        drafter, ctx_rows = self.drafter, self.rows
        ctx = drafter.context(feats)
        rope = drafter.rope_at(ctx_rows.committed_len[:, None] +
                               torch.arange(ctx.shape[1], device=ctx.device), ctx, self.rope_table)
        at = rows_at(ctx_rows.committed_len, ctx.shape[1])
        for layer, kv in zip(drafter.layers, self.cache.layers):
            write_rows(kv, at, *layer.self_attn.context_kv(ctx, rope))
        ctx_rows.committed_len += rows

    @torch.no_grad()
    def defer(self, hidden_states) -> None:
        """An autoregressive round's verdict (budget="auto"): its one accepted row (the root,
        row 0 of the pass) joins the context later. The rows wait in a buffer, behind the
        accepted rows of the drafted round before them (moved there, not written); the next
        draft step takes them as its own new context rows when they fit its block_size rows
        (no pass of their own), else one pass writes them first; a full buffer (DEFER_ROWS)
        is written by one pass. So switching between drafted and autoregressive rounds costs
        the drafter copies, and a run of autoregressive rounds one small copy a round."""
        if self.prompt is not None:  # the first round: the prompt's rows go in by one pass
            self._write_context(self.prompt, self.rows.new_t)
            self.rows.new_t.zero_()
            self.prompt = None
        if self.deferred_feats is None:
            self.deferred_feats = self.feats.new_zeros(
                self.feats.shape[0], self.DEFER_ROWS + self.drafter.block_size,
                self.feats.shape[-1])
        if self.block_pending:  # the drafted round's accepted rows go first
            self.deferred_feats[:, : self.feats.shape[1]] = self.feats
            self.deferred_count.copy_(self.rows.new_t)
            self.rows.new_t.zero_()
            self.deferred = self.feats.shape[1] if self.new_rows is None else self.new_rows
            self.block_pending = False
        if self.deferred >= self.DEFER_ROWS:
            self._flush_deferred()
        ids = self.drafter.target_layer_ids
        row = torch.cat([hidden_states[i + 1][:, :1] for i in ids], -1)
        self.deferred_feats.scatter_(1, self.deferred_count[:, None, None].expand_as(row), row)
        self.deferred_count += 1
        self.deferred += 1

    def _take_deferred(self) -> None:
        """Before a draft step: the deferred rows become the step's new context rows when they
        fit (no request has more than block_size of them), else one pass writes them."""
        if self.deferred > self.feats.shape[1]:
            self._flush_deferred()
        elif self.deferred:
            self.feats[:, : self.deferred] = self.deferred_feats[:, : self.deferred]
            self.rows.new_t.copy_(self.deferred_count)
            self.new_rows = self.deferred
            self.deferred_count.zero_()
            self.deferred = 0

    def _flush_deferred(self) -> None:
        """One pass writes the deferred rows (and the accepted rows before them) into the
        cache."""
        self._write_context(self.deferred_feats[:, : self.deferred], self.deferred_count)
        self.deferred_count.zero_()
        self.deferred = 0

    def commit(self, hidden_states, verdict) -> None:
        """The accepted rows' target features become the next step's new context rows."""
        from ..ops import gather_accepted

        features = self.drafter.target_features(hidden_states)
        self.feats.copy_(gather_accepted(features, verdict.accepted, verdict.accept_len))
        self.rows.new_t.copy_(verdict.accept_len)
        self.block_pending = True
        self.new_rows = None  # until the loop reads this verdict
