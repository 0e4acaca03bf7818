"""Tokens per second against batch size on the embedded pair: autoregressive, DFlash chain, DDTree
at fixed budgets and budget="auto", median and spread over the repeats (modes interleaved per
group of requests, the order alternating, the fast modes twice in a palindrome and
autoregressive / auto at least 8 times a batch size, 16 where it is one group; ratios paired
per repeat, then their median); every mode checked token-for-token against autoregressive;
auto's chosen budget per round as a histogram per batch size, its calibrated predicted vs
observed tokens per round, and a record of each of its generations (drafted request-rounds,
rounds per choice and reason, measured speed-up, the plain decoding time it estimated next to
the same requests' real autoregressive time).

  python bench/bench_concurrency.py [--batches 1 2 4 16 32] [--requests 16] [--new-tokens 96]
                                    [--repeats 3] [--json F] [--plot F] [--device cpu|cuda]
                                    [--attention ddtree|sdpa]

Throughput of a batch size = all requests' generated tokens / the wall time of the
generate_batch calls (prefill included, the same for every mode); requests = max(--requests,
batch), held-out prompts. Auto's cost profiles (each batch size and the smaller ones it
shrinks to as requests finish) are measured before the timed runs (not read from the disk
cache: a benchmark measures this build). The target verifies through --attention: "ddtree"
(default: the tree_attention op, no dense mask; what cuda_graph=True and `ddtree generate
--tree-attention` use) or "sdpa" (transformers' SDPA on the tree mask over the whole cache); the
drafter runs its default path (fused_attention="auto"). On a GPU the same
script runs unchanged (bench/gpu_check.sh calls it).
"""
import argparse
from collections import Counter
import json
import os
import statistics
import sys
import time

import torch

from ddtree import budget as cost_aware
from ddtree import embedded, models
from ddtree.generate import calibrate, generate_batch
from timing import write_result  # noqa: E402

# Auto next to autoregressive: with the order alternating between groups, the two always run
# back to back on the same requests (their ratio is the headline one).
MODES = [("autoregressive", None), ("tree", "auto"), ("chain", None), ("tree", 8), ("tree", 16),
         ("tree", 64), ("tree", 256)]
FAST = 5  # MODES[:FAST] run twice per group, in a palindrome (schedule)
# Autoregressive / auto runs of each at least, per batch size and repeat: where auto runs plain
# its ratio is the benchmark's own noise (same code path), about +-4 % a repeat with 4 on this VM.
# Twice as many where a batch size is one group (16, 32: there auto runs plain). More runs on
# the same requests are not more requests: where a batch size has several groups the extra runs
# would repeat one group's requests back to back, and auto's measured outcome (a running mean
# over its last requests) would rest on those few prompts (with 16 here, batch 2 went plain
# after four generations of one hard pair: 0.93x tree 8).
PAIRS_PER_BATCH = 8


