"""build_tree / verify_greedy / commit_kv_: golden vectors of the published reference, brute-force
optimality, property tests against reference.py, the CUDA kernels emulated (and on a GPU when
present), opcheck, bad input."""
import itertools
import math

import pytest
import torch
from hypothesis import given, settings

import ddtree
from ddtree.ops import reference
from helpers import KERNEL_BACKENDS, cuda_available, draft_inputs, kernel_device

ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def ops_for(backend):
    return torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree


def device_for(backend):
    return "cpu" if backend == "cpu" else kernel_device(backend)


def run(backend, name, *args):
    dev = device_for(backend)
    moved = [a.to(dev) if isinstance(a, torch.Tensor) else a for a in args]
    out = getattr(ops_for(backend), name)(*moved)
    return tuple(t.cpu() for t in out) if isinstance(out, (tuple, list)) else out


def golden_inputs(case, tensors):
    i, budget = case["case"], case["budget"]
    if budget == 0:
        return torch.zeros(1, case["depth"], 0), torch.zeros(1, case["depth"], 0, dtype=torch.int64)
    return tensors[f"case{i}.top_log_probs"][None], tensors[f"case{i}.top_token_ids"][None]


def check_golden_tree(out, row, case, tensors):
    i = case["case"]
    n = int(out[5][row])
    assert n == case["num_nodes"] + 1, f"case {i}"
    assert out[0][row, 0] == case["bonus_token"] + 1000  # the root token we supplied
    assert torch.equal(out[0][row, 1:n], tensors[f"case{i}.node_token_ids"]), f"case {i}"
    assert torch.equal(out[1][row, :n], tensors[f"case{i}.parents"]), f"case {i}"
    assert torch.equal(out[2][row, 1:n], tensors[f"case{i}.node_depths"]), f"case {i}"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_golden_trees_one_request_each(golden, backend):
    cases, tensors = golden
    for case in cases:
        lp, ids = golden_inputs(case, tensors)
        root = torch.tensor([case["bonus_token"] + 1000])
        out = run(backend, "build_tree", lp, ids, root, case["budget"])
        check_golden_tree(out, 0, case, tensors)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_golden_trees_as_one_padded_batch_with_per_request_budgets(golden, backend):
    """All cases in one call: L and K padded with -inf candidates, which never enter a tree."""
    cases, tensors = golden
    depth = max(c["depth"] for c in cases)
    k = max(1, max(golden_inputs(c, tensors)[0].shape[2] for c in cases))
    lp = torch.full((len(cases), depth, k), -math.inf)
    ids = torch.zeros(len(cases), depth, k, dtype=torch.int64)
    for row, case in enumerate(cases):
        one_lp, one_ids = golden_inputs(case, tensors)
        lp[row, : one_lp.shape[1], : one_lp.shape[2]] = one_lp[0]
        ids[row, : one_ids.shape[1], : one_ids.shape[2]] = one_ids[0]
    budgets = torch.tensor([c["budget"] for c in cases])
    roots = torch.tensor([c["bonus_token"] + 1000 for c in cases])
    out = run(backend, "build_tree", lp, ids, roots, int(budgets.max()), budgets)
    for row, case in enumerate(cases):
        check_golden_tree(out, row, case, tensors)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_golden_greedy_walk(golden, backend):
    cases, tensors = golden
    for case in cases:
        i = case["case"]
        lp, ids = golden_inputs(case, tensors)
        tree = run(backend, "build_tree", lp, ids, torch.tensor([case["bonus_token"]]), case["budget"])
        n = tree[0].shape[1]
        target = torch.zeros(1, n, dtype=torch.int64)
        posterior = tensors[f"case{i}.posterior"]
        target[0, : posterior.numel()] = posterior
        accepted, length, bonus = run(backend, "verify_greedy", tree[0], tree[3], tree[4], tree[5],
                                      target, case["depth"])
        gold = tensors[f"case{i}.accepted"]
        assert int(length[0]) == case["accepted_len"] == gold.numel(), f"case {i}"
        assert torch.equal(accepted[0, : gold.numel()], gold), f"case {i}"
        assert (accepted[0, gold.numel():] == -1).all()
        assert int(bonus[0]) == int(posterior[gold[-1]]), f"case {i}"


