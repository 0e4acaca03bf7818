"""The decoding loop on the embedded pair with its linears' products of several rows on packed
weights (models.use_packed_linears, what loading installs) against the same modules on nn.Linear's
product (the LM head packed in both): autoregressive decoding, tree 8 and tree 16 at each batch
size, total tokens/s of generate_batch over held-out prompts. The two settings alternate per
mode and group of requests, the order reversed every other group (the machine's drift hits both
alike); every generation checked token-for-token between them.

  python bench/bench_packed_linears.py [--batches 1 2 4] [--requests 16] [--new-tokens 96]
                                       [--repeats 2] [--json F]
"""
import argparse
import json
import platform
import sys
import time

import torch

from ddtree import embedded, models
from ddtree.generate import generate_batch
from timing import write_result  # noqa: E402

MODES = {"autoregressive": dict(mode="autoregressive"), "tree 8": dict(budget=8),
         "tree 16": dict(budget=16)}


def packed_modules(*models):
    return [m for model in models for m in model.modules()
            if isinstance(m, models.PackedLinear) and "packed_min_rows" in m.__dict__]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    target, drafter, tokenizer = embedded.load(dtype=torch.float32, device="cpu")
    models.use_tree_attention(target)
    modules = packed_modules(target, drafter)
    if not modules:
        raise SystemExit("bench_packed_linears: no linear was packed (torch without oneDNN?)")
    min_rows = {id(m): m.packed_min_rows for m in modules}
    shapes = sorted({tuple(m.weight.shape) for m in modules})
    print(f"{len(modules)} packed linears, weights {shapes}", file=sys.stderr)

    def setting(packed: bool):
        for m in modules:  # unpacked: every product below packed_min_rows, nn.Linear's
            m.packed_min_rows = min_rows[id(m)] if packed else sys.maxsize

    texts = embedded.heldout_prompts(max(args.requests, max(args.batches)))
    prompts = [tokenizer(t, return_tensors="pt").input_ids[0] for t in texts]
    rows = []
    for batch in args.batches:
        groups = [prompts[i:i + batch] for i in range(0, max(args.requests, batch), batch)]
        seconds = {(m, p): 0.0 for m in MODES for p in (False, True)}
        tokens = {m: 0 for m in MODES}
        for name, kwargs in MODES.items():  # warm-up, untimed
            for packed in (False, True):
                setting(packed)
                generate_batch(target, drafter, groups[0], 8, **kwargs)
        for rep in range(args.repeats):
            for g, group in enumerate(groups):
                for name, kwargs in MODES.items():
                    order = (False, True) if (rep + g) % 2 == 0 else (True, False)
                    outputs = []
                    for packed in order:
                        setting(packed)
                        start = time.perf_counter()
                        results = generate_batch(target, drafter, group, args.new_tokens, **kwargs)
                        seconds[(name, packed)] += time.perf_counter() - start
                        outputs.append([r.tokens for r in results])
                    if outputs[0] != outputs[1]:
                        raise SystemExit(f"bench_packed_linears: {name} at batch {batch} gave "
                                         f"other tokens with packed linears")
                    tokens[name] += sum(len(t) for t in outputs[0])
        ar_plain = seconds[("autoregressive", False)] / tokens["autoregressive"]
        for name in MODES:
            plain, packed = (tokens[name] / seconds[(name, p)] for p in (False, True))
            row = dict(batch=batch, mode=name, tokens_per_second_linear=plain,
                       tokens_per_second_packed=packed, packed_over_linear=packed / plain,
                       packed_vs_autoregressive_linear=packed * ar_plain,
                       linear_vs_autoregressive_linear=plain * ar_plain)
            rows.append(row)
            print(f"batch {batch:>2} {name:<15} linear {plain:7.1f} tok/s, packed {packed:7.1f} "
                  f"tok/s ({packed / plain:.3f}x); vs autoregressive on nn.Linear: "
                  f"{row['linear_vs_autoregressive_linear']:.3f}x -> "
                  f"{row['packed_vs_autoregressive_linear']:.3f}x", flush=True)
    setting(True)
    if args.json:
        write_result(args.json, dict(torch=torch.__version__, threads=torch.get_num_threads(),
                       machine=platform.machine(), weights=[list(s) for s in shapes],
                       requests=args.requests, new_tokens=args.new_tokens,
                       repeats=args.repeats, rows=rows))


if __name__ == "__main__":
    main()
