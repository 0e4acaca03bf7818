"""Build a draft tree from draft logits: ddtree ops (tree_topk -> build_tree) against the
published algorithm in plain PyTorch + heapq (log_softmax -> topk -> best-first heap per request,
ddtree.reference.build_tree_single), same inputs, same run. Checks both give the same trees, then
times each stage (median of repeats). Usage: python bench/bench_build.py [--quick] [--json FILE]
"""
import argparse
import json

import torch

from timing import median_time  # noqa: E402

import ddtree
from ddtree import reference

L = 15




def reference_topk(logits, k, chunk):
    """log_softmax + topk as the reference does it (in request chunks to bound memory)."""
    values, ids = [], []
    for part in logits.split(chunk):
        v, i = torch.topk(torch.log_softmax(part.float(), -1), k, dim=-1)
        values.append(v)
        ids.append(i)
    return torch.cat(values), torch.cat(ids)


def reference_heap(values, ids, roots, budget):
    lq, tok = values.tolist(), ids.tolist()
    return [reference.build_tree_single(lq[b], tok[b], budget, int(roots[b])) for b in range(len(lq))]


def run(batch, vocab, budget, repeats, chunk):
    g = torch.Generator().manual_seed(batch + vocab)
    logits = torch.randn(batch, L, vocab, generator=g) * 4
    roots = torch.randint(0, vocab, (batch,), generator=g)
    k = min(budget, vocab)

    # Checks: the same trees from the same top-k inputs (exact), and top-k agreement. (The two
    # top-k stages round log-probs differently, so near-ties may order differently.)
    ours_lp, ours_ids = ddtree.tree_topk(logits, k)
    ref_lp, ref_ids = reference_topk(logits, k, chunk)
    ref_trees = reference_heap(ref_lp, ref_ids, roots, budget)
    ours_tree = ddtree.build_tree(ref_lp, ref_ids, roots, budget)
    same = all(
        ours_tree.node_tokens[b, : len(t[0])].tolist() == t[0]
        and ours_tree.parents[b, : len(t[1])].tolist() == t[1]
        for b, t in enumerate(ref_trees)
    )
    topk_ids_agree = float((ours_ids == ref_ids).float().mean())
    topk_max_err = float((ours_lp - ref_lp).abs().max())

    t_ours_topk = median_time(lambda: ddtree.tree_topk(logits, k), repeats)
    t_ours_heap = median_time(lambda: ddtree.build_tree(ours_lp, ours_ids, roots, budget), repeats)
    t_ref_topk = median_time(lambda: reference_topk(logits, k, chunk), repeats)
    t_ref_heap = median_time(lambda: reference_heap(ref_lp, ref_ids, roots, budget), repeats)
    row = dict(batch=batch, vocab=vocab, depth=L, budget=budget, same_trees=same,
               topk_ids_agree=topk_ids_agree, topk_max_abs_err=topk_max_err,
               ours_topk_ms=1e3 * t_ours_topk, ours_heap_ms=1e3 * t_ours_heap,
               ref_topk_ms=1e3 * t_ref_topk, ref_heap_ms=1e3 * t_ref_heap)
    row["end_to_end_speedup"] = (t_ref_topk + t_ref_heap) / (t_ours_topk + t_ours_heap)
    row["heap_speedup"] = t_ref_heap / t_ours_heap
    return row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="small sizes only")
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    shapes = [(16, 32000), (64, 32000)] if args.quick else [
        (16, 32000), (64, 32000), (256, 32000), (1024, 32000),
        (16, 151936), (64, 151936), (256, 151936), (1024, 151936)]
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; L={L}, "
          f"budget={args.budget}, CPU")
    header = (f"{'B':>5} {'V':>7} | {'ref topk':>9} {'ref heap':>9} | {'ddtree topk':>11} "
              f"{'ddtree heap':>11} | {'end-to-end':>10} {'heap':>8} | same trees, top-k ids agree")
    print(header)
    rows = []
    for batch, vocab in shapes:
        repeats = 3 if batch * vocab > 10_000_000 else 7
        row = run(batch, vocab, args.budget, repeats, chunk=128)
        rows.append(row)
        print(f"{batch:>5} {vocab:>7} | {row['ref_topk_ms']:>7.1f}ms {row['ref_heap_ms']:>7.1f}ms | "
              f"{row['ours_topk_ms']:>9.1f}ms {row['ours_heap_ms']:>9.2f}ms | "
              f"{row['end_to_end_speedup']:>9.1f}x {row['heap_speedup']:>7.0f}x | "
              f"{row['same_trees']}, {100 * row['topk_ids_agree']:.2f}%", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(torch=torch.__version__, threads=torch.get_num_threads(), rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