# ---- optimality (the paper's Prop. 2 on our code) ----

@pytest.mark.parametrize("depth, vocab", [(1, 4), (2, 3), (3, 3), (4, 2), (3, 4)])
def test_tree_is_exactly_the_best_prefixes_brute_force(depth, vocab):
    g = torch.Generator().manual_seed(depth * 10 + vocab)
    logits = torch.randn(depth, vocab, generator=g) * 2
    lp = torch.log_softmax(logits, -1)
    values, ids = lp.sort(-1, descending=True)
    prefixes = []
    for length in range(1, depth + 1):
        for tokens in itertools.product(range(vocab), repeat=length):
            score = math.fsum(float(lp[d, t]) for d, t in enumerate(tokens))
            prefixes.append((score, tokens))
    prefixes.sort(key=lambda x: -x[0])
    for budget in range(0, len(prefixes) + 2):
        out = torch.ops.ddtree.build_tree(values[None], ids[None], torch.tensor([0]), budget)
        n = int(out[5][0])
        assert n - 1 == min(budget, len(prefixes))
        paths = {0: ()}
        got = []
        for i in range(1, n):
            paths[i] = paths[int(out[1][0, i])] + (int(out[0][0, i]),)
            got.append(paths[i])
        assert len(set(got)) == len(got)
        best = {tokens for _, tokens in prefixes[: n - 1]}
        assert set(got) == best, f"budget {budget}"


# ---- property tests against the reference ----

def check_tree_properties(out, budget, depth):
    tokens, parents, depths, first_child, next_sibling, counts = out[:6]
    batch = tokens.shape[0]
    assert tokens.shape == (batch, budget + 1) and counts.shape == (batch,)
    for b in range(batch):
        n = int(counts[b])
        assert 1 <= n <= budget + 1
        assert parents[b, 0] == -1 and depths[b, 0] == 0
        for i in range(1, n):
            p = int(parents[b, i])
            assert 0 <= p < i
            assert depths[b, i] == depths[b, p] + 1 <= depth
        # padding
        assert (tokens[b, n:] == 0).all() and (parents[b, n:] == -1).all()
        assert (depths[b, n:] == 0).all() and (first_child[b, n:] == -1).all()
        assert (next_sibling[b, n:] == -1).all()


def check_against_reference(backend, inputs):
    values, ids, roots, budget, budgets = inputs
    args = (values, ids, roots, budget) + ((budgets,) if budgets is not None else ())
    out = run(backend, "build_tree", *args)
    expected = reference.build_tree(values, ids, roots, budget, budgets)
    for got, exp, name in zip(out, expected, ("tokens", "parents", "depths", "first_child",
                                             "next_sibling", "num_nodes", "path_logprobs")):
        assert torch.equal(got, exp), name
    assert len(out) == len(expected) == 7
    check_tree_properties(out, budget, values.shape[1])
    # Sibling rank order: among children of one parent, lower index = better-ranked token.
    for b in range(values.shape[0]):
        for p in range(int(out[5][b])):
            c, ranks = int(out[3][b, p]), []
            while c >= 0:
                row = ids[b, int(out[2][b, c]) - 1].tolist()
                ranks.append(row.index(int(out[0][b, c])))
                c = int(out[4][b, c])
            assert ranks == sorted(ranks)


@settings(max_examples=1000, deadline=None)
@given(draft_inputs())
def test_build_tree_cpu_matches_reference_1000_cases(inputs):
    check_against_reference("cpu", inputs)


@settings(max_examples=60, deadline=None)
@given(draft_inputs(max_batch=2, max_budget=24))
def test_build_tree_emulated_kernel_matches_reference(inputs):
    check_against_reference("emulated", inputs)


