"""`ddtree train-drafter`: a DFlash drafter for a local Hugging Face target directory, written
in the published checkpoint format; refuses an --out that would overwrite anything else."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..models import DFlashDrafter
from ..models.loading import load_target, load_tokenizer
from ..train.corpus import corpus_texts, token_stream
from ..train.drafter import DrafterRecipe, drafter_config_for, is_drafter_config, train_drafter
from .common import UsageError, model_dir

DRAFTER_OUTPUTS = ("config.json", "model.safetensors", "training.json", "drafter_state.pt",
                   "drafter_log.jsonl")


def check_output_dir(out: str, target: str, overwrite: bool) -> None:
    """Refuses an --out that is (or lies inside) the target's directory, always, and without
    overwrite one that holds anything but this command's own earlier output."""
    out_path, target_path = Path(out).resolve(), Path(target).resolve()
    if out_path == target_path or target_path in out_path.parents:
        raise UsageError(f"--out {out!r} is inside the target's directory {target!r}: the drafter "
                         f"would overwrite the target's files; choose another directory")
    if not out_path.exists():
        return
    if not out_path.is_dir():
        raise UsageError(f"--out {out!r} exists and is not a directory")
    foreign = sorted(name for name in os.listdir(out_path) if name not in DRAFTER_OUTPUTS and
                     not (name.startswith(".") and name.endswith(".tmp")))
    config = out_path / "config.json"
    if config.exists() and not is_drafter_config(config):
        foreign.append("config.json (not a DFlash drafter's)")
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise UsageError(f"--out {out!r} holds files that are not train-drafter output ({shown}); "
                         f"choose an empty directory or pass --overwrite")


def cmd_train_drafter(args) -> int:
    """`ddtree train-drafter`: a DFlash drafter for a local Hugging Face target directory."""

    recipe = DrafterRecipe(steps=args.steps, batch=args.batch, anchors=args.anchors,
                           sequences=args.sequences, prompt_len=args.prompt_len,
                           gen_len=args.gen_len, labels=args.labels, gamma=args.gamma, lr=args.lr,
                           seed=args.seed)
    recipe.check()
    if args.layers < 1 or not 2 <= args.block_size <= 33:
        raise UsageError(f"--layers must be >= 1 and --block-size in [2, 33], got {args.layers} and "
                         f"{args.block_size}")
    model_dir("--target", args.target)
    check_output_dir(args.out, args.target, args.overwrite)
    torch.manual_seed(args.seed)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target = load_target(args.target, torch.float32, device)
    tokenizer = load_tokenizer(args.target)
    mask_id = args.mask_token_id
    if mask_id is None:
        mask_id = tokenizer.mask_token_id
    if mask_id is None:
        raise UsageError("the tokenizer has no mask token; pass --mask-token-id")
    cfg = drafter_config_for(target, args.layers, mask_id, args.block_size, args.target_layer_ids)
    drafter = DFlashDrafter(cfg).to(device)
    stream = token_stream(tokenizer, corpus_texts(args.corpus))
    info = train_drafter(target, drafter, stream, recipe, args.out, resume=args.resume,
                         quiet=args.quiet)
    print(f"[ddtree] drafter saved to {args.out} (data {info['data_seconds']} s, training "
          f"{info['train_seconds']} s)")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("train-drafter", help="train a DFlash drafter for a target (DFlash recipe)")
    p.add_argument("--target", required=True, help="local Hugging Face causal-LM directory")
    p.add_argument("--out", required=True, help="output directory (DFlash checkpoint format)")
    p.add_argument("--corpus", default=None,
                   help="text file or directory (.py/.txt/.md); default: the Python stdlib's train split")
    p.add_argument("--labels", choices=["greedy", "data"], default="greedy")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--target-layer-ids", type=int, nargs="+", default=None)
    p.add_argument("--mask-token-id", type=int, default=None)
    d = DrafterRecipe()
    for name in ("steps", "batch", "anchors", "sequences", "prompt_len", "gen_len", "seed"):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name))
    p.add_argument("--gamma", type=float, default=d.gamma)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--resume", action="store_true", help="continue from OUT/drafter_state.pt")
    p.add_argument("--overwrite", action="store_true",
                   help="write into --out even when it holds other files (never the target's "
                        "directory)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--device", default=None)
    p.set_defaults(func=cmd_train_drafter)
