"""budget="auto"'s policy replayed on recorded drafts, without a clock (batch 1, greedy).

A greedy generation is fixed by its prompt, so the draft at each position is too: with the
target's greedy continuation, `record_drafts` stores for every position (tokens emitted so far)
what a round of each bucket would emit there and the drafter's expected accepted nodes of that
bucket's tree. `replay` then runs a policy (the real AutoBudget, Calibration and RoundStats) over
those positions, each round pricing its bucket from a cost profile: the rounds any policy would
run, and their cost, with no machine noise. Policy changes are compared on identical drafts and
costs, and on cost regimes this machine does not have (verify nearly free, as on a GPU at small
batch, or dear). Round costs are the profile's, plus, when given (`switch_ms`), what a switch
between autoregressive and drafted rounds costs in the loop (the drafter's queued context
rows taken by the first draft step, the target's first rounds of the other kind).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import budget as cost_aware
from . import ops
from .generate import generate_batch, kept_rows


@dataclass
class DraftRecord:
    """One prompt's drafts. Row k - 1 is the position where k tokens have been emitted (token
    k - 1, the bonus, is the tree's root): expected[k - 1][i] = the drafter's expected accepted
    nodes of the best buckets[i]-node tree, emitted[k - 1][i] = tokens a round of buckets[i]
    emits there (accepted nodes + the bonus; 1 for bucket 0) — a bucket shallower than the
    drafter's depth from its own shorter draft, as the loop drafts it. shallow[d][k - 1]: every
    bucket's expected nodes from the draft of d depths (d < depth; trees no deeper than d), the
    statistics a round of bucket d reports."""
    buckets: List[int]
    depth: int
    expected: List[List[float]]
    emitted: List[List[int]]
    shallow: Dict[int, List[List[float]]] = field(default_factory=dict)

    def to_json(self) -> dict:
        rows = lambda table: [[round(x, 4) for x in row] for row in table]  # noqa: E731
        return dict(buckets=self.buckets, depth=self.depth, expected=rows(self.expected),
                    emitted=self.emitted,
                    shallow={str(d): rows(table) for d, table in self.shallow.items()})

    @classmethod
    def from_json(cls, d: dict) -> "DraftRecord":
        shallow = {int(k): v for k, v in (d.get("shallow") or {}).items()}
        return cls(**{**d, "shallow": shallow})

    def round_row(self, k: int, bucket: int) -> List[float]:
        """Every bucket's expected nodes as a round of `bucket` at row k - 1 reports them."""
        return self.shallow[bucket][k - 1] if bucket in self.shallow else self.expected[k - 1]


def _emitted(tree: ops.DraftTree, continuation: torch.Tensor, buckets: Sequence[int],
             depth: int) -> List[int]:
    """Tokens a greedy verify of each bucket's prefix tree emits (verify_greedy's accept_len:
    accepted nodes + the bonus): the target's token at a node of depth d is continuation[d],
    its greedy token after the node's path whenever that path is the target's own."""
    at = tree.depths.clamp(max=continuation.numel() - 1)
    target_tokens = continuation[at]
    return [int(ops.verify_greedy(ops.first_nodes(tree, b), target_tokens[:, : b + 1],
                                  depth).accept_len[0]) for b in buckets]


