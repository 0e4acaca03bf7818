"""budget="auto": lossless through every bucket transition (autoregressive rounds included, the
drafter's deferred context, dense and hybrid targets, batches, sampling), the drafter's context
after autoregressive rounds, the policy's choices against a cost profile, the cost profile's
measurement and disk cache, and the calibration of predicted against observed tokens."""
import json
import os
import statistics

import pytest
import torch

import ddtree
from ddtree import budget as cost_aware
from ddtree.generate import calibrate, calibration_run
from ddtree import embedded
from ddtree.generate import generate, generate_batch
from ddtree.models.dflash_state import DFlashDraftState
from helpers import (
    greedy_reference, PROMPTS, ScriptedBudgets, tiny_drafter, tiny_hybrid, tiny_target)

EVERY_TRANSITION = [0, 0, 4, 0, 0, 0, 0, 16, 64, 0, 8, 32, 32, 0, 4, 64, 0, 0, 16]


def profile(round_ms, batch=1):
    return cost_aware.CostProfile(batch=batch, round_ms=dict(round_ms), target="t", drafter="d",
                                  device="cpu", dtype="float32", version="test")


def make_target(kind):
    return tiny_target(seed=3) if kind == "qwen3" else tiny_hybrid(kind=kind)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5", "qwen3_next"])
def test_lossless_through_every_bucket_transition(kind, monkeypatch):
    """A batch of three prompts of different lengths; rounds switch between autoregressive and
    every tree size (the drafter's deferred rows written in chunks of 3 to cross chunk
    boundaries): tokens equal the target's greedy decoding."""
    monkeypatch.setattr(DFlashDraftState, "DEFER_ROWS", 3)
    target, drafter = make_target(kind), tiny_drafter()
    truths = [greedy_reference(target, torch.tensor([p]), 30) for p in PROMPTS]
    policy = ScriptedBudgets(EVERY_TRANSITION)
    results = generate_batch(target, drafter, PROMPTS, 30, budget="auto", policy=policy)
    assert [r.tokens for r in results] == truths
    assert set(policy.choices) == set(cost_aware.BUCKETS)
    for r in results:
        assert len(r.round_budgets) == len(r.acceptance_lengths) == len(r.predicted_lengths)
        for b, n, p in zip(r.round_budgets, r.acceptance_lengths, r.predicted_lengths):
            assert 1 <= n <= (1 if b == 0 else 1 + min(b, drafter.block_size - 1))
            assert p == 1.0 if b == 0 else 1.0 <= p <= 1 + min(b, drafter.block_size - 1)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("costs, expect", [
    ({0: 10.0, 4: 9.0, 8: 9.2, 16: 9.4, 32: 9.6, 64: 9.8}, "drafted"),  # trees always pay
    ({0: 1.0, 4: 9.0, 8: 12.0, 16: 20.0, 32: 40.0, 64: 80.0}, "autoregressive"),
])
def test_auto_policy_is_lossless_and_follows_the_costs(kind, costs, expect):
    """With the real AutoBudget policy: trees cheaper than a decoding step -> drafted rounds
    (even the untrained drafter's ~1 token a round pays); trees that cost more than they could
    ever return -> autoregressive rounds only (no draft step at all)."""
    target, drafter = make_target(kind), tiny_drafter()
    truths = [greedy_reference(target, torch.tensor([p]), 24) for p in PROMPTS[:2]]
    policy = cost_aware.AutoBudget(profile(costs, batch=2), learn_costs=False)
    results = generate_batch(target, drafter, PROMPTS[:2], 24, budget="auto", policy=policy)
    assert [r.tokens for r in results] == truths
    drafted = sum(1 for b in policy.choices if b > 0)
    if expect == "drafted":
        assert drafted >= len(policy.choices) - 1
    else:
        assert drafted == 0 and set(policy.reasons) == {
            "no tree could pay even if every node were accepted"}


def test_auto_sampling_is_reproducible_and_valid():
    target, drafter = tiny_target(seed=3), tiny_drafter()
    run = lambda seq: [r.tokens for r in generate_batch(  # noqa: E731
        target, drafter, PROMPTS, 16, budget="auto", policy=ScriptedBudgets(seq), temperature=0.9,
        top_k=20, seed=7)]
    first = run(EVERY_TRANSITION)
    assert first == run(EVERY_TRANSITION)
    assert all(len(t) == 16 and all(0 <= x < 96 for x in t) for t in first)


@pytest.mark.parametrize("plain_rounds, defer_rows", [(3, 64), (12, 64), (12, 5)],
                         ids=["taken-by-the-step", "written-before-the-step", "written-in-chunks"])
def test_deferred_context_equals_drafted_context(plain_rounds, defer_rows, monkeypatch):
    """Rows that reach the drafter's context through autoregressive rounds (defer: behind the
    drafted round's accepted rows, 2 and 4 per request here, then taken by the next draft step
    as its context rows, or written by a pass of their own when more than its block_size rows,
    or in chunks) give the next draft step the same logits as rows that went through draft
    steps one round at a time."""
    monkeypatch.setattr(DFlashDraftState, "DEFER_ROWS", defer_rows)
    target, drafter = tiny_target(seed=3), tiny_drafter()
    g = torch.Generator().manual_seed(0)
    hidden = lambda: tuple(torch.randn(2, 5, 64, generator=g) for _ in range(5))  # noqa: E731
    prompt = [hidden(), hidden()]
    rounds = [hidden() for _ in range(plain_rounds + 1)]
    from ddtree.ops import Verdict

    root_only = Verdict(torch.tensor([[0] + [-1] * 7] * 2), torch.tensor([1, 1]),
                        torch.tensor([3, 4]))
    uneven = Verdict(torch.tensor([[0, 2] + [-1] * 6, [0, 1, 3, 4] + [-1] * 4]),
                     torch.tensor([2, 4]), torch.tensor([3, 4]))
    prompt_states = [tuple(h[i:i + 1] for h in prompt[i]) for i in range(2)]
    bonus = torch.tensor([5, 6])
    drafted = DFlashDraftState(drafter, target, prompt_states, 64, False)
    deferred = DFlashDraftState(drafter, target, prompt_states, 64, False)
    for state in (drafted, deferred):
        state.step(bonus)
        state.commit(rounds[0], uneven)
        state.known_new_rows(4)
    for h in rounds[1:]:
        drafted.step(bonus)
        drafted.commit(h, root_only)
        deferred.defer(h)
    torch.testing.assert_close(deferred.step(bonus), drafted.step(bonus), rtol=1e-4, atol=1e-4)
    assert torch.equal(deferred.rows.committed_len, drafted.rows.committed_len)
    assert deferred.deferred == 0 and not deferred.deferred_count.any()


def test_a_shallow_round_extends_its_buckets_by_earlier_ratios():
    """A round that measured only its first buckets (observed=2: a tree of 4 drafted 4 deep)
    extends each larger bucket from the largest measured one by the running averages' ratios,
    per request and over the batch; the depth-limited values it carried are not used."""
    costs = profile({0: 10.0, 4: 20.0, 8: 22.0, 16: 25.0, 32: 40.0, 64: 80.0})
    policy = cost_aware.AutoBudget(costs, smoothing=0.5)
    policy.start(1, 15, "cpu")
    assert policy.per_request == [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]  # the prior
    full = [1.0, 2.0, 2.6, 3.2, 3.6, 4.0]
    policy.choose()
    policy.observe(cost_aware.RoundStats(expected=full, predicted=[2.0], live=1,
                                         per_row=[full], requests=[7]))
    after_full = [1.0, 2.5, 2.8, 3.1, 3.3, 3.5]
    assert policy.per_request == pytest.approx(after_full)
    shallow = [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]  # bucket 4 measured; 8.. built 4 deep
    policy.choose()
    policy.observe(cost_aware.RoundStats(expected=shallow, predicted=[3.0], live=1,
                                         per_row=[shallow], requests=[7], observed=2))
    # 3.0 / 2.5 = 1.2 times the earlier averages for 8 .. 64, then averaged in.
    extended = [1.0, 3.0, 2.8 * 1.2, 3.1 * 1.2, 3.3 * 1.2, 3.5 * 1.2]
    want = [(a + b) / 2 for a, b in zip(extended, after_full)]
    assert policy.per_request == pytest.approx(want)
    assert policy.by_request[7] == pytest.approx(want)
    assert cost_aware.observed_buckets((0, 4, 8, 16, 32, 64), 4, 15) == 2
    assert cost_aware.observed_buckets((0, 4, 8, 16, 32, 64), 8, 15) == 3
    assert cost_aware.observed_buckets((0, 4, 8, 16, 32, 64), 15, 15) is None


