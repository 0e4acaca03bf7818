"""Training: DFlash drafters for any transformers causal-LM target (`ddtree train-drafter`), and the
pieces that build the embedded pair (tokenizer, small target) from the Python standard library.

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
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, List, Optional

import torch
import torch.nn.functional as F

from . import loading
from .loading import text_config

# ---- corpus: the Python standard library's own sources, split by a hash of the path ----

_EXCLUDED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
_MAX_FILE_BYTES = 200_000  # generated tables (e.g. pydoc_data/topics.py) are not code


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(relative_path: str) -> bool:
    """One file in ten is held out: crc32 of its path relative to the stdlib root, mod 10 == 0.
    Stable across Python versions (a path keeps its split)."""
    return zlib.crc32(relative_path.encode()) % 10 == 0


def stdlib_files(split: str, root: Optional[Path] = None) -> List[Path]:
    """The stdlib's .py files of `split` ("train" or "heldout"), sorted by path."""
    if split not in ("train", "heldout"):
        raise ValueError(f"stdlib_files: split must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _EXCLUDED_DIRS & set(rel.split("/")[:-1]) or path.stat().st_size > _MAX_FILE_BYTES:
            continue
        if is_heldout(rel) == (split == "heldout"):
            out.append(path)
    return out


def read_texts(paths: Iterable[Path]) -> List[str]:
    return [Path(p).read_bytes().decode("utf-8", errors="replace") for p in paths]


def corpus_texts(corpus: Optional[str]) -> List[str]:
    """A text corpus: None = the stdlib's train split; a file; or a directory (its .py / .txt /
    .md files, recursively)."""
    if corpus is None:
        return read_texts(stdlib_files("train"))
    path = Path(corpus)
    if path.is_file():
        return read_texts([path])
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.suffix in (".py", ".txt", ".md") and p.is_file())
        if files:
            return read_texts(files)
    raise ValueError(f"corpus: {corpus!r} is neither a text file nor a directory holding .py / .txt "
                     f"/ .md files")


# ---- tokenizer ----

EOS_TOKEN, MASK_TOKEN = "<|endoftext|>", "<|mask|>"