@torch.no_grad()
def record_drafts(target, drafter, prompt: torch.Tensor, new_tokens: int,
                  buckets: Sequence[int] = cost_aware.BUCKETS) -> DraftRecord:
    """The drafts of one prompt (1-D token ids) at every position of its greedy continuation of
    `new_tokens` tokens: the target's hidden states of prompt + continuation come from one
    forward; at each position a fresh draft state over the rows before it drafts a block, and
    build_tree makes the tree of the largest bucket (what an auto round builds) — a bucket
    shallower than the drafter's depth from its own block of bucket + 1 rows (what a round of
    that bucket drafts), every other bucket from the full block."""
    depth = drafter.block_size - 1
    device = target.get_input_embeddings().weight.device
    prompt = prompt.reshape(-1).to(device)
    tokens = generate_batch(target, None, [prompt], new_tokens + depth,
                            mode="autoregressive")[0].tokens
    seq = torch.cat([prompt, torch.tensor(tokens[:-1], dtype=torch.long, device=device)])
    hidden = target(input_ids=seq[None], output_hidden_states=True).hidden_states
    largest, p = max(buckets), prompt.numel()
    continuation = torch.tensor(tokens, dtype=torch.long, device=device)
    expected, emitted, shallow = [], [], {}
    # The draft depths the loop asks for: a bucket shallower than the drafter drafts only as
    # deep as its tree can go (its own, slightly different, block), the others the full block.
    drafts = sorted({min(b, depth) for b in buckets if b > 0} | {depth})
    for k in range(1, new_tokens):
        rows = tuple(h[:, : p + k - 1] for h in hidden)
        root = torch.tensor([tokens[k - 1]], device=device)
        per_draft = {}
        for d in drafts:
            state = drafter.begin(target, [rows], p + k + 2 * depth + 1)
            tree = ops.draft_tree(state.step(root, d), root, largest)
            nodes = ops.expected_accepts(tree)[0].tolist()
            per_draft[d] = ([nodes[min(b, len(nodes) - 1)] for b in buckets],
                            _emitted(tree, continuation[k:], buckets, depth))
        # bucket 0 (no draft) reads the full draft's row: 0 nodes, 1 token either way
        pick = [per_draft[min(b, depth) if b > 0 else depth] for b in buckets]
        expected.append([row[0][i] for i, row in enumerate(pick)])
        emitted.append([row[1][i] for i, row in enumerate(pick)])
        for d in drafts[:-1]:
            shallow.setdefault(d, []).append(per_draft[d][0])
    return DraftRecord(list(buckets), depth, expected, emitted, shallow)


@dataclass
class Replayed:
    """One replayed generation: its rounds' buckets, tokens emitted per round, priced time."""
    choices: List[int]
    emitted: List[int]
    ms: float


def replay(record: DraftRecord, costs: Dict[int, float], policy,
           calibration: Optional[cost_aware.Calibration] = None,
           clock: Optional[Callable[[float], float]] = None,
           switch_ms: Tuple[float, float] = (0.0, 0.0)) -> Replayed:
    """One request's generation (replay_batch at batch 1, priced at `costs`)."""
    return replay_batch([record], {1: costs}, policy, calibration, clock, switch_ms)