def test_policy_choices_and_probes():
    """argmax of expected tokens per ms; while autoregressive rounds win, a probe after
    `probe_after` of them, the wait doubling after each probe that does not pay, up to
    `max_wait`, and back to `probe_after` after one that pays; a run of drafted rounds goes on
    while the estimate stays within `stay` of an autoregressive round."""
    costs = profile({0: 10.0, 4: 20.0, 8: 22.0, 16: 25.0, 32: 40.0, 64: 80.0})
    policy = cost_aware.AutoBudget(costs, probe_after=2, max_wait=6, probe_overhead=1.0)
    policy.start(1, 15, "cpu")
    assert policy.choose() > 0  # the prior (3 tokens a drafted round) pays here
    # 2.8 tokens at budget 16 for 25 ms beats 1 token per 10 ms and the other sizes.
    stats = cost_aware.RoundStats(expected=[1.0, 2.0, 2.3, 2.8, 2.9, 3.0], predicted=[2.8], live=1)
    for _ in range(3):  # the estimates move from the prior towards the observed gains
        policy.observe(stats)
        policy.choose()
    assert policy.choices[-1] == 16
    policy.observe(stats)
    # Estimates that no longer pay: autoregressive rounds, then a probe of the best tree.
    weak = cost_aware.RoundStats(expected=[1.0, 1.5, 1.7, 2.1, 2.2, 2.3], predicted=[2.1], live=1)
    for _ in range(4):
        policy.observe(weak)
    picks, probes = [], 0
    for _ in range(18):
        picks.append(policy.choose())
        if picks[-1]:
            probes += 1
        # The third probe pays (2.8 tokens at 16 for 25 ms). Drafting then goes on while the
        # estimate stays within `stay` (0.9) of an autoregressive round: blended with weak
        # rounds, 2.45 and 2.28 tokens (0.98 and 0.91 of it) keep drafting, 2.19 (0.88) stops.
        policy.observe(None if picks[-1] == 0 else stats if probes == 3 else weak)
    # Waits of 2, then 4, then 6 (max_wait) autoregressive rounds between probes.
    assert picks == [0, 0, 16, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 16, 16, 16, 0]
    assert [r for r, b in zip(policy.reasons[-18:], picks) if b] == ["probe"] * 3 + [
        "best expected tokens/s"] * 2
    # Without the hysteresis (stay = hurdle) the run ends at the first blend below the hurdle.
    strict = cost_aware.AutoBudget(costs, probe_after=2, max_wait=6, probe_overhead=1.0,
                                   stay=1.1)
    strict.start(1, 15, "cpu")
    strict.per_request = [1.0, 2.0, 2.3, 2.8, 2.9, 3.0]
    assert strict.choose() == 16
    strict.observe(weak)
    assert strict.choose() == 0
    # A probe that clears `stay` but not `hurdle` (0.95 of an autoregressive round) starts no
    # run: the next round is autoregressive and the wait doubles.
    near = cost_aware.AutoBudget(costs, probe_after=2, max_wait=6, probe_overhead=1.0)
    near.start(1, 15, "cpu")
    almost = cost_aware.RoundStats(expected=[1.0, 1.5, 1.7, 2.375, 2.2, 2.3], predicted=[2.4],
                                   live=1)
    near.per_request = list(almost.expected)
    assert near.speedup(16) == pytest.approx(0.95)
    near.observe(None)
    near.observe(None)  # two autoregressive rounds: the wait is over
    assert near.choose() == 16 and near.reasons[-1] == "probe"
    near.observe(almost)
    assert near.choose() == 0 and near.wait == 4
    assert "autoregressive" in policy.explain() or "trees of" in policy.explain()
    # Probes dear next to a decoding step: a tree of 16 costs 1.5 autoregressive rounds more, so
    # with probe_overhead 0.05 the first wait is >= 1.5 / 0.2 rounds and the longest >= 1.5 / 0.05.
    dear = cost_aware.AutoBudget(costs, probe_after=2, max_wait=6)
    dear.start(1, 15, "cpu")
    for _ in range(4):
        dear.choose()
        dear.observe(weak)
    picks = []
    for _ in range(100):
        picks.append(dear.choose())
        dear.observe(None if picks[-1] == 0 else weak)
    # Waits of max(wait, 8): 8, 8 (4), 8, 16, then 30 (not max_wait = 6).
    assert [i for i, b in enumerate(picks) if b] == [8, 17, 26, 43, 74]
    assert dear._longest_wait(16) == 30


def test_cost_profile_is_measured_once_and_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path))
    target, drafter = tiny_target(seed=3), tiny_drafter()
    measured = calibrate(target, drafter, 2, rounds=2, repeats=1, progress=False)
    assert set(measured.round_ms) == set(cost_aware.BUCKETS)
    assert all(ms > 0 for ms in measured.round_ms.values())
    files = list((tmp_path / "costs").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["batch"] == 2
    import ddtree.generate.loop as loop

    def no_measuring(*a, **k):
        raise AssertionError("a cached profile must not be measured again")

    monkeypatch.setattr(loop, "generate_batch", no_measuring)
    again = calibrate(target, drafter, 2, progress=False)
    assert again == measured
    assert cost_aware.load_profile(target, tiny_drafter(seed=9), 2) == measured  # same shapes
    assert cost_aware.load_profile(target, tiny_drafter(block_size=4), 2) is None  # other drafter
    assert cost_aware.load_profile(target, drafter, 3) is None               # other batch size
    # Another attention path costs otherwise: the drafter's unfused layers, the target's
    # tree_attention op.
    drafter.fused_attention = False
    assert cost_aware.load_profile(target, drafter, 2) is None
    drafter.fused_attention = "auto"
    from ddtree import models
    models.use_tree_attention(target)
    assert cost_aware.load_profile(target, drafter, 2) is None


def test_a_rebuilt_extension_measures_again(tmp_path, monkeypatch):
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path))
    target, drafter = tiny_target(seed=3), tiny_drafter()
    built = cost_aware.build_version()
    size = os.stat(ddtree._C.__file__).st_size
    assert built.startswith(ddtree.__version__ + "+") and f"{size:x}." in built
    measured = calibrate(target, drafter, 1, rounds=2, repeats=1, progress=False)
    assert measured.version == built
    assert cost_aware.load_profile(target, drafter, 1) == measured
    # Another build of the kernels (other size or time stamp): the profile is not reused.
    monkeypatch.setattr(cost_aware.costs, "build_version", lambda: ddtree.__version__ + "+other")
    assert cost_aware.load_profile(target, drafter, 1) is None


