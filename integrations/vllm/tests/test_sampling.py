"""Sampling through ddtree's verify_sample inside vLLM: reproducible per seed, parameters its
verification does not apply refused by name (HTTP 400), and distributed as
the target's own distribution: token 2 of many seeded draws (drawn by ddtree's tree walk) against
the target's exact conditional distribution (vLLM's 64 log-probabilities on the dense pair's
64-token vocabulary), through the randomised probability-integral transform and a chi-square
test of its uniformity."""
from __future__ import annotations

import math
import random
import urllib.error
from collections import Counter

import pytest
import torch
from conftest import Server, complete, complete_all, ddtree_config, held_out_prompts

SAMPLES = 1600
TEMPERATURE = 2.0   # flattens the random target, so token 2 spreads over many ids


def pit_values(draws, probs, rng):
    """Randomised probability-integral transform of discrete draws: u = F(t-) + V p(t) with V
    uniform; u is Uniform(0, 1) exactly when the draws follow `probs`."""
    order = sorted(probs, key=lambda t: (-probs[t], t))
    below, acc = {}, 0.0
    for t in order:
        below[t] = acc
        acc += probs[t]
    return [below[t] + rng.random() * probs[t] for t in draws]


def chi2_sf(stat: float, dof: int) -> float:
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64),
                                         torch.tensor(stat / 2.0, dtype=torch.float64)))


def target_probs(url, prefix):
    top = complete(url, prefix, 1, logprobs=64, return_tokens_as_token_ids=True,
                   temperature=TEMPERATURE)["logprobs"]["top_logprobs"][0]
    logits = {int(k.split(":")[-1]): v / TEMPERATURE for k, v in top.items()}
    assert len(logits) == 64     # vLLM returns the raw (temperature 1) log-probs of all 64
    norm = max(logits.values())
    total = sum(math.exp(v - norm) for v in logits.values())
    return {t: math.exp(v - norm) / total for t, v in logits.items()}


def test_sampling_reproducible_per_seed_and_distributed_as_the_target(dense_pair, tmp_path):
    target, drafter = dense_pair
    prompt = held_out_prompts(1, seed=7)[0]
    params = dict(temperature=TEMPERATURE, ignore_eos=True)
    with Server(target, "--dtype", "float32", "--speculative-config",
                ddtree_config(drafter, budget=32), log=tmp_path / "ddtree.log") as server:
        first = complete(server.url, prompt, 12, seed=123, **params)["token_ids"]
        again = complete(server.url, prompt, 12, seed=123, **params)["token_ids"]
        other = complete(server.url, prompt, 12, seed=124, **params)["token_ids"]
        # token 1 comes from the prefill step (vLLM's sampler), token 2 from ddtree's tree walk
        for name, value in (("presence_penalty", 0.5), ("repetition_penalty", 1.2),
                            ("logprobs", 2), ("min_p", 0.1)):
            with pytest.raises(urllib.error.HTTPError) as refused:
                complete(server.url, prompt, 4, **{name: value}, **params)
            assert refused.value.code == 400
            assert name in refused.value.read().decode()   # ddtree's message or vLLM's own
        draws = complete_all(server.url, [prompt] * SAMPLES, 2, clients=32,
                             seed=None, **params)
    assert first == again
    assert first != other
    pairs = [tuple(d["token_ids"]) for d in draws]
    leads = [t for t, c in Counter(p[0] for p in pairs).most_common() if c >= 15]
    rng = random.Random(0)
    u = []
    with Server(target, "--dtype", "float32", "--max-logprobs", "64",
                log=tmp_path / "reference.log") as server:
        for lead in leads:
            seconds = [p[1] for p in pairs if p[0] == lead]
            u += pit_values(seconds, target_probs(server.url, prompt + [lead]), rng)
    bins = 10
    observed = Counter(min(int(x * bins), bins - 1) for x in u)
    expected = len(u) / bins
    stat = sum((observed.get(b, 0) - expected) ** 2 / expected for b in range(bins))
    p = chi2_sf(stat, bins - 1)
    print(f"sampling: {len(u)} draws of token 2 after {len(leads)} token-1 values, "
          f"PIT chi-square {stat:.1f} on {bins - 1} dof, p = {p:.3f}")
    assert len(u) >= 400
    assert p > 1e-3
