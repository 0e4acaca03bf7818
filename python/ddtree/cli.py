"""`ddtree generate` and `ddtree bench` (also `python -m ddtree.cli ...`).

  ddtree generate --target DIR --draft DIR --prompt TEXT [--mode tree|chain|autoregressive]
                  [--budget 64|auto] [--max-new-tokens 128] [--temperature 0] [--top-k 0] [--top-p 1]
  ddtree bench --target DIR --draft DIR --prompts FILE [--budget 64|auto] [--plot out.png] [--json F]
  ddtree calibrate --target DIR --draft DIR [--batch 1 4 16] [--plot out.png] [--json F]
  ddtree train-drafter --target DIR --out DIR [--corpus PATH] [--labels greedy|data] [--steps N]
  torchrun --nproc-per-node N -m ddtree.cli generate ...   (tensor-parallel target, every rank
                                                            decodes, rank 0 prints)

Local directories in Hugging Face format; nothing is downloaded. `--target embedded` /
`--draft embedded` name the embedded pair shipped with the package (ddtree.embedded).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import List

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(ValueError):
    """A command-line input the command cannot use; main() prints it without a traceback."""


def _int_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def model_dir(flag: str, path: str) -> str:
    """`path` as a local model directory (with a config.json), or a UsageError naming the flag."""
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r}: no such directory (local Hugging Face model "
                         f"directories only; 'embedded' names the embedded pair)")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise UsageError(f"{flag} {path!r}: the directory has no config.json")
    return path


def _load(args):
    from . import distributed, embedded, loading

    dtype = DTYPES[args.dtype]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    target_path = str(embedded.target_dir()) if args.target == "embedded" else \
        model_dir("--target", args.target)
    draft_path = str(embedded.drafter_dir()) if args.draft == "embedded" else \
        model_dir("--draft", args.draft) if args.draft else None
    if args.tensor_parallel or distributed.is_torchrun():
        # Every rank loads its shard (the device follows LOCAL_RANK); the drafter is replicated.
        target = distributed.load_tensor_parallel(target_path, dtype)
        device = target.get_input_embeddings().weight.device
    else:
        target = loading.load_target(target_path, dtype, device)
    tokenizer = loading.load_tokenizer(target_path)
    drafter = loading.load_drafter(draft_path, dtype, device)
    if args.tree_attention or args.cuda_graph:
        from . import hf

        hf.use_tree_attention(target)
    return target, tokenizer, drafter, device


def _encode(tokenizer, text: str, device) -> torch.Tensor:
    ids = tokenizer(text, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise SystemExit("ddtree: the prompt encodes to no tokens")
    return ids.to(device)


def _stop_ids(tokenizer) -> List[int]:
    eos = tokenizer.eos_token_id
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def cmd_generate(args) -> int:
    from .generate import generate

    from .distributed import is_main_rank

    target, tokenizer, drafter, device = _load(args)
    ids = _encode(tokenizer, args.prompt, device)
    main_rank = is_main_rank()  # under torchrun every rank decodes the same tokens; rank 0 prints

    def stream(new):
        if main_rank:
            sys.stdout.write(tokenizer.decode(new))
            sys.stdout.flush()

    result = generate(target, drafter, ids, args.max_new_tokens, mode=args.mode, budget=args.budget,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                      stop_token_ids=_stop_ids(tokenizer), seed=args.seed, streamer=stream,
                      cuda_graph=args.cuda_graph)
    if main_rank:
        print(f"\n[ddtree] mode={args.mode} tokens={len(result.tokens)} tau={result.tau:.2f} "
              f"tokens/s={result.tokens_per_second:.1f}")
    return 0


def cmd_bench(args) -> int:
    from .generate import generate_batch, tokens_per_second

    if args.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {args.batch_size}")
    target, tokenizer, drafter, device = _load(args)
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
    encoded = [_encode(tokenizer, prompt, device)[0] for prompt in prompts]
    groups = [list(range(i, min(i + args.batch_size, len(encoded))))
              for i in range(0, len(encoded), args.batch_size)]
    for mode in ("autoregressive", "chain", "tree"):
        tokens, rounds, calls = 0, [], []
        for group in tqdm(groups, desc=mode, file=sys.stderr):
            results = generate_batch(target, drafter, [encoded[i] for i in group],
                                     args.max_new_tokens, mode=mode,
                                     budget=args.budget if mode == "tree" else 64,
                                     stop_token_ids=_stop_ids(tokenizer), cuda_graph=args.cuda_graph)
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
    from .distributed import is_main_rank

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


def _budget(text: str):
    return "auto" if text == "auto" else _int_at_least(0)(text)


def cmd_calibrate(args) -> int:
    """Measures (or reads from the cache) the cost profile of each batch size, prints it."""
    from . import budget as cost_aware

    target, _, drafter, _ = _load(args)
    profiles = []
    for batch in args.batch:
        profile = cost_aware.calibrate(target, drafter, batch, use_cache=not args.remeasure)
        profiles.append(profile)
    print(f"cost of one round (ms) on {profiles[0].device}, {profiles[0].dtype}; cache: "
          f"{cost_aware.cache_dir() / 'costs'}")
    print(f"{'batch':>5} " + " ".join(f"{('AR' if b == 0 else str(b)):>8}" for b in cost_aware.BUCKETS)
          + "   break-even tokens/round (vs AR)")
    for p in profiles:
        ms = [p.round_ms[b] for b in cost_aware.BUCKETS]
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
            ax.plot(cost_aware.BUCKETS, [p.round_ms[b] / p.round_ms[0] for b in cost_aware.BUCKETS],
                    "o-", label=f"batch {p.batch}")
        ax.set_xlabel("tree budget (0 = autoregressive round)")
        ax.set_ylabel("round cost / autoregressive round")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.plot)
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="ddtree", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from .train import add_train_drafter_parser

    add_train_drafter_parser(sub)
    for name in ("generate", "bench"):
        p = sub.add_parser(name)
        p.add_argument("--target", required=True,
                       help="target model directory (HF format), or 'embedded'")
        p.add_argument("--draft", required=name == "bench",
                       help="DFlash drafter directory, or 'embedded'")
        p.add_argument("--budget", type=_budget, default=64,
                       help="tree nodes, or 'auto': per round the size (or an autoregressive "
                            "step) with the most expected tokens per second")
        p.add_argument("--max-new-tokens", type=_int_at_least(1), default=128)
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
        else:
            p.add_argument("--prompts", required=True, help="text file, one prompt per line")
            p.add_argument("--batch-size", type=int, default=1,
                           help="prompts decoded together (generate_batch; different lengths)")
            p.add_argument("--plot", default=None, help="write a bar chart (PNG)")
            p.add_argument("--json", default=None)
    p = sub.add_parser("calibrate", help="measure the round cost per tree budget (budget='auto')")
    p.add_argument("--target", required=True, help="target model directory (HF format), or 'embedded'")
    p.add_argument("--draft", required=True, help="DFlash drafter directory, or 'embedded'")
    p.add_argument("--batch", type=_int_at_least(1), nargs="+", default=[1])
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--device", default=None)
    p.add_argument("--remeasure", action="store_true", help="ignore the cached profile")
    p.add_argument("--plot", default=None)
    p.add_argument("--json", default=None)
    p.set_defaults(tree_attention=False, cuda_graph=False, tensor_parallel=False,
                   func=cmd_calibrate)
    args = parser.parse_args(argv)
    if args.command == "generate" and args.mode != "autoregressive" and not args.draft:
        parser.error("--draft is required unless --mode autoregressive")
    command = {"generate": cmd_generate, "bench": cmd_bench}.get(args.command) or args.func
    try:
        return command(args)
    except (UsageError, ValueError, FileNotFoundError, FloatingPointError) as e:
        # Bad input (arguments, files, checkpoints, a diverging training run): the message names
        # it; no traceback. Anything else is a bug and keeps its traceback.
        print(f"ddtree {args.command}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
