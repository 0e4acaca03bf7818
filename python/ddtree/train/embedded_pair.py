"""How the embedded pair is built: a small hybrid Qwen3.5-text target (Gated DeltaNet + full
attention layers) trained on the Python standard library's own sources, and its DFlash drafter
trained with the DFlash recipe; saved as bf16 safetensors in python/ddtree/embedded_pair/ with the
recipe, seed, losses and training times in recipe.json.

  python -m ddtree.train.embedded_pair [--out DIR] [--resume]     (make embedded-pair)

rebuilds it: tokenizer -> target -> (target rounded to bf16) -> greedy data -> drafter.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from .corpus import read_texts, stdlib_files, token_stream, train_tokenizer
from .drafter import DrafterRecipe, drafter_config_for, train_drafter
from .optimise import TargetRecipe, train_target

PAIR_DIR = Path(__file__).resolve().parent.parent / "embedded_pair"
VOCAB_SIZE = 4096
SEED = 0

# Qwen3.5's 3:1 pattern of linear (Gated DeltaNet) to full attention layers, scaled down.
TARGET_CONFIG = dict(
    vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64,
    linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=8192,
    tie_word_embeddings=True, eos_token_id=0, pad_token_id=0)
DRAFT_LAYERS = 2
DRAFT_TARGET_LAYER_IDS = [1, 3]  # spec §2's default formula degenerates for 4 target layers


def target_dir(root: Path = PAIR_DIR) -> Path:
    return Path(root) / "target"


def drafter_dir(root: Path = PAIR_DIR) -> Path:
    return Path(root) / "drafter"


def build(out: Path = PAIR_DIR, resume: bool = False, quiet: bool = False,
          target_recipe: TargetRecipe = TargetRecipe(),
          drafter_recipe: DrafterRecipe = DrafterRecipe()) -> dict:
    """Trains and saves the pair in `out`; scratch state in out/work (removed at the end)."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

    from ..models import DFlashDrafter

    out = Path(out)
    work = out / "work"
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    texts = read_texts(stdlib_files("train"))
    tokenizer = train_tokenizer(texts, VOCAB_SIZE)
    stream = token_stream(tokenizer, texts)
    t_tok = time.perf_counter() - t0
    if not quiet:
        print(f"tokenizer: {len(texts)} files, {stream.numel()} tokens ({t_tok:.0f} s)")

    torch.manual_seed(SEED)
    target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TARGET_CONFIG))
    t_target = train_target(target, stream, target_recipe, str(work), resume=resume,
                                  quiet=quiet)
    target = target.to(torch.bfloat16)
    target.save_pretrained(str(target_dir(out)))
    tokenizer.save_pretrained(str(target_dir(out)))
    target = target.float().eval()  # the drafter learns the shipped (bf16-rounded) target

    torch.manual_seed(SEED)
    drafter = DFlashDrafter(drafter_config_for(
        target, DRAFT_LAYERS, tokenizer.mask_token_id, 16, DRAFT_TARGET_LAYER_IDS))
    info = train_drafter(target, drafter, stream, drafter_recipe, str(work), resume=resume,
                               quiet=quiet)
    drafter.to(torch.bfloat16).save_pretrained(str(drafter_dir(out)))

    def final_loss(name):
        rows = [json.loads(line) for line in open(work / f"{name}_log.jsonl")]
        return rows[-1]["loss"] if rows else None

    recipe = dict(
        python=platform.python_version(), torch=torch.__version__, threads=torch.get_num_threads(),
        machine=platform.machine(), seed=SEED, corpus_files=len(texts), corpus_tokens=stream.numel(),
        tokenizer=dict(kind="byte-level BPE", vocab_size=VOCAB_SIZE, seconds=round(t_tok, 1)),
        target=dict(config=TARGET_CONFIG, recipe=asdict(target_recipe), seconds=round(t_target, 1),
                    final_loss=final_loss("target")),
        drafter=dict(layers=DRAFT_LAYERS, target_layer_ids=DRAFT_TARGET_LAYER_IDS, **info,
                     final_loss=final_loss("drafter")),
        total_seconds=round(time.perf_counter() - t0, 1))
    for name in ("target", "drafter"):
        os.replace(work / f"{name}_log.jsonl", out / f"{name}_log.jsonl")
    for leftover in work.iterdir():
        leftover.unlink()
    work.rmdir()
    (drafter_dir(out) / "training.json").unlink(missing_ok=True)
    with open(out / "recipe.json", "w") as f:
        json.dump(recipe, f, indent=1)
    return recipe


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m ddtree.train.embedded_pair",
                                description="rebuild the embedded target + DFlash drafter pair")
    p.add_argument("--out", default=str(PAIR_DIR))
    p.add_argument("--resume", action="store_true", help="continue from OUT/work/*_state.pt")
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    recipe = build(Path(args.out), args.resume, args.quiet)
    print(json.dumps(recipe, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
