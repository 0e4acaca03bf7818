"""tree_topk and the draft_to_tree chain: reference.py, golden vectors, emulated kernel, bad input."""
import math

import pytest
import torch

import ddtree
from ddtree.ops import reference
from helpers import cuda_available, KERNEL_BACKENDS, kernel_device

ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def topk(backend, logits, k):
    if backend == "cpu":
        return torch.ops.ddtree.tree_topk(logits, k)
    ops = torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree
    lp, ids = ops.tree_topk(logits.to(kernel_device(backend)), k)
    return lp.cpu(), ids.cpu()


def check(backend, logits, k):
    lp, ids = topk(backend, logits, k)
    ref_lp, ref_ids = reference.tree_topk(logits, k)
    assert lp.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    # Log-sum-exp accumulation order differs (fp32): a few ulps of the row's scale.
    finite = ref_lp[torch.isfinite(ref_lp)]
    scale = 1 + (finite.abs().max().item() if finite.numel() else 0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=2e-6 * scale, equal_nan=True)


SHAPES = [(2, 3, 50, 5), (1, 2, 3000, 64), (2, 2, 777, 1), (1, 1, 2500, 1024), (1, 2, 1024, 1024),
          (3, 1, 5, 5), (1, 1, 1, 1)]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_matches_reference(backend, dtype, shape):
    b, l, v, k = shape
    g = torch.Generator().manual_seed(v * 31 + k)
    check(backend, (torch.randn(b, l, v, generator=g) * 3).to(dtype), k)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("k", [1, 8, 1024])
def test_candidate_buffer_compaction(backend, k):
    """Vocabularies beyond the kernel's candidate buffer (4096 keys): random rows compact once,
    ascending rows (every token beats the running k-th best) compact again and again."""
    g = torch.Generator().manual_seed(k)
    random_row = torch.randn(1, 1, 10000, generator=g)
    ascending = torch.arange(12000, dtype=torch.float32).reshape(1, 1, -1) / 1000
    check(backend, torch.cat([random_row[..., :9000], ascending[..., :9000]], 1), k)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_ties_go_to_the_lower_token_id(backend):
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(2, 3, 3000, generator=g).round()  # thousands of exact ties
    check(backend, logits, 100)
    flat = torch.zeros(1, 1, 2100)  # all equal: ids 0..k-1
    lp, ids = topk(backend, flat, 70)
    assert ids[0, 0].tolist() == list(range(70))
    torch.testing.assert_close(lp, torch.full_like(lp, -math.log(2100)))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_nan_and_inf_logits(backend):
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(1, 4, 1500, generator=g)
    logits[0, 0, 7] = math.nan          # a NaN makes the row's log-probs NaN (never in a tree)
    logits[0, 1, 100:] = -math.inf      # only 100 finite candidates
    logits[0, 2, :] = math.nan
    logits[0, 3, ::2] = -math.inf
    check(backend, logits, 300)
    lp, ids = topk(backend, logits, 300)
    assert ids[0, 1, :100].sort().values.tolist() == list(range(100))
    assert torch.isinf(lp[0, 1, 100:]).all()


def test_golden_top_k(golden):
    """The golden top-k inputs: same ids (ties aside, where torch's order is unspecified) and the
    same log-probs to float32 rounding."""
    cases, tensors = golden
    for case in cases:
        if case["budget"] == 0:
            continue
        i = case["case"]
        logits = tensors[f"case{i}.logits"][None]
        k = tensors[f"case{i}.top_log_probs"].shape[1]
        lp, ids = torch.ops.ddtree.tree_topk(logits, k)
        gold_lp, gold_ids = tensors[f"case{i}.top_log_probs"], tensors[f"case{i}.top_token_ids"]
        torch.testing.assert_close(lp[0], gold_lp, rtol=0, atol=1e-5)
        if case["logit_scale"] > 0:  # continuous logits: no ties
            assert torch.equal(ids[0], gold_ids), f"case {i}"
        else:  # ties: same multiset of values per depth, ours ordered by id among equals
            assert torch.equal(lp[0], lp[0].sort(-1, descending=True).values)
            assert torch.equal(torch.gather(logits[0], -1, ids[0]).sort(-1).values,
                               torch.gather(logits[0], -1, gold_ids).sort(-1).values)


