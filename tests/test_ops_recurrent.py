"""Recurrent-state branch forking (spec §6-§7): tree_causal_conv1d, tree_gated_delta_rule and
commit_recurrent_ against the ancestor-path oracle — transformers' own Qwen3.5 chain functions run
on each node's root->node path — and against reference.py; emulated CUDA kernels; bad input."""
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
from transformers.models.qwen3_5.modeling_qwen3_5 import (  # noqa: E402
    causal_conv1d_update,
    torch_recurrent_gated_delta_rule,
)

import ddtree  # noqa: E402
from ddtree.ops import reference  # noqa: E402
from helpers import KERNEL_BACKENDS, kernel_device  # noqa: E402

ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def ops_for(backend):
    return torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree


def random_parents(g, batch, n, shape):
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    counts = torch.zeros(batch, dtype=torch.int64)
    for b in range(batch):
        count = int(torch.randint(1, n + 1, (1,), generator=g)) if shape != "full" else n
        counts[b] = count
        for i in range(1, count):
            if shape == "chain":
                parents[b, i] = i - 1
            elif shape == "star":
                parents[b, i] = 0
            else:  # bushy and deep: hang under one of the last few nodes
                parents[b, i] = max(0, i - 1 - int(torch.randint(0, 3, (1,), generator=g)))
    return parents, counts


def depth_of(parents):
    depth = torch.zeros_like(parents)
    for b in range(parents.shape[0]):
        for i in range(parents.shape[1]):
            p = int(parents[b, i])
            depth[b, i] = depth[b, p] + 1 if p >= 0 else 0
    return int(depth.max()) if depth.numel() else 0


