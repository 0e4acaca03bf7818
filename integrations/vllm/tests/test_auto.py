"""budget="auto" inside vLLM (ddtree.integrations.vllm.auto.StepBudget): whether a step drafts and
how large its trees are, driven by a simulated engine whose step time follows a known cost
(a + b * verify tokens + d * draft rows) and whose drafter is confident or clueless."""
from __future__ import annotations

import pytest
import torch

from ddtree.integrations.vllm.auto import StepBudget
from ddtree.integrations.vllm.options import DDTreeOptions
from ddtree.ops import build_tree, tree_topk

DRAFT_LEN, VOCAB = 15, 64


def drafter_tree(batch: int, confident: bool, max_budget: int, gen: torch.Generator):
    logits = torch.randn(batch, DRAFT_LEN, VOCAB, generator=gen)
    if confident:   # the top token ~0.9 likely at every position
        logits[..., 0] += 8.0
    logprobs, ids = tree_topk(logits, min(max_budget, VOCAB))
    return build_tree(logprobs, ids, torch.zeros(batch, dtype=torch.long), max_budget)


def simulate(budget, confident: bool, b: float, d: float, steps: int = 400, batch: int = 16):
    """Drafting decisions and mean tree size per request over the steps after warm-up."""
    gen = torch.Generator().manual_seed(0)
    options = DDTreeOptions(budget=budget, max_budget=budget if budget != "auto" else 32,
                            draft_len=DRAFT_LEN)
    policy = StepBudget(options, DRAFT_LEN)
    drafted, sizes = [], []
    for step in range(steps):
        draft = policy.draft_step(batch)
        tokens = batch
        if draft:
            policy.drafted(batch * DRAFT_LEN)
            budgets = policy.choose(drafter_tree(batch, confident, options.max_budget, gen), batch)
            tokens += sum(budgets)
            if step >= steps // 2:
                sizes.append(sum(budgets) / batch)
        else:
            policy.drafted(0)
        seconds = 2e-3 + b * tokens + d * (batch * DRAFT_LEN if draft else 0)
        policy.observe_step(tokens, batch, seconds)
        if step >= steps // 2:
            drafted.append(draft)
    return sum(drafted) / len(drafted), (sum(sizes) / len(sizes) if sizes else 0.0)


def test_fixed_budgets_always_draft():
    share, size = simulate(8, confident=False, b=1e-3, d=1e-3, steps=60)
    assert share == 1.0 and size == 8


@pytest.mark.parametrize("confident", [False, True])
def test_auto_stops_drafting_when_the_drafter_costs_more_than_it_yields(confident):
    # the drafter's block costs as much as 15 verify tokens per request: a clueless drafter never
    # pays, and even a confident one (~ +5 tokens per step) loses to plain decoding at this price
    share, _ = simulate("auto", confident=confident, b=1e-4, d=2e-3)
    assert share <= 0.1, f"drafted {share:.0%} of the steps"


def test_auto_drafts_deep_trees_when_drafting_is_cheap():
    share, size = simulate("auto", confident=True, b=1e-5, d=1e-6)
    assert share >= 0.9, f"drafted {share:.0%} of the steps"
    assert size >= 4, f"trees of {size:.1f} nodes per request"


def test_rare_drafting_steps_still_price_the_drafter():
    """Where drafting never pays it is tried once every 4 x 32 decisions, and the fit keeps the
    drafter's price from those few steps (drafting and plain samples are kept apart)."""
    gen = torch.Generator().manual_seed(1)
    options = DDTreeOptions(budget="auto", max_budget=32, draft_len=DRAFT_LEN)
    policy = StepBudget(options, DRAFT_LEN)
    batch, a, b, d = 4, 2e-3, 1e-4, 2e-3
    drafted = []
    for step in range(2000):
        draft = policy.draft_step(batch)
        tokens = batch
        if draft:
            policy.drafted(batch * DRAFT_LEN)
            tokens += sum(policy.choose(drafter_tree(batch, False, 32, gen), batch))
        else:
            policy.drafted(0)
        policy.observe_step(tokens, batch, a + b * tokens + d * (batch * DRAFT_LEN if draft else 0))
        drafted.append(draft)
    late = drafted[1000:]
    assert sum(late) <= len(late) / 100, f"drafted {sum(late)} of {len(late)} late steps"
    _, fit_b, _, fit_d = policy.cost_fit()
    assert fit_d == pytest.approx(d, rel=0.05) and fit_b == pytest.approx(b, rel=0.05)


def test_a_step_is_timed_from_one_drafter_pass_to_the_next(monkeypatch):
    # the runner's order per step: drafter pass (step_starts, drafted), target forward and verify
    # (scheduled); a step's seconds end where the next drafter pass starts
    import ddtree.integrations.vllm.auto as auto

    clock = iter([0.0, 0.030, 0.037, 0.047])
    monkeypatch.setattr(auto.time, "perf_counter", lambda: next(clock))
    options = DDTreeOptions(budget="auto", max_budget=32, draft_len=DRAFT_LEN)
    policy = StepBudget(options, DRAFT_LEN)
    for tokens, rows in ((68, 4 * DRAFT_LEN), (4, 0), (4, 0)):
        policy.step_starts()
        policy.drafted(rows)
        policy.scheduled(tokens, 4)
    policy.step_starts()
    samples = list(policy.samples[True]) + list(policy.samples[False])
    assert [s[:3] for s in samples] == [(68, 4, 60), (4, 4, 0), (4, 4, 0)]
    assert [s[3] for s in samples] == pytest.approx([0.030, 0.007, 0.010])
    assert policy.last_seconds == pytest.approx(0.010)


def test_a_run_of_small_trees_does_not_stop_drafting():
    """One request, drafting pays with trees of ~16 nodes (a confident drafter, the drafter's
    block 3 ms against an 8 ms step). After a run of one-node trees (as an earlier, poor fit
    might choose), drafting is still priced at the best tree size on the drafter's curve."""
    gen = torch.Generator().manual_seed(2)
    options = DDTreeOptions(budget="auto", max_budget=32, draft_len=DRAFT_LEN)
    policy = StepBudget(options, DRAFT_LEN)
    a, b, d = 8e-3, 1e-4, 2e-4

    def run(steps):
        for _ in range(steps):
            draft = policy.draft_step(1)
            tokens = 1
            if draft:
                policy.drafted(DRAFT_LEN)
                tokens += sum(policy.choose(drafter_tree(1, True, 32, gen), 1))
            else:
                policy.drafted(0)
            policy.observe_step(tokens, 1, a + b * tokens + d * (DRAFT_LEN if draft else 0))

    run(200)
    policy._auto = lambda probs, batch: [1] * batch     # the next trees: one node each
    run(50)
    fit = policy.cost_fit()
    best = max((1 + policy.curve[n]) / (a + b * (1 + n) + d * DRAFT_LEN)
               for n in range(len(policy.curve))) * (a + b)
    assert policy.drafting_ratio(fit, 1) > 1.5
    assert policy.drafting_ratio(fit, 1) == pytest.approx(best, rel=0.1)
