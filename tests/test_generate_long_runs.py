"""Long generations on the shipped embedded pair: 2,000 tokens per mode, each identical to
autoregressive decoding (itself lossless against transformers' generate, test_train_embedded_pair.py),
with the process's resident memory flat across the rounds (static caches and buffers: nothing may
grow per round)."""
import pytest

from ddtree import embedded
from ddtree.generate import generate

TOKENS = 2000
GROWTH_MB = 8.0  # allowed RSS drift after round 20 (allocator noise is ~3 MB here)


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.fixture(scope="module")
def pair():
    target, drafter, tokenizer = embedded.load()
    ids = tokenizer(embedded.heldout_prompts(1)[0], return_tensors="pt").input_ids
    reference = generate(target, drafter, ids, TOKENS, mode="autoregressive").tokens
    return target, drafter, ids, reference


@pytest.mark.parametrize("mode,budget", [("autoregressive", 0), ("chain", 15), ("tree", 16)])
def test_two_thousand_tokens_without_memory_growth(pair, mode, budget):
    target, drafter, ids, reference = pair
    samples = []
    result = generate(target, drafter, ids, TOKENS, mode=mode, budget=budget,
                      streamer=lambda new: samples.append(rss_mb()))
    assert result.tokens == reference and len(result.tokens) == TOKENS
    assert len(samples) == len(result.acceptance_lengths) + 1 > 100
    growth = max(samples[20:]) - samples[20]
    assert growth < GROWTH_MB, f"{mode}: resident memory grew {growth:.1f} MB over the rounds"
