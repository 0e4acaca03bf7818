"""`make demo`: the speculative loop on the embedded trained pair (autoregressive vs DFlash chain
vs DDTree at budgets 16 / 64 / 256: τ, target forwards, tokens/s, lossless check, a plot), then
the ops on an example draft tree.
"""
import os
import sys
from typing import Optional

import torch

import ddtree
from ddtree.budget import auto_policy
from ddtree.ops import reference


def _show_tree(tokens, parents):
    children = {}
    for i, p in enumerate(parents):
        children.setdefault(p, []).append(i)

    def walk(i, indent):
        print(f"{'  ' * indent}[{i}] token {tokens[i]}")
        for c in children.get(i, []):
            walk(c, indent + 1)

    walk(0, 1)


MODES = [("autoregressive", 0), ("chain", 15), ("tree", 16), ("tree", 64), ("tree", 256),
         ("tree", "auto")]


def _label(mode: str, budget) -> str:
    if budget == "auto":
        return "tree auto"
    return f"tree B={budget}" if mode == "tree" else mode


def _marked(tokenizer, result, color: bool) -> str:
    """The generated text with each round's emitted span marked: alternating colours on a
    terminal, else every span wrapped in ⟦ ⟧. (The first token comes from the prefill.)"""
    spans, at = [result.tokens[:1]], 1
    for n in result.acceptance_lengths:
        spans.append(result.tokens[at:at + n])
        at += n
    pieces = [tokenizer.decode(s) for s in spans if s]
    if color:
        return "".join(f"\033[{'30;46' if i % 2 else '30;43'}m{p}\033[0m" for i, p in enumerate(pieces))
    return "".join(f"⟦{p}⟧" for p in pieces)