def test_learned_state_carries_over_between_generations(monkeypatch):
    target, drafter = tiny_target(seed=3), tiny_drafter()
    cheap = profile({0: 10.0, 4: 10.5, 8: 11.0, 16: 11.5, 32: 12.0, 64: 13.0})
    first = cost_aware.auto_policy(target, drafter, 1, cheap)
    first.learn_min_rounds = 1  # a short generation still teaches its gains
    generate(target, drafter, torch.tensor([PROMPTS[0]]), 12, budget="auto", policy=first)
    cost_aware.remember(first)
    second = cost_aware.auto_policy(target, drafter, 1, cheap)
    assert second.prior == first.learned and second.prior["expected_per_request"]
    second.start(1, drafter.block_size - 1, "cpu")
    assert second.per_request == first.learned["expected_per_request"]
    assert second.cost_ratios == first.cost_ratios and second.cost(4) == first.cost(4)
    assert second.calibration_prior() == first.learned["calibration"]


def test_one_calibration_is_shared_by_every_batch_size():
    """The drafter's confidence does not depend on the batch size: a batch-2 policy starts from
    the calibration the latest drafting generation learned at batch 1; a generation that drafted
    nothing leaves it as it was."""
    target, drafter = tiny_target(seed=3), tiny_drafter()
    cheap = {0: 10.0, 4: 10.5, 8: 11.0, 16: 11.5, 32: 12.0, 64: 13.0}
    profiles = [profile(cheap, batch=1), profile(cheap, batch=2)]
    alone = cost_aware.auto_policy(target, drafter, 1, profiles)
    generate(target, drafter, torch.tensor([PROMPTS[0]]), 12, budget="auto", policy=alone)
    assert any(alone.choices) and len(alone.learned["calibration"]) == \
        cost_aware.Calibration.POSITIONS
    pair = cost_aware.auto_policy(target, drafter, 2, profiles)
    assert pair.calibration_prior() == alone.learned["calibration"]
    dear = [profile({0: 1.0, 4: 90.0, 8: 92.0, 16: 95.0, 32: 97.0, 64: 99.0}, batch=b)
            for b in (1, 2)]
    plain = cost_aware.auto_policy(target, drafter, 2, dear)
    generate_batch(target, drafter, PROMPTS[:2], 8, budget="auto", policy=plain)
    assert not any(plain.choices)
    again = cost_aware.auto_policy(target, drafter, 1, profiles)
    assert again.calibration_prior() == alone.learned["calibration"]


def test_calibration_per_round_position():
    """Each of a generation's first rounds has its own calibration, later ones share the steady
    one; an early position is shrunk towards the steady ratio by a prior worth PRIOR predicted
    nodes (so one with no rounds follows it); sums of the steady position alone fill that one."""
    cal = cost_aware.Calibration("cpu")
    steady, prior = cal.STEADY, cost_aware.Calibration.PRIOR
    assert [cal.position(i) for i in range(steady + 3)] == list(range(steady)) + [steady] * 3
    assert [cal.ratio(p).item() for p in range(cal.POSITIONS)] == [1.0] * cal.POSITIONS
    cal.update(torch.tensor([4.0]), torch.tensor([2]), position=0)  # 4 predicted, 1 accepted
    assert cal.ratio(0).item() == pytest.approx((1 + prior * 1.0) / (4 + prior))
    assert cal.ratio(1).item() == cal.ratio(steady).item() == 1.0
    cal.update(torch.tensor([2.0]), torch.tensor([5]), position=steady)  # 2 predicted, 4 acc.
    r_steady = (prior * cal.decay + 4) / (prior * cal.decay + 2)
    assert cal.ratio(steady).item() == pytest.approx(r_steady)
    assert cal.ratio(1).item() == pytest.approx(r_steady)
    assert cal.ratio(0).item() == pytest.approx((1 + prior * r_steady) / (4 + prior))
    assert cal.expected_tokens(torch.tensor(3.0), 0).item() == \
        pytest.approx(1 + 3 * (1 + prior * r_steady) / (4 + prior))
    factors = cost_aware.Calibration.position_factors(cal.sums.tolist())
    assert factors[0] == pytest.approx((1 + prior * r_steady) / (4 + prior) / r_steady)
    assert factors[1:] == pytest.approx([1.0] * (cal.POSITIONS - 1))
    assert cost_aware.Calibration.position_factors(None) == [1.0] * cal.POSITIONS
    flat = cost_aware.Calibration("cpu", sums=[3.0, 6.0])
    assert flat.ratio(steady).item() == flat.ratio(0).item() == 0.5
    with pytest.raises(ValueError, match=r"sums must be \(obs, pred\) or \[7, 2\]"):
        cost_aware.Calibration("cpu", sums=[[1.0, 2.0]] * 3)


def test_early_rounds_use_their_positions_calibration():
    """The drafter over-predicts a generation's first rounds: learned calibrations that say so
    make the round's own prediction small there (predicted_lengths), and keep auto from drafting
    those rounds where the steady estimates would draft (lossless throughout)."""
    target, drafter = tiny_target(seed=3), tiny_drafter()
    truth = greedy_reference(target, torch.tensor([PROMPTS[0]]), 24)
    steady = cost_aware.Calibration.STEADY
    early_wrong = [[0.0, 1e6]] * steady + [[2.0, 2.0]]  # early rounds: nothing accepted
    fixed = cost_aware.FixedBucket(16, prior=dict(calibration=early_wrong))
    r = generate(target, drafter, torch.tensor([PROMPTS[0]]), 24, budget="auto", policy=fixed)
    assert r.tokens == truth and len(r.predicted_lengths) > steady
    assert r.predicted_lengths[:steady] == pytest.approx([1.0] * steady, abs=1e-3)
    assert all(p > 1.01 for p in r.predicted_lengths[steady:])
    assert fixed.learned["calibration"][0][1] > 1e6 * 0.95  # round 0's prediction added
    cheap = profile({0: 10.0, 4: 15.0, 8: 15.5, 16: 16.0, 32: 17.0, 64: 18.0})
    strong = {"expected_per_request": [1.0, 3.0, 3.0, 3.0, 3.0, 3.0]}
    for calibration, drafts_from in ([2.0, 2.0], 0), (early_wrong, steady):
        policy = cost_aware.AutoBudget(cheap, prior={**strong, "calibration": calibration},
                                       learn_costs=False)
        r = generate(target, drafter, torch.tensor([PROMPTS[0]]), 24, budget="auto",
                     policy=policy)
        assert r.tokens == truth
        assert policy.choices[:drafts_from] == [0] * drafts_from
        assert policy.choices[drafts_from] > 0
        assert policy.reasons[drafts_from] == "best expected tokens/s"


class RecordingBudget(cost_aware.AutoBudget):
    """AutoBudget that keeps every round's statistics."""

    def observe(self, stats):
        self.seen = getattr(self, "seen", []) + [stats]
        super().observe(stats)


def test_a_batch_is_priced_by_its_slowest_request():
    """A batch lasts until its slowest request is done: a tree that averages well over the batch
    but barely helps the request with the most rounds left does not pay (the others finishing
    early does not end the generation sooner); once that request is nearly done, it does."""
    costs = profile({0: 10.0, 4: 15.0, 8: 30.0, 16: 40.0, 32: 50.0, 64: 60.0}, batch=2)
    policy = cost_aware.AutoBudget(costs, learn_costs=False, probe_after=1000)
    policy.start(2, 15, "cpu")
    fast, slow = [1.0, 4.0, 4.5, 5.0, 5.0, 5.0], [1.0, 1.1, 1.2, 1.2, 1.2, 1.2]
    policy.by_request = {7: fast, 9: slow}
    policy.per_request = [(f + s) / 2 for f, s in zip(fast, slow)]
    policy.observe_remaining({7: 80, 9: 80})
    # Averaged: 2.55 tokens per 15 ms against 1 per 10 ms (1.7x); the slow request: 80 / 1.1
    # rounds of 15 ms against 80 of 10 ms (0.73x).
    assert policy.speedup(4, policy.per_request) == pytest.approx(2.55 / 1.5)
    assert policy.speedup(4) == pytest.approx(800 / (80 / 1.1 * 15))
    assert policy.choose() == 0
    policy.observe(None)
    policy.observe_remaining({7: 80, 9: 5})  # now the fast request has the most rounds left
    assert policy.speedup(4) == pytest.approx(800 / (20 * 15))
    assert policy.choose() == 4
    # Without remaining tokens (a policy driven outside generate) the batch average decides.
    plain = cost_aware.AutoBudget(costs, learn_costs=False)
    plain.start(2, 15, "cpu")
    plain.per_request = policy.per_request
    assert plain.speedup(4) == pytest.approx(2.55 / 1.5) and plain.choose() == 4