@pytest.mark.parametrize("backend", ["cpu", "emulated"])
@pytest.mark.parametrize("budget, ties", [(150, False), (600, True)])
def test_build_tree_at_large_budgets_matches_reference(backend, budget, ties):
    """Hundreds of queued candidates: the kernel's 32-ary warp heap sifts through several levels
    (a heap of more than 33 entries), with and without tied scores."""
    g = torch.Generator().manual_seed(budget)
    lp = torch.log_softmax(torch.randn(2, 12, 64, generator=g) * 0.7, -1)
    if ties:
        lp = (lp * 2).round() / 2  # coarse values: many candidates with equal scores
    values, ids = lp.topk(24, -1)
    inputs = (values.contiguous(), ids.contiguous(), torch.tensor([3, 5]), budget, None)
    check_against_reference(backend, inputs)


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
@settings(max_examples=300, deadline=None)
@given(draft_inputs(max_batch=8, max_budget=300, max_k=40, max_depth=15))
def test_build_tree_cuda_matches_reference(inputs):
    check_against_reference("cuda", inputs)


def random_tree_and_targets(seed, batch=4, depth=5, k=4, budget=30, follow=0.8):
    """A built tree plus target tokens that mostly follow some child (long acceptances)."""
    g = torch.Generator().manual_seed(seed)
    lp = torch.log_softmax(torch.randn(batch, depth, 16, generator=g), -1)
    values, ids = lp.sort(-1, descending=True)
    tree = torch.ops.ddtree.build_tree(values[..., :k].contiguous(), ids[..., :k].contiguous(),
                                       torch.randint(0, 16, (batch,), generator=g), budget)
    target = torch.randint(0, 16, (batch, budget + 1), generator=g)
    for b in range(batch):
        for i in range(budget + 1):
            c = int(tree[3][b, i])
            kids = []
            while c >= 0:
                kids.append(int(tree[0][b, c]))
                c = int(tree[4][b, c])
            if kids and torch.rand(1, generator=g).item() < follow:
                target[b, i] = kids[int(torch.randint(0, len(kids), (1,), generator=g))]
    return tree, target


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("seed", range(6))
def test_verify_greedy_matches_reference(backend, seed):
    tree, target = random_tree_and_targets(seed)
    for max_depth in (5, 2, 0):
        got = run(backend, "verify_greedy", tree[0], tree[3], tree[4], tree[5], target, max_depth)
        expected = reference.verify_greedy(tree[0], tree[1], tree[5], target, max_depth)
        for g_, e_ in zip(got, expected):
            assert torch.equal(g_, e_)


def test_verify_greedy_accepts_int32_inputs():
    tree, target = random_tree_and_targets(7)
    a = torch.ops.ddtree.verify_greedy(*(t.int() for t in (tree[0], tree[3], tree[4], tree[5], target)), 5)
    b = torch.ops.ddtree.verify_greedy(tree[0], tree[3], tree[4], tree[5], target, 5)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


# ---- commit_kv_ ----

def random_commit_case(seed, layout, dtype, batch=3, heads=2, seq=40, dim=24, width=6):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, dim) if layout == "BHSD" else (batch, seq, heads, dim)
    cache = torch.randn(shape, generator=g).to(dtype)
    past = torch.randint(0, 20, (batch,), generator=g)
    lengths = torch.randint(0, width + 1, (batch,), generator=g)
    accepted = torch.full((batch, width), -1, dtype=torch.int64)
    for b in range(batch):
        n = int(lengths[b])
        if n:
            rest = torch.randperm(14, generator=g)[: n - 1] + 1
            accepted[b, :n] = torch.cat([torch.zeros(1, dtype=torch.int64), rest.sort().values])
    return cache, past, accepted, lengths


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_commit_kv_matches_reference(backend, layout, dtype):
    for seed in range(3):
        cache, past, accepted, lengths = random_commit_case(seed, layout, dtype)
        expected = reference.commit_kv(cache, past, accepted, lengths, layout)
        dev = device_for(backend)
        moved = cache.to(dev)
        ops_for(backend).commit_kv_(moved, past.to(dev), accepted.to(dev), lengths.to(dev), layout)
        assert torch.equal(moved.cpu(), expected)


