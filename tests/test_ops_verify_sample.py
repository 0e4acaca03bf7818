"""verify_sample: lossless (chi-square against the exact target-sampling distribution),
reproducible counters, emulated kernel == CPU, filtering semantics, opcheck, bad input."""
import pytest
import torch

import ddtree
from ddtree import _C
from ddtree.ops import reference
from helpers import KERNEL_BACKENDS, kernel_device


def small_tree(seed=0, vocab=5, depth=3, k=3, budget=12):
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(1, depth, vocab, generator=g) * 1.5, -1)
    values, ids = lp.sort(-1, descending=True)
    tree = ddtree.build_tree(values[..., :k].contiguous(), ids[..., :k].contiguous(),
                             torch.tensor([0]), budget)
    logits = torch.randn(1, budget + 1, vocab, generator=g) * 1.5
    return tree, logits


def repeat_tree(tree, logits, batch):
    return ddtree.DraftTree(*(t.expand(batch, *t.shape[1:]).contiguous() for t in tree)), \
        logits.expand(batch, -1, -1).contiguous()


def emitted_sequences(verdict, tree):
    out = []
    for b in range(verdict.accept_len.shape[0]):
        path = verdict.accepted[b, 1: int(verdict.accept_len[b])].tolist()
        out.append(tuple(int(tree.node_tokens[b, i]) for i in path) + (int(verdict.bonus[b]),))
    return out


def chi_square_pvalue(counts, expected_probs, draws):
    """Pearson chi-square; cells with expected count < 5 are pooled."""
    cells, pooled_obs, pooled_exp = [], 0, 0.0
    for key, prob in expected_probs.items():
        exp = prob * draws
        if exp < 5:
            pooled_obs += counts.get(key, 0)
            pooled_exp += exp
        else:
            cells.append((counts.get(key, 0), exp))
    if pooled_exp > 0:
        cells.append((pooled_obs, pooled_exp))
    assert sum(counts.get(k, 0) for k in counts if k not in expected_probs) == 0, "impossible output"
    stat = sum((o - e) ** 2 / e for o, e in cells)
    dof = len(cells) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


SETTINGS = [dict(temperature=1.0), dict(temperature=0.8, top_k=3), dict(temperature=1.2, top_p=0.7),
            dict(temperature=1.0, top_k=4, top_p=0.9)]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
def test_emitted_tokens_are_distributed_as_target_sampling(settings):
    tree, logits = small_tree()
    draws = 6000
    trees, rows = repeat_tree(tree, logits, draws)
    verdict = ddtree.verify_sample(trees, rows, 3, seed=torch.arange(draws) + 1234, **settings)
    counts = {}
    for seq in emitted_sequences(verdict, trees):
        counts[seq] = counts.get(seq, 0) + 1
    expected = reference.sample_walk_distribution(tree.node_tokens[0], tree.parents[0],
                                                  tree.num_nodes[0], logits[0], 3, **settings)
    assert abs(sum(expected.values()) - 1) < 1e-9
    assert len(expected) >= 4  # several outcomes, long paths among them
    # Fixed seeds: deterministic; a correct sampler fails this with probability 1e-3.
    assert chi_square_pvalue(counts, expected, draws) > 1e-3


def test_a_biased_sampler_is_detected_by_the_same_statistic():
    """The test has power: sampling at the wrong temperature is rejected."""
    tree, logits = small_tree()
    draws = 6000
    trees, rows = repeat_tree(tree, logits, draws)
    verdict = ddtree.verify_sample(trees, rows, 3, temperature=1.3, seed=torch.arange(draws))
    counts = {}
    for seq in emitted_sequences(verdict, trees):
        counts[seq] = counts.get(seq, 0) + 1
    expected = reference.sample_walk_distribution(tree.node_tokens[0], tree.parents[0],
                                                  tree.num_nodes[0], logits[0], 3, 1.0)
    assert chi_square_pvalue(counts, expected, draws) < 1e-6


def test_same_seed_and_offset_reproduce_and_offset_changes_the_draw():
    tree, logits = small_tree(1)
    trees, rows = repeat_tree(tree, logits, 64)
    a = ddtree.verify_sample(trees, rows, 3, seed=7, offset=3)
    b = ddtree.verify_sample(trees, rows, 3, seed=7, offset=3)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    # Different requests (same seed) draw differently; a new offset gives a new draw.
    assert len(set(emitted_sequences(a, trees))) > 1
    c = ddtree.verify_sample(trees, rows, 3, seed=7, offset=4)
    assert emitted_sequences(a, trees) != emitted_sequences(c, trees)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("settings", SETTINGS + [dict(temperature=0.0)],
                         ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items()))