def test_drafting_generations_measured_slower_than_autoregressive_make_the_next_plain():
    """observe_generation: the time autoregressive decoding would have taken (each request's
    tokens after its first, one a round, at the power-of-two batch of the requests still live)
    over the generation's measured loop time, the prefill added to both (a ratio of running
    means over about plain_evidence requests, from generations of at least learn_min_rounds
    rounds); once that many requests
    were learned from, generations at that batch size that follow a mean below 1x run plain
    (re-checked every REFRESH_AFTER-th), not at batch 1."""
    ms = {0: 10.0, 4: 30.0, 8: 32.0, 16: 35.0, 32: 40.0, 64: 50.0}
    smaller = {2: profile({**ms, 0: 8.0}, batch=2), 1: profile({**ms, 0: 5.0}, batch=1)}
    policy = cost_aware.AutoBudget(profile(ms, batch=4), smaller=smaller)
    policy.start(4, 15, "cpu")
    policy.per_request = [1.0, 4.0, 4.5, 5.0, 5.0, 5.0]  # gains that look good
    # rounds 0-5: 4 or 3 live (batch 4, 10 ms), rounds 6-9: 2 live (batch 2, 8 ms) = 92 ms
    policy.observe_generation(115.0, [10, 10, 6, 3])
    assert policy.measured_speedup == pytest.approx(92 / 115)
    # The batch shrank to 1 by the end: the sizes it had are still priced by their profiles.
    policy.resize(1)
    policy.observe_generation(115.0, [10, 10, 6, 3])
    assert policy.measured_speedup == pytest.approx(92 / 115)
    # The prefill both pay (the drafter's prompt pass is in the loop's time).
    policy.observe_generation(115.0, [10, 10, 6, 3], prefill_ms=20.0)
    assert policy.measured_speedup == pytest.approx(112 / 135)
    policy.observe_generation(115.0, [10, 10, 6, 3])
    # A generation of fewer than learn_min_rounds rounds teaches nothing of the kind.
    assert "measured_speedup" not in policy.finish([1.0, 1.0])
    policy.choices = [4] * policy.learn_min_rounds
    learned = policy.finish([1.0, 1.0])
    assert learned["measured_speedup"] == pytest.approx(0.8)
    assert learned["evidence_requests"] == 4
    # Plain generations need plain_evidence requests learned from at this batch size (8): a
    # second batch of 4, measured at 0.6, weighs 4 / (4 + 4) of the running means.
    early = cost_aware.AutoBudget(profile(ms, batch=4), learn_costs=False, prior=learned)
    assert not early.plain_autoregressive(4, 15)
    second = cost_aware.AutoBudget(profile(ms, batch=4), smaller=smaller, prior=learned)
    second.start(4, 15, "cpu")
    second.choices = [4] * second.learn_min_rounds
    second.observe_generation(92.0 / 0.6, [10, 10, 6, 3])
    learned = second.finish([1.0, 1.0])
    assert learned["measured_speedup"] == pytest.approx(92 / ((115 + 92 / 0.6) / 2))
    assert learned["evidence_requests"] == 8
    after = cost_aware.AutoBudget(profile(ms, batch=4), learn_costs=False, prior=learned)
    assert after.plain_autoregressive(4, 15) and after.plain_reason.startswith("measured")
    assert not after.plain_autoregressive(1, 15)  # a single request: probes decide
    paid = cost_aware.AutoBudget(profile(ms, batch=4), learn_costs=False,
                                 prior={**learned, "measured_speedup": 1.2})
    assert not paid.plain_autoregressive(4, 15)
    refresh = cost_aware.AutoBudget(profile(ms, batch=4), learn_costs=False, prior={
        **learned, "plain_runs": cost_aware.AutoBudget.REFRESH_AFTER})
    assert not refresh.plain_autoregressive(4, 15)
    # The loop reports every auto generation.
    target, drafter = tiny_target(seed=3), tiny_drafter()
    looped = cost_aware.AutoBudget(profile(ms, batch=2), learn_min_rounds=1)
    generate_batch(target, drafter, PROMPTS[:2], 12, budget="auto", policy=looped)
    assert looped.measured_speedup > 0 and looped.learned["measured_speedup"] > 0
    # Under tensor parallelism (costs not learned) each rank's clock would decide differently.
    ranked = cost_aware.AutoBudget(profile(ms, batch=4), learn_costs=False, smaller=smaller)
    ranked.start(4, 15, "cpu")
    ranked.observe_generation(115.0, [10, 10, 6, 3])
    assert ranked.measured_speedup is None and "measured_speedup" not in ranked.finish([1, 1])


def test_round_statistics_cover_the_requests_that_took_part():
    """Every drafted round's statistics count the requests that took part in it — the round in
    which a request finishes included (counting it as gone would average a zero into the
    expected gains) — and an autoregressive round's expected tokens are one per request."""
    target, drafter = tiny_target(seed=3), tiny_drafter()
    cheap = profile({0: 10.0, 4: 1.0, 8: 1.1, 16: 1.2, 32: 1.3, 64: 1.4}, batch=2)
    policy = RecordingBudget(cheap, learn_costs=False)
    results = generate_batch(target, drafter, PROMPTS[:2], 17, budget="auto",
                             policy=policy)
    drafted = [s for s in policy.seen if s is not None]
    assert drafted and len(drafted) == len(policy.seen)
    taking_part = [sum(len(r.acceptance_lengths) > i for r in results)
                   for i in range(len(drafted))]
    assert [s.live for s in drafted] == taking_part
    assert all(s.expected[0] == pytest.approx(s.live) for s in drafted)
    for s in drafted:  # per row: 1 token at bucket 0 for the rows that took part, else zeros
        assert set(s.requests) <= {0, 1} and len(s.per_row) == len(s.requests)  # batch shrinks
        assert sum(row[0] for row in s.per_row) == pytest.approx(s.live)
        assert all(row == sorted(row) for row in s.per_row)  # bigger trees expect no fewer
    assert policy.per_request[0] == pytest.approx(1.0)