def replay_batch(records: Sequence[DraftRecord], costs: Dict[int, Dict[int, float]], policy,
                 calibration: Optional[cost_aware.Calibration] = None,
                 clock: Optional[Callable[[float], float]] = None,
                 switch_ms: Tuple[float, float] = (0.0, 0.0)) -> Replayed:
    """Runs `policy` (AutoBudget, FixedBucket or anything with choose / observe) over the
    records' positions as the auto loop would with one request per record (greedy decoding:
    a request's drafts depend on its own tokens alone): each round's bucket from the policy,
    every live request advancing by what a round of that bucket emits at its position; a
    drafted round's calibrated expected tokens (1 + nodes x calibration ratio; the steady
    ratio, and the round position's for its own prediction) per request and bucket as its
    statistics, the round position's calibration updated with each live request's verified
    bucket's prediction and what it emitted (as live, a round of a bucket shallower than the
    drafter's depth measures only the buckets no deeper than it); remaining tokens before each
    choice; finished requests leave the batch as the loop's do (the live ones padded to a power
    of two, policy.resize). Rounds are priced at costs[batch size][bucket] (a size without a
    table: the smallest larger one's, e.g. a last, partial generation), a drafted round after an
    autoregressive one switch_ms[0] more, an autoregressive round after a drafted one
    switch_ms[1] more; the policy is told clock(cost) as each round's wall time (default: the
    cost; JitteredClock: a machine whose speed drifts). The records' positions bound the generation (new_tokens of record_drafts).
    Replayed.emitted: the tokens of all requests per round."""
    if not (isinstance(switch_ms, (tuple, list)) and len(switch_ms) == 2 and
            all(isinstance(x, (int, float)) and 0 <= x < math.inf for x in switch_ms)):
        raise ValueError(f"replay: switch_ms must be two finite milliseconds >= 0 (into drafted "
                         f"rounds, out of them), got {switch_ms!r}")
    buckets, depth = records[0].buckets, records[0].depth
    calibration = calibration or cost_aware.Calibration("cpu")
    policy.start(len(records), depth, "cpu")
    total = [len(r.emitted) + 1 for r in records]
    k, rows, out = [1] * len(records), list(range(len(records))), Replayed([], [], 0.0)

    def remaining():
        return {i: total[i] - k[i] for i in rows if k[i] < total[i]}

    if hasattr(policy, "observe_remaining"):
        policy.observe_remaining(remaining())
    while any(k[i] < total[i] for i in rows):
        bucket = policy.choose()
        column = buckets.index(bucket)
        live = [k[i] < total[i] for i in rows]
        emitted = [records[i].emitted[k[i] - 1][column] if alive else 0
                   for i, alive in zip(rows, live)]
        stats = None
        if bucket > 0:
            nodes = torch.tensor([records[i].round_row(k[i], bucket) if alive else
                                  [0.0] * len(buckets) for i, alive in zip(rows, live)])
            took_part = torch.tensor(live, dtype=nodes.dtype)
            position = cost_aware.Calibration.position(len(out.choices))
            per_row = [row if alive else [0.0] * len(buckets) for row, alive in
                       zip(calibration.expected_tokens(nodes).tolist(), live)]
            predicted = calibration.expected_tokens(nodes[:, column], position).tolist()
            calibration.update(nodes[:, column], torch.tensor(emitted), position, took_part)
            stats = cost_aware.RoundStats(
                expected=[sum(col) for col in zip(*per_row)], live=sum(live),
                predicted=predicted, per_row=per_row, requests=list(rows),
                observed=cost_aware.observed_buckets(buckets, min(bucket, depth), depth))
        for i, n in zip(rows, emitted):
            k[i] += n
        out.choices.append(bucket)
        out.emitted.append(sum(emitted))
        cost = costs[min(n for n in costs if n >= len(rows))][bucket]
        if len(out.choices) > 1 and (out.choices[-2] == 0) != (bucket == 0):
            cost += switch_ms[0] if bucket else switch_ms[1]
        out.ms += cost
        if hasattr(policy, "observe_cost"):
            policy.observe_cost(bucket, clock(cost) if clock else cost)
        if hasattr(policy, "observe_remaining"):
            policy.observe_remaining(remaining())
        policy.observe(stats)
        keep = kept_rows([k[i] >= total[i] for i in rows])
        if keep is not None:
            rows = [rows[j] for j in keep]
            if hasattr(policy, "resize"):
                policy.resize(len(rows))
    return out


def replay_all(records: Sequence[DraftRecord], costs: Dict[int, float],
               make_policy: Callable[[Optional[dict]], object],
               clock: Optional[Callable[[float], float]] = None, batch: int = 1,
               switch_ms: Tuple[float, float] = (0.0, 0.0)) -> List[Replayed]:
    """The records as consecutive generations of `batch` requests each (batch 1: `costs` is
    {bucket: ms}; else {batch size: {bucket: ms}} for the batch and every power of two below it;
    switches priced at `switch_ms`, replay_batch), handled as generate_batch handles them:
    make_policy(prior) builds each one's policy from what the one before learned (the calibration's sums included); a generation its policy
    makes plain autoregressive (plain_autoregressive) runs bucket 0 throughout; a drafting one
    reports its time (observe_generation) before finish."""
    table = _cost_table(costs, batch)
    learned, out = None, []
    for start in range(0, len(records), batch):
        group = records[start: start + batch]
        policy = make_policy(learned)
        if hasattr(policy, "plain_autoregressive") and \
                policy.plain_autoregressive(len(group), group[0].depth):
            out.append(replay_batch(group, table, cost_aware.FixedBucket(0)))
            policy.record_autoregressive(len(out[-1].choices))
            learned = policy.learned
            continue
        prior = policy.calibration_prior() if hasattr(policy, "calibration_prior") else None
        calibration = cost_aware.Calibration("cpu", sums=prior)
        out.append(replay_batch(group, table, policy, calibration, clock, switch_ms))
        if hasattr(policy, "observe_generation"):
            policy.observe_generation(out[-1].ms, [len(r.emitted) for r in group])
        learned = policy.finish(calibration.sums.tolist()) if hasattr(policy, "finish") else None
    return out