def test_golden_top_k_emulated_on_mid_size_cases(golden):
    cases, tensors = golden
    for case in cases:
        if case["budget"] == 0 or case["vocab"] > 2000 or case["logit_scale"] <= 0:
            continue
        i = case["case"]
        logits = tensors[f"case{i}.logits"][None]
        k = tensors[f"case{i}.top_log_probs"].shape[1]
        _, ids = torch.ops.ddtree_emu.tree_topk(logits[:, :3], k)
        assert torch.equal(ids[0], tensors[f"case{i}.top_token_ids"][:3]), f"case {i}"


def test_draft_to_tree_chains_the_ops(golden):
    """From raw golden logits to the reference's tree, with visibility and positions."""
    cases, tensors = golden
    for case in cases:
        if case["logit_scale"] <= 0:
            continue  # tie cases: torch's top-k order among equal logits is unspecified
        i = case["case"]
        logits = tensors[f"case{i}.logits"][None]
        tree, vis = ddtree.draft_to_tree(logits, torch.tensor([case["bonus_token"]]), case["budget"],
                                         start=40)
        n = case["num_nodes"] + 1
        assert int(tree.num_nodes[0]) == n
        assert torch.equal(tree.node_tokens[0, 1:n], tensors[f"case{i}.node_token_ids"]), f"case {i}"
        assert torch.equal(tree.parents[0, :n], tensors[f"case{i}.parents"])
        assert torch.equal(vis.visible[0, :n, :n], tensors[f"case{i}.visibility"])
        assert torch.equal(vis.positions[0, :n], 40 + tree.depths[0, :n])


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    logits = torch.randn(2, 3, 100)
    torch.library.opcheck(getattr(torch.ops, namespace).tree_topk.default, (logits, 7))
    torch.library.opcheck(getattr(torch.ops, namespace).tree_topk.default, (logits.half(), 1))


def test_bad_input():
    x = torch.randn(2, 3, 100)
    with pytest.raises(RuntimeError, match=r"logits must be a 3-D tensor \[B, L, V\]"):
        torch.ops.ddtree.tree_topk(x[0], 5)
    with pytest.raises(RuntimeError, match="logits must be float32, bfloat16 or float16, got Double"):
        torch.ops.ddtree.tree_topk(x.double(), 5)
    with pytest.raises(RuntimeError, match="k = 101 exceeds the vocabulary size V = 100"):
        torch.ops.ddtree.tree_topk(x, 101)
    with pytest.raises(RuntimeError, match=r"k must be in \[0, 1024\], got 2000"):
        torch.ops.ddtree.tree_topk(torch.randn(1, 1, 3000), 2000)
    with pytest.raises(RuntimeError, match=r"k must be in \[0, 1024\], got -1"):
        torch.ops.ddtree.tree_topk(x, -1)


def test_empty_shapes():
    lp, ids = torch.ops.ddtree.tree_topk(torch.randn(0, 3, 10), 4)
    assert lp.shape == (0, 3, 4)
    lp, ids = torch.ops.ddtree_emu.tree_topk(torch.randn(2, 3, 10), 0)
    assert ids.shape == (2, 3, 0)


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
def test_cuda_large_vocabulary():
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(4, 15, 262144, generator=g).to(torch.bfloat16)
    check("cuda", logits, 1024)
    check("cuda", logits[:, :, :151936].contiguous(), 64)