@pytest.mark.parametrize("position", [0, 3, cost_aware.Calibration.STEADY])
def test_round_statistics_travel_raw_and_are_calibrated_on_the_host(position):
    """pack_stats sends the drafter's expected nodes, who took part and the calibration sums as
    they were; unpack_stats gives what the device-side calibration (expected_tokens) gives: per
    row 1 + nodes x the steady ratio (zeros for a row that took no part), their sum, and each
    row's own prediction at the round's position. The update then counts the rows that took part
    only."""
    g = torch.Generator().manual_seed(position)
    nodes = torch.rand(3, 6, generator=g).cumsum(1) * 3
    nodes[:, 0] = 0.0
    took_part = torch.tensor([1.0, 0.0, 1.0])
    cal = cost_aware.Calibration("cpu", sums=(torch.rand(7, 2, generator=g) * 5 + 0.5).tolist())
    width, column = 5, 3
    emitted = torch.zeros(3, width, dtype=torch.long)
    rows = torch.cat([emitted, cost_aware.pack_stats(nodes, took_part, cal.sums, width)]).tolist()
    stats = cost_aware.unpack_stats(rows[3:], 6, 3, column, position)
    want = cal.expected_tokens(nodes) * took_part[:, None]
    close = dict(rtol=1e-6, atol=1e-6)  # float32 values sent exactly, calibrated in float64
    torch.testing.assert_close(torch.tensor(stats.per_row), want, **close)
    torch.testing.assert_close(torch.tensor(stats.expected), want.sum(0), **close)
    assert stats.live == 2
    torch.testing.assert_close(torch.tensor(stats.predicted),
                               cal.expected_tokens(nodes[:, column], position), **close)
    before = cal.sums.clone()
    cal.update(nodes[:, column], torch.tensor([3, 0, 1]), position, took_part)
    obs = (3 - 1) + (1 - 1)  # accepted nodes of rows 0 and 2 (row 1 took no part)
    pred = float(nodes[0, column] + nodes[2, column])
    assert cal.sums[position].tolist() == pytest.approx(
        (before[position] * cal.decay + torch.tensor([obs, pred])).tolist())
    others = [p for p in range(cal.POSITIONS) if p != position]
    assert torch.equal(cal.sums[others], before[others])


def test_calibrated_prediction_matches_observed_tokens_on_held_out_prompts():
    """The embedded pair on held-out prompts, trees of 16 every round: after one generation to
    learn the calibration, the calibrated predicted tokens per round of the next generations
    are within 10% of the observed ones (the drafter alone is over- or under-confident)."""
    target, drafter, tokenizer = embedded.load()
    prompts = [tokenizer(t, return_tensors="pt").input_ids for t in embedded.heldout_prompts(5)]
    prior, first, predicted, observed = None, None, [], []
    for ids in prompts:
        policy = cost_aware.FixedBucket(16, prior=prior)
        r = generate(target, drafter, ids, 64, budget="auto", policy=policy)
        prior = policy.learned
        if first is None:
            first = r
            continue
        predicted += r.predicted_lengths
        observed += r.acceptance_lengths
    mean_p, mean_o = sum(predicted) / len(predicted), sum(observed) / len(observed)
    first_p = sum(first.predicted_lengths) / len(first.predicted_lengths)
    first_o = sum(first.acceptance_lengths) / len(first.acceptance_lengths)
    print(f"predicted {mean_p:.3f} vs observed {mean_o:.3f} tokens per round (the first "
          f"generation, from an uncalibrated start: {first_p:.3f} vs {first_o:.3f})")
    assert abs(mean_p - mean_o) <= 0.1 * mean_o


def test_a_size_measured_slower_makes_relatively_dearer_sizes_plain(tmp_path, monkeypatch):
    """Drafting generations measured slower than autoregressive decoding at one batch size
    (plain_evidence requests) make another batch size plain from its first generation where no
    tree costs relatively more at the first size than at the new one (a request's expected gain
    does not depend on the batch size); not where some tree is relatively cheaper, not at batch
    1, not on thinner evidence or a measured gain, and not once the new size has evidence of
    its own."""
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path))
    target, drafter = tiny_target(seed=3), tiny_drafter()
    pair = profile({0: 10.0, 4: 20.0, 8: 22.0, 16: 25.0, 32: 40.0, 64: 80.0}, batch=2)
    three = profile({0: 11.0, 4: 24.0, 8: 27.0, 16: 33.0, 32: 55.0, 64: 110.0}, batch=3)

    def drafting_generation(speedup):  # a generation of the auto loop at batch 2, as measured
        policy = cost_aware.auto_policy(target, drafter, 2, pair)
        policy.start(2, drafter.block_size - 1, "cpu")
        policy.choices = [4] * policy.learn_min_rounds
        policy.measured_ms = [100.0 * speedup, 100.0]  # plain decoding's time, this one's
        policy.finish([1.0, 1.0])
        cost_aware.remember(policy)
        return policy.learned

    assert drafting_generation(0.8)["relative_costs"] == [1.0, 2.0, 2.2, 2.5, 4.0, 8.0]
    fresh = cost_aware.auto_policy(target, drafter, 3, three)
    assert not fresh.plain_autoregressive(3, 15)  # 2 requests learned from: too few
    assert drafting_generation(0.8)["evidence_requests"] == 4
    assert not cost_aware.auto_policy(target, drafter, 3, three).plain_autoregressive(3, 15)
    for _ in range(2):
        learned = drafting_generation(0.8)
    assert learned["evidence_requests"] == 8 and learned["measured_speedup"] < 1.0
    new = cost_aware.auto_policy(target, drafter, 3, three)
    assert new.other_sizes[2]["measured_speedup"] == learned["measured_speedup"]
    assert new.plain_autoregressive(3, 15) and new.plain_reason.startswith("measured at batch 2")
    truths = [greedy_reference(target, torch.tensor([p]), 12) for p in PROMPTS[:3]]
    results = generate_batch(target, drafter, PROMPTS[:3], 12, budget="auto", policy=new)
    assert [r.tokens for r in results] == truths
    assert set(new.choices) == {0} and set(new.reasons) == {new.plain_reason}
    assert new.learned["plain_runs"] == 1
    assert cost_aware.auto_policy(target, drafter, 3, three).plain_autoregressive(3, 15)
    # Tree 4 relatively cheaper at the new size (2.0x an autoregressive round at batch 2).
    cheaper = profile({**three.round_ms, 4: 21.0}, batch=3)
    assert not cost_aware.auto_policy(target, drafter, 3, cheaper).plain_autoregressive(3, 15)
    alone = profile({k: v / 2 for k, v in three.round_ms.items()}, batch=1)
    assert not cost_aware.auto_policy(target, drafter, 1, alone).plain_autoregressive(1, 15)
    # The new size's own evidence decides once it has it: drafting measured to pay there.
    own = cost_aware.auto_policy(target, drafter, 3, three)
    own.prior.update(evidence_requests=9, measured_speedup=1.2)
    assert not own.plain_autoregressive(3, 15)
    # Drafting measured to pay at batch 2 after all: no longer a reason elsewhere.
    for _ in range(4):
        drafting_generation(1.5)
    assert not cost_aware.auto_policy(target, drafter, 3, three).plain_autoregressive(3, 15)


