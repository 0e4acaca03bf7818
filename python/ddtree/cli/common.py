"""What the commands share: the usage error, argument parsers, loading the models a command names
(local directories or the embedded pair), prompts and stop tokens."""
from __future__ import annotations

import argparse
import os
from typing import List

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(ValueError):
    """A command-line input the command cannot use; main() prints it without a traceback."""


def int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def model_dir(flag: str, path: str) -> str:
    """`path` as a local model directory (with a config.json), or a UsageError naming the flag."""
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r}: no such directory (local Hugging Face model "
                         f"directories only; 'embedded' names the embedded pair)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{flag} {path!r}: the directory has no config.json")
    return path


def load_models(args):
    from .. import embedded, parallel
    from ..models import loading

    dtype = DTYPES[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_path = str(embedded.target_dir()) if args.target == "embedded" else \
        model_dir("--target", args.target)
    draft_path = str(embedded.drafter_dir()) if args.draft == "embedded" else \
        model_dir("--draft", args.draft) if args.draft else None
    if args.tensor_parallel or parallel.is_torchrun():
        # Every rank loads its shard (the device follows LOCAL_RANK); the drafter is replicated.
        target = parallel.load_tensor_parallel(target_path, dtype)
        device = target.get_input_embeddings().weight.device
    else:
        target = loading.load_target(target_path, dtype, device)
    tokenizer = loading.load_tokenizer(target_path)
    drafter = loading.load_drafter(draft_path, dtype, device)
    if args.tree_attention or args.cuda_graph:
        from ..models.attention import use_tree_attention

        use_tree_attention(target)
    return target, tokenizer, drafter, device


def encode(tokenizer, text: str, device) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise SystemExit("ddtree: the prompt encodes to no tokens")
    return ids.to(device)


def stop_ids(tokenizer) -> List[int]:
    eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