def test_commit_kv_on_a_strided_view():
    big = torch.randn(3, 2, 50, 32)
    cache = big[:, :, 5:45, :24]  # non-contiguous view of a larger buffer
    _, past, accepted, lengths = random_commit_case(1, "BHSD", torch.float32)
    expected = reference.commit_kv(cache, past, accepted, lengths)
    before = big.clone()
    ddtree.commit_kv_(cache, past, accepted, lengths)
    assert torch.equal(cache, expected)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[:, :, 5:45, :24] = False
    assert torch.equal(big[outside], before[outside])


# ---- opcheck and bad input ----

def sample_build_args():
    lp = torch.log_softmax(torch.randn(2, 3, 8), -1).sort(-1, descending=True)
    return lp.values[..., :4].contiguous(), lp.indices[..., :4].contiguous(), torch.tensor([1, 2]), 6


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    ops = getattr(torch.ops, namespace)
    lp, ids, roots, budget = sample_build_args()
    torch.library.opcheck(ops.build_tree.default, (lp, ids, roots, budget))
    torch.library.opcheck(ops.build_tree.default, (lp, ids, roots, budget, torch.tensor([3, 6])))
    tree = ops.build_tree(lp, ids, roots, budget)
    target = torch.randint(0, 8, (2, budget + 1))
    torch.library.opcheck(ops.verify_greedy.default, (tree[0], tree[3], tree[4], tree[5], target, 3))
    cache, past, accepted, lengths = random_commit_case(0, "BHSD", torch.float32)
    torch.library.opcheck(ops.commit_kv_.default, (cache, past, accepted, lengths, "BHSD"))


BUILD_BAD = [
    (lambda lp, ids, r, b: (lp.double(), ids, r, b), "logprobs must be float32"),
    (lambda lp, ids, r, b: (lp[0], ids, r, b), r"logprobs must be a 3-D tensor \[B, L, K\]"),
    (lambda lp, ids, r, b: (lp, ids[:, :2], r, b), r"ids must have shape \[B, L, K\] like logprobs"),
    (lambda lp, ids, r, b: (lp, ids.float(), r, b), "ids must be int32 or int64"),
    (lambda lp, ids, r, b: (lp, ids, r[:1], b), r"root_tokens must have shape \[B\]"),
    (lambda lp, ids, r, b: (lp, ids, r, -1), r"budget must be in \[0, 4096\], got -1"),
    (lambda lp, ids, r, b: (lp, ids, r, 5000), r"budget must be in \[0, 4096\], got 5000"),
    (lambda lp, ids, r, b: (lp.flip(-1).contiguous(), ids, r, b), "must be sorted in non-increasing order"),
    (lambda lp, ids, r, b: (lp, -ids - 1, r, b), "ids must be token ids >= 0"),
    (lambda lp, ids, r, b: (torch.zeros(1, 33, 2), torch.zeros(1, 33, 2, dtype=torch.long),
                            r[:1], b), "depth L = 33 exceeds the supported maximum 32"),
    (lambda lp, ids, r, b: (lp, ids, r, b, torch.tensor([1, 7])), r"budgets must be in \[0, budget\]"),
    (lambda lp, ids, r, b: (lp, ids, r, b, torch.tensor([1])), r"budgets must have shape \[B\]"),
]


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
@pytest.mark.parametrize("make_bad, message", BUILD_BAD)
def test_build_tree_bad_input(namespace, make_bad, message):
    with pytest.raises(RuntimeError, match=message):
        getattr(torch.ops, namespace).build_tree(*make_bad(*sample_build_args()))


