"""Fuzzing the tree ops with hypothesis: random batch sizes (0 included), tree sizes, parent
dtypes, strided views, multi-root forests, corrupted trees (parents out of order or out of range,
padding rows with parents, node counts outside [0, N]), random starts / prefixes / paths. Every
call either equals the reference written from docs/spec.md (python/ddtree/ops/reference.py) or raises a
RuntimeError naming the op and the offending argument — never a crash, a hang or a silently wrong
answer. CPU and the emulated CUDA kernels (and the GPU when present).

Profiles: the default is sized for CI; DDTREE_FUZZ=long runs 10x the examples (by hand). The
number of trees each test checked is printed in pytest's summary (conftest.py)."""
import os
import re

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ddtree  # noqa: F401  (registers the ops)
from ddtree.ops import reference
from helpers import draft_inputs, KERNEL_BACKENDS, kernel_device

SCALE = 10 if os.environ.get("DDTREE_FUZZ") == "long" else 1
BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS
TREES = {}  # test name -> trees checked (reported by conftest's terminal summary)
TREE_ERROR = re.compile(r"(parents\[\d+, \d+\] = -?\d+ (must be smaller|is invalid|is a padding "
                        r"row)|num_nodes\[\d+\] = -?\d+ must be in \[0, N\])")


def fuzz_settings(examples):
    return settings(max_examples=examples * SCALE, deadline=None, derandomize=SCALE == 1,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def count_trees(name, batch):
    TREES[name] = TREES.get(name, 0) + batch


def ops_for(backend):
    return torch.ops.ddtree if backend == "cpu" else torch.ops.ddtree_emu


def device_for(backend):
    return "cpu" if backend == "cpu" else kernel_device(backend)


@st.composite
def forests(draw, max_batch=6, max_n=70, corrupt=True):
    """(parents [B, N] int32/int64, possibly a strided view; num_nodes [B]; valid?)."""
    batch = draw(st.integers(0, max_batch))
    n = draw(st.integers(1, max_n))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, n + 1, (batch,), generator=g)
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    roots = draw(st.sampled_from([0.0, 0.0, 0.1]))  # share of extra roots (forests)
    for b in range(batch):
        for i in range(1, int(counts[b])):
            if torch.rand(1, generator=g).item() >= roots:
                parents[b, i] = torch.randint(0, i, (1,), generator=g)
    valid = True
    if corrupt and batch > 0 and draw(st.integers(0, 3)) == 0:
        valid = False
        b = draw(st.integers(0, batch - 1))
        kind = draw(st.sampled_from(["order", "range", "padding", "count"]))
        if kind == "count":
            counts[b] = draw(st.sampled_from([-1, n + 1, n + 7]))
        else:
            i = draw(st.integers(0, n - 1))
            if kind == "padding" and i >= counts[b]:
                parents[b, i] = draw(st.integers(0, max(0, i - 1))) if i > 0 else 0
            elif kind == "range":
                parents[b, i] = draw(st.integers(-2**31, -2))
            else:
                parents[b, i] = draw(st.integers(i, i + 5))
            if kind == "padding" and i < counts[b]:
                valid = True  # it landed on a real row: a legal parent was drawn over
                parents[b, i] = -1
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    parents = parents.to(dtype)
    if draw(st.booleans()):  # a strided view of a wider buffer
        wide = torch.full((batch, 2 * n), 7, dtype=dtype)
        wide[:, ::2] = parents
        parents = wide[:, ::2]
    return parents, counts, valid


def expect_tree_error(fn):
    with pytest.raises(RuntimeError) as err:
        fn()
    assert TREE_ERROR.search(str(err.value)), str(err.value)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(700)
