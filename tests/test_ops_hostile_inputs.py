"""Memory safety with the value checks off (ddtree.validation(False), as inside the speculative
loop's rounds): every data-dependent index, length, slot and count of every op is replaced by
hostile values (negative, one past the end, 2**31, 2**62, ...). The result is unspecified, but
the call must return, and nothing outside the op's output tensors may change: in-place outputs
(caches, state pools) live inside larger buffers whose margins are checked byte for byte, and
every input is compared with a copy afterwards. CPU and the emulated CUDA kernels; under
`make test-asan` the same calls run against AddressSanitizer (any out-of-bounds access aborts).
"""
import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import ddtree
from helpers import KERNEL_BACKENDS, kernel_device

BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS
MARGIN = 64  # guard elements on each side of an in-place output


def hostile(n):
    """Index values around the valid range [0, n) and far outside it."""
    return st.sampled_from([-2**62, -2**31, -n - 1, -2, -1, 0, 1, n - 1, n, n + 1, 2 * n + 3,
                            2**31, 2**62])


def ops_for(backend):
    return torch.ops.ddtree if backend == "cpu" else torch.ops.ddtree_emu


def device_for(backend):
    return "cpu" if backend == "cpu" else kernel_device(backend)


def hostile_settings(examples):
    return settings(max_examples=examples, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


class Guarded:
    """A tensor of `shape` inside a buffer with MARGIN guard elements on each side (a contiguous
    view, as the in-place ops require); `intact()` says whether the guards kept their values."""

    def __init__(self, shape, dtype, device, g):
        numel = 1
        for s in shape:
            numel *= s
        buf = torch.randn(numel + 2 * MARGIN, generator=g).to(dtype)
        self.buffer = buf.to(device)
        self.tensor = self.buffer[MARGIN:MARGIN + numel].view(shape)
        self.guards = self.buffer.clone()

    def intact(self) -> bool:
        return (torch.equal(self.buffer[:MARGIN], self.guards[:MARGIN])
                and torch.equal(self.buffer[-MARGIN:], self.guards[-MARGIN:]))


def run_unchecked(fn, inputs):
    """fn() with the value checks off; the inputs must come back unchanged."""
    before = [t.clone() for t in inputs]
    with ddtree.validation(False):
        out = fn()
    for t, b in zip(inputs, before):
        assert torch.equal(t, b), "an input tensor was written"
    return out


def index_tensor(values, device, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=device)


@pytest.mark.parametrize("backend", BACKENDS)
@hostile_settings(40)
@given(st.integers(1, 3), st.integers(1, 9), st.data())
def test_hostile_build_tree(backend, batch, budget, data):
    device = device_for(backend)
    g = torch.Generator().manual_seed(batch * 31 + budget)
    lp, ids = torch.randn(batch, 4, 5, generator=g).log_softmax(-1).sort(-1, descending=True)
    lp, ids = lp.to(device), ids.to(device)
    roots = torch.zeros(batch, dtype=torch.long, device=device)
    budgets = index_tensor([data.draw(hostile(budget)) for _ in range(batch)], device)
    tree = run_unchecked(lambda: ops_for(backend).build_tree(lp, ids, roots, budget, budgets),
                         [lp, ids, roots, budgets])
    counts = tree[5].cpu()
    assert ((counts >= 1) & (counts <= budget + 1)).all()  # budgets were clamped into [0, budget]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@hostile_settings(40)
@given(st.integers(1, 3), st.integers(1, 12), st.data())
def test_hostile_verify(backend, sample, batch, n, data):
    device = device_for(backend)
    links = [[data.draw(hostile(n)) for _ in range(n)] for _ in range(batch)]
    siblings = [[data.draw(hostile(n)) for _ in range(n)] for _ in range(batch)]
    tokens = index_tensor([[data.draw(hostile(5)) for _ in range(n)] for _ in range(batch)], device)
    first_child, next_sibling = index_tensor(links, device), index_tensor(siblings, device)
    num_nodes = index_tensor([data.draw(hostile(n)) for _ in range(batch)], device)
    max_depth = data.draw(st.integers(0, 6))
    ops = ops_for(backend)
    if sample:
        logits = torch.randn(batch, n, 5).to(device)
        one = torch.ones(batch, device=device)
        seeds = torch.zeros(batch, dtype=torch.long, device=device)
        args = [tokens, first_child, next_sibling, num_nodes, logits, one,
                seeds + data.draw(st.sampled_from([0, 2, 7])), one, seeds, seeds]
        accepted, accept_len, bonus = run_unchecked(lambda: ops.verify_sample(*args, max_depth), args)
    else:
        target = index_tensor([[data.draw(hostile(5)) for _ in range(n)] for _ in range(batch)],
                              device)
        args = [tokens, first_child, next_sibling, num_nodes, target]
        accepted, accept_len, bonus = run_unchecked(lambda: ops.verify_greedy(*args, max_depth), args)
    accepted, accept_len = accepted.cpu(), accept_len.cpu()
    assert ((accept_len >= 1) & (accept_len <= max_depth + 1)).all()
    assert ((accepted >= -1) & (accepted < n)).all()  # node indices of the tree, or padding


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["BHSD", "BSHD"])
@hostile_settings(40)
@given(st.integers(1, 3), st.integers(1, 10), st.data())
def test_hostile_commit_kv(backend, layout, batch, seq, data):
    device = device_for(backend)
    g = torch.Generator().manual_seed(batch * 100 + seq)
    shape = (batch, 2, seq, 8) if layout == "BHSD" else (batch, seq, 2, 8)
    caches = [Guarded(shape, torch.bfloat16, device, g) for _ in range(2)]
    width = data.draw(st.integers(1, 5))
    past = index_tensor([data.draw(hostile(seq)) for _ in range(batch)], device)
    accepted = index_tensor([[data.draw(hostile(seq)) for _ in range(width)] for _ in range(batch)],
                            device)
    accept_len = index_tensor([data.draw(hostile(width)) for _ in range(batch)], device)
    dst = index_tensor([data.draw(hostile(seq)) for _ in range(batch)], device) \
        if data.draw(st.booleans()) else None
    inputs = [past, accepted, accept_len] + ([dst] if dst is not None else [])
    ops = ops_for(backend)
    run_unchecked(lambda: ops.commit_kv_layers_([c.tensor for c in caches], past, accepted,
                                                accept_len, layout, dst), inputs)
    run_unchecked(lambda: ops.commit_kv_(caches[0].tensor, past, accepted, accept_len, layout, dst),
                  inputs)
    assert all(c.intact() for c in caches)


