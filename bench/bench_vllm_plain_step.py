"""What a step without drafts costs inside a ddtree engine: vLLM without speculation against a
ddtree engine whose `auto` never drafts (its draft decision forced to "no"), in-process
`LLM.generate` on the embedded pair (bf16), the same prompts, greedy. Each measurement is its own
process (one engine each), the two modes alternating; reported: output tokens/s, best of 3
generates per process, and the ratio of the medians over rounds.

    .venv-vllm/bin/python bench/bench_vllm_plain_step.py [--requests 16] [--rounds 2]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODES = ("vllm without speculation", "ddtree, no drafts")


def measure(mode: str, requests: int, tokens: int) -> float:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent / "integrations" / "vllm" / "tests"))
    from bench_vllm_serving import third_party_prompts
    from conftest import EMBEDDED
    from vllm import LLM, SamplingParams

    kwargs = {}
    if mode == MODES[1]:
        from ddtree.integrations.vllm import auto

        auto.StepBudget.draft_step = lambda self, batch: False
        kwargs["speculative_config"] = {"method": "ddtree", "model": str(EMBEDDED / "drafter"),
                                        "budget": "auto"}
    llm = LLM(str(EMBEDDED / "target"), dtype="bfloat16", enable_prefix_caching=False,
              max_num_seqs=max(requests, 4), enforce_eager=True, **kwargs)
    prompts = third_party_prompts(requests)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:4], params, use_tqdm=False)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    return requests * tokens / best


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--one", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps({"tokens_per_s": measure(args.one, args.requests, args.tokens)}))
        return
    samples = {m: [] for m in MODES}
    for r in range(args.rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            out = subprocess.run([sys.executable, __file__, "--one", mode, "--requests",
                                  str(args.requests), "--tokens", str(args.tokens)],
                                 capture_output=True, text=True, check=True).stdout
            tps = json.loads(out.strip().splitlines()[-1])["tokens_per_s"]
            samples[mode].append(tps)
            print(f"round {r} {mode:<25} {tps:8.1f} tok/s", flush=True)
    medians = {m: statistics.median(v) for m, v in samples.items()}
    print(f"ddtree without drafts / vLLM without speculation: "
          f"{medians[MODES[1]] / medians[MODES[0]]:.3f}x ({args.requests} requests x "
          f"{args.tokens} tokens, {os.cpu_count()} CPU cores)")


if __name__ == "__main__":
    main()