def test_when_a_whole_generation_runs_plain_autoregressive():
    """At batch 1 weak learned estimates do not switch the drafter off for a generation (a
    request's gains swing with its prompt): it starts autoregressive and probes after
    probe_after rounds. At batch >= 2 they do (a batch's estimate averages its requests) once
    plain_evidence requests were learned from, and every REFRESH_AFTER-th such generation
    drafts again (a re-check, judged on its own measured speed-up). Costs at which no tree
    could pay even with every node accepted — as profiled, or as earlier generations measured
    them — make any generation plain."""
    weak = {"expected_per_request": [1.0, 1.1, 1.1, 1.2, 1.2, 1.2], "calibration": [1.0, 2.0],
            "evidence_requests": 8}
    target, drafter = tiny_target(seed=3), tiny_drafter()
    truths = [greedy_reference(target, torch.tensor([p]), 24) for p in PROMPTS[:2]]
    alone = profile({0: 10.0, 4: 20.0, 8: 22.0, 16: 25.0, 32: 40.0, 64: 80.0}, batch=1)
    policy = cost_aware.AutoBudget(alone, prior=weak, learn_costs=False)
    assert not policy.plain_autoregressive(1, drafter.block_size - 1)
    results = generate_batch(target, drafter, PROMPTS[:1], 24, budget="auto", policy=policy)
    assert [r.tokens for r in results] == truths[:1]
    assert policy.choices[: policy.probe_after] == [0] * policy.probe_after
    assert policy.choices[policy.probe_after] > 0 and policy.reasons[policy.probe_after] == "probe"
    pair = profile(alone.round_ms, batch=2)
    unproven = {**weak, "evidence_requests": 6}  # three batches of 2 learned from: too few
    assert not cost_aware.AutoBudget(pair, prior=unproven).plain_autoregressive(2, 15)
    plain = cost_aware.AutoBudget(pair, prior=weak)
    assert plain.plain_autoregressive(2, 15)
    results = generate_batch(target, drafter, PROMPTS[:2], 16, budget="auto", policy=plain)
    assert [r.tokens for r in results] == [t[:16] for t in truths]
    assert set(results[0].round_budgets) == {0} and set(plain.choices) == {0}
    assert set(plain.reasons) == {"learned expected gains: no tree comes close to paying"}
    assert plain.learned["plain_runs"] == 1 and "autoregressive rounds in" in plain.explain()
    due = {**weak, "plain_runs": cost_aware.AutoBudget.REFRESH_AFTER}
    assert not cost_aware.AutoBudget(pair, prior=due).plain_autoregressive(2, 15)
    # The re-check is a drafting generation, its rounds chosen as any's: here trees are dear
    # and the learned gains weak, so it decodes autoregressively and probes after probe_after
    # rounds, losslessly.
    recheck = cost_aware.AutoBudget(pair, prior=due, learn_costs=False)
    assert not recheck.plain_autoregressive(2, 15) and recheck.rechecking
    results = generate_batch(target, drafter, PROMPTS[:2], 16, budget="auto", policy=recheck)
    assert [r.tokens for r in results] == [t[:16] for t in truths]
    assert recheck.choices[: recheck.probe_after] == [0] * recheck.probe_after
    assert recheck.reasons[recheck.probe_after] == "probe"
    assert "plain_runs" not in recheck.learned
    # Nothing measured (learn_costs off): the plain generations before the next one double.
    doubled = 2 * cost_aware.AutoBudget.REFRESH_AFTER
    assert recheck.learned["refresh_after"] == doubled
    assert cost_aware.AutoBudget(pair, prior=recheck.learned).plain_autoregressive(2, 15)
    waiting = {**recheck.learned, "plain_runs": doubled - 1}
    assert cost_aware.AutoBudget(pair, prior=waiting).plain_autoregressive(2, 15)
    again = cost_aware.AutoBudget(pair, prior={**waiting, "plain_runs": doubled})
    assert not again.plain_autoregressive(2, 15) and again.rechecking
    capped = cost_aware.AutoBudget(pair, prior={
        **waiting, "plain_runs": cost_aware.AutoBudget.REFRESH_MAX,
        "refresh_after": cost_aware.AutoBudget.REFRESH_MAX})
    assert not capped.plain_autoregressive(2, 15) and capped.rechecking
    capped.start(2, 15, "cpu")
    assert capped.finish([1.0, 1.0])["refresh_after"] == cost_aware.AutoBudget.REFRESH_MAX

    # A batch size plain on its measured outcome: the re-check's own measured speed-up replaces
    # the learned one (not averaged with it). 20 rounds at batch 2 of an autoregressive round of
    # 10 ms (the profile's; no round timed): plain decoding 200 ms.
    good_gains = {"expected_per_request": [1.0, 3.0, 3.5, 4.0, 4.2, 4.4], "evidence_requests": 8,
                  "measured_ms": [100.0, 110.0], "measured_speedup": 100 / 110,
                  "plain_runs": cost_aware.AutoBudget.REFRESH_AFTER}

    def judged(loop_ms, drafted="best expected tokens/s"):
        """A re-check of learn_min_rounds rounds, the middle one a tree 8 chosen for `drafted`
        (every other round autoregressive)."""
        policy = cost_aware.AutoBudget(pair, prior=good_gains)
        assert not policy.plain_autoregressive(2, 15) and policy.rechecking
        policy.start(2, 15, "cpu")
        rounds = policy.learn_min_rounds
        policy.choices = [8 if i == rounds // 2 else 0 for i in range(rounds)]
        policy.reasons = [drafted if i == rounds // 2 else "best expected tokens/s"
                          for i in range(rounds)]
        policy.observe_generation(loop_ms, [20, 20])
        return policy.finish([1.0, 1.0])

    slower = judged(250.0)
    assert slower["measured_speedup"] == pytest.approx(0.8)
    assert slower["refresh_after"] == doubled
    assert cost_aware.AutoBudget(pair, prior=slower).plain_autoregressive(2, 15)
    faster = judged(160.0)
    assert faster["measured_speedup"] == pytest.approx(1.25)
    assert "refresh_after" not in faster  # back to REFRESH_AFTER
    assert not cost_aware.AutoBudget(pair, prior=faster).plain_autoregressive(2, 15)
    # Faster, but only a probe drafted: its speed-up is plain rounds' (noise), not drafting's.
    probed = judged(160.0, drafted="probe")
    assert probed["measured_speedup"] == pytest.approx(1.25)
    assert probed["refresh_after"] == doubled
    # A re-check where trees pay (priced below an autoregressive round) drafts from its start.
    cheap = profile({0: 10.0, 4: 1.0, 8: 1.1, 16: 1.2, 32: 1.3, 64: 1.4}, batch=2)
    paying = cost_aware.AutoBudget(cheap, learn_costs=False, prior={
        **due, "measured_speedup": 0.9, "expected_per_request": None})
    assert not paying.plain_autoregressive(2, 15) and paying.rechecking
    results = generate_batch(target, drafter, PROMPTS[:2], 24, budget="auto", policy=paying)
    assert [r.tokens for r in results] == truths
    assert paying.choices[0] > 0 and sum(b > 0 for b in paying.choices) > 1
    never = profile({0: 1.0, 4: 9.0, 8: 12.0, 16: 20.0, 32: 40.0, 64: 80.0}, batch=1)
    assert cost_aware.AutoBudget(never).plain_autoregressive(1, 15)
    # What earlier generations measured counts: trees profiled as paying, measured at 10x.
    measured = {0: 1.0, 1: 10.0}  # kinds of round: autoregressive, drafted
    learned = cost_aware.AutoBudget(alone, prior={"cost_ratios": {1: measured}})
    assert learned.plain_autoregressive(1, 15)


def test_tree_buckets_share_one_measured_cost_ratio():
    """A slow spell while tree 16 runs must not make it look dear for good: the ratio is shared,
    so rounds of tree 32 measured at their profile bring tree 16's cost back too, and the
    profile's order of the tree buckets holds whatever was measured (with a ratio per bucket,
    16 stayed at twice its profile once 32 ran instead)."""
    costs = profile({0: 10.0, 4: 12.0, 8: 13.0, 16: 14.0, 32: 15.0, 64: 16.0})
    policy = cost_aware.AutoBudget(costs, cost_smoothing=0.5)
    policy.start(1, 15, "cpu")
    for _ in range(8):
        policy.observe_cost(16, 28.0)  # a slow spell: twice the profile
    assert policy.cost(32) == pytest.approx(30.0, rel=0.01)
    for _ in range(8):
        policy.observe_cost(32, 15.0)
    assert policy.cost(16) == pytest.approx(14.0, rel=0.01)
    assert [policy.cost(b) for b in (4, 8, 16, 32, 64)] == sorted(
        policy.cost(b) for b in (4, 8, 16, 32, 64))


def test_a_kind_of_round_that_does_not_run_follows_the_drift_of_the_other():
    """The machine's speed drifts for every round alike: while only drafted rounds run (drafting
    pays), the autoregressive rounds' cost — what plain decoding is priced at, in the choice
    and in the measured speed-up — follows them instead of staying where a slow spell left it
    (most of the way: a lasting deviation of one kind is mostly, not wholly, the machine's);
    both kinds' own times, interleaved, settle how they stand to each other."""
    costs = profile({0: 10.0, 4: 12.0, 8: 13.0, 16: 14.0, 32: 15.0, 64: 16.0})
    policy = cost_aware.AutoBudget(costs, cost_smoothing=0.5)
    policy.start(1, 15, "cpu")
    policy.observe_cost(0, 20.0)  # a slow spell: twice the profile
    policy.observe_cost(16, 28.0)
    for _ in range(12):
        policy.observe_cost(16, 14.0)  # the spell is over; only drafted rounds run
    assert policy.cost(16) == pytest.approx(14.0, rel=0.01)
    assert 10.0 <= policy.cost(0) < 11.0  # not the spell's 20
    # Both kinds interleaved, autoregressive rounds dearer than the profile's relation.
    for _ in range(80):
        policy.observe_cost(0, 12.0)
        policy.observe_cost(16, 14.0)
    assert policy.cost(0) == pytest.approx(12.0, rel=0.02)
    assert policy.cost(16) == pytest.approx(14.0, rel=0.02)
    # ... and that relation holds through the next drift.
    for _ in range(12):
        policy.observe_cost(32, 30.0)
    assert policy.cost(32) == pytest.approx(30.0, rel=0.01)
    assert 22.0 <= policy.cost(0) <= 24.0


def test_one_very_slow_round_moves_the_costs_a_bounded_step():
    """A round measured far off its price (a collection pause, a page fault) moves the prices by
    at most half its cost_smoothing, both kinds alike; a lasting change still takes a few rounds."""
    costs = profile({0: 10.0, 4: 12.0, 8: 13.0, 16: 14.0, 32: 15.0, 64: 16.0})
    policy = cost_aware.AutoBudget(costs)
    policy.start(1, 15, "cpu")
    policy.observe_cost(0, 10.0)
    policy.observe_cost(16, 14.0)
    policy.observe_cost(16, 140.0)  # ten times its price
    step = 1 + 0.5 * policy.cost_smoothing
    assert policy.cost(0) == pytest.approx(10.0 * step)
    assert policy.cost(16) == pytest.approx(14.0 * step * (1 + 0.5 * policy.relation_smoothing))
    policy.observe_cost(0, 1.0)  # a tenth
    down = (1 - 0.5 * policy.cost_smoothing) * (1 - 0.5 * policy.relation_smoothing)
    assert policy.cost(0) == pytest.approx(10.0 * step * down)
    for _ in range(12):
        policy.observe_cost(16, 28.0)  # the machine at half speed
    assert policy.cost(16) == pytest.approx(28.0, rel=0.02)


def test_a_shrinking_batch_is_priced_with_the_smaller_batch_costs():
    """Finished requests leave the batch: the policy switches to the smaller batch size's cost
    profile (trees that did not pay at batch 4 pay at batch 1); a size without a profile keeps
    the current one."""
    at4 = profile({0: 10.0, 4: 60.0, 8: 70.0, 16: 80.0, 32: 90.0, 64: 100.0}, batch=4)
    at1 = profile({0: 10.0, 4: 11.0, 8: 12.0, 16: 13.0, 32: 14.0, 64: 15.0}, batch=1)
    policy = cost_aware.AutoBudget(at4, smaller={1: at1})
    stats = cost_aware.RoundStats(expected=[4.0, 8.0, 9.0, 10.0, 10.0, 10.0], predicted=[2.5] * 4,
                                  live=4)
    policy.start(4, 15, "cpu")
    policy.choose()
    policy.observe(stats)
    assert policy.choose() == 0  # 10 tokens in 80 ms < 4 tokens in 10 ms
    policy.resize(2)  # no profile of batch 2: the batch-4 costs stay
    assert policy.profile is at4 and policy.choose() == 0
    policy.observe_cost(0, 20.0)  # measured at batch 4: twice the profile
    policy.resize(1)
    assert policy.profile is at1
    assert policy.cost(0) == 20.0 and policy.cost(4) == 22.0  # the batch-4 ratio stands in
    policy.observe_cost(0, 10.0)  # at batch 1, the profile's: the ratio moves towards 1
    assert 15.0 < policy.cost(0) < 20.0
    policy.cost_ratios[1] = {}
    assert policy.choose() == 4  # per request: 2 tokens in 11 ms > 1 token in 10 ms


def test_auto_policy_gathers_the_smaller_batch_profiles(tmp_path, monkeypatch):
    """auto_policy: with no profile given, the batch's and every smaller power of two's profile
    are measured (or read from the cache); given profiles are used by their batch size, a single
    one for the batch itself with the smaller sizes from the cache where measured."""
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path))
    target, drafter = tiny_target(seed=3), tiny_drafter()
    assert cost_aware.shrink_sizes(1) == [] and cost_aware.shrink_sizes(4) == [1, 2]
    assert cost_aware.shrink_sizes(5) == [1, 2, 4] and cost_aware.shrink_sizes(32) == [1, 2, 4, 8, 16]
    measured = []

    def fake_calibrate(target, drafter, batch, run, **kwargs):
        measured.append(batch)
        return profile({b: float(batch + b) for b in cost_aware.BUCKETS}, batch=batch)

    monkeypatch.setattr(cost_aware.policy_setup, "calibrate", fake_calibrate)
    policy = cost_aware.auto_policy(target, drafter, 5, run=calibration_run(target, drafter))
    assert measured == [5, 1, 2, 4]
    assert policy.profile.batch == 5 and sorted(policy.smaller) == [1, 2, 4]
    at2 = profile({b: 2.0 + b for b in cost_aware.BUCKETS}, batch=2)
    at4 = profile({b: 4.0 + b for b in cost_aware.BUCKETS}, batch=4)
    listed = cost_aware.auto_policy(target, drafter, 4, [at4, at2])
    assert listed.profile is at4 and listed.smaller == {2: at2}
    with pytest.raises(ValueError, match="no cost profile of batch 3"):
        cost_aware.auto_policy(target, drafter, 3, [at4, at2])
    cached = profile({b: 1.0 + b for b in cost_aware.BUCKETS}, batch=1)
    cached = cost_aware.CostProfile(**{**cached.to_json(), "round_ms": cached.round_ms,
                                       **cost_aware.profile_identity(target, drafter)})
    cost_aware.save_profile(cached)
    single = cost_aware.auto_policy(target, drafter, 4, at4)
    assert single.profile is at4 and single.smaller == {1: cached}
    assert measured == [5, 1, 2, 4]  # nothing measured when profiles are given
    assert single.learn_costs  # one process: round times correct the costs
    monkeypatch.setattr(cost_aware.policy_setup, "world_size", lambda: 2)
    assert not cost_aware.auto_policy(target, drafter, 4, at4).learn_costs  # tensor parallel