def gdn_inputs(batch, n, g, device, dtype=torch.float32):
    hk, hv, dk, dv, channels = 1, 2, 8, 4, 6
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    return dict(q=rand(batch, n, hk, dk), k=rand(batch, n, hk, dk), v=rand(batch, n, hv, dv),
                g=-rand(batch, n, hv).abs().float(), beta=rand(batch, n, hv).sigmoid().float(),
                x=rand(batch, n, channels), weight=rand(channels, 4).float(),
                dims=(hv, dk, dv, channels))


@pytest.mark.parametrize("backend", BACKENDS)
@hostile_settings(30)
@given(st.integers(1, 3), st.integers(1, 10), st.integers(1, 3), st.data())
def test_hostile_recurrent(backend, batch, n, pool, data):
    device = device_for(backend)
    g = torch.Generator().manual_seed(batch * 100 + n * 10 + pool)
    t = gdn_inputs(batch, n, g, device)
    hv, dk, dv, channels = t["dims"]
    state = Guarded((pool, hv, dk, dv), torch.float32, device, g)
    conv_state = Guarded((pool, channels, 4), torch.float32, device, g)
    slots = index_tensor([data.draw(hostile(pool)) for _ in range(batch)], device)
    parents = index_tensor([[data.draw(hostile(n)) for _ in range(n)] for _ in range(batch)], device)
    num_nodes = index_tensor([data.draw(hostile(n)) for _ in range(batch)], device)
    max_depth = data.draw(st.integers(0, 3))  # may be below the tree's depth
    ops = ops_for(backend)
    tree_inputs = [slots, parents, num_nodes, t["x"], t["q"], t["k"], t["v"], t["g"], t["beta"]]
    run_unchecked(lambda: ops.tree_causal_conv1d(t["x"], conv_state.tensor, slots, t["weight"],
                                                 None, parents, num_nodes, "silu"), tree_inputs)
    run_unchecked(lambda: ops.tree_gated_delta_rule(t["q"], t["k"], t["v"], t["g"], t["beta"],
                                                    state.tensor, slots, parents, num_nodes,
                                                    max_depth), tree_inputs)
    width = data.draw(st.integers(1, 5))
    accepted = index_tensor([[data.draw(hostile(n)) for _ in range(width)] for _ in range(batch)],
                            device)
    accept_len = index_tensor([data.draw(hostile(width)) for _ in range(batch)], device)
    run_unchecked(lambda: ops.commit_recurrent_(state.tensor, conv_state.tensor, slots, t["k"],
                                                t["v"], t["g"], t["beta"], t["x"], accepted,
                                                accept_len),
                  tree_inputs + [accepted, accept_len])
    assert state.intact() and conv_state.intact()


