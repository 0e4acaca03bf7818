"""`ddtree replay`: budget="auto"'s policy replayed on recorded drafts (budget.replay) — records
the embedded pair's drafts on held-out prompts (or reads recorded ones) and prints the replayed
speed-ups of auto and of the fixed trees under given or measured cost profiles."""
from __future__ import annotations

import json
import math

from .common import UsageError


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="replay budget='auto' on recorded drafts (no clock)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--first", type=int, default=0,
                   help="index of the first held-out prompt recorded")
    p.add_argument("--new-tokens", type=int, default=96)
    p.add_argument("--out", default=None, help="write the records (JSON) here")
    p.add_argument("--records", default=None,
                   help="replay the records of this JSON (as --out writes) instead")
    p.add_argument("--costs", default=None,
                   help='JSON {"0": ms, "4": ms, ...}; default: calibrate batch 1 here')
    p.add_argument("--profiles", default=None,
                   help="the costs: the cost profiles a bench_concurrency.py JSON holds")
    p.add_argument("--batch", type=int, default=1,
                   help="requests per generation (the records taken in order)")
    p.add_argument("--switch-ms", type=float, nargs=2, default=(0.0, 0.0),
                   metavar=("INTO", "OUT_OF"),
                   help="what a switch costs: a drafted round after autoregressive ones, "
                        "an autoregressive round after a drafted one (ms; default 0 0)")
    p.add_argument("--noisy-clocks", type=int, default=0,
                   help="also replay auto told round times of N seeded JitteredClocks")
    p.set_defaults(func=cmd_replay)


def cmd_replay(args) -> int:
    """ddtree replay [--prompts 16] [--first 0] [--new-tokens 96] [--out F]
    [--records F] [--costs JSON | --profiles F] [--batch 1] [--switch-ms INTO OUT_OF]
    [--noisy-clocks N]: records the embedded pair's drafts on held-out prompts (the first
    --prompts from the --first-th: the data of tests/test_budget_replay.py by default; --records
    F reads records --out wrote instead) and prints the replayed speed-ups of auto and the fixed trees, the records taken
    in generations of --batch requests, under cost profiles (--costs: {bucket: ms} at batch 1,
    {batch size: {bucket: ms}} for the batch and every power of two below it otherwise;
    --profiles: those a bench_concurrency.py JSON holds; default: the profiles measured on this
    machine)."""
    from .. import embedded
    from ..budget import shrink_sizes
    from ..budget.replay import DraftRecord, JitteredClock, speedups
    from ..generate import calibrate, record_drafts

    if not all(0 <= x < math.inf for x in args.switch_ms):
        raise UsageError(f"--switch-ms must be two finite milliseconds >= 0, got "
                         f"{args.switch_ms}")
    if args.first < 0 or args.prompts < 1 or args.batch < 1:
        raise UsageError(f"--first must be >= 0 and --prompts, --batch >= 1, got {args.first}, "
                         f"{args.prompts} and {args.batch}")
    sizes = [args.batch, *shrink_sizes(args.batch)]
    if args.costs and args.profiles:
        raise UsageError("--costs and --profiles: give one")
    # The given costs as {batch size: {bucket: ms}} (None: measured here), and where from.
    tables, source = None, "--profiles" if args.profiles else "--costs"
    if args.profiles:
        try:
            with open(args.profiles) as f:
                data = json.load(f)
            profiles = data.get("result", data)["profiles"]  # a result file, or its payload
            tables = {int(n): {int(b): float(ms) for b, ms in p["round_ms"].items()}
                      for n, p in profiles.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"--profiles {args.profiles}: not a JSON with cost profiles as "
                             f"bench_concurrency.py writes them ({type(e).__name__}: {e})")
    if args.costs:
        try:
            given = json.loads(args.costs)
            tables = {1: {int(k): float(v) for k, v in given.items()}} if args.batch == 1 else \
                {int(n): {int(k): float(v) for k, v in t.items()} for n, t in given.items()}
        except (ValueError, AttributeError, TypeError) as e:
            shape = '{"0": ms, "4": ms, ...}' if args.batch == 1 else \
                '{"batch size": {"0": ms, "4": ms, ...}, ...}'
            raise UsageError(f"--costs must be a JSON object {shape}, got {args.costs!r} "
                             f"({type(e).__name__}: {e})")
    if tables is not None and not set(sizes) <= set(tables):
        raise UsageError(f"{source} has no costs of batch sizes "
                         f"{sorted(set(sizes) - set(tables))} (--batch {args.batch} needs "
                         f"{sorted(sizes)})")
    # The pair is loaded only to record drafts or to measure the costs.
    pair = embedded.load() if not (args.records and tables) else None
    if args.records:
        try:
            with open(args.records) as f:
                records = [DraftRecord.from_json(r) for r in json.load(f)["records"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--records {args.records}: not a JSON of records as --out writes "
                             f"them ({type(e).__name__}: {e})")
        if not records:
            raise UsageError(f"--records {args.records}: holds no records")
    else:
        texts = embedded.heldout_prompts(args.first + args.prompts)[args.first:]
        if len(texts) < args.prompts:
            raise UsageError(f"--first {args.first} --prompts {args.prompts}: there are "
                             f"{args.first + len(texts)} held-out prompts")
        target, drafter, tokenizer = pair
        records = [record_drafts(target, drafter,
                                 tokenizer(text, return_tensors="pt").input_ids[0],
                                 args.new_tokens) for text in texts]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(pair="embedded", new_tokens=args.new_tokens,
                           records=[r.to_json() for r in records]), f, separators=(",", ":"))
    missing = sorted(set(records[0].buckets) - set.intersection(
        *[set(tables[n]) for n in sizes])) if tables else []
    if missing:
        raise UsageError(f"{source} has no cost for budgets {missing} (the records' buckets: "
                         f"{records[0].buckets})")
    tables = tables or {n: calibrate(pair[0], pair[1], n).round_ms for n in sizes}
    for n in sorted(sizes):
        print(f"round cost (ms), batch {n}: " + ", ".join(
            f"{b}: {ms:.2f}" for b, ms in sorted(tables[n].items())))
    costs = tables[1] if args.batch == 1 else tables
    switch = tuple(args.switch_ms)
    for name, value in speedups(records, costs, batch=args.batch, switch_ms=switch).items():
        print(f"{name:>22s}  {value:.3f}x autoregressive")
    for seed in range(args.noisy_clocks):
        value = speedups(records, costs, clock=JitteredClock(seed), batch=args.batch,
                         switch_ms=switch)["auto"]
        print(f"{'auto, noisy clock ' + str(seed):>22s}  {value:.3f}x autoregressive")
    return 0
