"""The DFlash draft step on the embedded pair: ddtree's loop state (DFlashDraftState.step, as
generate_batch drives it) timed step by step; with --reference DIR (a checkout of the published
DDTree code, whose model/dflash.py holds its DFlashDraftModel) that drafter too, loaded from the
same checkpoint and fed the same inputs, the two stepping in lockstep (which one goes first
alternates between repeats) so the machine's speed drift hits both alike.

  python bench/bench_draft_step.py [--reference DIR] [--accepted 3] [--rounds 30] [--prompts 8]
                                   [--repeats 6] [--json F]

Three drafters step in lockstep: ddtree's default (fused_attention="auto": on this pair's CPU
steps, the fused draft_attention op), ddtree with fused_attention=False (projections, norms, RoPE, scatter and
SDPA as separate torch ops) and, with --reference, the published one.

Inputs: held-out prompts and the target's greedy continuation of each; a step's block starts at
the continuation's next token and brings the target features of the `accepted` rows before it
(the accepted path of the previous round; about 3 for tree 16 on these prompts), after the
prompt's rows in the first step (not timed). A step = the draft logits of one block: context
rows in, block embeddings, the drafter's layers, the target's LM head. The two drafters' logits
are compared (max |difference| printed and recorded).
"""
import argparse
import copy
import json
import os
import statistics
import sys
import time
import types

import torch

from ddtree import embedded
from ddtree.ops import Verdict
from timing import write_result  # noqa: E402


def continuation(target, tokenizer, text, new_tokens):
    """(prompt length, prompt + greedy continuation ids [1, T], hidden states of them)."""
    ids = tokenizer(text, return_tensors="pt").input_ids
    out = target.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return ids.shape[1], out, target(out, output_hidden_states=True).hidden_states


def ddtree_steps(target, drafter, prompt_len, ids, hidden, rounds, accepted):
    """Yields (seconds, logits) of each step of the loop's draft state."""
    bs = drafter.block_size
    state = drafter.begin(target, [tuple(h[:, :prompt_len] for h in hidden)],
                          ids.shape[1] + 2 * bs + 1, False)
    rows = torch.full((1, bs), -1)
    rows[0, :accepted] = torch.arange(accepted)
    verdict = Verdict(rows, torch.tensor([accepted]), ids[:, 0])
    start = prompt_len
    for _ in range(rounds):
        t0 = time.perf_counter()
        logits = state.step(ids[:, start])
        yield time.perf_counter() - t0, logits
        state.commit(tuple(h[:, start: start + accepted] for h in hidden), verdict)
        state.known_new_rows(accepted)  # what the loop's host read tells it
        start += accepted


def reference_steps(reference, target, prompt_len, ids, hidden, rounds, accepted):
    """Yields (seconds, logits) of each step of the published code's drafter, driven as its own
    generation loop drives it (a DynamicCache cropped to the committed context each step)."""
    from transformers import DynamicCache

    cache, bs = DynamicCache(), reference.block_size
    features = torch.cat([hidden[i + 1] for i in reference.target_layer_ids], -1)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    start, cached = prompt_len, 0
    for _ in range(rounds):
        block = torch.full((1, bs), reference.mask_token_id, dtype=torch.long)
        block[:, 0] = ids[:, start]
        t0 = time.perf_counter()
        out = reference(target_hidden=features[:, cached:start], noise_embedding=embed(block),
                        position_ids=torch.arange(cached, start + bs)[None],
                        past_key_values=cache, use_cache=True, is_causal=False)
        logits = head(out[:, 1 - bs:])
        cache.crop(start)
        yield time.perf_counter() - t0, logits
        cached, start = start, start + accepted


def load_reference(directory, drafter_dir):
    """The published code's DFlashDraftModel (imported from `directory`) on the embedded
    drafter's checkpoint, fp32. Its model/utils.py imports `datasets` for its benchmark's data
    loading only; a stand-in module is used when that package is absent."""
    sys.path.insert(0, os.path.abspath(directory))
    try:
        import datasets  # noqa: F401
    except ImportError:
        sys.modules["datasets"] = types.SimpleNamespace(
            load_dataset=None, Features=None, Sequence=None, Value=None)
    from model.dflash import DFlashDraftModel

    return DFlashDraftModel.from_pretrained(drafter_dir).float().eval()


def quantiles(values):
    values = sorted(values)
    return dict(median=statistics.median(values), p25=values[len(values) // 4],
                p75=values[3 * len(values) // 4], n=len(values))


@torch.no_grad()
def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", default=None,
                        help="a checkout of the published DDTree code (its model/dflash.py)")
    parser.add_argument("--accepted", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.accepted < 1 or args.rounds < 2:
        parser.error("--accepted must be >= 1 and --rounds >= 2")
    target, drafter, tokenizer = embedded.load()
    new_tokens = args.accepted * args.rounds + drafter.block_size
    data = [continuation(target, tokenizer, t, new_tokens)
            for t in embedded.heldout_prompts(args.prompts)]
    unfused = copy.deepcopy(drafter)
    unfused.fused_attention = False
    runs = {"ddtree": lambda *a: ddtree_steps(target, drafter, *a),
            "ddtree-unfused": lambda *a: ddtree_steps(target, unfused, *a)}
    if args.reference:
        reference = load_reference(args.reference, str(embedded.drafter_dir()))
        runs["reference"] = lambda *a: reference_steps(reference, target, *a)
    times = {name: [] for name in runs}
    max_diff = 0.0
    for repeat in range(args.repeats + 1):  # the first pass warms up, untimed
        names = list(runs) if repeat % 2 == 0 else list(runs)[::-1]
        for prompt_len, ids, hidden in data:
            steps = [runs[n](prompt_len, ids, hidden, args.rounds, args.accepted) for n in names]
            for i, step in enumerate(zip(*steps)):  # lockstep: one step of each in turn
                for other in step[1:]:
                    max_diff = max(max_diff, (step[0][1] - other[1]).abs().max().item())
                if repeat and i:  # the first step brings the prompt's rows
                    for name, (seconds, _) in zip(names, step):
                        times[name].append(seconds)
    result = dict(threads=torch.get_num_threads(), torch=torch.__version__, accepted=args.accepted,
                  rounds=args.rounds, prompts=args.prompts, repeats=args.repeats,
                  fused_attention=drafter.uses_fused_attention(
                      max(ids.shape[1] for _, ids, _ in data) + 2 * drafter.block_size + 1),
                  max_logit_difference=max_diff,
                  ms={n: {k: (1e3 * v if k != "n" else v) for k, v in quantiles(t).items()}
                      for n, t in times.items()})
    for name, q in result["ms"].items():
        print(f"{name:<15} draft step median {q['median']:.3f} ms (p25 {q['p25']:.3f}, "
              f"p75 {q['p75']:.3f}; {q['n']} steps)")
    pairs = [("ddtree", "ddtree-unfused")] + \
        [(n, "reference") for n in ("ddtree", "ddtree-unfused") if "reference" in times]
    for name, base in pairs:
        ratios = quantiles([a / b for a, b in zip(times[name], times[base])])
        result[f"{name}_over_{base}".replace("-", "_")] = ratios
        print(f"{name} / {base}, paired per step: median {ratios['median']:.3f} "
              f"(p25 {ratios['p25']:.3f}, p75 {ratios['p75']:.3f})")
    print(f"max |logit difference| against ddtree: {max_diff:.2e}")
    if args.json:
        write_result(args.json, result)


if __name__ == "__main__":
    torch.set_num_threads(min(2, torch.get_num_threads()))
    main()