@pytest.mark.parametrize("backend", BACKENDS)
@hostile_settings(25)
@given(st.integers(1, 2), st.integers(1, 20), st.data())
def test_hostile_draft_attention(backend, batch, seq, data):
    device = device_for(backend)
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    d, lq, ctx, hq, hkv = (8 if backend == "cpu" else 64), 3, 2, 2, 1
    g = torch.Generator().manual_seed(batch * 100 + seq)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    q, k_new, v_new = rand(batch, lq, hq, d), rand(batch, ctx + lq, hkv, d), rand(batch, ctx + lq, hkv, d)
    k_cache = Guarded((batch, hkv, seq, d), dtype, device, g)
    v_cache = Guarded((batch, hkv, seq, d), dtype, device, g)
    norm = torch.ones(d, device=device)
    cos, sin = torch.ones(batch, ctx + lq, d, device=device), torch.zeros(batch, ctx + lq, d, device=device)
    cache_len = index_tensor([data.draw(hostile(seq)) for _ in range(batch)], device)
    context_len = index_tensor([data.draw(hostile(ctx)) for _ in range(batch)], device) \
        if data.draw(st.booleans()) else None
    inputs = [q, k_new, v_new, cache_len, cos, sin] + ([context_len] if context_len is not None else [])
    run_unchecked(lambda: ops_for(backend).draft_attention(
        q, k_new, v_new, k_cache.tensor, v_cache.tensor, cache_len, norm, norm, cos, sin, ctx, 1e-6,
        None, data.draw(st.sampled_from([None, 1, 3])), context_len), inputs)
    assert k_cache.intact() and v_cache.intact()


@pytest.mark.parametrize("backend", BACKENDS)
@hostile_settings(25)
@given(st.integers(1, 2), st.integers(1, 6), st.integers(1, 40), st.data())
def test_hostile_tree_attention(backend, batch, n, seq, data):
    device = device_for(backend)
    dtype = torch.float32 if backend == "cpu" else torch.bfloat16
    d, hq, hkv = (8 if backend == "cpu" else 64), 2, 1
    g = torch.Generator().manual_seed(batch * 100 + n * 10 + seq)
    rand = lambda *s: torch.randn(*s, generator=g).to(device=device, dtype=dtype)
    q, k, v = rand(batch, n, hq, d), rand(batch, hkv, seq, d), rand(batch, hkv, seq, d)
    packed = torch.randint(-2**31, 2**31 - 1, (batch, n, (n + 31) // 32), generator=g,
                           dtype=torch.int64).to(torch.int32).to(device)
    past = index_tensor([data.draw(hostile(seq)) for _ in range(batch)], device)
    prefix = index_tensor([data.draw(hostile(seq)) for _ in range(batch)], device) \
        if data.draw(st.booleans()) else None
    inputs = [q, k, v, past, packed] + ([prefix] if prefix is not None else [])
    run_unchecked(lambda: ops_for(backend).tree_attention(
        q, k, v, past, packed, None, prefix, data.draw(st.sampled_from([None, 1, 2]))), inputs)


@pytest.mark.parametrize("backend", BACKENDS)
@hostile_settings(40)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(0, 12), st.data())
def test_hostile_tree_visibility(backend, batch, n, past, data):
    device = device_for(backend)
    parents = index_tensor([[data.draw(hostile(n)) for _ in range(n)] for _ in range(batch)], device)
    if data.draw(st.booleans()):
        parents = parents.clamp(-2**31, 2**31 - 1).to(torch.int32)
    num_nodes = index_tensor([data.draw(hostile(n)) for _ in range(batch)], device)
    start = index_tensor([data.draw(st.sampled_from([-2**40, -1, 0, 7, 2**40]))
                          for _ in range(batch)], device)
    prefix = index_tensor([data.draw(hostile(past + 1)) for _ in range(batch)], device)
    ops = ops_for(backend)
    run_unchecked(lambda: ops.tree_visibility(parents, num_nodes, start),
                  [parents, num_nodes, start])
    mask = run_unchecked(lambda: ops.tree_attention_mask(parents, num_nodes, past, torch.float32,
                                                         prefix, start),
                         [parents, num_nodes, prefix, start])
    assert mask.shape == (batch, 1, n, past + n)
