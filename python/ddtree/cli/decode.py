"""`ddtree generate`, `ddtree bench` and `ddtree calibrate`: decoding with a target and a drafter
from the command line, comparing the modes, measuring the cost profile of budget="auto"."""
from __future__ import annotations

import json
import sys

from .common import DTYPES, UsageError, encode, int_at_least, load_models, stop_ids


def cmd_generate(args) -> int:
    from ..generate import generate
    from ..parallel import is_main_rank

    target, tokenizer, drafter, device = load_models(args)
    ids = encode(tokenizer, args.prompt, device)
    main_rank = is_main_rank()  # under torchrun every rank decodes the same tokens; rank 0 prints

    def stream(new):
        if main_rank:
            sys.stdout.write(tokenizer.decode(new))
            sys.stdout.flush()

    result = generate(target, drafter, ids, args.max_new_tokens, mode=args.mode, budget=args.budget,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      stop_token_ids=stop_ids(tokenizer), seed=args.seed, streamer=stream,
                      cuda_graph=args.cuda_graph)
    if main_rank:
        print(f"\n[ddtree] mode={args.mode} tokens={len(result.tokens)} tau={result.tau:.2f} "
              f"tokens/s={result.tokens_per_second:.1f}")
    return 0


def cmd_bench(args) -> int:
    from ..generate import generate_batch, tokens_per_second

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    target, tokenizer, drafter, device = load_models(args)
    try:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
    except UnicodeDecodeError as e:
        raise UsageError(f"--prompts {args.prompts!r}: not UTF-8 text ({e})") from None
    except OSError as e:
        raise UsageError(f"--prompts {args.prompts!r}: cannot be read ({e.strerror})") from None
    if not prompts:
        raise UsageError(f"--prompts {args.prompts!r}: no prompts in the file")
    try:
        from tqdm import tqdm
    except ImportError:  # progress bars are optional
        def tqdm(x, **_):
            return x
    rows = []
    reference = {}
    encoded = [encode(tokenizer, prompt, device)[0] for prompt in prompts]
    groups = [list(range(i, min(i + args.batch_size, len(encoded))))
              for i in range(0, len(encoded), args.batch_size)]
    for mode in ("autoregressive", "chain", "tree"):
        tokens, rounds, calls = 0, [], []
        for group in tqdm(groups, desc=mode, file=sys.stderr):
            results = generate_batch(target, drafter, [encoded[i] for i in group],
                                     args.max_new_tokens, mode=mode,
                                     budget=args.budget if mode == "tree" else 64,
                                     stop_token_ids=stop_ids(tokenizer), cuda_graph=args.cuda_graph)
            for i, r in zip(group, results):
                if mode == "autoregressive":
                    reference[i] = r.tokens
                elif r.tokens != reference[i]:
                    raise SystemExit(f"ddtree bench: {mode} output differs from autoregressive on "
                                     f"prompt {i} (lossless violated)")
                tokens += len(r.tokens)
                rounds += r.acceptance_lengths
            calls.append(results)
        rows.append(dict(mode=mode, batch_size=args.batch_size, tokens=tokens,
                         seconds=sum(results[0].seconds for results in calls),
                         tokens_per_second=tokens_per_second(calls),
                         tau=sum(rounds) / max(1, len(rounds))))
    base = rows[0]["tokens_per_second"]
    from ..parallel import is_main_rank

    if not is_main_rank():  # under torchrun: rank 0 reports
        return 0
    print(f"{'mode':<15} {'tau':>6} {'tokens/s':>10} {'speed-up':>9}")
    for r in rows:
        r["speedup"] = r["tokens_per_second"] / base
        print(f"{r['mode']:<15} {r['tau']:>6.2f} {r['tokens_per_second']:>10.1f} {r['speedup']:>8.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(5, 3))
        ax.bar([r["mode"] for r in rows], [r["tokens_per_second"] for r in rows])
        ax.set_ylabel("tokens / s")
        ax.set_title(f"ddtree, budget {args.budget}")
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


def budget_arg(text: str):
    return "auto" if text == "auto" else int_at_least(0)(text)


def cmd_calibrate(args) -> int:
    """Measures (or reads from the cache) the cost profile of each batch size, prints it."""
    from ..budget import BUCKETS, cache_dir
    from ..generate import calibrate

    target, _, drafter, _ = load_models(args)
    profiles = []
    for batch in args.batch:
        profile = calibrate(target, drafter, batch, use_cache=not args.remeasure)
        profiles.append(profile)
    print(f"cost of one round (ms) on {profiles[0].device}, {profiles[0].dtype}; cache: "
          f"{cache_dir() / 'costs'}")
    print(f"{'batch':>5} " + " ".join(f"{('AR' if b == 0 else str(b)):>8}" for b in BUCKETS)
          + "   break-even tokens/round (vs AR)")
    for p in profiles:
        ms = [p.round_ms[b] for b in BUCKETS]
        even = " ".join(f"{m / ms[0]:.1f}" for m in ms[1:])
        print(f"{p.batch:>5} " + " ".join(f"{m:>8.2f}" for m in ms) + f"   {even}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump([p.to_json() for p in profiles], f, indent=1)
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        for p in profiles:
            ax.plot(BUCKETS, [p.round_ms[b] / p.round_ms[0] for b in BUCKETS],
                    "o-", label=f"batch {p.batch}")
        ax.set_xlabel("tree budget (0 = autoregressive round)")
        ax.set_ylabel("round cost / autoregressive round")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


def add_parsers(sub) -> None:
    """The generate, bench and calibrate subcommands."""
    for name in ("generate", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--target", required=True,
                       help="target model directory (HF format), or 'embedded'")
        p.add_argument("--draft", required=name == "bench",
                       help="DFlash drafter directory, or 'embedded'")
        p.add_argument("--budget", type=budget_arg, default=64,
                       help="tree nodes, or 'auto': per round the size (or an autoregressive "
                            "step) with the most expected tokens per second")
        p.add_argument("--max-new-tokens", type=int_at_least(1), default=128)
        p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
        p.add_argument("--device", default=None)
        p.add_argument("--tree-attention", action="store_true",
                       help="verify with the tree_attention op (transformers attention 'ddtree')")
        p.add_argument("--cuda-graph", action="store_true",
                       help="capture the verify step as a CUDA graph (CUDA; implies --tree-attention)")
        p.add_argument("--tensor-parallel", action="store_true",
                       help="shard the target over the ranks of this torchrun job (tp_plan 'auto'); "
                            "the default under torchrun with more than one process")
        if name == "generate":
            p.add_argument("--prompt", required=True)
            p.add_argument("--mode", choices=("tree", "chain", "autoregressive"), default="tree")
            p.add_argument("--temperature", type=float, default=0.0)
            p.add_argument("--top-k", type=int, default=0)
            p.add_argument("--top-p", type=float, default=1.0)
            p.add_argument("--seed", type=int, default=0)
            p.set_defaults(func=cmd_generate)
        else:
            p.add_argument("--prompts", required=True, help="text file, one prompt per line")
            p.add_argument("--batch-size", type=int, default=1,
                           help="prompts decoded together (generate_batch; different lengths)")
            p.add_argument("--plot", default=None, help="write a bar chart (PNG)")
            p.add_argument("--json", default=None)
            p.set_defaults(func=cmd_bench)
    p = sub.add_parser("calibrate", help="measure the round cost per tree budget (budget='auto')")
    p.add_argument("--target", required=True, help="target model directory (HF format), or 'embedded'")
    p.add_argument("--draft", required=True, help="DFlash drafter directory, or 'embedded'")
    p.add_argument("--batch", type=int_at_least(1), nargs="+", default=[1])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--remeasure", action="store_true", help="ignore the cached profile")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(tree_attention=False, cuda_graph=False, tensor_parallel=False,
                   func=cmd_calibrate)