def train_tokenizer(texts: List[str], vocab_size: int):
    """A byte-level BPE tokenizer (`tokenizers`) with <|endoftext|> (id 0) and <|mask|> (id 1, the
    drafter's mask token), wrapped as a transformers PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, MASK_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=EOS_TOKEN,
                                   mask_token=MASK_TOKEN)


def token_stream(tokenizer, texts: List[str]) -> torch.Tensor:
    """All texts encoded and concatenated, each followed by the end-of-text token (when the
    tokenizer has one): int64 [T]."""
    eos = tokenizer.eos_token_id
    ids: List[int] = []
    for enc in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def random_windows(stream: torch.Tensor, count: int, length: int, g: torch.Generator) -> torch.Tensor:
    if stream.numel() <= length:
        raise ValueError(f"corpus: {stream.numel()} tokens, fewer than one window of {length + 1}")
    starts = torch.randint(0, stream.numel() - length, (count,), generator=g)
    return torch.stack([stream[s:s + length] for s in starts.tolist()])


# ---- schedules, logs, resumable state ----

def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class _Run:
    """Progress bar, a JSON-lines loss log and a resumable state file in `out`. The state holds
    the recipe it was trained with: a resume under another recipe is refused."""

    def __init__(self, out: str, name: str, steps: int, quiet: bool, recipe: dict):
        self.out = Path(out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.state_path = self.out / f"{name}_state.pt"
        self.log_path = self.out / f"{name}_log.jsonl"
        self.steps, self.quiet, self.name, self.recipe = steps, quiet, name, recipe

    def resume(self, model, opt, g: torch.Generator) -> int:
        """Loads the state (if any) and cuts the loss log back to its step; returns that step."""
        if not self.state_path.exists():
            return 0
        state = torch.load(self.state_path, weights_only=False)
        saved = state.get("recipe")
        if saved is None:
            raise ValueError(f"{self.state_path}: holds no recipe, so the resume cannot be checked; "
                             f"start again without --resume")
        changed = {k: (saved.get(k), v) for k, v in self.recipe.items() if saved.get(k) != v}
        if changed:
            diff = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(changed.items()))
            raise ValueError(f"{self.state_path}: was trained with another recipe ({diff}); resume "
                             f"with the saved settings or start again without --resume")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        g.set_state(state["generator"])
        step = int(state["step"])
        self._truncate_log(step)
        return step

    def _truncate_log(self, step: int) -> None:
        if not self.log_path.exists():
            return
        with open(self.log_path, encoding="utf-8") as f:
            rows = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        from .models.dflash import atomic_path

        with atomic_path(str(self.log_path)) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(rows)

    def save(self, model, opt, g: torch.Generator, step: int) -> None:
        from .models.dflash import atomic_path

        with atomic_path(str(self.state_path)) as tmp:
            torch.save(dict(model=model.state_dict(), optimizer=opt.state_dict(),
                            generator=g.get_state(), step=step, recipe=self.recipe), tmp)

    def bar(self, first: int):
        from tqdm import tqdm

        return tqdm(range(first, self.steps), initial=first, total=self.steps, desc=self.name,
                    disable=self.quiet, mininterval=2.0)

    def log(self, **row) -> None:
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")


def _optimise(model, params, steps, lr, warmup, loss_fn, run: _Run, g, resume, save_every):
    """The shared training loop: AdamW (0.9, 0.95, wd 0.1), clip 1.0, lr schedule, log, resume.
    A NaN / inf loss stops it (FloatingPointError) before the step is taken."""
    opt = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    first = run.resume(model, opt, g) if resume else 0
    if not resume and run.log_path.exists():
        run.log_path.unlink()
    started, losses = time.perf_counter(), []
    bar = run.bar(first)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        loss = loss_fn()
        value = loss.item()
        if not math.isfinite(value):
            raise FloatingPointError(
                f"{run.name} training: the loss is {value} at step {step + 1} (lr "
                f"{opt.param_groups[0]['lr']:.3g}); stopped. The last state saved is "
                f"{run.state_path if run.state_path.exists() else 'none'}")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        losses.append(value)
        if (step + 1) % 10 == 0 or step + 1 == steps:
            mean = sum(losses) / len(losses)
            losses = []
            bar.set_postfix(loss=f"{mean:.3f}")
            run.log(step=step + 1, loss=round(mean, 5), lr=opt.param_groups[0]["lr"],
                    seconds=round(time.perf_counter() - started, 1))
        if save_every and (step + 1) % save_every == 0 and step + 1 < steps:
            run.save(model, opt, g, step + 1)
    run.save(model, opt, g, steps)
    return time.perf_counter() - started


# ---- the target (causal LM pre-training, for the embedded pair) ----

@dataclass
class TargetRecipe:
    steps: int = 900
    batch: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    warmup: int = 60
    seed: int = 0


def train_target(model, stream: torch.Tensor, recipe: TargetRecipe, out: str, resume=False,
                 quiet=False, save_every=200) -> float:
    """Next-token training of `model` on random windows of `stream`; returns seconds."""
    g = torch.Generator().manual_seed(recipe.seed)
    run = _Run(out, "target", recipe.steps, quiet, asdict(recipe))
    model.train()

    def loss_fn():
        x = random_windows(stream, recipe.batch, recipe.seq_len + 1, g)
        logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())

    params = [p for p in model.parameters() if p.requires_grad]
    seconds = _optimise(model, params, recipe.steps, recipe.lr, recipe.warmup, loss_fn, run, g,
                        resume, save_every)
    model.eval()
    return seconds


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
    (tests/test_train.py)."""
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
    from .models import dflash_config

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
    run = _Run(out, "drafter", recipe.steps, quiet, asdict(recipe))
    drafter.train()

    def loss_fn():
        rows = torch.randint(0, tokens.shape[0], (recipe.batch,), generator=g)
        anchors = torch.randint(first_anchor, last_anchor + 1, (recipe.batch, recipe.anchors),
                                generator=g)
        device = drafter.fc.weight.device
        return drafter_loss(drafter, target, feats[rows].to(device), tokens[rows].to(device),
                            anchors.to(device), recipe.gamma)

    params = [p for p in drafter.parameters() if p.requires_grad]
    t_train = _optimise(drafter, params, recipe.steps, recipe.lr, recipe.warmup, loss_fn, run, g,
                        resume, save_every)
    drafter.eval()
    drafter.save_pretrained(out)
    info = dict(recipe=asdict(recipe), data_seconds=round(t_data, 1),
                train_seconds=round(t_train, 1))
    from .models.dflash import atomic_path

    with atomic_path(os.path.join(out, "training.json")) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=1)
    return info


# What `train-drafter` writes into --out (the drafter, its recipe, the resumable state, the loss
# log); temporary files are ".<name>.<pid>.<tag>.tmp".
DRAFTER_OUTPUTS = ("config.json", "model.safetensors", "training.json", "drafter_state.pt",
                   "drafter_log.jsonl")


def check_output_dir(out: str, target: str, overwrite: bool) -> None:
    """Refuses an --out that is (or lies inside) the target's directory, always, and without
    overwrite one that holds anything but this command's own earlier output."""
    from .cli import UsageError

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
    if config.exists() and not _is_drafter_config(config):
        foreign.append("config.json (not a DFlash drafter's)")
    if foreign and not overwrite:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise UsageError(f"--out {out!r} holds files that are not train-drafter output ({shown}); "
                         f"choose an empty directory or pass --overwrite")


def _is_drafter_config(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and "dflash_config" in config


def cmd_train_drafter(args) -> int:
    """`ddtree train-drafter`: a DFlash drafter for a local Hugging Face target directory."""
    from .cli import UsageError, model_dir
    from .models import DFlashDrafter

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
    target = loading.load_target(args.target, torch.float32, device)
    tokenizer = loading.load_tokenizer(args.target)
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


def add_train_drafter_parser(sub) -> None:
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