def _cost_table(costs, batch: int) -> Dict[int, Dict[int, float]]:
    """{batch size: {bucket: ms}} from replay_all's `costs` at `batch`, checked."""
    if not isinstance(batch, int) or batch < 1:
        raise ValueError(f"replay_all: batch must be an integer >= 1, got {batch!r}")
    if batch == 1:
        return {1: costs}
    missing = [b for b in [batch, *cost_aware.shrink_sizes(batch)] if b not in costs]
    if missing:
        raise ValueError(f"replay_all: costs has no table for batch sizes {missing} (a batch of "
                         f"{batch} needs its own and every power of two below it)")
    return costs


def _profile(batch: int, costs: Dict[int, float]) -> cost_aware.CostProfile:
    return cost_aware.CostProfile(batch=batch, round_ms=dict(costs), target="replay",
                                  drafter="replay", device="replay", dtype="replay",
                                  version="replay")


def auto(costs: Dict[int, float], batch: int = 1, **kwargs) -> Callable[[Optional[dict]], object]:
    """make_policy for replay_all: AutoBudget on `costs` (as replay_all takes them for `batch`;
    each round reports its exact cost, so the learned cost ratios stay 1)."""
    table = _cost_table(costs, batch)
    smaller = {b: _profile(b, table[b]) for b in cost_aware.shrink_sizes(batch)}
    return lambda prior: cost_aware.AutoBudget(_profile(batch, table[batch]), prior=prior,
                                               smaller=smaller, **kwargs)


class JitteredClock:
    """Round times of a noisy machine for replay's policy: a round's cost x speed x jitter, the
    speed a slow random walk (log steps of `drift`, pulled back towards 1, within [0.7, 1.5]:
    slow and fast spells lasting many rounds) and the jitter independent per round (`jitter`
    standard deviation). Seeded."""

    def __init__(self, seed: int, drift: float = 0.03, jitter: float = 0.06):
        import random

        self.rng, self.speed = random.Random(seed), 1.0
        self.drift, self.jitter = drift, jitter

    def __call__(self, ms: float) -> float:
        step = (1 + self.rng.gauss(0, self.drift)) * self.speed ** -0.05
        self.speed = min(1.5, max(0.7, self.speed * step))
        return ms * self.speed * (1 + self.rng.gauss(0, self.jitter))


def speedups(records: Sequence[DraftRecord], costs: Dict[int, float],
             make_policy: Optional[Callable] = None,
             clock: Optional[Callable[[float], float]] = None, batch: int = 1,
             switch_ms: Tuple[float, float] = (0.0, 0.0)) -> Dict[str, float]:
    """Tokens per ms over autoregressive decoding's, all records together in generations of
    `batch` requests (costs as replay_all takes them): 'auto' (make_policy, default AutoBudget;
    told clock's round times; its switches priced at `switch_ms`, replay_batch — a fixed bucket
    never switches), each fixed bucket ('tree N'), and 'best fixed per prompt' (an oracle that
    knows each generation's best fixed bucket in advance)."""
    make_policy = make_policy or auto(costs, batch)
    fixed = {b: replay_all(records, costs, lambda prior, b=b: cost_aware.FixedBucket(b),
                           batch=batch) for b in records[0].buckets}
    plain = sum(r.ms for r in fixed[0])
    out = {"auto": plain / sum(r.ms for r in replay_all(records, costs, make_policy, clock,
                                                        batch, switch_ms))}
    out.update({f"tree {b}": plain / sum(r.ms for r in runs) for b, runs in fixed.items() if b})
    out["best fixed per prompt"] = plain / sum(
        min(fixed[b][i].ms for b in fixed) for i in range(len(fixed[0])))
    return out