def test_verify_greedy_bad_input():
    lp, ids, roots, budget = sample_build_args()
    t = torch.ops.ddtree.build_tree(lp, ids, roots, budget)
    target = torch.zeros(2, budget + 1, dtype=torch.long)
    verify = torch.ops.ddtree.verify_greedy
    with pytest.raises(RuntimeError, match=r"target_tokens must have shape \[B, N\]"):
        verify(t[0], t[3], t[4], t[5], target[:, :3], 3)
    with pytest.raises(RuntimeError, match="target_tokens must be int32 or int64"):
        verify(t[0], t[3], t[4], t[5], target.float(), 3)
    with pytest.raises(RuntimeError, match=r"num_nodes must be in \[1, N\]"):
        verify(t[0], t[3], t[4], torch.tensor([0, 2]), target, 3)
    with pytest.raises(RuntimeError, match="max_depth must be >= 0"):
        verify(t[0], t[3], t[4], t[5], target, -1)
    with pytest.raises(RuntimeError, match=r"node_tokens must be a 2-D tensor \[B, N\]"):
        verify(t[0][0], t[3], t[4], t[5], target, 3)


def test_verify_greedy_never_loops_on_malformed_links():
    tokens = torch.tensor([[5, 1, 1]])
    cyclic_child = torch.tensor([[1, 0, -1]])  # node 1's first child is the root
    cyclic_sibling = torch.tensor([[-1, 1, -1]])  # node 1 is its own sibling
    accepted, length, _ = torch.ops.ddtree.verify_greedy(
        tokens, cyclic_child, cyclic_sibling, torch.tensor([3]), torch.ones(1, 3, dtype=torch.long), 4)
    assert int(length[0]) == 2 and accepted[0].tolist() == [0, 1, -1, -1, -1]


def test_commit_kv_bad_input():
    cache, past, accepted, lengths = random_commit_case(0, "BHSD", torch.float32)
    commit = torch.ops.ddtree.commit_kv_
    with pytest.raises(RuntimeError, match='layout must be "BHSD" or "BSHD"'):
        commit(cache, past, accepted, lengths, "SBHD")
    with pytest.raises(RuntimeError, match="cache must be float16, bfloat16, float32 or float64"):
        commit(cache.int(), past, accepted, lengths, "BHSD")
    with pytest.raises(RuntimeError, match="cache must be a 4-D tensor"):
        commit(cache[0], past, accepted, lengths, "BHSD")
    with pytest.raises(RuntimeError, match="last .*dimension must be contiguous"):
        commit(cache.transpose(2, 3), past, accepted, lengths, "BHSD")
    with pytest.raises(RuntimeError, match=r"accept_len\[0\] = 9 must be in \[0, 6\]"):
        commit(cache, past, accepted, torch.tensor([9, 0, 0]), "BHSD")
    bad = accepted.clone()
    bad[:, 0] = 0
    bad[:, 1] = 0
    with pytest.raises(RuntimeError, match="breaks the path order"):
        commit(cache, past, bad, torch.full((3,), 2), "BHSD")
    with pytest.raises(RuntimeError, match="beyond its 40 rows"):
        commit(cache, torch.full((3,), 39), accepted, torch.full((3,), 2).clamp(max=lengths), "BHSD")
    with pytest.raises(RuntimeError, match=r"past_len must have shape \[B\]"):
        commit(cache, past[:2], accepted, lengths, "BHSD")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_commit_kv_to_a_per_request_destination(backend):
    """Batched caches: the tree starts at a shared row, each path lands at its request's length."""
    cache, past, accepted, lengths = random_commit_case(4, "BHSD", torch.float32)
    past = torch.full((3,), 20)
    dst = torch.tensor([20, 11, 3])
    expected = reference.commit_kv(cache, past, accepted, lengths, "BHSD", dst)
    dev = device_for(backend)
    moved = cache.clone().to(dev)
    ops_for(backend).commit_kv_(moved, past.to(dev), accepted.to(dev), lengths.to(dev), "BHSD", dst.to(dev))
    assert torch.equal(moved.cpu(), expected)
    with pytest.raises(RuntimeError, match=r"committed_len must be in \[0, past_len\]"):
        torch.ops.ddtree.commit_kv_(cache, past, accepted, lengths, "BHSD", past + 1)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("count", [1, 6, 130])  # 130 > 128: two launches