@pytest.mark.parametrize("threads", [3, 4, 16])
def test_cpu_rows_split_over_threads(threads):
    """Fewer rows than threads: each row is split into vocabulary ranges whose partial
    log-sum-exps and top-k lists are merged — same ids and log-probs as one pass."""
    g = torch.Generator().manual_seed(threads)
    logits = torch.randn(1, 2, 70000, generator=g) * 3
    special = logits.clone()
    special[0, 0, 69999] = 50.0            # the max in the last range: rescaling on merge
    special[0, 1, 20000:] = -math.inf      # later ranges hold nothing finite
    nan_row = torch.randn(1, 1, 70000, generator=g)
    nan_row[0, 0, 65000] = math.nan        # a NaN in one range only
    inf_row = torch.randn(1, 1, 70000, generator=g)
    inf_row[0, 0, 3] = math.inf
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for x, k in ((logits, 64), (special, 1024), (nan_row, 5), (inf_row, 3)):
            check("cpu", x, k)
    finally:
        torch.set_num_threads(before)


def selection_rows():
    """Rows for the CPU log-sum-exp pass and the floor-guided selection: the max jumping by more
    than the pass's headroom mid-row, +inf / NaN mid-row, large logits (the m log2 e rounding
    correction), ties at the floor, few real values (no finite floor), a plateau of equal maxima."""
    g = torch.Generator().manual_seed(12)
    V = 40000
    rows = torch.randn(9, V, generator=g) * 3
    rows[0, 30001] = 200.0                       # jump far above the running max
    rows[0, 35000:35300] = 150.0
    rows[1, 20000] = math.inf
    rows[2, 17] = math.nan
    rows[3] *= 2000.0                            # |logits| in the thousands
    rows[4] = rows[4].round()                    # many ties, some exactly at the floor
    rows[5, :] = -math.inf
    rows[5, ::997] = torch.arange(len(range(0, V, 997)), dtype=torch.float32)  # 41 real values
    rows[6, :] = 7.0                             # every value equal: ids decide
    rows[7, 5000:] = -100.0                      # later blocks far below the max, exps ~0
    rows[8] = torch.linspace(-50, 50, V)         # ascending: each block raises the max
    return rows.reshape(1, 9, V)


SELECTION_K = (1, 5, 64, 300, 1024)


def test_cpu_selection_edge_rows():
    logits = selection_rows()
    for threads in (1, 2, 3):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            for k in SELECTION_K:
                check("cpu", logits, k)
        finally:
            torch.set_num_threads(before)


def test_cpu_baseline_isa_loops():
    """The CPU loops built for the baseline instruction set (picked on CPUs without AVX2 + FMA;
    DDTREE_CPU_ISA=baseline forces them) against the reference, in a fresh process."""
    import os
    import pathlib
    import subprocess
    import sys
    here = pathlib.Path(__file__).resolve().parent
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import test_ops_topk as t\n"
        "t.test_cpu_selection_edge_rows()\n"
        "for shape in t.SHAPES:\n"
        "    b, l, v, k = shape\n"
        "    g = torch.Generator().manual_seed(v)\n"
        "    t.check('cpu', torch.randn(b, l, v, generator=g) * 3, k)\n"
        "lp, _ = torch.ops.ddtree.tree_topk(torch.zeros(1, 1, 3), 1)\n"
        "print('ok')\n")
    env = dict(os.environ, DDTREE_CPU_ISA="baseline")
    out = subprocess.run([sys.executable, "-c", script, str(here)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


# ---- chain_tree: the K = 1 tree straight from the logits ----

def chain(backend, logits, roots):
    if backend == "cpu":
        out = torch.ops.ddtree.chain_tree(logits, roots)
    else:
        ops = torch.ops.ddtree_emu if backend == "emulated" else torch.ops.ddtree
        dev = kernel_device(backend)
        out = ops.chain_tree(logits.to(dev), roots.to(dev))
    return tuple(t.cpu() for t in out)


def check_chain(backend, logits, roots):
    got = chain(backend, logits, roots)
    want = reference.chain_tree(logits, roots)
    for name, a, b in zip(ddtree.DraftTree._fields, got, want):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 15, 300), (1, 3, 5000), (3, 1, 17), (1, 4, 1)],
                         ids=lambda s: "x".join(map(str, s)))
