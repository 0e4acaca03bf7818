"""The shared training loop (AdamW, warm-up + cosine schedule, clipping, a JSON-lines loss log,
resumable state) and the target's causal-LM pre-training (the embedded pair's target)."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..models.common import atomic_path
from .corpus import random_windows

# ---- schedules, logs, resumable state ----

def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warm-up, then cosine decay to lr / 10."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


class Run:
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
        with atomic_path(str(self.log_path)) as tmp:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(rows)

    def save(self, model, opt, g: torch.Generator, step: int) -> None:
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


def optimise(model, params, steps, lr, warmup, loss_fn, run: Run, g, resume, save_every):
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
    run = Run(out, "target", recipe.steps, quiet, asdict(recipe))
    model.train()

    def loss_fn():
        x = random_windows(stream, recipe.batch, recipe.seq_len + 1, g)
        logits = model(input_ids=x[:, :-1]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten())

    params = [p for p in model.parameters() if p.requires_grad]
    seconds = optimise(model, params, recipe.steps, recipe.lr, recipe.warmup, loss_fn, run, g,
                        resume, save_every)
    model.eval()
    return seconds
