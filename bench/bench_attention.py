"""tree_attention against SDPA with the dense additive tree mask (what transformers does without
ddtree), CPU, same inputs, same run: verify-pass shapes (N tree rows over a prefix).
Usage: python bench/bench_attention.py [--json FILE]
"""
import argparse
import json

import torch
from timing import median_time

import ddtree


def run(past, n, hq, hkv, d, dtype):
    g = torch.Generator().manual_seed(past + n)
    parents = torch.tensor([[-1] + [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g)))
                                    for i in range(1, n)]])
    counts = torch.tensor([n])
    vis = ddtree.tree_visibility(parents, counts)
    q = torch.randn(1, n, hq, d, generator=g).to(dtype)
    k = torch.randn(1, hkv, past + n, d, generator=g).to(dtype)
    v = torch.randn(1, hkv, past + n, d, generator=g).to(dtype)
    past_t = torch.tensor([past])

    def ours():
        return ddtree.tree_attention(q, k, v, past_t, vis.packed)

    def dense():
        mask = ddtree.tree_attention_mask(parents, counts, past, dtype)
        qt = q.transpose(1, 2)
        rep = hq // hkv
        o = torch.nn.functional.scaled_dot_product_attention(
            qt, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
        return o.transpose(1, 2)

    err = float((ours().float() - dense().float()).abs().max())
    t_ours, t_dense = median_time(ours, 5), median_time(dense, 5)
    return dict(past=past, n=n, hq=hq, hkv=hkv, d=d, dtype=str(dtype), ours_ms=1e3 * t_ours,
                sdpa_dense_ms=1e3 * t_dense, ratio=t_dense / t_ours, max_abs_diff=err)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    print(f"{'past':>6} {'N':>5} {'Hq/Hkv':>7} {'D':>4} {'dtype':>9} | {'SDPA+mask':>10} "
          f"{'ddtree':>9} {'ratio':>6} | max diff")
    rows = []
    for past, n in ((512, 65), (4096, 65), (4096, 257)):
        for dtype in (torch.float32, torch.bfloat16):
            r = run(past, n, 16, 4, 128, dtype)
            rows.append(r)
            print(f"{past:>6} {n:>5} {'16/4':>7} {128:>4} {str(dtype)[6:]:>9} | "
                  f"{r['sdpa_dense_ms']:>8.1f}ms {r['ours_ms']:>7.1f}ms {r['ratio']:>5.2f}x | "
                  f"{r['max_abs_diff']:.1e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