def test_chain_tree_matches_the_reference(backend, dtype, shape):
    b, l, v = shape
    g = torch.Generator().manual_seed(v + l)
    logits = (torch.randn(b, l, v, generator=g) * 3).to(dtype)
    check_chain(backend, logits, torch.randint(0, v, (b,), generator=g))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_chain_tree_stops_at_the_first_depth_without_a_real_top_1(backend):
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(5, 6, 400, generator=g).round()  # exact ties: lower id wins
    logits[0, 2, 123] = math.nan                          # chain of 2 nodes
    logits[1, 0, :] = -math.inf                           # root only
    logits[2, 4, 9] = math.inf                            # chain of 4
    logits[3, 3, :] = math.nan                            # chain of 3
    logits[4, :, 200:] = -math.inf                        # -inf tail: full chain
    logits[4, 5, 0] = math.nan
    roots = torch.tensor([1, 2, 3, 4, 5])
    check_chain(backend, logits, roots)
    assert chain(backend, logits, roots)[5].tolist() == [3, 1, 5, 4, 6]


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_chain_tree_equals_draft_to_tree_with_k_1(threads):
    g = torch.Generator().manual_seed(threads)
    logits = torch.randn(1, 15, 40000, generator=g)
    logits[0, 7, 39999] = 30.0  # the best in the last vocabulary range
    roots = torch.tensor([5])
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        tree, vis = ddtree.chain_to_tree(logits, roots, start=torch.tensor([9]))
        want, want_vis = ddtree.draft_to_tree(logits, roots, 15, start=torch.tensor([9]), k=1)
    finally:
        torch.set_num_threads(before)
    for a, b in zip(tree[:6] + vis, want[:6] + want_vis):  # chain trees carry no path_logprobs
        assert torch.equal(a, b)
    assert int(tree.node_tokens[0, 8]) == 39999


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_chain_tree_opcheck(namespace):
    op = getattr(torch.ops, namespace).chain_tree.default
    torch.library.opcheck(op, (torch.randn(2, 3, 100), torch.tensor([1, 2])))
    torch.library.opcheck(op, (torch.randn(1, 15, 64).half(), torch.tensor([0], dtype=torch.int32)))


def test_chain_tree_bad_input():
    x = torch.randn(2, 3, 100)
    roots = torch.tensor([1, 2])
    with pytest.raises(RuntimeError, match=r"chain_tree: logits must be a 3-D tensor \[B, L, V\]"):
        torch.ops.ddtree.chain_tree(x[0], roots)
    with pytest.raises(RuntimeError, match="chain_tree: logits must be float32, bfloat16 or float16"):
        torch.ops.ddtree.chain_tree(x.double(), roots)
    with pytest.raises(RuntimeError, match=r"chain_tree: root_tokens must have shape \[B\]"):
        torch.ops.ddtree.chain_tree(x, roots[:1])
    with pytest.raises(RuntimeError, match="root_tokens"):
        torch.ops.ddtree.chain_tree(x, roots.float())
    with pytest.raises(RuntimeError, match=r"vocabulary size V must be in \[1, 2\^31\)"):
        torch.ops.ddtree.chain_tree(torch.randn(1, 2, 0), roots[:1])
    out = torch.ops.ddtree.chain_tree(torch.randn(0, 3, 10), roots[:0])
    assert out[0].shape == (0, 4)


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
def test_chain_tree_cuda_large_vocabulary():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(2, 15, 151936, generator=g).to(torch.bfloat16)
    check_chain("cuda", logits, torch.tensor([3, 4]))
