"""The drafter's confidence against what the target accepts, by a round's position in the
generation: the embedded pair on held-out prompts, one generation per prompt at batch 1, trees of
a fixed size every round (greedy, so the rounds do not depend on any policy). Per round
position: the drafter's expected accepted nodes of the verified tree (uncalibrated), the nodes
the target accepted, and their ratio — what budget="auto"'s per-position calibration
(ddtree.budget.Calibration) learns.

Then the calibration itself, on other held-out prompts at each batch size of --batches: trees of
--calibrated-bucket every round, the calibration learned online as budget="auto" learns it (each
generation starts from the sums the previous one left) over one set of --prompts held-out
prompts (the ones above, or the next --prompts), then the calibrated predicted tokens per round
against the observed ones over the other set, by round position (0, 1-5, 6 on) and in all, per
request-round; both ways round.

  python bench/bench_calibration.py [--buckets 4 16 64] [--prompts 32] [--new-tokens 96]
                                    [--positions 12] [--batches 1 2 4 16 32]
                                    [--calibrated-bucket 16] [--json F] [--device cpu|cuda]
"""
import argparse
import json
import sys

import torch

from ddtree import budget as cost_aware
from ddtree import embedded, models
from ddtree.generate import generate, generate_batch
from timing import write_result  # noqa: E402

GROUPS = (("0", 0, 1), ("1-5", 1, 6), ("6+", 6, None), ("all", 0, None))  # round positions


def calibrated(target, drafter, learn, check, bucket, batch, new_tokens):
    """Learns the calibration over the prompts `learn`, then returns the calibrated predicted and
    observed tokens per request-round over the prompts `check`, by the position groups of GROUPS
    (batches of `batch`, trees of `bucket`)."""
    prior, sums = None, {name: [0.0, 0.0, 0] for name, _, _ in GROUPS}
    groups = [(False, learn[i:i + batch]) for i in range(0, len(learn), batch)] + \
             [(True, check[i:i + batch]) for i in range(0, len(check), batch)]
    for checked, group in groups:
        policy = cost_aware.FixedBucket(bucket, prior=prior)
        results = generate_batch(target, drafter, group, new_tokens, budget="auto",
                                 policy=policy)
        prior = policy.learned
        if not checked:
            continue
        for r in results:
            for k, (p, n) in enumerate(zip(r.predicted_lengths, r.acceptance_lengths)):
                for name, lo, hi in GROUPS:
                    if lo <= k and (hi is None or k < hi):
                        s = sums[name]
                        s[0], s[1], s[2] = s[0] + p, s[1] + n, s[2] + 1
    return sums


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--buckets", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--positions", type=int, default=12,
                        help="rounds shown one by one; later ones are pooled")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 16, 32])
    parser.add_argument("--calibrated-bucket", type=int, default=16)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if min(args.batches) < 1 or args.prompts < 1:
        parser.error(f"--batches and --prompts must be >= 1, got {args.batches} and "
                     f"{args.prompts}")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, drafter, tokenizer = embedded.load(dtype=dtype, device=args.device)
    models.use_tree_attention(target)
    texts = embedded.heldout_prompts(2 * args.prompts)
    if len(texts) < 2 * args.prompts:
        raise SystemExit(f"bench_calibration: --prompts {args.prompts} needs "
                         f"{2 * args.prompts} held-out prompts, there are {len(texts)}")
    encoded = [tokenizer(t, return_tensors="pt").input_ids[0].to(args.device) for t in texts]
    prompts = [ids[None] for ids in encoded[:args.prompts]]
    # Sums so large that no round moves them: every prediction is the drafter's own (ratio 1).
    uncalibrated = dict(calibration=[[1e12, 1e12]] * cost_aware.Calibration.POSITIONS)
    rows = []
    for bucket in args.buckets:
        sums = {}  # position -> [predicted nodes, accepted nodes, rounds]
        for ids in prompts:
            policy = cost_aware.FixedBucket(bucket, prior=uncalibrated)
            r = generate(target, drafter, ids, args.new_tokens, budget="auto", policy=policy)
            for k, (p, n) in enumerate(zip(r.predicted_lengths, r.acceptance_lengths)):
                s = sums.setdefault(min(k, args.positions), [0.0, 0.0, 0])
                s[0], s[1], s[2] = s[0] + p - 1, s[1] + n - 1, s[2] + 1
        for k, (pred, obs, n) in sorted(sums.items()):
            rows.append(dict(bucket=bucket, position=k, pooled=k == args.positions,
                             predicted_nodes=pred / n, accepted_nodes=obs / n,
                             ratio=obs / max(pred, 1e-9), rounds=n))
    print(f"{'tree':>5} {'round':>6} {'predicted':>10} {'accepted':>9} {'ratio':>6} {'rounds':>7}")
    for r in rows:
        where = f"{r['position']}+" if r["pooled"] else str(r["position"])
        print(f"{r['bucket']:>5} {where:>6} {r['predicted_nodes']:>10.2f} "
              f"{r['accepted_nodes']:>9.2f} {r['ratio']:>6.2f} {r['rounds']:>7}")
    after = []
    n = args.prompts
    sets = {f"0-{n - 1}": encoded[:n], f"{n}-{2 * n - 1}": encoded[n:]}
    for batch in args.batches:
        for learned, checked in [list(sets), list(sets)[::-1]]:
            sums = calibrated(target, drafter, sets[learned], sets[checked],
                              args.calibrated_bucket, batch, args.new_tokens)
            for name, _, _ in GROUPS:
                pred, obs, rounds = sums[name]
                after.append(dict(batch=batch, learned_on=learned, checked_on=checked,
                                  positions=name, rounds=rounds,
                                  predicted_tokens=pred / max(rounds, 1),
                                  observed_tokens=obs / max(rounds, 1),
                                  error=(pred - obs) / max(obs, 1e-9)))
    print(f"\ncalibrated, tree {args.calibrated_bucket}, held-out prompts (learned on one set, "
          f"checked on the other): predicted / observed tokens per request-round")
    print(f"{'batch':>5} {'learned':>8} {'checked':>8} {'rounds':>7} {'predicted':>10} "
          f"{'observed':>9} {'error':>7} {'request-rounds':>15}")
    for r in after:
        print(f"{r['batch']:>5} {r['learned_on']:>8} {r['checked_on']:>8} {r['positions']:>7} "
              f"{r['predicted_tokens']:>10.3f} {r['observed_tokens']:>9.3f} "
              f"{100 * r['error']:>6.1f}% {r['rounds']:>15}")
    if args.json:
        write_result(args.json, dict(device=cost_aware.device_name(torch.device(args.device)),
                                     dtype=str(dtype), prompts=args.prompts,
                                     new_tokens=args.new_tokens, rows=rows,
                                     calibrated_bucket=args.calibrated_bucket, calibrated=after))
    return 0


if __name__ == "__main__":
    sys.exit(main())