@given(forests(), st.integers(0, 5000))
def test_fuzz_tree_visibility(backend, case, start):
    parents, counts, valid = case
    dev = device_for(backend)
    starts = torch.full((parents.shape[0],), start, dtype=torch.int64)
    call = lambda: ops_for(backend).tree_visibility(parents.to(dev), counts.to(dev),  # noqa: E731
                                                    starts.to(dev))
    if not valid:
        return expect_tree_error(call)
    visible, packed, positions = call()
    want = reference.tree_visibility(parents, counts, starts)
    for got, exp in zip((visible, packed, positions), want):
        assert torch.equal(got.cpu(), exp)
    count_trees(f"tree_visibility[{backend}]", parents.shape[0])


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(300)
@given(forests(max_n=40), st.integers(0, 40), st.sampled_from([torch.float32, torch.bfloat16]),
       st.booleans(), st.booleans())
def test_fuzz_tree_attention_mask(backend, case, past, dtype, with_prefix, with_start):
    parents, counts, valid = case
    dev = device_for(backend)
    prefix = torch.randint(0, past + 1, (parents.shape[0],)) if with_prefix else None
    start = torch.randint(0, past + 1, (parents.shape[0],)) if with_start else None
    to_dev = lambda t: None if t is None else t.to(dev)  # noqa: E731
    call = lambda: ops_for(backend).tree_attention_mask(  # noqa: E731
        parents.to(dev), counts.to(dev), past, dtype, to_dev(prefix), to_dev(start))
    if not valid:
        return expect_tree_error(call)
    assert torch.equal(call().cpu(), reference.tree_attention_mask(parents, counts, past, dtype,
                                                                   prefix, start))
    count_trees(f"tree_attention_mask[{backend}]", parents.shape[0])


def tree_links(parents, counts):
    """first_child / next_sibling (children in index order) of a valid forest."""
    batch, n = parents.shape
    first = torch.full((batch, n), -1, dtype=torch.int64)
    sibling = torch.full((batch, n), -1, dtype=torch.int64)
    for b in range(batch):
        last = {}
        for i in range(1, int(counts[b])):
            p = int(parents[b, i])
            if p < 0:
                continue
            if p in last:
                sibling[b, last[p]] = i
            else:
                first[b, p] = i
            last[p] = i
    return first, sibling


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(700)
@given(forests(corrupt=False), st.integers(1, 6), st.integers(0, 12), st.integers(0, 2**31 - 1))
def test_fuzz_verify_greedy(backend, case, vocab, max_depth, seed):
    """Random trees over a small vocabulary (so target tokens often match a child) and a max_depth
    that may cut paths short."""
    parents, counts, _ = case
    g = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    counts = counts.clamp(min=1)
    if batch:
        parents = parents.clone()
        for b in range(batch):
            parents[b, int(counts[b]):] = -1
            parents[b, 0] = -1
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    target = torch.randint(0, vocab, (batch, n), generator=g)
    first, sibling = tree_links(parents, counts)
    dev = device_for(backend)
    got = ops_for(backend).verify_greedy(*(t.to(dev) for t in (tokens, first, sibling, counts,
                                                                 target)), max_depth)
    want = reference.verify_greedy(tokens, parents, counts, target, max_depth)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    count_trees(f"verify_greedy[{backend}]", batch)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(300)
@given(st.integers(0, 5), st.integers(1, 24), st.integers(1, 9), st.integers(0, 2**31 - 1),
       st.sampled_from(["BHSD", "BSHD"]), st.sampled_from([torch.float32, torch.bfloat16]),
       st.sampled_from(["ok", "accept_len", "accepted", "past_len"]))
