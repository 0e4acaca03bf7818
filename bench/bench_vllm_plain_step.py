"""What a step without drafts costs inside a ddtree engine: vLLM without speculation against a
ddtree engine whose `auto` never drafts (its draft decision forced to "no"), both engines in one
process (in-process `LLM.generate`, the embedded pair in bf16, the same prompts, greedy), their
generates alternating (the order flipped every round). Reported: output tokens/s of each engine
(median over rounds) and the median and range of the per-round ratio ddtree / vLLM, so drift on
the machine falls on both alike. The engine without speculation is built first: the ddtree hooks
installed afterwards leave it on vLLM's code (every hook checks for the runner's ddtree state).

    .venv-vllm/bin/python bench/bench_vllm_plain_step.py [--requests 16] [--rounds 8]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=8)
    args = p.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "integrations" / "vllm" / "tests"))
    from bench_vllm_serving import third_party_prompts
    from conftest import EMBEDDED
    from vllm import LLM, SamplingParams

    from ddtree.integrations.vllm import auto

    auto.StepBudget.draft_step = lambda self, batch: False
    common = dict(dtype="bfloat16", enable_prefix_caching=False, enforce_eager=True,
                  max_num_seqs=max(args.requests, 4))
    engines = {"vllm without speculation": LLM(str(EMBEDDED / "target"), **common)}
    engines["ddtree, no drafts"] = LLM(
        str(EMBEDDED / "target"), speculative_config={
            "method": "ddtree", "model": str(EMBEDDED / "drafter"), "budget": "auto"}, **common)
    prompts = third_party_prompts(args.requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    for llm in engines.values():
        llm.generate(prompts[:4], params, use_tqdm=False)
    seconds = {name: [] for name in engines}
    names = list(engines)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            start = time.perf_counter()
            engines[name].generate(prompts, params, use_tqdm=False)
            seconds[name].append(time.perf_counter() - start)
    tokens = args.requests * args.tokens
    for name in names:
        print(f"{name:<25} {tokens / statistics.median(seconds[name]):8.1f} tok/s")
    ratios = sorted(a / d for a, d in zip(seconds[names[0]], seconds[names[1]]))
    print(f"ddtree without drafts / vLLM without speculation: {statistics.median(ratios):.3f}x "
          f"(rounds {ratios[0]:.3f}-{ratios[-1]:.3f}; {args.requests} requests x {args.tokens} "
          f"tokens, {args.rounds} rounds, {os.cpu_count()} CPU cores)")


if __name__ == "__main__":
    main()
