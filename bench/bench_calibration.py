"""The drafter's confidence against what the target accepts, by a round's position in the
generation: the embedded pair on held-out prompts, one generation per prompt at batch 1, trees of
a fixed size every round (greedy, so the rounds do not depend on any policy). Per round
position: the drafter's expected accepted nodes of the verified tree (uncalibrated), the nodes
the target accepted, and their ratio — what budget="auto"'s per-position calibration
(ddtree.budget.Calibration) learns.

  python bench/bench_calibration.py [--buckets 4 16 64] [--prompts 32] [--new-tokens 96]
                                    [--positions 12] [--json F] [--device cpu|cuda]
"""
import argparse
import json
import sys

import torch

from ddtree import budget as cost_aware
from ddtree import embedded, hf
from ddtree.generate import generate


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--buckets", type=int, nargs="+", default=[4, 16, 64])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--positions", type=int, default=12,
                        help="rounds shown one by one; later ones are pooled")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    target, drafter, tokenizer = embedded.load(dtype=dtype, device=args.device)
    hf.use_tree_attention(target)
    prompts = [tokenizer(t, return_tensors="pt").input_ids.to(args.device)
               for t in embedded.heldout_prompts(args.prompts)]
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=cost_aware.device_name(torch.device(args.device)),
                           dtype=str(dtype), prompts=args.prompts, new_tokens=args.new_tokens,
                           rows=rows), f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
