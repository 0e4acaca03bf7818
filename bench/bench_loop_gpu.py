"""GPU loop benchmark (run by bench/gpu_check.sh): random-weight bf16 targets — a dense
Qwen3-architecture one and a hybrid Qwen3.5-architecture one (Gated DeltaNet + attention) — on
the tree_attention implementation, with a random DFlash drafter; tokens/s and per-stage times
(synchronised) of autoregressive decoding, of chain and tree rounds run eagerly and (on a GPU)
with cuda_graph=True, same prompts, outputs checked equal to autoregressive.
Random weights give short acceptances: the numbers compare step costs, not a real drafter's
speed-up."""
import argparse
import json
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import ddtree
from ddtree import models
from ddtree.generate import generate_batch
from ddtree.models import DFlashDrafter, dflash_config
from timing import write_result  # noqa: E402


def build(layers, hidden, heads, kv_heads, head_dim, vocab, device, dtype, hybrid=False):
    torch.manual_seed(0)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                  intermediate_size=3 * hidden, max_position_embeddings=8192)
    if hybrid:
        from transformers import Qwen3_5TextConfig
        from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5ForCausalLM

        target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
            layer_types=["linear_attention", "linear_attention", "linear_attention",
                         "full_attention"] * (layers // 4),
            linear_num_key_heads=heads // 2, linear_num_value_heads=heads,
            linear_key_head_dim=head_dim, linear_value_head_dim=head_dim,
            linear_conv_kernel_dim=4, **common))
    else:
        target = Qwen3ForCausalLM(Qwen3Config(**common))
    target = target.eval().to(device, dtype)
    models.use_tree_attention(target)
    dcfg = dflash_config(dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1,
                              num_attention_heads=heads, num_key_value_heads=kv_heads,
                              head_dim=head_dim, intermediate_size=3 * hidden, block_size=16,
                              num_target_layers=layers, dflash_config={"mask_token_id": vocab - 1}))
    drafter = DFlashDrafter(dcfg).eval().to(device, dtype)
    return target, drafter


def run_model(dims, device, dtype, hybrid, new_tokens):
    target, drafter = build(**dims, device=device, dtype=dtype, hybrid=hybrid)
    model = "qwen3.5-like hybrid" if hybrid else "qwen3-like dense"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, dims["vocab"] - 1, (n,), generator=g).to(device)
               for n in (200, 57, 513, 31)]
    runs = [("autoregressive", dict(mode="autoregressive")), ("chain", dict(mode="chain")),
            ("tree 64", dict(mode="tree", budget=64))]
    if device == "cuda":
        runs += [("chain cuda_graph", dict(mode="chain", cuda_graph=True)),
                 ("tree 64 cuda_graph", dict(mode="tree", budget=64, cuda_graph=True))]
    rows, reference = [], None
    for name, kw in runs:
        generate_batch(target, drafter, prompts[:1], 8, **kw)  # warm-up
        sync()
        start = time.perf_counter()
        results = generate_batch(target, drafter, prompts, new_tokens, **kw)
        sync()
        seconds = time.perf_counter() - start
        tokens = [r.tokens for r in results]
        if reference is None:
            reference = tokens
        elif tokens != reference:
            print(f"bench_loop_gpu: {model} {name} differs from autoregressive (bf16 tree vs "
                  f"chain numerics, or a bug)", flush=True)
        rounds = sum(len(r.acceptance_lengths) for r in results) / len(results)
        stages = {k: 1e3 * v / max(1.0, rounds) for k, v in results[0].stage_seconds.items()}
        rows.append(dict(model=model, name=name, batch=len(prompts),
                         tokens_per_second=sum(map(len, tokens)) / seconds,
                         tau=sum(r.tau for r in results) / len(results), ms_per_round=stages,
                         same_as_autoregressive=tokens == reference))
        print(f"{model:20s} {name:20s} B={len(prompts)}: {rows[-1]['tokens_per_second']:8.1f} tok/s, "
              f"tau {rows[-1]['tau']:.2f}, ms/round " +
              " ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smoke-cpu", action="store_true",
                        help="tiny fp32 model on CPU, no CUDA graphs (checks the script)")
    args = parser.parse_args()
    if args.smoke_cpu:
        device, dtype, dims = "cpu", torch.float32, dict(layers=4, hidden=64, heads=4, kv_heads=2,
                                                         head_dim=16, vocab=512)
    else:
        if not torch.cuda.is_available() or not ddtree.has_cuda_kernels():
            print("bench_loop_gpu: needs a GPU and the CUDA build")
            return
        device, dtype, dims = "cuda", torch.bfloat16, dict(layers=8, hidden=1024, heads=16,
                                                           kv_heads=4, head_dim=128, vocab=32000)
    rows = []
    for hybrid in (False, True):
        rows += run_model(dims, device, dtype, hybrid, args.new_tokens)
    if args.json:
        write_result(args.json, rows)


if __name__ == "__main__":
    main()
