"""Autoregressive vs DFlash chain vs DDTree (budgets 16 / 64 / 256) on the embedded trained pair:
τ, target forwards, tokens/s, wall time, on held-out stdlib prompts (CPU fp32, greedy, warm-up
excluded; every mode checked identical to autoregressive). The numbers in the README come from it.

  python bench/bench_embedded_pair.py [--prompts 8] [--new-tokens 96] [--json F] [--plot F]
"""
import argparse
import json
import os

import torch

from ddtree import demo
from timing import write_result  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args()
    rows, _ = demo.run_loop_demo(args.prompts, args.new_tokens, plot=args.plot)
    if not all(r["identical"] for r in rows):
        raise SystemExit("bench_embedded_pair: a mode differs from autoregressive (lossless violated)")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        write_result(args.json, dict(torch=torch.__version__, threads=torch.get_num_threads(),
                       prompts=args.prompts, new_tokens=args.new_tokens, rows=rows))


if __name__ == "__main__":
    main()
