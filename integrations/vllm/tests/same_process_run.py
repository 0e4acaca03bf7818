"""Two in-process vLLM engines on the dense pair (fp32): one without speculation, built first,
and a ddtree engine built after it (which installs ddtree's hooks on vLLM's classes). Prints the
greedy tokens of the engine without speculation before and after the ddtree engine exists, and
the ddtree engine's, as JSON.

    python same_process_run.py TARGET DRAFTER
"""
from __future__ import annotations

import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def main(target: str, drafter: str) -> None:
    from vllm import LLM, SamplingParams

    from conftest import held_out_prompts

    common = dict(dtype="float32", enforce_eager=True, enable_prefix_caching=False, max_num_seqs=8)
    prompts = [{"prompt_token_ids": p} for p in held_out_prompts(8)]
    params = SamplingParams(temperature=0.0, max_tokens=32)

    def tokens(llm):
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    plain = LLM(target, **common)
    before = tokens(plain)
    ddtree = LLM(target, speculative_config={"method": "ddtree", "model": drafter, "budget": 16},
                 **common)
    result = {"before": before, "ddtree": tokens(ddtree), "after": tokens(plain)}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    main(*sys.argv[1:3])
