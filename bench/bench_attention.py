"""CPU attention ops against the torch ops they replace, same inputs, same run:
- tree_attention against SDPA with the dense additive tree mask (what transformers does without
  ddtree): verify-pass shapes (N tree rows over a prefix);
- draft_attention against the unfused drafter layer's torch ops (q / k rms_norm, RoPE, the new
  rows written into the cache, SDPA with GQA over it): draft-step shapes (a block of Lq rows and
  C new context rows over a cached context).
Usage: python bench/bench_attention.py [--json FILE]
"""
import argparse
import json

import torch
from timing import median_time, write_result

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
    return dict(op="tree_attention", past=past, n=n, hq=hq, hkv=hkv, d=d, dtype=str(dtype), ours_ms=1e3 * t_ours,
                sdpa_dense_ms=1e3 * t_dense, ratio=t_dense / t_ours, max_abs_diff=err)


def rope(x, cos, sin):
    """x [B, H, S, D] rotated at cos / sin [B, S, D] (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[:, None] + rotated * sin[:, None]


def run_draft(cached, context, lq, hq, hkv, d, dtype):
    """draft_attention against the unfused torch ops at batch 1 (one request's step)."""
    g = torch.Generator().manual_seed(cached + context)
    t = context + lq
    q = torch.randn(1, lq, hq, d, generator=g).to(dtype)
    k_new = torch.randn(1, t, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(1, t, hkv, d, generator=g).to(dtype)
    k_cache = torch.randn(1, hkv, cached + t, d, generator=g).to(dtype)
    v_cache = torch.randn(1, hkv, cached + t, d, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = (cached + torch.arange(t))[None, :, None].float() * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    qw, kw = torch.ones(d), torch.ones(d)
    lens = torch.tensor([cached])

    def ours():
        return ddtree.draft_attention(q, k_new, v_new, k_cache, v_cache, lens, qw, kw, cos, sin,
                                      context, 1e-6)

    def unfused():
        qn = torch.nn.functional.rms_norm(q, (d,), qw.to(dtype), 1e-6).transpose(1, 2)
        kn = torch.nn.functional.rms_norm(k_new, (d,), kw.to(dtype), 1e-6).transpose(1, 2)
        kn = rope(kn, cos.to(dtype), sin.to(dtype))
        k_cache[:, :, cached: cached + t] = kn
        v_cache[:, :, cached: cached + t] = v_new.transpose(1, 2)
        o = torch.nn.functional.scaled_dot_product_attention(
            rope(qn, cos[:, context:].to(dtype), sin[:, context:].to(dtype)), k_cache,
            v_cache, enable_gqa=hq != hkv)
        return o.transpose(1, 2)

    err = float((ours().float() - unfused().float()).abs().max())
    t_ours, t_unfused = median_time(ours, 20), median_time(unfused, 20)
    return dict(op="draft_attention", cached=cached, context=context, lq=lq, hq=hq, hkv=hkv, d=d,
                dtype=str(dtype), ours_ms=1e3 * t_ours, unfused_ms=1e3 * t_unfused,
                ratio=t_unfused / t_ours, max_abs_diff=err)


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
    print(f"\ndraft_attention (batch 1) against the unfused ops\n{'cached':>6} {'C':>3} {'Lq':>3} "
          f"{'Hq/Hkv':>7} {'D':>4} {'dtype':>9} | {'unfused':>10} {'ddtree':>9} {'ratio':>6} | "
          f"max diff")
    # The embedded pair's drafter (4 / 2 heads, D 64) and a Qwen3-8B-sized one (32 / 8, D 128).
    for cached, context, hq, hkv, d in ((300, 3, 4, 2, 64), (2000, 3, 4, 2, 64),
                                        (300, 3, 32, 8, 128), (2000, 3, 32, 8, 128)):
        for dtype in (torch.float32, torch.bfloat16):
            r = run_draft(cached, context, 16, hq, hkv, d, dtype)
            rows.append(r)
            print(f"{cached:>6} {context:>3} {16:>3} {f'{hq}/{hkv}':>7} {d:>4} "
                  f"{str(dtype)[6:]:>9} | {r['unfused_ms']:>8.2f}ms {r['ours_ms']:>7.2f}ms "
                  f"{r['ratio']:>5.2f}x | {r['max_abs_diff']:.1e}", flush=True)
    if args.json:
        write_result(args.json, rows)


if __name__ == "__main__":
    main()