@pytest.mark.parametrize("b", [1, 6, 64])  # rows drawn at once (small batches) or on the walk
def test_kernel_equals_cpu_for_the_same_counters(backend, settings, b):
    tree, logits = small_tree(2, vocab=40, depth=4, k=4, budget=20)
    trees, rows = repeat_tree(tree, logits, b)
    rows = rows + torch.randn(rows.shape, generator=torch.Generator().manual_seed(3))
    args = dict(seed=torch.arange(b) * 11, offset=torch.full((b,), 5), **settings)
    expected = ddtree.verify_sample(trees, rows, 4, **args)
    dev = kernel_device(backend)
    ops = torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree
    per = ddtree.ops.tree._per_request
    got = ops.verify_sample(*(t.to(dev) for t in (trees.node_tokens, trees.first_child,
                                                   trees.next_sibling, trees.num_nodes, rows)),
                            per(settings.get("temperature", 1.0), b, torch.float32, dev),
                            per(settings.get("top_k", 0), b, torch.int64, dev),
                            per(settings.get("top_p", 1.0), b, torch.float32, dev),
                            args["seed"].to(dev), args["offset"].to(dev), 4)
    # Every float a decision depends on is correctly rounded (x / T, exp): the GPU's fast-math
    # build draws the same tokens as the CPU.
    assert all(torch.equal(x.cpu(), y) for x, y in zip(got, expected))


def test_greedy_setting_matches_verify_greedy():
    tree, logits = small_tree(4, vocab=30, budget=25)
    trees, rows = repeat_tree(tree, logits, 3)
    sampled = ddtree.verify_sample(trees, rows, 3, temperature=0.0)
    greedy = ddtree.verify_greedy(trees, rows.argmax(-1), 3)
    assert all(torch.equal(x, y) for x, y in zip(sampled, greedy))


def test_filtering_semantics_of_the_reference():
    x = torch.tensor([2.0, 1.0, 1.0, 0.0, -1.0])
    p = reference.filtered_probs(x, 1.0, top_k=2)  # ties at the k-th value are kept
    assert (p > 0).tolist() == [True, True, True, False, False]
    full = torch.softmax(x.double(), 0)
    p = reference.filtered_probs(x, 1.0, top_p=1 - float(full[4]) - 1e-12)
    assert (p > 0).tolist() == [True, True, True, True, False]
    p = reference.filtered_probs(x, 0.0)
    assert p.tolist() == [1.0, 0, 0, 0, 0]


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    tree, logits = small_tree()
    b = 1
    args = (tree.node_tokens, tree.first_child, tree.next_sibling, tree.num_nodes, logits,
            torch.ones(b), torch.zeros(b, dtype=torch.long), torch.ones(b),
            torch.zeros(b, dtype=torch.long), torch.zeros(b, dtype=torch.long), 3)
    torch.library.opcheck(getattr(torch.ops, namespace).verify_sample.default, args)


def test_bad_input():
    tree, logits = small_tree()
    with pytest.raises(RuntimeError, match=r"target_logits must have shape \[B, N, V\]"):
        ddtree.verify_sample(tree, logits[:, :3], 3)
    with pytest.raises(RuntimeError, match="target_logits must be float32, bfloat16 or float16"):
        ddtree.verify_sample(tree, logits.double(), 3)
    with pytest.raises(RuntimeError, match=r"top_p must be in \(0, 1\]"):
        ddtree.verify_sample(tree, logits, 3, top_p=0.0)
    with pytest.raises(RuntimeError, match="top_k must be >= 0"):
        ddtree.verify_sample(tree, logits, 3, top_k=-2)
    with pytest.raises(RuntimeError, match="max_depth must be >= 0"):
        ddtree.verify_sample(tree, logits, -1)
    with pytest.raises(RuntimeError, match=r"temperature must have shape \[B\]"):
        torch.ops.ddtree.verify_sample(tree.node_tokens, tree.first_child, tree.next_sibling,
                                       tree.num_nodes, logits, torch.ones(2),
                                       torch.zeros(1, dtype=torch.long), torch.ones(1),
                                       torch.zeros(1, dtype=torch.long),
                                       torch.zeros(1, dtype=torch.long), 3)


def _exact_weight(e: float) -> int:
    """round(e * 2^44), halves up, in exact rationals (the quantisation core/tree_sample.h states)."""
    from fractions import Fraction
    import math
    if not e > 0:
        return 0
    return math.floor(Fraction(e) * 2 ** 44 + Fraction(1, 2))


