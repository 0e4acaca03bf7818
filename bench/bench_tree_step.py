"""The tree step of one round (draft logits -> tree + visibility), ddtree against a plain-PyTorch
baseline written here from the DDTree paper's algorithm, same inputs, same run:

  baseline tree : log_softmax -> topk(K = budget) -> tolist -> heapq best-first per request
                  (ddtree.ops.reference.build_tree_single) -> node token / parent tensors
  ddtree tree   : draft_to_tree (tree_topk -> build_tree -> tree_visibility)
  baseline chain: argmax -> cat(root, argmax) -> positions        (DFlash's chain)
  ddtree chain  : chain_to_tree (chain_tree -> tree_visibility)

and `tree_topk` alone against one read of the same logits: torch.amax over them (same threads, same
cache state: small batches stay in the L3 cache) and bytes / the measured DRAM read bandwidth
("/ DRAM"). Checks first that ddtree's
build_tree gives the baseline's trees from the baseline's top-k, and how often the two top-k agree. Medians of repeats, warm-up excluded.

  python bench/bench_tree_step.py [--quick] [--json FILE]
"""
import argparse
import json
import os
import platform

import torch

from timing import median_time  , write_result# noqa: E402

import ddtree
from ddtree.ops import reference

L = 15


def baseline_topk(logits, budget):
    k = min(budget, logits.shape[-1])
    return torch.topk(torch.log_softmax(logits.float(), -1), k, dim=-1)


def baseline_tree(logits, roots, budget):
    return baseline_heap(*baseline_topk(logits, budget), roots, budget)


def baseline_heap(values, ids, roots, budget):
    lq, tok = values.tolist(), ids.tolist()
    trees = [reference.build_tree_single(lq[b], tok[b], budget, int(roots[b]))
             for b in range(len(lq))]
    n = budget + 1
    tokens = torch.zeros(len(trees), n, dtype=torch.long)
    parents = torch.full((len(trees), n), -1, dtype=torch.long)
    for b, (t, p, _) in enumerate(trees):
        tokens[b, :len(t)] = torch.tensor(t)
        parents[b, :len(p)] = torch.tensor(p)
    return tokens, parents


def baseline_chain(logits, roots, start):
    ids = logits.argmax(-1)
    tokens = torch.cat([roots[:, None], ids], 1)
    positions = start[:, None] + torch.arange(logits.shape[1] + 1)
    return tokens, positions


def bandwidth(mib=512):
    """(read GB/s, copy GB/s) over a buffer larger than the caches, all threads."""
    x = torch.empty(mib * 2 ** 18).uniform_()
    y = torch.empty_like(x)
    read = x.numel() * 4 / median_time(lambda: torch.amax(x), 5) / 1e9
    copy = 2 * x.numel() * 4 / median_time(lambda: y.copy_(x), 5) / 1e9
    return read, copy


