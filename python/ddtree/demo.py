"""`make demo`: runs the ops on an example draft tree and prints what they compute.

(The speculative loop over Hugging Face weights replaces this demo once it exists.)
"""
import torch

import ddtree
from ddtree import reference


def _show_tree(tokens, parents):
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)

    def walk(i, indent):
        print(f"{'  ' * indent}[{i}] token {tokens[i]}")
        for c in children.get(i, []):
            walk(c, indent + 1)

    walk(0, 1)


def _embedded_models():
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from .models import DFlashDrafter, dflash_config

    torch.manual_seed(0)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256)).eval()
    drafter = DFlashDrafter(dflash_config(dict(
        vocab_size=512, hidden_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, intermediate_size=256, block_size=16,
        num_target_layers=4, dflash_config={"mask_token_id": 511})))
    return target, drafter.eval()


def _loop_demo() -> None:
    from .generate import generate

    target, drafter = _embedded_models()
    prompt = torch.tensor([[11, 42, 7, 300, 5]])
    print("\nSpeculative decoding on the embedded default (Qwen3-architecture target, 4 layers, "
          "vocab 512; DFlash drafter, block 16; random weights, CPU fp32):")
    results = {}
    for mode in ("autoregressive", "chain", "tree"):
        r = generate(target, drafter, prompt, 48, mode=mode, budget=64)
        results[mode] = r
        stages = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in r.stage_seconds.items() if v)
        print(f"  {mode:<22} tau {r.tau:4.2f}  {r.tokens_per_second:7.1f} tokens/s  ({stages})")
    # The same tree mode with the tree_attention op (transformers attention "ddtree", no dense
    # mask) on the fixed-shape verify step that cuda_graph=True captures on a GPU.
    from . import hf

    hf.use_tree_attention(target)
    r = generate(target, drafter, prompt, 48, mode="tree", budget=64)
    results["tree + tree_attention"] = r
    stages = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in r.stage_seconds.items() if v)
    print(f"  {'tree + tree_attention':<22} tau {r.tau:4.2f}  {r.tokens_per_second:7.1f} tokens/s  "
          f"({stages})")
    print("  tokens:", results["tree"].tokens[:24], "...")
    same = all(r.tokens == results["autoregressive"].tokens for r in results.values())
    print(f"  lossless: every mode == autoregressive greedy tokens: {same}")
    if not same:
        raise SystemExit("demo: speculative output differs from the target's greedy decoding")
    print("  (random drafter weights accept little; see tests/test_generate.py for long acceptances)")


def main() -> None:
    print(f"ddtree {ddtree.__version__} (torch {torch.__version__}); "
          f"CUDA kernels compiled in: {ddtree.has_cuda_kernels()}")
    _loop_demo()
    # A draft tree as build_tree numbers it (pop order: parent < child), root = bonus token.
    tokens = [791, 3363, 1917, 264, 13, 279, 374, 311]
    parents = [-1, 0, 0, 1, 1, 2, 3, 3]
    par = torch.tensor([parents + [-1, -1]], dtype=torch.int64)  # padded to N = 10
    num = torch.tensor([len(parents)])
    print("\nExample tree (8 nodes, padded to 10 rows):")
    _show_tree(tokens, parents)

    out = ddtree.tree_visibility(par, num, start=100)
    print("\ntree_visibility -> visible (row i = what node i attends to inside the tree):")
    for i, row in enumerate(out.visible[0].int().tolist()):
        print(f"  {i}: {''.join('x' if v else '.' for v in row)}")
    print("positions (start 100 + depth):", out.positions[0].tolist())
    print("packed rows (int32, bit j = column j):", out.packed[0, :, 0].tolist())

    mask = ddtree.tree_attention_mask(par, num, past=3, dtype=torch.float16)
    print(f"\ntree_attention_mask(past=3, float16) shape {tuple(mask.shape)}; row 6:")
    print("  ", [0 if v == 0 else "min" for v in mask[0, 0, 6].tolist()])

    ref = reference.tree_visibility(par, num, 100)
    emu = torch.ops.ddtree_emu.tree_visibility(par, num, torch.tensor([100]))
    same_ref = all(torch.equal(a, b) for a, b in zip(out, ref))
    same_emu = all(torch.equal(a, b) for a, b in zip(out, emu))
    print(f"\nCPU op == reference.py: {same_ref}; CUDA kernel source run in the SIMT emulator == "
          f"CPU op: {same_emu}")
    if ddtree.has_cuda_kernels() and torch.cuda.is_available():
        gpu = ddtree.tree_visibility(par.cuda(), num.cuda(), start=100)
        print("CUDA kernel on", torch.cuda.get_device_name(), "== CPU op:",
              all(torch.equal(a.cpu(), b) for a, b in zip(gpu, out)))
    if not (same_ref and same_emu):
        raise SystemExit("demo: implementations disagree")
    _round_demo()


def _round_demo() -> None:
    """One speculative round with synthetic logits: draft -> tree -> verify -> commit."""
    g = torch.Generator().manual_seed(0)
    vocab, depth, budget = 1000, 15, 32
    truth = torch.randint(0, vocab, (depth + 1,), generator=g)  # the "target's" continuation
    draft_logits = torch.randn(1, depth, vocab, generator=g) * 2
    draft_logits[0, torch.arange(depth), truth[1:]] += 9  # a drafter that is usually right
    tree, vis = ddtree.draft_to_tree(draft_logits, truth[:1], budget, start=50)
    n = int(tree.num_nodes[0])
    print(f"\nOne round: draft logits [1, {depth}, {vocab}] -> draft_to_tree(budget {budget}) -> "
          f"{n} nodes, max depth {int(tree.depths[0].max())}")
    # Target argmax per node: the true next token if the node is on the true path, else junk.
    target = torch.randint(0, vocab, (1, budget + 1), generator=g)
    for i in range(n):
        d = int(tree.depths[0, i])
        node, on_path = i, True
        while node > 0:
            on_path &= int(tree.node_tokens[0, node]) == int(truth[int(tree.depths[0, node])])
            node = int(tree.parents[0, node])
        if on_path and d < depth:
            target[0, i] = truth[d + 1]
    verdict = ddtree.verify_greedy(tree, target, depth)
    k = int(verdict.accept_len[0])
    path = verdict.accepted[0, :k].tolist()
    print(f"verify_greedy: accepted nodes {path} (tokens {tree.node_tokens[0, path].tolist()}), "
          f"bonus {int(verdict.bonus[0])}; true continuation {truth[:k + 1].tolist()}")
    cache = torch.arange(1 * 2 * (50 + budget + 1) * 4, dtype=torch.float32).view(1, 2, -1, 4)
    ddtree.commit_kv_(cache, torch.tensor([50]), verdict.accepted, verdict.accept_len)
    print(f"commit_kv_: cache rows 50..{50 + k - 1} now hold tree rows {path} "
          f"(row 50+j == old row 50+path[j]: {[int(cache[0, 0, 50 + j, 0]) // 4 - 0 for j in range(k)]})")


if __name__ == "__main__":
    main()