def test_calibration_times_the_warm_rounds_of_the_whole_batch(monkeypatch, tmp_path):
    """calibrate times rounds of the whole batch (its requests share one prompt, so none leaves
    early) after their warm-up (the rounds the loop reports to observe_cost: of the two
    autoregressive rounds of a cycle the second, after an autoregressive one), every bucket
    cycled round by round in one generation per repeat, and a bucket's cost is the median of
    its rounds over every repeat; with three cycles or more in which every bucket was timed,
    the buckets (autoregressive rounds among them) are priced within those cycles (each one's
    share of its cycle's mean, median over the cycles, times the median cycle mean)."""
    monkeypatch.setenv("DDTREE_CACHE_DIR", str(tmp_path))
    import ddtree.generate.loop as loop

    sizes, timed, cycles, choices, real = [], {}, [], [], loop.generate_batch

    def recording(*args, **kwargs):
        out = real(*args, **kwargs)
        sizes.extend(s for r in out for s in r.round_batch_sizes)
        policy = kwargs["policy"]
        choices.append(list(policy.choices))
        # No bucket timed twice in a cycle: of its two autoregressive rounds one is timed.
        assert len(policy.round_ms) == sum(len(c) for c in policy.cycles.values())
        for bucket, ms in policy.times.items():
            timed.setdefault(bucket, []).extend(ms)
        cycles.extend(c for c in policy.cycles.values() if len(c) == len(set(policy.cycle)))
        return out

    monkeypatch.setattr(loop, "generate_batch", recording)
    for buckets in ((0, 16), cost_aware.BUCKETS, (4, 16)):
        sizes.clear(), timed.clear(), cycles.clear(), choices.clear()
        measured = calibrate(tiny_target(seed=3), tiny_drafter(), 3, buckets=buckets,
                             rounds=2, repeats=2, progress=False, use_cache=False)
        trees = [b for b in buckets if b]
        plain = [0, 0] if 0 in buckets else []
        assert len(choices) == 2  # one generation a repeat, the trees' order alternating
        for repeat, rounds in enumerate(choices):
            cycle = plain + (trees if repeat % 2 == 0 else trees[::-1])
            assert rounds == [cycle[i % len(cycle)] for i in range(len(rounds))]
        assert sizes and set(sizes) == {3}
        assert set(timed) == set(buckets) and all(timed.values())
        assert len(cycles) >= 3  # the tiny pair's short drafts give many cycles
        means = [sum(c.values()) / len(c) for c in cycles]
        level = statistics.median(means)
        shares = {b: level * statistics.median(c[b] / m for c, m in zip(cycles, means))
                  for b in buckets}
        fit = cost_aware.non_decreasing([shares[b] for b in trees], [len(cycles)] * len(trees))
        assert [measured.round_ms[b] for b in trees] == pytest.approx(fit)
        if plain:
            assert measured.round_ms[0] == pytest.approx(shares[0])