def test_token_weights_are_exact_roundings_of_exp_to_multiples_of_2_pow_minus_44():
    import numpy as np
    f32 = lambda x: float(np.float32(x))  # noqa: E731
    edges = [0.0, -0.0, 1.0, f32(np.nextafter(np.float32(1), np.float32(0))), 0.5,
             f32(np.nextafter(np.float32(0.5), np.float32(1))), 2.0 ** -44, 2.0 ** -45,
             f32(np.nextafter(np.float32(2.0 ** -45), np.float32(1))),
             f32(np.nextafter(np.float32(2.0 ** -45), np.float32(0))), 2.0 ** -46, 2.0 ** -126,
             f32(np.float32(1e-40)), 3.0 * 2.0 ** -46, 5.0 * 2.0 ** -47, 1e-10, 0.3]
    g = np.random.default_rng(0)
    randoms = (g.random(4000) * np.exp2(-g.integers(0, 60, 4000).astype(np.float64))).astype(np.float32)
    for e in [f32(x) for x in edges] + [float(x) for x in randoms]:  # the op's e is a float32
        assert _C.quantise_weight(e) == _exact_weight(e), e
    assert _C.quantise_weight(float("nan")) == 0
    assert _C.quantise_weight(-0.25) == 0


@pytest.mark.parametrize("batch, grids", [(1, 2), (6, 1)])
def test_emulated_kernel_draws_rows_at_once_for_small_batches_and_walks_otherwise(batch, grids):
    """Small batches: every row drawn by its own block, then the walks (two launches); larger ones:
    one block per request walks (one launch). Both equal the CPU op."""
    tree, logits = small_tree(5, vocab=40, depth=4, k=4, budget=20)
    trees, rows = repeat_tree(tree, logits, batch)
    rows = rows + torch.randn(rows.shape, generator=torch.Generator().manual_seed(6))
    settings = dict(temperature=0.9, top_k=6, top_p=0.8)
    args = dict(seed=torch.arange(batch) * 7, offset=torch.full((batch,), 3), **settings)
    expected = ddtree.verify_sample(trees, rows, 4, **args)
    per = ddtree.ops.tree._per_request
    before = _C.emulator_grids_run()
    got = torch.ops.ddtree_emu.verify_sample(
        trees.node_tokens, trees.first_child, trees.next_sibling, trees.num_nodes, rows,
        per(0.9, batch, torch.float32, "cpu"), per(6, batch, torch.int64, "cpu"),
        per(0.8, batch, torch.float32, "cpu"), args["seed"], args["offset"], 4)
    assert _C.emulator_grids_run() - before == grids
    assert all(torch.equal(x, y) for x, y in zip(got, expected))


def test_gpu_division_by_the_temperature_equals_the_cpus():
    """The device form of x / T (q = RN(x * RN(1/T)), then an fma correction) equals the correctly
    rounded division for random float32 values over many binades (subnormal results excluded:
    a fast-math GPU flushes them)."""
    g = torch.Generator().manual_seed(7)
    x = (torch.rand(20000, generator=g) - 0.5) * torch.exp2(torch.randint(-20, 20, (20000,), generator=g).float())
    t = torch.rand(20000, generator=g) * torch.exp2(torch.randint(-6, 5, (20000,), generator=g).float()) + 1e-3
    want = x / t  # float32, correctly rounded
    for xi, ti, wi in zip(x.tolist(), t.tolist(), want.tolist()):
        if abs(wi) >= 2.0 ** -126 or wi == 0:
            assert _C.scaled_logit_fma(xi, ti) == wi, (xi, ti)


def test_sample_exp_is_within_two_ulp_of_exp():
    """verify_sample's exp (fma-only, bit-identical across builds) against float64 exp."""
    import math
    import numpy as np
    xs = np.linspace(-87.0, 0.0, 200001, dtype=np.float32).tolist()
    xs += [float(np.float32(x)) for x in (0.0, -1e-8, -0.5, -86.99)]  # the op's x is a float32
    worst = 0.0
    for x in xs:
        got, exact = _C.sample_exp(x), math.exp(x)
        worst = max(worst, abs(got - exact) / float(np.spacing(np.float32(exact))))
    assert worst <= 2.0, worst
    assert _C.sample_exp(0.0) == 1.0
    assert _C.sample_exp(-88.0) == 0.0 and _C.sample_exp(float("nan")) == 0.0