def schedule(flip: bool, groups: int):
    """One group's runs: the fast modes forth and back (autoregressive, auto, chain, tree 8,
    tree 16, tree 16, tree 8, chain, auto, autoregressive — each mode's mean position the same,
    so a drift of the machine's speed that is linear over the group hits them alike); where a
    batch size has fewer than PAIRS_PER_BATCH groups (twice as many where it is one group: batch
    16 and 32), more (autoregressive, auto, auto, autoregressive) blocks, so that its headline
    ratio rests on as many runs; then the slow trees once. The whole order reversed when `flip`."""
    ar, auto = MODES[0], MODES[1]
    pairs = 2 * PAIRS_PER_BATCH if groups == 1 else PAIRS_PER_BATCH
    blocks = max(0, -(-pairs // groups) - 1)
    order = MODES[:FAST] + MODES[:FAST][::-1] + [ar, auto, auto, ar] * blocks + MODES[FAST:]
    return order[::-1] if flip else order


def label(mode, budget):
    return mode if budget is None else f"tree {budget}"


def run_group(target, drafter, group, mode, budget, new_tokens, profile):
    """One generate_batch call: (results, seconds, the AutoBudget of an auto call or None)."""
    kwargs = dict(mode=mode) if budget is None else dict(budget=budget)
    policy = None
    if budget == "auto":  # the policy generate_batch would make; what earlier calls learned
        policy = kwargs["policy"] = cost_aware.auto_policy(target, drafter, len(group), profile)
    start = time.perf_counter()
    out = generate_batch(target, drafter, group, new_tokens, **kwargs)
    return out, time.perf_counter() - start, policy


def generation_record(results, policy) -> dict:
    """What one auto generation did and why: its drafted request-rounds, its rounds per choice
    and reason ("bucket: reason", AutoBudget.choices / reasons: the per-round choice, a probe, a
    plain generation's rule), whether it re-checked a batch size that ran plain, the speed-up it
    measured and the time it estimated plain decoding would have taken (None when it measured
    none; main adds the group's real autoregressive time next to it)."""
    rounds = Counter(f"{b}: {reason}" for b, reason in zip(policy.choices, policy.reasons))
    speedup = getattr(policy, "measured_speedup", None)
    times = getattr(policy, "measured_ms", None)
    return dict(drafted_request_rounds=sum(b > 0 for r in results for b in r.round_budgets),
                rounds_by_choice=dict(rounds), recheck=bool(getattr(policy, "rechecking", False)),
                measured_speedup=None if speedup is None else round(speedup, 4),
                plain_estimate_ms=None if times is None else round(times[0], 1))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16, 32])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    parser.add_argument("--attention", choices=["ddtree", "sdpa"], default="ddtree")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype) if args.dtype else \
        (torch.bfloat16 if args.device == "cuda" else torch.float32)
    target, drafter, tokenizer = embedded.load(dtype=dtype, device=args.device)
    if args.attention == "ddtree":
        models.use_tree_attention(target)
    texts = embedded.heldout_prompts(max(args.requests, max(args.batches)))
    prompts = [tokenizer(t, return_tensors="pt").input_ids[0].to(args.device) for t in texts]
    # Every batch size and the smaller ones it shrinks to as requests finish.
    sizes = sorted({s for b in args.batches for s in [b, *cost_aware.shrink_sizes(b)]})
    measured = {}
    for size in sizes:
        measured[size] = calibrate(target, drafter, size, use_cache=False)
        print(f"cost profile, batch {size}: " + ", ".join(
            f"{b}: {ms:.1f} ms" for b, ms in sorted(measured[size].round_ms.items())),
            file=sys.stderr)
    profiles = {b: [measured[s] for s in [b, *cost_aware.shrink_sizes(b)]]
                for b in args.batches}
    for batch in args.batches:  # warm-up: every mode once at every batch size, untimed
        for mode, budget in MODES:
            run_group(target, drafter, prompts[:batch], mode, budget, 8, profiles[batch])
    generations = {}  # batch -> generation_record of every timed auto call, in order
    runs = {}  # (batch, label) -> list of tokens/s over repeats
    chosen, calibration = {}, {}
    for rep in range(args.repeats):
        for batch in args.batches:
            work = prompts[: max(args.requests, batch)]
            groups = [work[i:i + batch] for i in range(0, len(work), batch)]
            totals = {label(m, b): [0, 0.0] for m, b in MODES}  # tokens, seconds
            outputs = {label(m, b): [] for m, b in MODES}
            for g, group in enumerate(groups):
                # Modes interleaved per group of requests, the order alternating: the VM's slow
                # drifts hit every mode alike.
                done, records, ar_seconds = {}, [], []
                for mode, budget in schedule((rep + g) % 2 == 1, len(groups)):
                    name = label(mode, budget)
                    results, seconds, policy = run_group(target, drafter, group, mode, budget,
                                                         args.new_tokens, profiles[batch])
                    totals[name][0] += sum(len(r.tokens) for r in results)
                    totals[name][1] += seconds
                    tokens = [r.tokens for r in results]
                    if done.setdefault(name, tokens) != tokens:
                        raise SystemExit(f"bench_concurrency: {name} at batch {batch} gave "
                                         f"other tokens on a later run")
                    if mode == "autoregressive":
                        ar_seconds.append(seconds)
                    if budget == "auto":
                        records.append(generation_record(results, policy))
                        generations.setdefault(batch, []).append(records[-1])
                        chosen.setdefault(batch, []).extend(
                            b for r in results for b in r.round_budgets)
                        drafted = [(p, n) for r in results for p, n, b in zip(
                            r.predicted_lengths, r.acceptance_lengths, r.round_budgets) if b > 0]
                        cal = calibration.setdefault(batch, [0.0, 0.0, 0])
                        cal[0] += sum(p for p, _ in drafted)
                        cal[1] += sum(n for _, n in drafted)
                        cal[2] += len(drafted)
                # The plain decoding time auto estimated (measured speed-up's numerator) next
                # to the real one: the same requests' autoregressive generations.
                ar_ms = round(1e3 * statistics.mean(ar_seconds), 1)
                for record in records:
                    record["autoregressive_ms"] = ar_ms
                for name, tokens in done.items():
                    outputs[name] += tokens
            for name, (tokens, seconds) in totals.items():
                runs.setdefault((batch, name), []).append(tokens / seconds)
                print(f"repeat {rep} batch {batch:>2} {name:<15} {tokens / seconds:8.1f} tok/s",
                      file=sys.stderr)
            for name, tokens in outputs.items():
                if tokens != outputs["autoregressive"]:
                    raise SystemExit(f"bench_concurrency: {name} at batch {batch} differs from "
                                     f"autoregressive (lossless violated)")
    rows = []
    for batch in args.batches:
        # Ratios are paired: a mode's tokens/s over another's in the same repeat (the same
        # requests, run back to back), then the median over repeats — the VM's speed drifts
        # between repeats far more than between neighbouring runs.
        def paired(name, base):
            return statistics.median(a / b for a, b in zip(runs[(batch, name)],
                                                           runs[(batch, base)]))

        fixed = [label(m, b) for m, b in MODES if b != "auto"]
        best_fixed = max(fixed, key=lambda n: paired(n, "autoregressive"))
        for mode, budget in MODES:
            name = label(mode, budget)
            values = runs[(batch, name)]
            med = statistics.median(values)
            row = dict(batch=batch, mode=name, tokens_per_second=med, min=min(values),
                       max=max(values), vs_autoregressive=paired(name, "autoregressive"),
                       vs_autoregressive_per_repeat=[
                           a / b for a, b in zip(values, runs[(batch, "autoregressive")])])
            if budget == "auto":
                row["vs_best_fixed"] = paired(name, best_fixed)
                row["best_fixed"] = best_fixed
                counts = {b: chosen[batch].count(b) for b in cost_aware.BUCKETS}
                row["chosen_budgets"] = counts
                p, o, n = calibration.get(batch, [0.0, 0.0, 0])
                row["predicted_tokens_per_drafted_round"] = p / n if n else None
                row["observed_tokens_per_drafted_round"] = o / n if n else None
                row["generations"] = generations[batch]
                estimates = [g["plain_estimate_ms"] / g["autoregressive_ms"]
                             for g in generations[batch] if g["plain_estimate_ms"]]
                row["plain_estimate_vs_autoregressive"] = \
                    statistics.median(estimates) if estimates else None
            rows.append(row)
    print(f"{'batch':>5} {'mode':<15} {'tok/s':>9} {'spread':>17} {'vs AR':>7}")
    for r in rows:
        extra = ""
        if r["mode"] == "tree auto":
            extra = (f"  vs best fixed ({r['best_fixed']}) {r['vs_best_fixed']:.2f}x; budgets "
                     f"{ {b: c for b, c in r['chosen_budgets'].items() if c} }")
            if r["predicted_tokens_per_drafted_round"] is not None:
                extra += (f"; tokens/drafted round predicted "
                          f"{r['predicted_tokens_per_drafted_round']:.2f} observed "
                          f"{r['observed_tokens_per_drafted_round']:.2f}")
            idle = [g for g in r["generations"] if not g["drafted_request_rounds"]]
            extra += f"; {len(idle)} of {len(r['generations'])} generations drafted no round"
            if r["plain_estimate_vs_autoregressive"] is not None:
                extra += (f"; plain decoding estimated at "
                          f"{r['plain_estimate_vs_autoregressive']:.2f}x its real time")
        print(f"{r['batch']:>5} {r['mode']:<15} {r['tokens_per_second']:>9.1f} "
              f"{r['min']:>8.1f}-{r['max']:<8.1f} {r['vs_autoregressive']:>6.2f}x{extra}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_result(args.json, dict(device=cost_aware.device_name(torch.device(args.device)),
                       dtype=str(dtype), torch=torch.__version__, attention=args.attention,
                       drafter_fused_attention=str(drafter.fused_attention),
                       requests=args.requests,
                       new_tokens=args.new_tokens, repeats=args.repeats, rows=rows,
                       profiles={s: p.to_json() for s, p in measured.items()}))
    if args.plot:
        plot(rows, args.batches, args.plot)


