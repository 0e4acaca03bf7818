"""budget="auto"'s policy replayed on recorded drafts, without a clock (batch 1, greedy).

A greedy generation is fixed by its prompt, so the draft at each position is too: with the
target's greedy continuation, `record_drafts` stores for every position (tokens emitted so far)
what a round of each bucket would emit there and the drafter's expected accepted nodes of that
bucket's tree. `replay` then runs a policy (the real AutoBudget, Calibration and RoundStats) over
those positions, each round pricing its bucket from a cost profile: the rounds any policy would
run, and their cost, with no machine noise. Policy changes are compared on identical drafts and
costs, and on cost regimes this machine does not have (verify nearly free, as on a GPU at small
batch, or dear). Round costs are the profile's: switching between autoregressive and drafted
rounds (the drafter's deferred context) is not priced.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence

import torch

from . import budget as cost_aware
from . import ops


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
    from .generate import generate_batch

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
           clock: Optional[Callable[[int], float]] = None) -> Replayed:
    """Runs `policy` (AutoBudget, FixedBucket or anything with choose / observe) over the
    record's positions as the auto loop would at batch 1: the round's bucket from the policy; a
    drafted round's calibrated expected tokens (1 + nodes x calibration ratio; the steady ratio,
    and the round position's for its own prediction) for every bucket as its statistics, the
    round position's calibration updated with the verified bucket's prediction and what it
    emitted (as live, a round of a bucket shallower than the drafter's depth measures only the
    buckets no deeper than it); remaining tokens before each choice. Rounds are priced at
    `costs`; the policy is told clock(bucket) as each round's wall time (default: its cost;
    JitteredClock: a machine whose speed drifts). The record's positions bound the generation
    (new_tokens of record_drafts)."""
    buckets = record.buckets
    calibration = calibration or cost_aware.Calibration("cpu")
    policy.start(1, record.depth, "cpu")
    total = len(record.emitted) + 1
    k, out = 1, Replayed([], [], 0.0)
    if hasattr(policy, "observe_remaining"):
        policy.observe_remaining({0: total - k})
    while k < total:
        bucket = policy.choose()
        column = buckets.index(bucket)
        stats = None
        n = record.emitted[k - 1][column]
        if bucket > 0:
            nodes = torch.tensor([record.round_row(k, bucket)])
            position = cost_aware.Calibration.position(len(out.choices))
            expected = calibration.expected_tokens(nodes)[0].tolist()
            predicted = calibration.expected_tokens(nodes[0, column], position).item()
            calibration.update(nodes[:, column], torch.tensor([n]), position)
            stats = cost_aware.RoundStats(
                expected=expected, live=1, predicted=[predicted], per_row=[expected],
                requests=[0], observed=cost_aware.observed_buckets(
                    buckets, min(bucket, record.depth), record.depth))
        k += n
        out.choices.append(bucket)
        out.emitted.append(n)
        out.ms += costs[bucket]
        if hasattr(policy, "observe_cost"):
            policy.observe_cost(bucket, clock(bucket) if clock else costs[bucket])
        if hasattr(policy, "observe_remaining"):
            policy.observe_remaining({0: total - k} if k < total else {})
        policy.observe(stats)
    return out


def replay_all(records: Sequence[DraftRecord], costs: Dict[int, float],
               make_policy: Callable[[Optional[dict]], object],
               clock: Optional[Callable[[int], float]] = None) -> List[Replayed]:
    """The records as consecutive generations, handled as generate_batch handles them:
    make_policy(prior) builds each one's policy from what the one before learned (the
    calibration's sums included); a generation its policy makes plain autoregressive
    (plain_autoregressive) runs bucket 0 throughout; a drafting one reports its time
    (observe_generation) before finish."""
    learned, out = None, []
    for record in records:
        policy = make_policy(learned)
        if hasattr(policy, "plain_autoregressive") and \
                policy.plain_autoregressive(1, record.depth):
            out.append(replay(record, costs, cost_aware.FixedBucket(0)))
            policy.record_autoregressive(len(out[-1].choices))
            learned = policy.learned
            continue
        prior = policy.calibration_prior() if hasattr(policy, "calibration_prior") else None
        calibration = cost_aware.Calibration("cpu", sums=prior)
        out.append(replay(record, costs, policy, calibration, clock))
        if hasattr(policy, "observe_generation"):
            policy.observe_generation(out[-1].ms, [len(record.emitted)])
        learned = policy.finish(calibration.sums.tolist()) if hasattr(policy, "finish") else None
    return out


def auto(costs: Dict[int, float], **kwargs) -> Callable[[Optional[dict]], object]:
    """make_policy for replay_all: AutoBudget on `costs` (each round reports its exact cost, so
    the learned cost ratios stay 1)."""
    profile = cost_aware.CostProfile(batch=1, round_ms=dict(costs), target="replay",
                                     drafter="replay", device="replay", dtype="replay",
                                     version="replay")
    return lambda prior: cost_aware.AutoBudget(profile, prior=prior, **kwargs)


class JitteredClock:
    """Round times of a noisy machine for replay's policy: cost x speed x jitter, the speed a
    slow random walk (log steps of `drift`, pulled back towards 1, within [0.7, 1.5]: slow and
    fast spells lasting many rounds) and the jitter independent per round (`jitter` standard
    deviation). Seeded."""

    def __init__(self, costs: Dict[int, float], seed: int, drift: float = 0.03,
                 jitter: float = 0.06):
        import random

        self.costs, self.rng, self.speed = costs, random.Random(seed), 1.0
        self.drift, self.jitter = drift, jitter

    def __call__(self, bucket: int) -> float:
        step = (1 + self.rng.gauss(0, self.drift)) * self.speed ** -0.05
        self.speed = min(1.5, max(0.7, self.speed * step))
        return self.costs[bucket] * self.speed * (1 + self.rng.gauss(0, self.jitter))


def speedups(records: Sequence[DraftRecord], costs: Dict[int, float],
             make_policy: Optional[Callable] = None,
             clock: Optional[Callable[[int], float]] = None) -> Dict[str, float]:
    """Tokens per ms over autoregressive decoding's, all records together: 'auto' (make_policy,
    default AutoBudget; told clock's round times), each fixed bucket ('tree N'), and 'best fixed
    per prompt' (an oracle that knows each prompt's best fixed bucket in advance)."""
    make_policy = make_policy or auto(costs)
    fixed = {b: replay_all(records, costs, lambda prior, b=b: cost_aware.FixedBucket(b))
             for b in records[0].buckets}
    plain = sum(r.ms for r in fixed[0])
    out = {"auto": plain / sum(r.ms for r in replay_all(records, costs, make_policy, clock))}
    out.update({f"tree {b}": plain / sum(r.ms for r in runs) for b, runs in fixed.items() if b})
    out["best fixed per prompt"] = plain / sum(
        min(fixed[b][i].ms for b in fixed) for i in range(len(records)))
    return out


def main(argv=None) -> int:
    """python -m ddtree.policy_replay [--prompts 16] [--first 0] [--new-tokens 96] [--out F]
    [--records F] [--costs JSON] [--noisy-clocks N]: records the embedded pair's drafts on
    held-out prompts (the first --prompts from the --first-th: the data of
    tests/test_policy_replay.py by default; --records F reads records --out wrote instead) and
    prints the replayed speed-ups of auto and the fixed trees under a cost profile (default: the
    batch-1 profile measured on this machine)."""
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
    parser.add_argument("--noisy-clocks", type=int, default=0,
                        help="also replay auto told round times of N seeded JitteredClocks")
    args = parser.parse_args(argv)
    if args.first < 0 or args.prompts < 1:
        parser.error(f"--first must be >= 0 and --prompts >= 1, got {args.first} and "
                     f"{args.prompts}")
    costs = None
    if args.costs:
        try:
            costs = {int(k): float(v) for k, v in json.loads(args.costs).items()}
        except (ValueError, AttributeError, TypeError) as e:
            parser.error(f'--costs must be a JSON object {{"0": ms, "4": ms, ...}}, got '
                         f"{args.costs!r} ({type(e).__name__}: {e})")
    # The pair is loaded only to record drafts or to measure the costs.
    pair = embedded.load() if not (args.records and costs) else None
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
    missing = sorted(set(records[0].buckets) - set(costs or records[0].buckets))
    if missing:
        parser.error(f"--costs has no cost for budgets {missing} (the records' buckets: "
                     f"{records[0].buckets})")
    costs = costs or cost_aware.calibrate(pair[0], pair[1], 1).round_ms
    print("round cost (ms): " + ", ".join(f"{b}: {ms:.2f}" for b, ms in sorted(costs.items())))
    for name, value in speedups(records, costs).items():
        print(f"{name:>22s}  {value:.3f}x autoregressive")
    for seed in range(args.noisy_clocks):
        value = speedups(records, costs, clock=JitteredClock(costs, seed))["auto"]
        print(f"{'auto, noisy clock ' + str(seed):>22s}  {value:.3f}x autoregressive")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