def test_commit_kv_layers_equals_commit_kv_on_each_cache(backend, count):
    """The K and V of many layers in one call (one launch per 128 caches), each cache compacted
    exactly as the reference does it, per-request destinations included."""
    cache, past, accepted, lengths = random_commit_case(5, "BHSD", torch.bfloat16)
    past = torch.full((3,), 20)
    dst = torch.tensor([20, 9, 0])
    g = torch.Generator().manual_seed(count)
    caches = [torch.randn(cache.shape, generator=g).to(cache.dtype) for _ in range(count)]
    expected = [reference.commit_kv(c, past, accepted, lengths, "BHSD", dst) for c in caches]
    dev = device_for(backend)
    moved = [c.to(dev) for c in caches]
    ops_for(backend).commit_kv_layers_(moved, past.to(dev), accepted.to(dev), lengths.to(dev),
                                       "BHSD", dst.to(dev))
    for got, want in zip(moved, expected):
        assert torch.equal(got.cpu(), want)


def test_commit_kv_layers_opcheck_and_bad_input():
    cache, past, accepted, lengths = random_commit_case(0, "BHSD", torch.float32)
    for namespace in ("ddtree", "ddtree_emu"):
        op = getattr(torch.ops, namespace).commit_kv_layers_
        torch.library.opcheck(op.default, ([cache.clone(), cache.clone()], past, accepted, lengths))
    op = torch.ops.ddtree.commit_kv_layers_
    with pytest.raises(RuntimeError, match="caches must hold at least one tensor"):
        op([], past, accepted, lengths)
    with pytest.raises(RuntimeError, match=r"caches\[1\] must have the shape, strides and dtype"):
        op([cache, cache.double()], past, accepted, lengths)
    with pytest.raises(RuntimeError, match=r"caches\[1\] must have the shape, strides and dtype"):
        op([cache, cache[:, :, :-1]], past, accepted, lengths)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_path_logprobs_sum_to_the_expected_accepted_nodes(backend):
    """spec §3's objective, checked by simulation: when the target's token at depth d is drawn
    from the drafter's own distribution q_d (depths independent), a node is accepted with
    probability exp(path log-prob), so the mean number of accepted nodes of the best n-node tree
    is the prefix sum of exp(path_logprobs) over rows 1..n (ops.expected_accepts), for every n."""
    g = torch.Generator().manual_seed(5)
    depth, vocab, budget, trials = 4, 5, 12, 20000
    q = torch.randn(1, depth, vocab, generator=g).mul(1.5).softmax(-1)
    lp, ids = q.log().sort(-1, descending=True)
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    tree = ddtree.build_tree(lp.to(dev), ids.to(dev), torch.tensor([0], device=dev), budget)
    tree = ddtree.DraftTree(*(t.cpu() for t in tree))
    want = reference.build_tree(lp, ids, torch.tensor([0]), budget)[6]
    assert torch.equal(tree.path_logprobs, want)
    rows = tree.path_logprobs[0, 1:]
    assert (rows[1:] <= rows[:-1]).all()  # pop order: non-increasing
    predicted = ddtree.expected_accepts(tree)[0]  # [N]: row i = expected accepted of rows 1..i
    draws = torch.multinomial(q[0], trials, replacement=True, generator=g)  # [depth, trials]
    for n in (1, 4, budget):
        sub = ddtree.DraftTree(*(t[:, : n + 1] if t.dim() == 2 else t.clamp(max=n + 1)
                                 for t in tree))
        children = {}
        for i in range(1, int(sub.num_nodes[0])):
            children.setdefault(int(sub.parents[0, i]), {})[int(sub.node_tokens[0, i])] = i
        accepted = 0
        for t in range(trials):
            node, d = 0, 0
            while d < depth and int(draws[d, t]) in children.get(node, {}):
                node = children[node][int(draws[d, t])]
                accepted += 1
                d += 1
        mean = accepted / trials
        assert abs(mean - float(predicted[n])) < 0.03 * max(1.0, float(predicted[n])), (n, mean)
