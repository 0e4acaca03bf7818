"""GPU loop benchmark (run by bench/gpu_check.sh): one random-weight bf16 Qwen3-architecture
target (tree_attention verification) and a random DFlash drafter; tokens/s and per-stage times
of autoregressive, tree (eager verify) and tree with cuda_graph=True, on the same prompts, with
the outputs checked equal. Random weights give short acceptances: the numbers measure the step
costs (verify eager vs graph replay), not a real drafter's speed-up."""
import argparse
import json
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import ddtree
from ddtree import hf
from ddtree.generate import generate_batch
from ddtree.models import DFlashDrafter, dflash_config


def build(layers, hidden, heads, kv_heads, head_dim, vocab, device, dtype):
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      intermediate_size=3 * hidden, max_position_embeddings=8192)
    target = Qwen3ForCausalLM(cfg).eval().to(device, dtype)
    hf.use_tree_attention(target)
    dcfg = dflash_config(dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                              num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, intermediate_size=3 * hidden, block_size=16,
                              num_target_layers=layers, dflash_config={"mask_token_id": vocab - 1}))
    drafter = DFlashDrafter(dcfg).eval().to(device, dtype)
    return target, drafter


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny fp32 model on CPU, static_cache instead of the graph (checks the script)")
    args = parser.parse_args()
    if args.smoke_cpu:
        device, dtype, dims = "cpu", torch.float32, dict(layers=2, hidden=64, heads=4, kv_heads=2,
                                                         head_dim=16, vocab=512)
    else:
        if not torch.cuda.is_available() or not ddtree.has_cuda_kernels():
            print("bench_loop_gpu: needs a GPU and the CUDA build")
            return
        device, dtype, dims = "cuda", torch.bfloat16, dict(layers=8, hidden=1024, heads=16,
                                                           kv_heads=4, head_dim=128, vocab=32000)
    target, drafter = build(**dims, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, dims["vocab"] - 1, (n,), generator=g).to(device)
               for n in (200, 57, 513, 31)]
    graph = dict(cuda_graph=True) if device == "cuda" else dict(static_cache=True)
    rows, reference = [], None
    for name, kw in (("autoregressive", dict(mode="autoregressive")),
                     ("tree eager", dict(mode="tree", budget=64)),
                     ("tree cuda_graph" if device == "cuda" else "tree static",
                      dict(mode="tree", budget=64, **graph))):
        generate_batch(target, drafter, prompts[:1], 8, **kw)  # warm-up
        sync()
        start = time.perf_counter()
        results = generate_batch(target, drafter, prompts, args.new_tokens, **kw)
        sync()
        seconds = time.perf_counter() - start
        tokens = [r.tokens for r in results]
        if reference is None:
            reference = tokens
        elif tokens != reference:
            raise SystemExit(f"bench_loop_gpu: {name} differs from autoregressive (lossless violated)")
        rounds = sum(len(r.acceptance_lengths) for r in results) / len(results)
        stages = {k: 1e3 * v / max(1.0, rounds) for k, v in results[0].stage_seconds.items()}
        rows.append(dict(name=name, batch=len(prompts), tokens_per_second=sum(map(len, tokens)) / seconds,
                         tau=sum(r.tau for r in results) / len(results), ms_per_round=stages))
        print(f"{name:16s} B={len(prompts)}: {rows[-1]['tokens_per_second']:8.1f} tok/s, "
              f"tau {rows[-1]['tau']:.2f}, ms/round " +
              " ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