def plot(rows, batches, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for mode, budget in MODES:
        name = label(mode, budget)
        mine = [r for r in rows if r["mode"] == name]
        axes[0].plot([r["batch"] for r in mine], [r["vs_autoregressive"] for r in mine], "o-",
                     label=name, lw=2.5 if budget == "auto" else 1.2)
    axes[0].axhline(1.0, color="gray", ls=":")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xticks(batches, [str(b) for b in batches])
    axes[0].set_xlabel("batch size")
    axes[0].set_ylabel("tokens/s vs autoregressive (median)")
    axes[0].legend(fontsize=8)
    auto = [r for r in rows if r["mode"] == "tree auto"]
    width = 0.8 / max(1, len(auto))
    for i, r in enumerate(auto):
        total = max(1, sum(r["chosen_budgets"].values()))
        xs = [j + i * width for j in range(len(cost_aware.BUCKETS))]
        axes[1].bar(xs, [r["chosen_budgets"][b] / total for b in cost_aware.BUCKETS], width,
                    label=f"batch {r['batch']}")
    axes[1].set_xticks([j + 0.4 - width / 2 for j in range(len(cost_aware.BUCKETS))],
                       [str(b) for b in cost_aware.BUCKETS])
    axes[1].set_xlabel("budget chosen by auto (0 = autoregressive round)")
    axes[1].set_ylabel("fraction of rounds")
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