def test_tree_buckets_are_priced_within_each_cycle():
    """cycle_relative_costs: a machine whose speed changes between cycles (each cycle scaled as
    a whole) leaves the buckets' relation exact, at the median cycle's level; one round three
    times as slow moves it little."""
    true = {4: 10.0, 16: 11.0, 64: 12.0}
    speeds = [1.0, 1.5, 0.9, 2.0, 1.1]
    cycles = [{b: ms * s for b, ms in true.items()} for s in speeds]
    costs = cost_aware.cycle_relative_costs(cycles, [4, 16, 64])
    assert costs == pytest.approx({4: 11.0, 16: 12.1, 64: 13.2})  # level: the cycle at 1.1x
    cycles[2] = {**cycles[2], 64: 3 * cycles[2][64]}  # one round three times as slow
    costs = cost_aware.cycle_relative_costs(cycles, [4, 16, 64])
    assert costs[64] / costs[16] == pytest.approx(12 / 11, rel=0.02)


def test_calibration_cycles_the_tree_buckets_round_by_round():
    """CyclingBuckets: round i verifies buckets[i mod n] (the loop follows it), and the times the
    loop reports land under their bucket."""
    target, drafter = tiny_target(seed=3), tiny_drafter()
    policy = cost_aware.CyclingBuckets([4, 16, 64])
    results = generate_batch(target, drafter, PROMPTS[:1], 20, budget="auto", policy=policy)
    rounds = results[0].round_budgets
    assert rounds == [[4, 16, 64][i % 3] for i in range(len(rounds))] and len(rounds) > 6
    assert sum(map(len, policy.times.values())) == len(policy.round_ms) > 0
    assert all(policy.times[b] for b in (4, 16, 64))
    # Per cycle: round i is in cycle i // 3, each time under its cycle and bucket.
    assert sorted(ms for c in policy.cycles.values() for ms in c.values()) == \
        sorted(policy.round_ms)
    assert all(set(c) <= {4, 16, 64} for c in policy.cycles.values())
    assert sum(len(c) == 3 for c in policy.cycles.values()) >= 1


def test_tree_costs_are_fitted_non_decreasing():
    """Pool adjacent violators, weighted: an inversion is replaced by the weighted mean of the
    run; an increasing sequence is kept as is."""
    fit = cost_aware.non_decreasing
    assert fit([1.0, 2.0, 3.0], [1, 1, 1]) == [1.0, 2.0, 3.0]
    assert fit([16.1, 17.9, 19.8, 19.1, 32.0], [1, 1, 1, 1, 1]) == \
        pytest.approx([16.1, 17.9, 19.45, 19.45, 32.0])
    assert fit([5.0, 3.0, 1.0], [1, 1, 2]) == pytest.approx([2.5, 2.5, 2.5])
    assert fit([4.0, 2.0], [3, 1]) == pytest.approx([3.5, 3.5])
    assert fit([2.0, 1.0, 9.0, 3.0], [1, 1, 1, 1]) == pytest.approx([1.5, 1.5, 6.0, 6.0])


def test_round_costs_follow_the_measured_round_times():
    """observe_cost: a bucket's cost becomes the profile's times a running ratio of measured to
    profiled time, one ratio for autoregressive rounds and one for all tree buckets (before a
    kind has run, the other kind's); the choice follows (trees profiled as paying, measured at
    about 4x their profile, stop paying), and the next generation starts from the measured
    costs. The loop reports warm rounds only: every reported bucket ran before at that batch
    size."""
    costs = profile({0: 10.0, 4: 12.0, 8: 13.0, 16: 14.0, 32: 15.0, 64: 16.0})
    policy = cost_aware.AutoBudget(costs, cost_smoothing=0.5)
    policy.start(1, 15, "cpu")
    assert policy.cost(16) == 14.0 and policy.choose() > 0
    policy.observe(cost_aware.RoundStats(expected=[1.0, 1.8, 2.0, 2.2, 2.3, 2.4],
                                         predicted=[2.2], live=1))
    policy.observe_cost(0, 12.0)
    assert policy.cost(0) == pytest.approx(12.0) and policy.cost(16) == pytest.approx(14.0 * 1.2)
    for _ in range(6):
        policy.observe_cost(16, 56.0)
    assert policy.cost(16) == pytest.approx(56.0, rel=0.03)
    assert policy.cost(64) == pytest.approx(16.0 * policy.cost_ratios[1][1])
    assert policy.cost(64) / policy.cost(16) == pytest.approx(16.0 / 14.0)
    for _ in range(6):
        policy.observe_cost(4, 48.0)
    assert policy.choose() == 0
    after = cost_aware.AutoBudget(costs, prior=policy.finish([1.0, 1.0]))  # the next generation
    after.start(1, 15, "cpu")
    assert after.cost(16) == policy.cost(16) and after.cost(0) == policy.cost(0)
    fixed = cost_aware.AutoBudget(costs, learn_costs=False)
    fixed.start(1, 15, "cpu")
    fixed.observe_cost(16, 42.0)
    assert fixed.cost(16) == 14.0
    target, drafter = tiny_target(seed=3), tiny_drafter()
    seen = []

    class Recording(ScriptedBudgets):
        def observe_cost(self, bucket, ms):
            seen.append((len(self.choices) - 1, bucket, ms))

    rec = Recording([0, 4, 4, 0, 0, 16, 4, 16, 16, 0, 0])
    generate_batch(target, drafter, PROMPTS[:2], 24, budget="auto", policy=rec)
    assert seen and all(ms > 0 for _, _, ms in seen)
    for i, bucket, _ in seen:
        assert i > 0 and bucket in rec.choices[:i]
        assert bucket == 0 or sum(1 for b in rec.choices[: i + 1] if b) > 2
        # An autoregressive round right after a drafted one also writes the drafter's context:
        # not a plain decoding step's time.
        assert bucket or rec.choices[i - 1] == 0
    assert (4, 0) in [(i, b) for i, b, _ in seen] and (3, 0) not in [(i, b) for i, b, _ in seen]