def test_fuzz_commit_kv(backend, batch, n, a, seed, layout, dtype, corrupt):
    """Random accepted paths (root first, increasing rows of the tree block), destination rows
    below the tree, caches
    just long enough; corrupted lengths / rows / offsets must be reported by name."""
    g = torch.Generator().manual_seed(seed)
    heads, dim = 2, 4
    past = torch.randint(0, 8, (batch,), generator=g)
    seq = int(past.max()) + n if batch else n
    shape = (batch, heads, seq, dim) if layout == "BHSD" else (batch, seq, heads, dim)
    cache = torch.randn(shape, generator=g).to(dtype)
    lengths = torch.randint(0, min(a, n) + 1, (batch,), generator=g)
    accepted = torch.full((batch, a), -1, dtype=torch.int64)
    for b in range(batch):  # a root-to-node path: root 0 first, indices increasing
        rest = (torch.randperm(n - 1, generator=g)[: max(0, int(lengths[b]) - 1)] + 1).sort().values
        accepted[b, : lengths[b]] = torch.cat([torch.zeros(1, dtype=torch.int64), rest])[: int(lengths[b])]
    dst = (past - torch.randint(0, 3, (batch,), generator=g)).clamp(min=0)
    if corrupt != "ok" and batch:
        if corrupt == "accept_len":
            lengths[0] = a + 1
        elif corrupt == "accepted":
            lengths[0] = 1
            accepted[0, 0] = seq  # past the cache
        else:  # the tree block starts past the cache: its root row is not there
            lengths[0] = max(1, int(lengths[0]))
            accepted[0, 0] = 0
            past[0] = seq
    dev = device_for(backend)
    out = cache.clone().to(dev)
    call = lambda: ops_for(backend).commit_kv_(out, past.to(dev), accepted.to(dev),  # noqa: E731
                                               lengths.to(dev), layout, dst.to(dev))
    if corrupt != "ok" and batch:
        with pytest.raises(RuntimeError, match=corrupt):
            call()
        return
    call()
    want = reference.commit_kv(cache, past, accepted, lengths, layout, dst)
    assert torch.equal(out.cpu(), want)
    count_trees(f"commit_kv_[{backend}]", batch)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(300)
