"""The `ddtree` speculative method's options: parsed from vLLM's `speculative_config` dict, turned
into the DFlash config vLLM already knows (the drafter loads as vLLM's own DFlash), and handed to
every engine process through the environment. No vLLM import here (tested without vLLM)."""
from __future__ import annotations

import dataclasses
import functools
import json
import numbers
import os
from typing import Optional, Union

ENV = "DDTREE_VLLM_OPTIONS"  # JSON of DDTreeOptions, set by the engine-args hook, read by workers
METHOD = "ddtree"
MAX_BUDGET = 256             # tree nodes per request (the scheduler reserves this many KV slots)

# vLLM speculative_config keys passed through unchanged (the rest of vLLM's keys do not apply to
# a DFlash drafter under ddtree and are refused by name).
PASSTHROUGH = ("model", "draft_tensor_parallel_size", "max_model_len", "revision",
               "code_revision", "quantization", "enforce_eager", "attention_backend")
DDTREE_KEYS = ("budget", "max_budget", "draft_len")


@dataclasses.dataclass(frozen=True)
class DDTreeOptions:
    budget: Union[int, str]   # tree nodes per request (root excluded), or "auto"
    max_budget: int           # the largest tree "auto" may pick (== budget when fixed)
    draft_len: int            # drafter block positions proposed per step (DFlash block - 1)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @staticmethod
    def from_json(text: str) -> "DDTreeOptions":
        return DDTreeOptions(**json.loads(text))


def _positive_int(name: str, value, upper: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 1 <= value <= upper:
        raise ValueError(f"ddtree speculative_config: {name!r} must be an integer in [1, {upper}], "
                         f"got {value!r}")
    return int(value)


def drafter_block_size(drafter_dir: str) -> int:
    """The DFlash block size of a drafter directory (its config.json `block_size`)."""
    path = os.path.join(drafter_dir, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"ddtree speculative_config: 'model' must be a DFlash drafter directory "
                         f"with a config.json, got {drafter_dir!r}")
    with open(path) as f:
        config = json.load(f)
    if "dflash_config" not in config or "block_size" not in config:
        raise ValueError(f"ddtree speculative_config: 'model' {drafter_dir!r} is not a DFlash "
                         f"drafter (its config.json has no dflash_config / block_size)")
    return int(config["block_size"])


def check_drafter_matches(drafter_dir: str, target_config: dict) -> None:
    """The drafter conditions on the target's hidden states and shares its vocabulary: hidden size,
    vocabulary and the tapped target layers must fit the target, or start-up fails naming 'model'."""
    with open(os.path.join(drafter_dir, "config.json")) as f:
        drafter = json.load(f)
    target = target_config.get("text_config", target_config)
    for key in ("hidden_size", "vocab_size"):
        if key in target and drafter.get(key) != target[key]:
            raise ValueError(f"ddtree speculative_config: 'model' {drafter_dir!r} does not match the "
                             f"target: drafter {key} {drafter.get(key)} != target {target[key]}")
    layers = (drafter.get("dflash_config") or {}).get("target_layer_ids", [])
    n = target.get("num_hidden_layers")
    if n is not None and any(not 0 <= int(i) < n for i in layers):
        raise ValueError(f"ddtree speculative_config: 'model' {drafter_dir!r} taps target layers "
                         f"{layers}, the target has {n} layers")


def parse(config: dict, target_config: Optional[dict] = None):
    """speculative_config with method "ddtree" -> (the DFlash dict vLLM builds, DDTreeOptions).
    budget: N (1..MAX_BUDGET) or "auto" (default "auto"); max_budget: auto's ceiling (default 64);
    draft_len: drafter positions per step (default the drafter's block size - 1)."""
    config = {k.replace("-", "_"): v for k, v in config.items()}
    if config.get("method") != METHOD:
        raise ValueError(f"ddtree speculative_config: method must be {METHOD!r}, "
                         f"got {config.get('method')!r}")
    unknown = sorted(set(config) - set(PASSTHROUGH) - set(DDTREE_KEYS) - {"method",
                                                                       "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"ddtree speculative_config: unknown option(s) {unknown}; ddtree takes "
                         f"{list(DDTREE_KEYS)} and vLLM's {list(PASSTHROUGH)}")
    if not config.get("model"):
        raise ValueError("ddtree speculative_config: 'model' (the DFlash drafter directory) is "
                         "required")
    block = drafter_block_size(str(config["model"]))
    if target_config is not None:
        check_drafter_matches(str(config["model"]), target_config)
    draft_len = _positive_int("draft_len", config.get("draft_len", block - 1), block - 1)
    if "num_speculative_tokens" in config:
        raise ValueError("ddtree speculative_config: 'num_speculative_tokens' is set by ddtree "
                         "(the tree budget); use 'budget' (N or \"auto\") and 'draft_len'")
    budget = config.get("budget", "auto")
    if budget == "auto":
        max_budget = _positive_int("max_budget", config.get("max_budget", 64), MAX_BUDGET)
    elif isinstance(budget, str):
        raise ValueError(f"ddtree speculative_config: 'budget' must be an integer in "
                         f"[1, {MAX_BUDGET}] or \"auto\", got {budget!r}")
    else:
        budget = _positive_int("budget", budget, MAX_BUDGET)
        if "max_budget" in config:
            raise ValueError("ddtree speculative_config: 'max_budget' applies to budget=\"auto\" "
                             "only")
        max_budget = budget
    options = DDTreeOptions(budget=budget, max_budget=max_budget, draft_len=draft_len)
    dflash = {k: v for k, v in config.items() if k in PASSTHROUGH}
    # vLLM reserves num_speculative_tokens KV slots per request (hybrid targets: also
    # num_speculative_tokens + 1 GDN state slots) and sizes the drafter's query buffers by it:
    # the larger of the tree and the drafter block.
    dflash.update(method="dflash", num_speculative_tokens=max(max_budget, draft_len))
    return dflash, options


def active_options() -> Optional[DDTreeOptions]:
    """The options of the engine this process serves (None: ddtree is not the method)."""
    text = os.environ.get(ENV)
    return _parsed(text) if text else None


@functools.lru_cache(maxsize=8)
def _parsed(text: str) -> DDTreeOptions:
    return DDTreeOptions.from_json(text)