def _plot(rows, results, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tree = [r for r in rows if r["mode"] == "tree" and r["budget"] != "auto"]
    budgets = [r["budget"] for r in tree]
    by = {r["label"]: r for r in rows}
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, name in ((axes[0], "tau", "τ (tokens per target forward)"),
                          (axes[1], "tokens_per_second", "tokens / s (CPU)")):
        ax.plot(budgets, [r[key] for r in tree], "o-", label="DDTree")
        ax.axhline(by["chain"][key], color="tab:orange", ls="--", label="DFlash chain")
        ax.axhline(by["autoregressive"][key], color="gray", ls=":", label="autoregressive")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("tree budget (nodes)")
        ax.set_ylabel(name)
        ax.legend(fontsize=8)
    hist = axes[2]
    width = 0.8 / 3
    for i, label in enumerate(["chain", "tree B=64", "tree B=256"]):
        lengths = [n for r in results[label] for n in r.acceptance_lengths]
        counts = [lengths.count(k) / max(1, len(lengths)) for k in range(1, 17)]
        hist.bar([k + (i - 1) * width for k in range(1, 17)], counts, width, label=label)
    hist.set_xticks(range(1, 17))
    hist.set_xlabel("tokens emitted per round")
    hist.set_ylabel("fraction of rounds")
    hist.legend(fontsize=8)
    fig.suptitle("ddtree on the embedded pair (held-out stdlib prompts, greedy)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_loop_demo(prompt_count: int = 4, new_tokens: int = 96, plot: Optional[str] = None,
                  modes=MODES, verbose: bool = True):
    """Every mode of `modes` on held-out prompts with the embedded pair (CPU, fp32, greedy, stop
    at end-of-text); warm-up excluded. Returns (rows, results by label)."""
    from . import embedded
    from .generate import calibration_run, generate, tokens_per_second

    log = print if verbose else (lambda *a, **k: None)
    target, drafter, tokenizer = embedded.load()
    prompts = embedded.heldout_prompts(prompt_count)
    ids = [tokenizer(p, return_tensors="pt").input_ids for p in prompts]
    stops = [tokenizer.eos_token_id]
    for mode, budget in modes:  # warm-up (first calls allocate, build caches, load kernels;
        # budget="auto" measures its cost profile here, or reads it from the cache)
        generate(target, drafter, ids[0], 8, mode=mode, budget=budget, stop_token_ids=stops)
    results, rows, policies = {}, [], []
    for mode, budget in modes:
        label = _label(mode, budget)
        results[label] = []
        for x in ids:
            policy = auto_policy(target, drafter, 1, run=calibration_run(target, drafter)) \
                if budget == "auto" else None
            results[label].append(generate(target, drafter, x, new_tokens, mode=mode,
                                           budget=budget, stop_token_ids=stops, policy=policy))
            policies += [policy] if policy else []
        rs = results[label]
        tokens = sum(len(r.tokens) for r in rs)
        rounds = sum(len(r.acceptance_lengths) for r in rs)
        seconds = sum(r.seconds for r in rs)
        rows.append(dict(label=label, mode=mode, budget=budget, tokens=tokens,
                         forwards=rounds + len(rs),  # + one prefill per prompt
                         tau=sum(sum(r.acceptance_lengths) for r in rs) / max(1, rounds),
                         tokens_per_second=tokens_per_second([[r] for r in rs]), seconds=seconds,
                         ms_per_round={k: round(1e3 * sum(r.stage_seconds[k] for r in rs)
                                                / max(1, rounds), 2) for k in rs[0].stage_seconds},
                         identical=all(r.tokens == a.tokens
                                       for r, a in zip(rs, results["autoregressive"]))))
    log(f"\nEmbedded pair: hybrid Qwen3.5-text target (3 Gated DeltaNet + 1 attention layer, "
        f"hidden {target.config.hidden_size}, vocab {target.config.vocab_size}) + 2-layer DFlash "
        f"drafter, trained on the Python stdlib; {len(prompts)} held-out prompts, up to "
        f"{new_tokens} new tokens, CPU fp32, greedy.")
    show = "tree B=64"
    log(f"\nPrompt 1 continued by {show} (each round's accepted tokens + bonus marked):")
    log(prompts[0] + _marked(tokenizer, results[show][0], sys.stdout.isatty()))
    log(f"\n{'mode':<16}{'tau':>6}{'target fwd':>12}{'tokens':>8}{'tokens/s':>10}{'wall s':>8}"
        f"  identical to autoregressive")
    for r in rows:
        log(f"{r['label']:<16}{r['tau']:>6.2f}{r['forwards']:>12}{r['tokens']:>8}"
            f"{r['tokens_per_second']:>10.1f}{r['seconds']:>8.2f}  {'yes' if r['identical'] else 'NO'}")
    if policies:
        log(_auto_sentence(policies, results["tree auto"]))
    if plot:
        os.makedirs(os.path.dirname(os.path.abspath(plot)), exist_ok=True)
        _plot(rows, results, plot)
        log(f"plot: {plot}")
    return rows, results


def _auto_sentence(policies, results) -> str:
    """What budget="auto" chose over all prompts, and why (the last prompt's estimates)."""
    chosen = [b for r in results for b in r.round_budgets]
    counts = {b: chosen.count(b) for b in sorted(set(chosen))}
    shares = ", ".join(f"{'autoregressive' if b == 0 else f'budget {b}'} {100 * c / len(chosen):.0f}%"
                       for b, c in counts.items())
    drafted = [(p, o) for r in results for p, o, b in zip(r.predicted_lengths, r.acceptance_lengths,
                                                          r.round_budgets) if b > 0]
    calib = ""
    if drafted:
        calib = (f"; in drafted rounds it predicted {sum(p for p, _ in drafted) / len(drafted):.2f} "
                 f"tokens per round and got {sum(o for _, o in drafted) / len(drafted):.2f}")
    return f"auto rounds: {shares}{calib}.\n{policies[-1].explain()}."


def _loop_demo() -> None:
    rows, results = run_loop_demo(plot=os.path.join("build", "demo", "ddtree_demo.png"))
    # The same tree mode with the tree_attention op (transformers attention "ddtree", no dense
    # mask) in the fixed-shape round that cuda_graph=True captures on a GPU.
    from . import embedded
    from .generate import generate
    from .models.attention import use_tree_attention

    target, drafter, tokenizer = embedded.load()
    use_tree_attention(target)
    prompt = tokenizer(embedded.heldout_prompts(1)[0], return_tensors="pt").input_ids
    r = generate(target, drafter, prompt, 96, mode="tree", budget=64,
                 stop_token_ids=[tokenizer.eos_token_id])
    same_op = r.tokens == results["autoregressive"][0].tokens
    print(f"{'tree + tree_attention':<22} (tree_attention op, prompt 1): tau {r.tau:4.2f}, "
          f"identical to autoregressive: {'yes' if same_op else 'NO'}")
    same = all(row["identical"] for row in rows) and same_op
    print(f"lossless: every mode == autoregressive greedy tokens: {same}")
    if not same:
        raise SystemExit("demo: speculative output differs from the target's greedy decoding")


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