def main(argv=None) -> int:
    """python -m ddtree.policy_replay [--prompts 16] [--first 0] [--new-tokens 96] [--out F]
    [--records F] [--costs JSON | --profiles F] [--batch 1] [--switch-ms INTO OUT_OF]
    [--noisy-clocks N]: records the
    embedded pair's drafts on held-out prompts (the first --prompts from the --first-th: the
    data of tests/test_policy_replay.py by default; --records F reads records --out wrote
    instead) and prints the replayed speed-ups of auto and the fixed trees, the records taken
    in generations of --batch requests, under cost profiles (--costs: {bucket: ms} at batch 1,
    {batch size: {bucket: ms}} for the batch and every power of two below it otherwise;
    --profiles: those a bench_concurrency.py JSON holds; default: the profiles measured on this
    machine)."""
    import argparse
    import json

    from . import embedded

    parser = argparse.ArgumentParser(prog="python -m ddtree.policy_replay")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--first", type=int, default=0,
                        help="index of the first held-out prompt recorded")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--out", default=None, help="write the records (JSON) here")
    parser.add_argument("--records", default=None,
                        help="replay the records of this JSON (as --out writes) instead")
    parser.add_argument("--costs", default=None,
                        help='JSON {"0": ms, "4": ms, ...}; default: calibrate batch 1 here')
    parser.add_argument("--profiles", default=None,
                        help="the costs: the cost profiles a bench_concurrency.py JSON holds")
    parser.add_argument("--batch", type=int, default=1,
                        help="requests per generation (the records taken in order)")
    parser.add_argument("--switch-ms", type=float, nargs=2, default=(0.0, 0.0),
                        metavar=("INTO", "OUT_OF"),
                        help="what a switch costs: a drafted round after autoregressive ones, "
                             "an autoregressive round after a drafted one (ms; default 0 0)")
    parser.add_argument("--noisy-clocks", type=int, default=0,
                        help="also replay auto told round times of N seeded JitteredClocks")
    args = parser.parse_args(argv)
    if not all(0 <= x < math.inf for x in args.switch_ms):
        parser.error(f"--switch-ms must be two finite milliseconds >= 0, got {args.switch_ms}")
    if args.first < 0 or args.prompts < 1 or args.batch < 1:
        parser.error(f"--first must be >= 0 and --prompts, --batch >= 1, got {args.first}, "
                     f"{args.prompts} and {args.batch}")
    sizes = [args.batch, *cost_aware.shrink_sizes(args.batch)]
    if args.costs and args.profiles:
        parser.error("--costs and --profiles: give one")
    # The given costs as {batch size: {bucket: ms}} (None: measured here), and where from.
    tables, source = None, "--profiles" if args.profiles else "--costs"
    if args.profiles:
        try:
            with open(args.profiles) as f:
                profiles = json.load(f)["profiles"]
            tables = {int(n): {int(b): float(ms) for b, ms in p["round_ms"].items()}
                      for n, p in profiles.items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            parser.error(f"--profiles {args.profiles}: not a JSON with cost profiles as "
                         f"bench_concurrency.py writes them ({type(e).__name__}: {e})")
    if args.costs:
        try:
            given = json.loads(args.costs)
            tables = {1: {int(k): float(v) for k, v in given.items()}} if args.batch == 1 else \
                {int(n): {int(k): float(v) for k, v in t.items()} for n, t in given.items()}
        except (ValueError, AttributeError, TypeError) as e:
            shape = '{"0": ms, "4": ms, ...}' if args.batch == 1 else \
                '{"batch size": {"0": ms, "4": ms, ...}, ...}'
            parser.error(f"--costs must be a JSON object {shape}, got {args.costs!r} "
                         f"({type(e).__name__}: {e})")
    if tables is not None and not set(sizes) <= set(tables):
        parser.error(f"{source} has no costs of batch sizes {sorted(set(sizes) - set(tables))} "
                     f"(--batch {args.batch} needs {sorted(sizes)})")
    # The pair is loaded only to record drafts or to measure the costs.
    pair = embedded.load() if not (args.records and tables) else None
    if args.records:
        try:
            with open(args.records) as f:
                records = [DraftRecord.from_json(r) for r in json.load(f)["records"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--records {args.records}: not a JSON of records as --out writes "
                         f"them ({type(e).__name__}: {e})")
        if not records:
            parser.error(f"--records {args.records}: holds no records")
    else:
        texts = embedded.heldout_prompts(args.first + args.prompts)[args.first:]
        if len(texts) < args.prompts:
            parser.error(f"--first {args.first} --prompts {args.prompts}: there are "
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
        parser.error(f"{source} has no cost for budgets {missing} (the records' buckets: "
                     f"{records[0].buckets})")
    tables = tables or {n: cost_aware.calibrate(pair[0], pair[1], n).round_ms for n in sizes}
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


if __name__ == "__main__":
    raise SystemExit(main())
