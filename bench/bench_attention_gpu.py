"""GPU attention benchmarks (run by bench/gpu_check.sh): tree_attention vs SDPA with the dense
tree mask (and FlashAttention without a mask, as the unmasked floor, when flash_attn is
installed), draft_attention vs the unfused chain (RMSNorm -> RoPE -> cat -> cache write -> SDPA),
one split vs the automatic split over keys; bf16, CUDA events; achieved TFLOP/s and GB/s and
their fraction of the device's published peak. Prints a table; --json writes the rows."""
import argparse
import json

import torch

import ddtree
from ddtree.ops import reference
from timing import write_result  # noqa: E402

try:
    from flash_attn import flash_attn_func
except ImportError:
    flash_attn_func = None

# Published dense BF16 tensor-core TFLOP/s and memory GB/s (NVIDIA datasheets: H100 SXM5 989 /
# 3350, H200 SXM 989 / 4800; RTX PRO 6000 Blackwell 1792 GB/s, TFLOP/s left unknown here).
PEAKS = {"H100": (989.0, 3350.0), "H200": (989.0, 4800.0), "RTX PRO 6000": (None, 1792.0)}


def device_peak():
    name = torch.cuda.get_device_name()
    for key, peak in PEAKS.items():
        if key in name:
            return peak
    return (None, None)


def fraction(value, peak):
    return f"{100 * value / peak:.0f}% of peak" if peak else "peak unknown"


def cuda_time_ms(fn, iters=50):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def tree_case(past, n, hq, hkv, d):
    g = torch.Generator().manual_seed(past + n)
    parents = torch.tensor([[-1] + [max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g)))
                                    for i in range(1, n)]], device="cuda")
    counts = torch.tensor([n], device="cuda")
    vis = ddtree.tree_visibility(parents, counts)
    q = torch.randn(1, n, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, hkv, past + n, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    past_t = torch.tensor([past], device="cuda")
    mask = ddtree.tree_attention_mask(parents, counts, past, torch.bfloat16)
    rep = hq // hkv

    def ours():
        return ddtree.tree_attention(q, k, v, past_t, vis.packed)

    def ours_one_split():
        return ddtree.tree_attention(q, k, v, past_t, vis.packed, num_splits=1)

    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
        return o.transpose(1, 2)

    err = float((ours().float() - sdpa().float()).abs().max())
    t_ours, t_one, t_sdpa = cuda_time_ms(ours), cuda_time_ms(ours_one_split), cuda_time_ms(sdpa)
    t_flash = None
    if flash_attn_func is not None:
        kf, vf = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        t_flash = cuda_time_ms(lambda: flash_attn_func(q, kf, vf))
    flops = 4.0 * n * hq * (past + n) * d
    bytes_moved = 2.0 * (2 * hkv * (past + n) * d + 2 * n * hq * d)
    return dict(op="tree_attention", past=past, n=n, hq=hq, hkv=hkv, d=d, ours_us=1e3 * t_ours,
                one_split_us=1e3 * t_one, sdpa_us=1e3 * t_sdpa, speedup=t_sdpa / t_ours,
                flash_unmasked_us=None if t_flash is None else 1e3 * t_flash,
                tflops=flops / t_ours / 1e9, gbps=bytes_moved / t_ours / 1e6, max_abs_diff=err)


def draft_case(cached, ctx, lq, hq, hkv, d):
    g = torch.Generator(device="cuda").manual_seed(cached)
    t = ctx + lq
    q = torch.randn(1, lq, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k_new = torch.randn(1, t, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_new = torch.randn_like(k_new)
    k_cache = torch.randn(1, hkv, cached + t + 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    pos = cached + torch.arange(t, device="cuda")
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, device="cuda").float() / d))
    emb = torch.cat([pos[:, None] * inv] * 2, -1)[None]
    cos, sin = emb.cos(), emb.sin()
    w = torch.ones(d, device="cuda")
    lens = torch.tensor([cached], device="cuda")

    def ours():
        return ddtree.draft_attention(q, k_new, v_new, k_cache, v_cache, lens, w, w, cos, sin, ctx, 1e-6)

    def ours_one_split():
        return ddtree.draft_attention(q, k_new, v_new, k_cache, v_cache, lens, w, w, cos, sin, ctx,
                                      1e-6, num_splits=1)

    def chain():
        return reference.draft_attention(q.float(), k_new.float(), v_new.float(), k_cache.float(),
                                         v_cache.float(), lens.cpu(), w, w, cos, sin, ctx, 1e-6)[0]

    t_ours, t_one, t_chain = cuda_time_ms(ours), cuda_time_ms(ours_one_split), cuda_time_ms(chain, 5)
    flops = 4.0 * lq * hq * (cached + t) * d
    bytes_moved = 2.0 * (2 * hkv * (cached + t) * d + 2 * lq * hq * d)
    return dict(op="draft_attention", cached=cached, ctx=ctx, lq=lq, hq=hq, hkv=hkv, d=d,
                ours_us=1e3 * t_ours, one_split_us=1e3 * t_one, chain_us=1e3 * t_chain,
                speedup=t_chain / t_ours, tflops=flops / t_ours / 1e9,
                gbps=bytes_moved / t_ours / 1e6)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available() or not ddtree.has_cuda_kernels():
        print("bench_attention_gpu: needs a GPU and the CUDA build")
        return
    peak_tflops, peak_gbps = device_peak()
    print(torch.cuda.get_device_name(), "| flash_attn:", "yes" if flash_attn_func else "not installed")
    rows = []
    for past, n in ((1024, 65), (8192, 65), (8192, 257), (32768, 65)):
        rows.append(tree_case(past, n, 32, 8, 128))
        r = rows[-1]
        flash = "" if r["flash_unmasked_us"] is None else f", flash (no mask) {r['flash_unmasked_us']:.1f} us"
        print(f"tree_attention  past {past:>6} N {n:>4}: {r['ours_us']:8.1f} us (1 split "
              f"{r['one_split_us']:.1f}) vs SDPA+mask {r['sdpa_us']:8.1f} us ({r['speedup']:.2f}x){flash}; "
              f"{r['tflops']:.1f} TFLOP/s ({fraction(r['tflops'], peak_tflops)}), {r['gbps']:.0f} GB/s "
              f"({fraction(r['gbps'], peak_gbps)}), max diff {r['max_abs_diff']:.1e}", flush=True)
    for cached in (512, 8192, 32768):
        rows.append(draft_case(cached, 8, 16, 32, 8, 128))
        r = rows[-1]
        print(f"draft_attention cached {cached:>6}: {r['ours_us']:8.1f} us (1 split "
              f"{r['one_split_us']:.1f}) vs unfused chain {r['chain_us']:8.1f} us "
              f"({r['speedup']:.2f}x), {r['tflops']:.2f} TFLOP/s, {r['gbps']:.0f} GB/s "
              f"({fraction(r['gbps'], peak_gbps)})", flush=True)
    if args.json:
        write_result(args.json, rows)


if __name__ == "__main__":
    main()