def run_case(batch, vocab, budgets, repeats, read_bw):
    g = torch.Generator().manual_seed(batch * 7 + vocab)
    logits = torch.randn(batch, L, vocab, generator=g) * 4
    roots = torch.randint(0, vocab, (batch,), generator=g)
    start = torch.full((batch,), 100)
    nbytes = logits.numel() * 4
    t_read = median_time(lambda: torch.amax(logits), repeats)
    rows = []
    for budget in budgets:
        # Same trees from the same top-k inputs (exact), and top-k agreement: the two log-sum-exps
        # round differently, so far down a big tree near-equal scores may pop in another order.
        base_lp, base_ids = baseline_topk(logits, budget)
        tokens, parents = baseline_heap(base_lp, base_ids, roots, budget)
        tree = ddtree.build_tree(base_lp, base_ids, roots, budget)
        same = bool(torch.equal(tree.node_tokens, tokens) and torch.equal(tree.parents, parents))
        k = min(budget, vocab, 1024)
        ours_lp, ours_ids = ddtree.tree_topk(logits, k)
        ids_agree = float((ours_ids == base_ids[..., :k]).float().mean())
        lp_err = float((ours_lp - base_lp[..., :k]).abs().max())
        t_topk = median_time(lambda: ddtree.tree_topk(logits, k), repeats)
        t_ours = median_time(lambda: ddtree.draft_to_tree(logits, roots, budget, start=start), repeats)
        t_base = median_time(lambda: baseline_tree(logits, roots, budget), repeats)
        # The tree-building step alone, same top-k inputs: build_tree (value checks on) against
        # the heap from Python lists (tolist included, as the baseline needs it).
        t_build = median_time(lambda: ddtree.build_tree(base_lp, base_ids, roots, budget), 5 * repeats)
        t_heap = median_time(lambda: baseline_heap(base_lp, base_ids, roots, budget), 5 * repeats)
        rows.append(dict(batch=batch, vocab=vocab, budget=budget, same_trees=same,
                         topk_ids_agree=ids_agree, topk_max_abs_err=lp_err,
                         logits_mb=nbytes / 1e6, one_read_ms=1e3 * t_read,
                         topk_ms=1e3 * t_topk, topk_gbps=nbytes / t_topk / 1e9,
                         topk_over_one_read=t_topk / t_read,
                         topk_over_bandwidth_read=t_topk / (nbytes / (read_bw * 1e9)),
                         ddtree_ms=1e3 * t_ours, baseline_ms=1e3 * t_base,
                         build_tree_us=1e6 * t_build, heap_us=1e6 * t_heap,
                         speedup=t_base / t_ours))
    chain, _ = ddtree.chain_to_tree(logits, roots, start)
    tokens, _ = baseline_chain(logits, roots, start)
    same_chain = bool(torch.equal(chain.node_tokens, tokens))  # random logits: no NaN, full chains
    t_chain = median_time(lambda: ddtree.chain_to_tree(logits, roots, start), repeats)
    t_chain_base = median_time(lambda: baseline_chain(logits, roots, start), repeats)
    chain_row = dict(batch=batch, vocab=vocab, same_chain=same_chain, one_read_ms=1e3 * t_read,
                     ddtree_chain_ms=1e3 * t_chain, baseline_chain_ms=1e3 * t_chain_base,
                     chain_over_baseline=t_chain / t_chain_base)
    return rows, chain_row


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="batch 1 and V = 32000 / 151936 only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    budgets = [16, 64, 256, 1024]
    cases = [(1, 32000), (1, 151936)] if args.quick else [
        (1, 32000), (1, 151936), (1, 262144), (64, 32000), (64, 151936), (64, 262144)]
    read_bw, copy_bw = bandwidth(128 if args.quick else 512)
    threads = torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {platform.processor() or platform.machine()}; "
          f"L = {L}; measured bandwidth: read {read_bw:.1f} GB/s, copy {copy_bw:.1f} GB/s")
    print(f"{'B':>3} {'V':>7} {'budget':>6} | {'baseline':>9} {'ddtree':>8} {'speed-up':>8} | "
          f"{'tree_topk':>9} {'GB/s':>6} {'/ 1 read':>8} {'/ DRAM':>6} | build_tree / heap us | "
          f"same trees, top-k ids agree")
    tree_rows, chain_rows = [], []
    for batch, vocab in cases:
        repeats = 3 if batch * vocab > 5_000_000 else 11
        rows, chain_row = run_case(batch, vocab, budgets, repeats, read_bw)
        tree_rows += rows
        chain_rows.append(chain_row)
        for r in rows:
            print(f"{batch:>3} {vocab:>7} {r['budget']:>6} | {r['baseline_ms']:>7.2f}ms "
                  f"{r['ddtree_ms']:>6.2f}ms {r['speedup']:>7.1f}x | {r['topk_ms']:>7.2f}ms "
                  f"{r['topk_gbps']:>6.1f} {r['topk_over_one_read']:>7.2f}x "
                  f"{r['topk_over_bandwidth_read']:>5.2f}x | {r['build_tree_us']:>7.1f} / "
                  f"{r['heap_us']:>8.1f} | {r['same_trees']}, "
                  f"{100 * r['topk_ids_agree']:.2f}%",
                  flush=True)
    print(f"\nchain mode (K = 1, no log-softmax): {'B':>3} {'V':>7} | argmax baseline | "
          f"chain_to_tree | ratio | one read")
    for c in chain_rows:
        print(f"{'':>35} {c['batch']:>3} {c['vocab']:>7} | {c['baseline_chain_ms']:>13.3f}ms | "
              f"{c['ddtree_chain_ms']:>11.3f}ms | {c['chain_over_baseline']:>5.2f} | "
              f"{c['one_read_ms']:.3f}ms  same: {c['same_chain']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_result(args.json, dict(torch=torch.__version__, threads=threads, read_gbps=read_bw,
                       copy_gbps=copy_bw, tree=tree_rows, chain=chain_rows))


if __name__ == "__main__":
    main()