@given(st.integers(0, 4), st.integers(0, 6), st.integers(1, 40), st.integers(0, 48),
       st.integers(0, 2**31 - 1), st.sampled_from(["normal", "ties", "nan", "inf", "neg_inf"]),
       st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_fuzz_tree_topk_and_chain_tree(backend, batch, levels, vocab, k, seed, style, dtype):
    """k > V and k = 0, vocabulary 1, rows with NaN / +inf / all -inf, ties; tree_topk equals the
    reference (ids exactly), chain_tree equals build_tree over the top-1."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, levels, vocab, generator=g) * 3
    if style == "ties":
        logits = logits.round()
    elif batch and levels:
        row = logits[torch.randint(0, batch, (1,), generator=g), torch.randint(0, levels, (1,), generator=g)]
        row[..., torch.randint(0, vocab, (1,), generator=g)] = {"nan": float("nan"), "inf": float("inf"),
                                                               "neg_inf": float("-inf"),
                                                               "normal": 0.0}[style]
        if style == "neg_inf":
            row.fill_(float("-inf"))
        logits[0, 0] = row
    logits = logits.to(dtype)
    dev = device_for(backend)
    op = ops_for(backend)
    if k > vocab:
        with pytest.raises(RuntimeError, match=r"tree_topk: k = \d+ exceeds the vocabulary size"):
            op.tree_topk(logits.to(dev), k)
    else:
        values, ids = op.tree_topk(logits.to(dev), k)
        want_values, want_ids = reference.tree_topk(logits, k)
        assert torch.equal(ids.cpu(), want_ids)
        torch.testing.assert_close(values.cpu(), want_values, rtol=1e-5, atol=1e-5, equal_nan=True)
    roots = torch.randint(0, vocab, (batch,), generator=g)
    chain = op.chain_tree(logits.to(dev), roots.to(dev))
    want = reference.chain_tree(logits, roots)
    for a, b in zip(chain, want):
        assert torch.equal(a.cpu(), b)
    count_trees(f"chain_tree[{backend}]", batch)


@st.composite
def build_inputs(draw):
    """Sorted top-k draft rows (ties, -inf / NaN tails, K = 0, L = 0, per-request budgets), or a
    corruption the op must name: unsorted rows, negative ids, per-request budgets above the
    budget, a budget beyond 4096."""
    values, ids, roots, budget, budgets = draw(draft_inputs(max_batch=4, max_depth=8, max_k=8,
                                                            max_budget=60))
    corrupt = draw(st.sampled_from([None] * 6 + ["sorted", "ids", "budgets", "budget"]))
    if corrupt == "sorted" and values.shape[-1] >= 2 and values.shape[1] >= 1:
        values = values.clone()
        values[0, 0, 1] = values[0, 0, 0].nan_to_num(nan=0.0, neginf=0.0) + 1.0
    elif corrupt == "ids" and ids.numel():
        ids = ids.clone()
        ids.view(-1)[0] = -3
    elif corrupt == "budgets":
        budgets = torch.full((values.shape[0],), budget + 1)
    elif corrupt == "budget":
        budget = 4097
    else:
        corrupt = None
    return values, ids, roots, budget, budgets, corrupt


BUILD_ERRORS = {"sorted": "logprobs must be sorted in non-increasing order",
                "ids": "ids must be token ids >= 0", "budgets": r"budgets must be in \[0, budget\]",
                "budget": r"budget must be in \[0, 4096\]"}


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(800)
@given(build_inputs())
def test_fuzz_build_tree(backend, case):
    values, ids, roots, budget, budgets, corrupt = case
    dev = device_for(backend)
    call = lambda: ops_for(backend).build_tree(  # noqa: E731
        values.to(dev), ids.to(dev), roots.to(dev), budget, None if budgets is None else budgets.to(dev))
    if corrupt:
        with pytest.raises(RuntimeError, match=BUILD_ERRORS[corrupt]):
            call()
        return
    got = call()
    want = reference.build_tree(values, ids, roots, budget, budgets)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    count_trees(f"build_tree[{backend}]", values.shape[0])


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(150)
@given(forests(max_batch=3, max_n=24), st.integers(1, 4), st.integers(0, 2**31 - 1),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_fuzz_recurrent_ops(backend, case, width, seed, dtype):
    """tree_causal_conv1d and tree_gated_delta_rule over random forests (GQA, pool slots, any
    kernel width): equal to the reference, or the tree error named."""
    parents, counts, valid = case
    g = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    dev = device_for(backend)
    op = ops_for(backend)
    x = torch.randn(batch, n, 6, generator=g).to(dtype)
    conv_state = torch.randn(batch + 1, 6, width, generator=g).to(dtype)
    weight, bias = torch.randn(6, width, generator=g), torch.randn(6, generator=g)
    slots = torch.randperm(batch + 1, generator=g)[:batch]
    q, k = (torch.randn(batch, n, 1, 8, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(batch, n, 2, 4, generator=g).to(dtype)
    gate = -torch.rand(batch, n, 2, generator=g)
    beta = torch.rand(batch, n, 2, generator=g)
    state = torch.randn(batch + 1, 2, 8, 4, generator=g)
    depth = int(reference.tree_depths(parents, counts.clamp(0, n)).max()) if batch and valid else n
    conv = lambda: op.tree_causal_conv1d(  # noqa: E731
        *(t.to(dev) for t in (x, conv_state, slots, weight, bias, parents, counts)), "silu")
    gdn = lambda: op.tree_gated_delta_rule(  # noqa: E731
        *(t.to(dev) for t in (q, k, v, gate, beta, state, slots, parents, counts)), depth)
    if not valid:
        expect_tree_error(conv)
        return expect_tree_error(gdn)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(conv().cpu().float(), reference.tree_causal_conv1d(
        x, conv_state, slots, weight, bias, parents, counts).float(), **tol)
    torch.testing.assert_close(gdn().cpu().float(), reference.tree_gated_delta_rule(
        q, k, v, gate, beta, state, slots, parents, counts).float(), **tol)
    count_trees(f"recurrent[{backend}]", 2 * batch)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(60)
@given(forests(max_batch=3, max_n=40, corrupt=False), st.integers(0, 2**31 - 1),
       st.sampled_from([(4, 2), (2, 2), (4, 1)]), st.booleans())
def test_fuzz_tree_attention(backend, case, seed, heads, with_prefix):
    """Random forests over random prefixes (GQA, committed_len below the tree start); CPU in fp32
    with head dims 8 / 12 / 16 / 40 / 64, the emulated mma kernel in bf16 with 64."""
    parents, counts, _ = case
    g = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    hq, hkv = heads
    kernel = backend != "cpu"
    d = 64 if kernel else [8, 12, 16, 40, 64][seed % 5]  # CPU column chunks of 32 / 8 / 1
    dtype = torch.bfloat16 if kernel else torch.float32
    past = torch.randint(0, 30, (batch,), generator=g)
    s = (int(past.max()) if batch else 0) + n + 3
    q = torch.randn(batch, n, hq, d, generator=g).to(dtype)
    k_cache, v_cache = (torch.randn(batch, hkv, s, d, generator=g).to(dtype) for _ in range(2))
    prefix = (past - torch.randint(0, 4, (batch,), generator=g)).clamp(min=0) if with_prefix else None
    vis = reference.tree_visibility_bool(parents, counts)
    packed = reference.pack_rows(vis)
    dev = device_for(backend)
    got = ops_for(backend).tree_attention(
        q.to(dev), k_cache.to(dev), v_cache.to(dev), past.to(dev), packed.to(dev), None,
        None if prefix is None else prefix.to(dev), None).cpu().float()
    want = reference.tree_attention(q.float(), k_cache.float(), v_cache.float(), past, vis, None,
                                    prefix)
    tol = dict(rtol=2e-2, atol=2e-2) if kernel else dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got, want, **tol)
    count_trees(f"tree_attention[{backend}]", batch)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(40)
@given(st.integers(0, 3), st.integers(1, 17), st.integers(0, 9), st.sampled_from([(4, 2), (2, 2), (4, 1)]),
       st.integers(0, 2**31 - 1), st.booleans(), st.sampled_from([None, 2, 5]))
def test_fuzz_draft_attention(backend, batch, lq, context, heads, seed, per_request, splits):
    """The DFlash layer attention (RMSNorm + RoPE of the block and the new context, SDPA over
    [cache; context; block], context appended to the cache) on random batch sizes (0 included),
    block lengths, context rows (0 included), cache fills up to the cache end, per-request
    context lengths, GQA and key splits; CPU in fp32 / bf16 with head dims 8 / 24 / 64, the
    emulated mma kernel in bf16 with 64. Checks the output and the cache append against the
    float64 reference (test_draft_attention.check)."""
    from test_ops_draft_attention import case as draft_case, check as draft_check

    g = torch.Generator().manual_seed(seed)
    kernel = backend != "cpu"
    d = 64 if kernel else [8, 24, 64][seed % 3]
    dtype = torch.bfloat16 if kernel or seed % 2 else torch.float32
    s = lq + context + int(torch.randint(0, 40, (1,), generator=g))
    cached = tuple(int(x) for x in torch.randint(0, s - lq - context + 1, (batch,), generator=g))
    hq, hkv = heads
    c = draft_case(seed % 1000, batch, lq, (context,), hq, hkv, d, cached, s, dtype)
    lens = torch.randint(0, context + 1, (batch,), generator=g) if per_request else None
    # fp32: the reference is float64 inside, so its own error is ~0 and the bound is the floor;
    # the fused CPU path (polynomial exp, online softmax) was seen at 6 ulp of the output scale.
    draft_check(backend, c, num_splits=splits if kernel else None, context_len=lens,
                floor_ulps=8 if dtype == torch.float32 else 4)
    count_trees(f"draft_attention[{backend}]", batch)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(120)
@given(forests(max_batch=3, max_n=20, corrupt=False), st.integers(0, 2**31 - 1),
       st.integers(1, 4), st.booleans())
def test_fuzz_commit_recurrent(backend, case, seed, width, too_long):
    """Random accepted root paths (lengths 0..depth + 1) in random forests; an accept length past
    the path buffer is named."""
    parents, counts, _ = case
    g = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    k = torch.randn(batch, n, 1, 8, generator=g)
    v = torch.randn(batch, n, 2, 4, generator=g)
    gate, beta = -torch.rand(batch, n, 2, generator=g), torch.rand(batch, n, 2, generator=g)
    conv_x = torch.randn(batch, n, 6, generator=g)
    state = torch.randn(batch + 1, 2, 8, 4, generator=g)
    conv_state = torch.randn(batch + 1, 6, width, generator=g)
    slots = torch.randperm(batch + 1, generator=g)[:batch]
    a = n
    accepted = torch.full((batch, a), -1, dtype=torch.int64)
    lengths = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        if int(counts[b]) == 0:
            continue
        leaf = int(torch.randint(0, int(counts[b]), (1,), generator=g))
        path = reference.tree_path(parents[b], int(counts[b]), leaf)
        if path[0] != 0:  # a node under another root of the forest: keep the root alone
            path = [0]
        lengths[b] = int(torch.randint(0, len(path) + 1, (1,), generator=g))
        accepted[b, : lengths[b]] = torch.tensor(path[: int(lengths[b])])
    if too_long and batch:
        lengths[0] = a + 1
    dev = device_for(backend)
    st_, cs = state.clone().to(dev), conv_state.clone().to(dev)
    call = lambda: ops_for(backend).commit_recurrent_(  # noqa: E731
        st_, cs, *(t.to(dev) for t in (slots, k, v, gate, beta, conv_x, accepted, lengths)))
    if too_long and batch:
        with pytest.raises(RuntimeError, match=r"accept_len\[0\] = \d+ must be in \[0, \d+\]"):
            call()
        return
    call()
    want_state, want_conv = reference.commit_recurrent(state, conv_state, slots, k, v, gate, beta,
                                                       conv_x, accepted, lengths)
    torch.testing.assert_close(st_.cpu(), want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cs.cpu(), want_conv, rtol=0, atol=0)
    count_trees(f"commit_recurrent_[{backend}]", batch)


@pytest.mark.parametrize("backend", BACKENDS)
@fuzz_settings(150)
@given(forests(max_batch=4, max_n=30, corrupt=False), st.integers(1, 12), st.integers(0, 12),
       st.integers(0, 2**31 - 1), st.sampled_from(["greedy", "top1", "bad_top_p", "bad_top_k"]))
def test_fuzz_verify_sample(backend, case, vocab, max_depth, seed, setting):
    """Temperature 0, and top-k 1 without tied values, make the sampling walk deterministic: it
    must equal the greedy walk of the reference over the logits' argmax (ties to the lower id);
    top_p outside (0, 1] and top_k < 0 are named."""
    parents, counts, _ = case
    g = torch.Generator().manual_seed(seed)
    batch, n = parents.shape
    counts = counts.clamp(min=1)
    parents = parents.clone()
    for b in range(batch):
        parents[b, int(counts[b]):] = -1
        parents[b, 0] = -1
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    logits = torch.randn(batch, n, vocab, generator=g)
    if setting == "greedy":  # ties go to the lower id; top-k 1 keeps tied values (HF), so no ties
        logits = logits.round()
    first, sibling = tree_links(parents, counts)
    temperature = torch.full((batch,), 0.0 if setting == "greedy" else 0.7)
    top_k = torch.full((batch,), -1 if setting == "bad_top_k" else 1 if setting == "top1" else 0)
    top_p = torch.full((batch,), 0.0 if setting == "bad_top_p" else 1.0)
    seeds, offsets = torch.arange(batch), torch.zeros(batch, dtype=torch.int64)
    dev = device_for(backend)
    call = lambda: ops_for(backend).verify_sample(  # noqa: E731
        *(t.to(dev) for t in (tokens, first, sibling, counts, logits, temperature, top_k, top_p,
                              seeds, offsets)), max_depth)
    if setting.startswith("bad") and batch:
        with pytest.raises(RuntimeError, match="top_p" if setting == "bad_top_p" else "top_k"):
            call()
        return
    if setting.startswith("bad"):
        return
    got = call()
    argmax = reference.tree_topk(logits, 1)[1][..., 0]
    want = reference.verify_greedy(tokens, parents, counts, argmax, max_depth)
    for a, b in zip(got, want):
        assert torch.equal(a.cpu(), b)
    count_trees(f"verify_sample[{backend}]", batch)
