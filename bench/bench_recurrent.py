"""Tree Gated DeltaNet + tree short conv (CPU): ddtree ops against running the chain oracle
(transformers' torch_recurrent_gated_delta_rule / causal_conv1d_update) on every node's path,
same run. Also reports the op's scratch bytes next to one-state-per-node storage, and the commit
of every GDN layer in one commit_recurrent_layers_ call against one commit_recurrent_ call per
layer (same inputs, same run).
Usage: python bench/bench_recurrent.py [--json FILE]
"""
import argparse
import json
import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule  # noqa: E402

from timing import median_time  , write_result# noqa: E402

import ddtree  # noqa: E402
from ddtree.ops import reference  # noqa: E402

L = 15




def draft_tree(budget, seed):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(1, L, 1000, generator=g) * 6, -1).sort(-1, descending=True)
    k = min(budget, 1000)
    return ddtree.build_tree(lp.values[..., :k].contiguous(), lp.indices[..., :k].contiguous(),
                             torch.tensor([0]), budget)


def run(budget, hk, hv, dk, dv):
    tree = draft_tree(budget, budget)
    n = budget + 1
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, n, hk, dk, generator=g)
    k = torch.randn(1, n, hk, dk, generator=g)
    v = torch.randn(1, n, hv, dv, generator=g)
    gate = -torch.rand(1, n, hv, generator=g)
    beta = torch.rand(1, n, hv, generator=g)
    state = torch.randn(1, hv, dk, dv, generator=g)
    slots = torch.tensor([0])
    depth = int(tree.depths.max())
    ours = lambda: ddtree.tree_gated_delta_rule(q, k, v, gate, beta, state, slots, tree.parents,  # noqa: E731
                                                tree.num_nodes, depth)
    rep = hv // hk

    def oracle():
        out = torch.empty(1, n, hv, dv)
        for i in range(n):
            path = reference.tree_path(tree.parents[0], int(tree.num_nodes[0]), i)
            o, _ = torch_recurrent_gated_delta_rule(
                q[:, path].repeat_interleave(rep, 2), k[:, path].repeat_interleave(rep, 2), v[:, path],
                g=gate[:, path], beta=beta[:, path], initial_state=state.clone(),
                output_final_state=False, use_qk_l2norm_in_kernel=True)
            out[0, i] = o[0, -1]
        return out

    err = float((ours() - oracle()).abs().max())
    t_ours, t_oracle = median_time(ours), median_time(oracle, 1)
    scratch = (depth + 1) * hv * dk * dv * 4
    per_node = n * hv * dk * dv * 4
    return dict(budget=budget, nodes=n, depth=depth, hv=hv, dk=dk, dv=dv, max_abs_err=err,
                ours_ms=1e3 * t_ours, oracle_ms=1e3 * t_oracle, speedup=t_oracle / t_ours,
                scratch_bytes=scratch, per_node_state_bytes=per_node)


def run_commit(layers, batch, hk, hv, dk, dv, accept, width=4, n=65):
    """commit_recurrent_layers_ (one call) vs commit_recurrent_ per layer, Qwen3.5-like shapes."""
    g = torch.Generator().manual_seed(2)
    channels = 2 * hk * dk + hv * dv
    per = []
    for _ in range(layers):
        per.append((torch.randn(batch, hv, dk, dv, generator=g),
                    torch.randn(batch, channels, width, generator=g),
                    torch.randn(batch, n, hk, dk, generator=g), torch.randn(batch, n, hv, dv, generator=g),
                    -torch.rand(batch, n, hv, generator=g), torch.rand(batch, n, hv, generator=g),
                    torch.randn(batch, n, channels, generator=g)))
    slots = torch.arange(batch)
    accepted = torch.full((batch, 16), -1, dtype=torch.long)
    accepted[:, :accept] = torch.arange(accept)
    lengths = torch.full((batch,), accept)
    lists = list(zip(*per))

    def one_call():
        ddtree.ops.commit_recurrent_layers_(*lists[:2], slots, *lists[2:], accepted, lengths)

    def per_layer():
        for st, cs, k, v, gt, bt, x in per:
            ddtree.commit_recurrent_(st, cs, slots, k, v, gt, bt, x, accepted, lengths)

    with ddtree.validation(False):
        t_one, t_per = median_time(one_call, 5), median_time(per_layer, 5)
    return dict(layers=layers, batch=batch, hv=hv, dk=dk, dv=dv, accept=accept,
                one_call_ms=1e3 * t_one, per_layer_ms=1e3 * t_per, speedup=t_per / t_one)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU; L = {L}")
    print(f"{'budget':>6} {'depth':>5} {'Hv x Dk x Dv':>14} | {'oracle':>9} {'ddtree':>9} {'x':>6} | "
          f"{'scratch':>9} {'per-node states':>15} | max err")
    rows = []
    for budget in (64, 256):
        for hk, hv, dk, dv in ((2, 4, 128, 128), (16, 32, 128, 128)):
            if hv == 32 and budget == 256:
                continue  # the oracle alone takes minutes here
            r = run(budget, hk, hv, dk, dv)
            rows.append(r)
            print(f"{budget:>6} {r['depth']:>5} {f'{hv}x{dk}x{dv}':>14} | {r['oracle_ms']:>7.0f}ms "
                  f"{r['ours_ms']:>7.1f}ms {r['speedup']:>5.0f}x | {r['scratch_bytes'] / 2**20:>7.1f}MiB "
                  f"{r['per_node_state_bytes'] / 2**20:>13.1f}MiB | {r['max_abs_err']:.1e}", flush=True)
    print("commit of every GDN layer (validation off, as in the loop):")
    commits = []
    for layers, batch in ((24, 1), (24, 8), (48, 4)):
        r = run_commit(layers, batch, hk=4, hv=8, dk=128, dv=128, accept=6)
        commits.append(r)
        print(f"  {layers} layers, B={batch}, Hv 8 x 128 x 128, 6 accepted: one commit_recurrent_layers_ "
              f"{r['one_call_ms']:.2f} ms vs commit_recurrent_ per layer {r['per_layer_ms']:.2f} ms "
              f"({r['speedup']:.2f}x)", flush=True)
    if args.json:
        write_result(args.json, dict(tree_gdn=rows, commit_layers=commits))


if __name__ == "__main__":
    main()
