"""The DFlash drafter's configuration and checkpoint files (the published format): the config's
`dflash_config` block checked, the target layers it reads, the weight files a directory declares."""
from __future__ import annotations

import json
import os
from typing import List

from transformers import Qwen3Config

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
