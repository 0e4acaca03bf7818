"""Lossless through the OpenAI-compatible server: at temperature 0, ddtree's tokens equal vLLM's
own non-speculative tokens for the same prompts, all submitted at once by concurrent clients.
Dense fp32 target: every prompt identical. Hybrid bf16 target (vLLM's CPU GDN): identical except
where the reference's two best tokens tie within bf16 resolution, and never fewer identical
prompts than vLLM's own `dflash`."""
from __future__ import annotations

import math

import pytest
import torch
from conftest import Server, complete_all, ddtree_config, held_out_prompts, read_stats

PROMPTS = 32
TOKENS = 48


def bf16_step(x: float) -> float:
    """The spacing of bf16 numbers at |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(abs(x))) - 7) if x else 2.0 ** -133


# A near-tie: the reference's two best logits at most this many bf16 steps apart (the low 3 of
# bf16's 8 significant bits). The speculative paths (ddtree's tree ops, vLLM's own spec kernels)
# round the conv, the recurrence and the attention differently from vLLM's one-token decode
# kernels, by about one bf16 step per op (test_gdn.py), and that accumulates over the layers and
# the generated tokens; vLLM without speculation is itself batch-invariant (bitwise the same
# logits at 1, 5 and 32 clients), so every divergence comes from those roundings.
NEAR_TIE_STEPS = 8


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y),
                None if len(a) == len(b) else min(len(a), len(b)))


@pytest.fixture(scope="module")
def dense_reference(dense_pair):
    target, _ = dense_pair
    prompts = held_out_prompts(PROMPTS)
    with Server(target, "--dtype", "float32") as server:
        return prompts, [c["token_ids"] for c in complete_all(server.url, prompts, TOKENS,
                                                              ignore_eos=True)]


@pytest.mark.parametrize("budget", [64, "auto"])
def test_dense_fp32_identical_to_vllm_greedy(dense_pair, dense_reference, budget, tmp_path):
    target, drafter = dense_pair
    prompts, reference = dense_reference
    stats = tmp_path / "stats.jsonl"
    with Server(target, "--dtype", "float32", "--speculative-config",
                ddtree_config(drafter, budget=budget), stats=stats,
                log=tmp_path / "serve.log") as server:
        got = [c["token_ids"] for c in complete_all(server.url, prompts, TOKENS, ignore_eos=True)]
    assert all(len(t) == TOKENS for t in got)
    mismatched = [(i, first_difference(r, g)) for i, (r, g) in enumerate(zip(reference, got))
                  if r != g]
    assert mismatched == [], f"prompts differing from vLLM's greedy (index, first token): {mismatched}"
    steps = read_stats(stats)
    # the tree path ran: branching trees were verified and accepted nodes moved to chain slots
    assert sum(s["branching"] for s in steps) > 0
    if budget == "auto":
        # every request decodes in one step: the scheduler reserves each request the drafter's
        # draft_len query rows, not the 64-node tree budget (32 x 65 > max_num_batched_tokens)
        assert max(s["requests"] for s in steps) == len(prompts)
    if budget == 64:
        assert sum(s["relocated"] for s in steps) > 0
        assert sum(s["accepted"] for s in steps) > 0


def hybrid_run(target, prompts, *args, logprobs=None, stats=None):
    with Server(target, "--dtype", "bfloat16", "--no-enable-prefix-caching", *args,
                stats=stats) as server:
        return complete_all(server.url, prompts, TOKENS, logprobs=logprobs, ignore_eos=True)


CODE_PROMPTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):\n",
    "for i in range(10):\n", "def read_file(path):\n    with open(path) as f:\n",
    "# parse the arguments\n", "if __name__ == '__main__':\n", "def merge(a, b):\n",
    "    return self._data[key]\n", "try:\n    import numpy as np\nexcept ImportError:\n",
    "def __repr__(self):\n", "with open('out.txt', 'w') as f:\n", "while queue:\n",
    "@property\ndef name(self):\n", "raise ValueError(", "def test_add():\n    assert",
    "x = [i * i for i in", "logger = logging.getLogger(", "def main(argv=None):\n",
    "class Config(dict):\n", "    for key, value in", "import json\n\ndef load(path):\n",
    "def parse_args():\n    parser = argparse.", "if not os.path.exists(",
    "def __eq__(self, other):\n", "    except KeyError:\n", "self.assertEqual(",
    "def sort(items, key=None):\n", "async def fetch(url):\n", "return sum(",
    "def wrapper(*args, **kwargs):\n", "print('done')\n",
]


@pytest.mark.parametrize("budget", ["auto", 16])
def test_hybrid_bf16_identical_but_for_bf16_ties(embedded_pair, budget, tmp_path):
    target, drafter = embedded_pair
    # the reference's raw logits (bf16 from the LM head) of its two best tokens at every position
    reference = hybrid_run(target, CODE_PROMPTS, "--logprobs-mode", "raw_logits", logprobs=2)
    dflash = hybrid_run(target, CODE_PROMPTS, "--speculative-config",
                        f'{{"method": "dflash", "model": "{drafter}", "num_speculative_tokens": 15}}')
    stats = tmp_path / "stats.jsonl"
    ours = hybrid_run(target, CODE_PROMPTS, "--speculative-config",
                      ddtree_config(drafter, budget=budget), stats=stats)
    ref_ids = [c["token_ids"] for c in reference]
    same_dflash = sum(r == c["token_ids"] for r, c in zip(ref_ids, dflash))
    same_ours = sum(r == c["token_ids"] for r, c in zip(ref_ids, ours))
    listing = []
    for i, (r, c) in enumerate(zip(reference, ours)):
        at = first_difference(r["token_ids"], c["token_ids"])
        if at is None:
            continue
        top = sorted(r["logprobs"]["top_logprobs"][at].values(), reverse=True)
        margin = top[0] - top[1] if len(top) > 1 else math.inf
        listing.append((i, at, top[0], margin, margin / bf16_step(top[0])))
    print(f"hybrid budget={budget}: identical ddtree {same_ours}/{len(CODE_PROMPTS)}, dflash "
          f"{same_dflash}; divergences (prompt, token, reference top logit, top-2 margin, "
          f"margin in bf16 steps): {listing}")
    assert all(steps <= NEAR_TIE_STEPS for *_, steps in listing), listing
    # "auto" sizes its trees from measured step times, so its trees (and roundings) differ from
    # run to run: 24, 24, 24, 23 identical in 4 runs on an AVX-512 CPU without AMX; dflash 24 in
    # each of its 4. On CPUs with AMX tiles vLLM's speculative conv runs the same packed C++
    # kernel as its one-token decode (the reference), so vLLM's dflash shares the reference's
    # roundings, while ddtree's tree conv rounds once from fp32 (bitwise the correctly rounded
    # value on all elements of test_gdn.py's check, vLLM's kernel on 99.6%): there dflash 28,
    # ddtree 25 to 27 of 32, every divergence a near tie (asserted above)
    slack = (1 if budget == "auto" else 0) + (3 if torch.cpu._is_amx_tile_supported() else 0)
    assert same_ours >= same_dflash - slack, listing
    steps = read_stats(stats)
    # trees on the hybrid target: branching trees verified, off-chain nodes accepted
    assert sum(s["branching"] for s in steps) > 0 and sum(s["relocated"] for s in steps) > 0


@pytest.mark.parametrize("budget", [64, "auto"])
def test_dense_fp32_identical_under_preemption(dense_pair, dense_reference, budget, tmp_path):
    """A KV cache of 24 blocks of 32 tokens for 32 requests of up to 48 + 48 tokens (+ their
    trees): the scheduler preempts requests (recomputed from their prompt later) and the tokens
    are still vLLM's greedy ones; every block is free again afterwards."""
    target, drafter = dense_pair
    prompts, reference = dense_reference
    with Server(target, "--dtype", "float32", "--block-size", "32", "--max-model-len", "256",
                "--num-gpu-blocks-override", "24", "--speculative-config",
                ddtree_config(drafter, budget=budget), log=tmp_path / "serve.log") as server:
        got = [c["token_ids"] for c in complete_all(server.url, prompts, TOKENS, ignore_eos=True)]
        preemptions = server.metric("vllm:num_preemptions_total")
        usage = server.metric("vllm:kv_cache_usage_perc")
    mismatched = [(i, first_difference(r, g)) for i, (r, g) in enumerate(zip(reference, got))
                  if r != g]
    assert mismatched == [], f"prompts differing from vLLM's greedy (index, first token): {mismatched}"
    print(f"budget={budget}: {preemptions:.0f} preemptions, 32 / 32 prompts identical")
    assert preemptions > 0, "the load did not preempt any request"
    assert usage == 0.0