def gdn_case(seed, batch=2, n=9, hk=1, hv=2, dk=16, dv=12, pool=4, shape="bushy",
             dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    parents, counts = random_parents(g, batch, n, shape)
    q = torch.randn(batch, n, hk, dk, generator=g).to(dtype)
    k = torch.randn(batch, n, hk, dk, generator=g).to(dtype)
    v = torch.randn(batch, n, hv, dv, generator=g).to(dtype)
    a = torch.randn(batch, n, hv, generator=g)
    gate = -torch.exp(torch.randn(hv, generator=g)) * torch.nn.functional.softplus(a + 0.5)
    beta = torch.sigmoid(torch.randn(batch, n, hv, generator=g))
    state = torch.randn(pool, hv, dk, dv, generator=g) * 0.5
    slots = torch.randperm(pool, generator=g)[:batch]
    return q, k, v, gate, beta, state, slots, parents, counts


def run_gdn(backend, q, k, v, gate, beta, state, slots, parents, counts, max_depth=None):
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    max_depth = depth_of(parents) if max_depth is None else max_depth
    args = [t.to(dev) for t in (q, k, v, gate, beta, state, slots, parents, counts)]
    return ops_for(backend).tree_gated_delta_rule(*args, max_depth).cpu()


def oracle_gdn(q, k, v, gate, beta, state, slots, parents, counts):
    """transformers' torch_recurrent_gated_delta_rule on every node's path."""
    rep = v.shape[2] // k.shape[2]
    out = torch.zeros(v.shape, dtype=torch.float32)
    for b in range(q.shape[0]):
        for i in range(q.shape[1]):
            path = reference.tree_path(parents[b], int(counts[b]), i)
            o, _ = torch_recurrent_gated_delta_rule(
                q[b, path][None].float().repeat_interleave(rep, 2),
                k[b, path][None].float().repeat_interleave(rep, 2),
                v[b, path][None].float(), g=gate[b, path][None], beta=beta[b, path][None],
                initial_state=state[int(slots[b])][None].clone(), output_final_state=True,
                use_qk_l2norm_in_kernel=True)
            out[b, i] = o[0, -1]
    return out


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("shape", ["bushy", "chain", "star", "full"])
def test_gdn_node_output_equals_transformers_chain_on_its_path(backend, shape):
    for seed in range(3):
        case = gdn_case(seed, shape=shape, hk=1 + seed % 2, hv=2 * (1 + seed % 2))
        state_before = case[5].clone()
        got = run_gdn(backend, *case)
        torch.testing.assert_close(got, oracle_gdn(*case), rtol=1e-5, atol=1e-5)
        assert torch.equal(case[5], state_before)  # the committed state is not modified


def test_gdn_larger_trees_cpu():
    for n, shape in [(65, "bushy"), (257, "bushy"), (1, "chain"), (40, "chain")]:
        case = gdn_case(n, batch=2, n=n, hk=2, hv=4, dk=32, dv=32, shape=shape)
        torch.testing.assert_close(run_gdn("cpu", *case), reference.tree_gated_delta_rule(*case),
                                   rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_gdn_kernel_matches_cpu(backend):
    for seed, dims in enumerate([(16, 12), (64, 64), (128, 70), (130, 8)]):
        case = gdn_case(seed, batch=2, n=7, dk=dims[0], dv=dims[1])
        torch.testing.assert_close(run_gdn(backend, *case), run_gdn("cpu", *case), rtol=1e-5,
                                   atol=1e-5)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_gdn_bf16_inputs(backend):
    case = gdn_case(3, dtype=torch.bfloat16)
    got = run_gdn(backend, *case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.tree_gated_delta_rule(*case), rtol=2e-2,
                               atol=2e-2)


def test_siblings_do_not_see_each_other():
    """Adding a sibling subtree (and renumbering nothing before it) leaves earlier nodes' outputs
    unchanged; a node's output depends only on its path."""
    case = list(gdn_case(11, batch=1, n=6, shape="chain"))
    base = run_gdn("cpu", *case)
    grown = [t.clone() for t in case]
    g = torch.Generator().manual_seed(5)
    for idx in (0, 1, 2):  # q, k, v: two extra rows
        extra = torch.randn(1, 2, *case[idx].shape[2:], generator=g)
        grown[idx] = torch.cat([case[idx], extra], 1)
    grown[3] = torch.cat([case[3], -torch.rand(1, 2, case[3].shape[2], generator=g)], 1)
    grown[4] = torch.cat([case[4], torch.rand(1, 2, case[4].shape[2], generator=g)], 1)
    grown[7] = torch.cat([case[7], torch.tensor([[1, 6]])], 1)  # siblings under node 1
    grown[8] = torch.tensor([8])
    out = run_gdn("cpu", *grown)
    torch.testing.assert_close(out[:, :6], base, rtol=0, atol=0)


# ---- short convolution ----

def conv_case(seed, batch=2, n=9, channels=10, width=4, pool=3, shape="bushy", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    parents, counts = random_parents(g, batch, n, shape)
    x = torch.randn(batch, n, channels, generator=g).to(dtype)
    conv_state = torch.randn(pool, channels, width, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g)
    bias = torch.randn(channels, generator=g)
    slots = torch.randperm(pool, generator=g)[:batch]
    return x, conv_state, slots, weight, bias, parents, counts


def oracle_conv(x, conv_state, slots, weight, bias, parents, counts, activation="silu"):
    out = torch.zeros(x.shape, dtype=torch.float32)
    for b in range(x.shape[0]):
        for i in range(x.shape[1]):
            path = reference.tree_path(parents[b], int(counts[b]), i)
            state = conv_state[int(slots[b])][None].float().clone()
            y = causal_conv1d_update(x[b, path].float().t()[None], state, weight, bias, activation)
            out[b, i] = y[0, :, -1]
    return out


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("shape", ["bushy", "chain", "star"])
@pytest.mark.parametrize("width", [4, 2, 1])
def test_conv_node_output_equals_transformers_update_on_its_path(backend, shape, width):
    case = conv_case(width, shape=shape, width=width)
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    got = ops_for(backend).tree_causal_conv1d(*(t.to(dev) for t in case), "silu").cpu()
    torch.testing.assert_close(got, oracle_conv(*case), rtol=1e-5, atol=1e-5)
    no_act = ops_for(backend).tree_causal_conv1d(*(t.to(dev) for t in case), None).cpu()
    torch.testing.assert_close(no_act, oracle_conv(*case, activation=None), rtol=1e-5, atol=1e-5)


def test_conv_reference_and_bf16():
    case = conv_case(7, dtype=torch.bfloat16, n=30)
    got = ddtree.tree_causal_conv1d(*case)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), reference.tree_causal_conv1d(*case), rtol=2e-2, atol=2e-2)
    emu = torch.ops.ddtree_emu.tree_causal_conv1d(*case, "silu")
    assert torch.equal(emu, got)


# ---- commit ----

def commit_case(seed, accept):
    q, k, v, gate, beta, state, slots, parents, counts = gdn_case(seed, batch=2, n=9, shape="chain")
    g = torch.Generator().manual_seed(seed + 100)
    conv_x = torch.randn(2, 9, 10, generator=g)
    conv_state = torch.randn(4, 10, 4, generator=g)
    accepted = torch.full((2, 9), -1, dtype=torch.int64)
    lengths = torch.tensor(accept)
    for b, n_acc in enumerate(accept):
        accepted[b, :n_acc] = torch.arange(n_acc)
    return state, conv_state, slots, k, v, gate, beta, conv_x, accepted, lengths, q


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("accept", [(1, 5), (3, 9), (0, 2)])
def test_commit_equals_chain_final_state_on_the_accepted_path(backend, accept):
    state, conv_state, slots, k, v, gate, beta, conv_x, accepted, lengths, q = commit_case(1, accept)
    exp_state, exp_conv = state.clone(), conv_state.clone()
    rep = v.shape[2] // k.shape[2]
    for b in range(2):
        path = list(range(accept[b]))
        if not path:
            continue
        slot = int(slots[b])
        _, final = torch_recurrent_gated_delta_rule(
            q[b, path][None].repeat_interleave(rep, 2), k[b, path][None].repeat_interleave(rep, 2),
            v[b, path][None], g=gate[b, path][None], beta=beta[b, path][None],
            initial_state=state[slot][None].clone(), output_final_state=True,
            use_qk_l2norm_in_kernel=True)
        exp_state[slot] = final[0]
        window = conv_state[slot][None].clone()
        causal_conv1d_update(conv_x[b, path].t()[None], window, torch.ones(10, 4), None, None)
        exp_conv[slot] = window[0]
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    st, cs = state.clone().to(dev), conv_state.clone().to(dev)
    ops_for(backend).commit_recurrent_(st, cs, *(t.to(dev) for t in (slots, k, v, gate, beta, conv_x,
                                                                     accepted, lengths)))
    torch.testing.assert_close(st.cpu(), exp_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cs.cpu(), exp_conv, rtol=0, atol=0)
    ref_state, ref_conv = reference.commit_recurrent(state, conv_state, slots, k, v, gate, beta,
                                                     conv_x, accepted, lengths)
    torch.testing.assert_close(st.cpu(), ref_state, rtol=1e-5, atol=1e-5)


def test_commit_then_next_round_continues_the_chain():
    """Tree round, commit of a deep branch, then a second round from the committed state: the
    outputs equal one long chain over [path of round 1, path of round 2]."""
    q, k, v, gate, beta, state, slots, parents, counts = gdn_case(21, batch=1, n=10, shape="bushy")
    rep = v.shape[2] // k.shape[2]
    leaf = int(counts[0]) - 1
    path = reference.tree_path(parents[0], int(counts[0]), leaf)
    accepted = torch.full((1, 10), -1, dtype=torch.int64)
    accepted[0, : len(path)] = torch.tensor(path)
    conv_x = torch.randn(1, 10, 3)
    conv_state = torch.zeros(4, 3, 4)
    pool = state.clone()
    ddtree.commit_recurrent_(pool, conv_state, slots, k, v, gate, beta, conv_x, accepted,
                             torch.tensor([len(path)]))
    out2 = ddtree.tree_gated_delta_rule(q, k, v, gate, beta, pool, slots, parents, counts, 9)
    for i in range(int(counts[0])):
        second = reference.tree_path(parents[0], int(counts[0]), i)
        full = path + second
        o, _ = torch_recurrent_gated_delta_rule(
            q[0, full][None].repeat_interleave(rep, 2), k[0, full][None].repeat_interleave(rep, 2),
            v[0, full][None], g=gate[0, full][None], beta=beta[0, full][None],
            initial_state=state[int(slots[0])][None].clone(), output_final_state=False,
            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out2[0, i], o[0, -1], rtol=1e-4, atol=1e-5)


# ---- opcheck and bad input ----

@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    ops = getattr(torch.ops, namespace)
    case = gdn_case(0, n=5)
    torch.library.opcheck(ops.tree_gated_delta_rule.default, (*case, depth_of(case[7])))
    torch.library.opcheck(ops.tree_causal_conv1d.default, (*conv_case(0, n=5), "silu"))
    c = commit_case(0, (2, 3))
    torch.library.opcheck(ops.commit_recurrent_.default, c[:10])


def test_bad_input():
    q, k, v, gate, beta, state, slots, parents, counts = gdn_case(0)
    d = depth_of(parents)
    gdn = torch.ops.ddtree.tree_gated_delta_rule
    with pytest.raises(RuntimeError, match="Hv = 3 must be a multiple of the number of key heads Hk = 2"):
        gdn(q.repeat(1, 1, 2, 1), k.repeat(1, 1, 2, 1), torch.randn(2, 9, 3, 12), gate[..., :1].repeat(1, 1, 3),
            beta[..., :1].repeat(1, 1, 3), torch.zeros(4, 3, 16, 12), slots, parents, counts, d)
    with pytest.raises(RuntimeError, match=r"state must be a pool \[P, Hv, Dk, Dv\]"):
        gdn(q, k, v, gate, beta, state[:, :, :8], slots, parents, counts, d)
    with pytest.raises(RuntimeError, match="state must be float32"):
        gdn(q, k, v, gate, beta, state.double(), slots, parents, counts, d)
    with pytest.raises(RuntimeError, match=r"slots must index the state pool's 4 rows"):
        gdn(q, k, v, gate, beta, state, torch.tensor([0, 4]), parents, counts, d)
    bad = parents.clone()
    bad[0, 1] = 1
    with pytest.raises(RuntimeError, match=r"parents\[0, 1\] = 1 must be smaller than its own index"):
        gdn(q, k, v, gate, beta, state, slots, bad, counts.clamp(min=2), d)
    with pytest.raises(RuntimeError, match=r"depth .* > max_depth = 0"):
        gdn(q, k, v, gate, beta, state, slots, parents, counts.clamp(min=2), 0)
    with pytest.raises(RuntimeError, match="q, k and v must share one dtype"):
        gdn(q.double(), k, v, gate, beta, state, slots, parents, counts, d)
    with pytest.raises(RuntimeError, match=r"g must have shape \[B, N, Hv\]"):
        gdn(q, k, v, gate[:, :3], beta, state, slots, parents, counts, d)
    x, conv_state, cslots, weight, bias, cparents, ccounts = conv_case(0)
    conv = torch.ops.ddtree.tree_causal_conv1d
    with pytest.raises(RuntimeError, match=r"kernel width W = 9 must be in \[1, 8\]"):
        conv(x, torch.zeros(3, 10, 9), cslots, torch.zeros(10, 9), bias, cparents, ccounts, "silu")
    with pytest.raises(RuntimeError, match='activation must be "silu" or None'):
        conv(x, conv_state, cslots, weight, bias, cparents, ccounts, "gelu")
    with pytest.raises(RuntimeError, match="conv_state must have x's dtype"):
        conv(x, conv_state.double(), cslots, weight, bias, cparents, ccounts, "silu")
    with pytest.raises(RuntimeError, match=r"parents must have shape \[B, N\]"):
        conv(x, conv_state, cslots, weight, bias, cparents[:, :3], ccounts, "silu")
    c = list(commit_case(0, (2, 3))[:10])
    c[9] = torch.tensor([2, 12])
    with pytest.raises(RuntimeError, match=r"accept_len\[1\] = 12 must be in \[0, 9\]"):
        torch.ops.ddtree.commit_recurrent_(*c)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("layers,accept", [(3, (3, 6)), (35, (4, 2))], ids=["3-layers", "35-layers"])
def test_commit_recurrent_layers_commits_every_layer_like_the_reference(backend, layers, accept):
    """One op call for several layers (different states, conv pools and saved tensors, shared
    paths), also more than the 32 one launch carries: each layer equals reference.commit_recurrent
    on its own inputs."""
    cases = [commit_case(seed + 2, accept) for seed in range(layers)]
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    states = [c[0].clone().to(dev) for c in cases]
    convs = [c[1].clone().to(dev) for c in cases]
    slots, accepted, lengths = cases[0][2], cases[0][8], cases[0][9]
    lists = [[c[i].to(dev) for c in cases] for i in (3, 4, 5, 6, 7)]  # k, v, g, beta, conv_x
    ops_for(backend).commit_recurrent_layers_(states, convs, slots.to(dev), *lists,
                                              accepted.to(dev), lengths.to(dev))
    for c, st, cs in zip(cases, states, convs):
        ref_state, ref_conv = reference.commit_recurrent(c[0], c[1], slots, c[3], c[4], c[5], c[6],
                                                         c[7], accepted, lengths)
        torch.testing.assert_close(st.cpu(), ref_state, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cs.cpu(), ref_conv, rtol=0, atol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_gdn_and_commit_read_q_k_v_as_views_of_the_conv_output(backend):
    """q / k / v as the hybrid loop passes them: slices of one [B, N, 2 Hk Dk + Hv Dv] conv output
    (token stride wider than a head group; read in place). Output and commit equal the reference
    on the same values."""
    q, k, v, gate, beta, state, slots, parents, counts = gdn_case(7, hk=2, hv=4, dk=16, dv=8)
    b, n = k.shape[:2]
    mixed = torch.cat([x.reshape(b, n, -1) for x in (q, k, v)], -1)
    dev = "cpu" if backend == "cpu" else kernel_device(backend)
    views = mixed.to(dev)
    qd, kd, vd = (t.reshape(b, n, h, -1) for t, h in
                  zip(torch.split(views, [32, 32, 32], -1), (2, 2, 4)))
    assert not kd.is_contiguous()
    rest = [t.to(dev) for t in (gate, beta, state, slots, parents, counts)]
    got = ops_for(backend).tree_gated_delta_rule(qd, kd, vd, *rest, depth_of(parents)).cpu()
    torch.testing.assert_close(got, reference.tree_gated_delta_rule(q, k, v, gate, beta, state,
                                                                     slots, parents, counts),
                               rtol=1e-5, atol=1e-5)
    conv_state = torch.randn(4, 96, 4)
    accepted = torch.full((b, n), -1)
    paths = [reference.tree_path(parents[r], int(counts[r]), int(counts[r]) - 1) for r in range(b)]
    lengths = torch.tensor([min(3, len(paths[0])), 1])
    for r in range(b):
        accepted[r, : lengths[r]] = torch.tensor(paths[r][: lengths[r]])
    st, cs = state.clone().to(dev), conv_state.clone().to(dev)
    ops_for(backend).commit_recurrent_(st, cs, slots.to(dev), kd, vd, gate.to(dev), beta.to(dev),
                                       views, accepted.to(dev), lengths.to(dev))
    want_state, want_conv = reference.commit_recurrent(state, conv_state, slots, k, v, gate, beta,
                                                       mixed, accepted, lengths)
    torch.testing.assert_close(st.cpu(), want_state, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cs.cpu(), want_conv, rtol=0, atol=0)


@pytest.mark.parametrize("layers,launches", [(1, 1), (3, 1), (32, 1), (33, 2)])
def test_commit_recurrent_layers_launch_count(layers, launches):
    """The emulated kernels count grids: one launch commits the GDN states and conv windows of up
    to 32 layers."""
    from ddtree import _C

    cases = [commit_case(seed % 4, (3, 6)) for seed in range(layers)]
    lists = [[c[i].clone() for c in cases] for i in range(8)]
    before = _C.emulator_grids_run()
    torch.ops.ddtree_emu.commit_recurrent_layers_(lists[0], lists[1], cases[0][2], *lists[3:],
                                                  cases[0][8], cases[0][9])
    assert _C.emulator_grids_run() - before == launches


def test_commit_recurrent_layers_opcheck_and_bad_input():
    state, conv_state, slots, k, v, gate, beta, conv_x, accepted, lengths, _ = commit_case(5, (2, 4))
    for namespace in ("ddtree", "ddtree_emu"):
        op = getattr(torch.ops, namespace).commit_recurrent_layers_
        torch.library.opcheck(op.default, ([state.clone()], [conv_state.clone()], slots, [k], [v],
                                           [gate], [beta], [conv_x], accepted, lengths))
    other = commit_case(6, (2, 4))
    with pytest.raises(RuntimeError, match="layer 1's tensors must have layer 0's shapes"):
        torch.ops.ddtree.commit_recurrent_layers_(
            [state, other[0]], [conv_state, other[1][:, :6].contiguous()], slots, [k, other[3]],
            [v, other[4]], [gate, other[5]], [beta, other[6]], [conv_x, other[7][..., :6]],
            accepted, lengths)
    with pytest.raises(RuntimeError, match="v holds 2 tensors, states holds 1"):
        torch.ops.ddtree.commit_recurrent_layers_([state], [conv_state], slots, [k], [v, v], [gate],
                                                  [beta], [conv_x], accepted, lengths)
