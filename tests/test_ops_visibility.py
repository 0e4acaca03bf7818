"""tree_visibility / tree_attention_mask: golden vectors, random trees vs reference.py, the CUDA
kernel through the SIMT emulator (and on a GPU when present), fake kernels, bad input."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

import ddtree
from ddtree.ops import reference
from helpers import cuda_available, KERNEL_BACKENDS, kernel_device

OPS = {"cpu": torch.ops.ddtree, "emulated": torch.ops.ddtree_emu, "cuda": torch.ops.ddtree}
ALL_BACKENDS = [pytest.param("cpu", id="cpu")] + KERNEL_BACKENDS


def run_visibility(backend, parents, num_nodes, start):
    dev = kernel_device(backend) if backend != "cpu" else "cpu"
    out = OPS[backend].tree_visibility(parents.to(dev), num_nodes.to(dev), start.to(dev))
    return tuple(t.cpu() for t in out)


def run_mask(backend, parents, num_nodes, past, dtype):
    dev = kernel_device(backend) if backend != "cpu" else "cpu"
    return OPS[backend].tree_attention_mask(parents.to(dev), num_nodes.to(dev), past, dtype).cpu()


def golden_batch(golden):
    """All golden trees as one padded batch: parents [14, 1025]."""
    cases, tensors = golden
    n_max = max(c["num_nodes"] for c in cases) + 1
    parents = torch.full((len(cases), n_max), -1, dtype=torch.int64)
    counts = torch.zeros(len(cases), dtype=torch.int64)
    for row, case in enumerate(cases):
        p = tensors[f"case{case['case']}.parents"]
        parents[row, : p.numel()] = p
        counts[row] = p.numel()
    return parents, counts


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_golden_visibility_and_positions(golden, backend):
    cases, tensors = golden
    parents, counts = golden_batch(golden)
    start = torch.arange(len(cases), dtype=torch.int64) * 1000 + 7
    visible, packed, positions = run_visibility(backend, parents, counts, start)
    n_max = parents.shape[1]
    for row, case in enumerate(cases):
        i = case["case"]
        n = int(counts[row])
        gold = tensors[f"case{i}.visibility"]
        assert torch.equal(visible[row, :n, :n], gold), f"case {i}"
        assert not visible[row, :n, n:].any() and not visible[row, n:, :n].any()
        assert torch.equal(visible[row, n:, n:], torch.eye(n_max - n, dtype=torch.bool))
        depths = torch.cat([torch.zeros(1, dtype=torch.int64), tensors[f"case{i}.node_depths"]])
        assert torch.equal(positions[row, :n], start[row] + depths), f"case {i}"
        assert torch.equal(positions[row, n:], start[row].expand(n_max - n))
        full = torch.eye(n_max, dtype=torch.bool)
        full[:n, :n] = gold
        assert torch.equal(packed[row], reference.pack_rows(full)), f"case {i}"


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_golden_attention_mask(golden, backend):
    parents, counts = golden_batch(golden)
    parents, counts = parents[:6, :300], counts[:6].clamp(max=300)
    parents[torch.arange(300).expand(6, 300) >= counts[:, None]] = -1
    got = run_mask(backend, parents, counts, 5, torch.float32)
    assert torch.equal(got, reference.tree_attention_mask(parents, counts, 5, torch.float32))


@st.composite
def padded_trees(draw, max_batch=4, max_n=70):
    batch = draw(st.integers(0, max_batch))
    n = draw(st.integers(0, max_n))
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    counts = []
    for b in range(batch):
        count = draw(st.integers(0, n))
        shape = draw(st.sampled_from(["random", "chain", "star", "forest"]))
        for i in range(1, count):
            if shape == "chain":
                parents[b, i] = i - 1
            elif shape == "star":
                parents[b, i] = 0
            else:
                low = -1 if shape == "forest" else 0
                parents[b, i] = draw(st.integers(low, i - 1))
        counts.append(count)
    dtype = draw(st.sampled_from([torch.int32, torch.int64]))
    start = torch.tensor([draw(st.integers(0, 5000)) for _ in range(batch)], dtype=torch.int64)
    return parents.to(dtype), torch.tensor(counts, dtype=torch.int64), start


def check_against_reference(backend, trees):
    parents, counts, start = trees
    got = run_visibility(backend, parents, counts.to(torch.int32), start)
    expected = reference.tree_visibility(parents, counts, start)
    for g, e, name in zip(got, expected, ("visible", "packed", "positions")):
        assert torch.equal(g, e), name


@settings(max_examples=150, deadline=None)
@given(padded_trees())
def test_random_trees_cpu_match_reference(trees):
    check_against_reference("cpu", trees)


@settings(max_examples=40, deadline=None)
@given(padded_trees(max_batch=3, max_n=40))
def test_random_trees_emulated_kernel_match_reference(trees):
    check_against_reference("emulated", trees)


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
@settings(max_examples=100, deadline=None)
@given(padded_trees(max_batch=6, max_n=300))
def test_random_trees_cuda_match_reference(trees):
    check_against_reference("cuda", trees)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("past", [0, 3, 37])
def test_attention_mask_dtypes(backend, dtype, past):
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, -1], [-1, 0, 1, 2, -1, -1, -1]], dtype=torch.int32)
    counts = torch.tensor([6, 4])
    got = run_mask(backend, parents, counts, past, dtype)
    expected = reference.tree_attention_mask(parents, counts, past, dtype)
    assert got.dtype == dtype and got.shape == (2, 1, 7, past + 7)
    assert torch.equal(got, expected)
    # Every row keeps at least its own column: a softmax over it stays finite.
    assert torch.isfinite(torch.softmax(got.float(), -1)).all()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_large_tree_uses_several_row_blocks(backend):
    n = 1025  # budget 1024 + root: 33 packed words, 17 row blocks on the GPU
    parents = torch.tensor([[-1] + [(i - 1) // 3 for i in range(1, n)]], dtype=torch.int64)
    counts = torch.tensor([n])
    got = run_visibility(backend, parents, counts, torch.tensor([0]))
    expected = reference.tree_visibility(parents, counts, 0)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_empty_shapes():
    for b, n in [(0, 5), (3, 0), (0, 0)]:
        parents = torch.full((b, n), -1, dtype=torch.int64)
        counts = torch.zeros(b, dtype=torch.int64)
        for ops in (torch.ops.ddtree, torch.ops.ddtree_emu):
            vis, packed, pos = ops.tree_visibility(parents, counts, torch.zeros(b, dtype=torch.int64))
            assert vis.shape == (b, n, n) and packed.shape == (b, n, (n + 31) // 32)
            assert pos.shape == (b, n)
            assert ops.tree_attention_mask(parents, counts, 2, torch.float32).shape == (b, 1, n, n + 2)


def test_non_contiguous_inputs():
    base = torch.tensor([[-1, -1], [0, 0], [0, 1], [1, 2]], dtype=torch.int64)
    parents = base.t()  # [2, 4], non-contiguous
    counts = torch.tensor([4, 4])
    got = ddtree.tree_visibility(parents, counts, start=torch.tensor([1, 2]))
    expected = reference.tree_visibility(parents.contiguous(), counts, torch.tensor([1, 2]))
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_python_wrapper_int_start():
    parents = torch.tensor([[-1, 0, 1]])
    out = ddtree.tree_visibility(parents, torch.tensor([3]), start=10)
    assert out.positions.tolist() == [[10, 11, 12]]


# ---- fake kernels, opcheck, torch.compile ----

def _sample_args():
    parents = torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 1, -1, -1]], dtype=torch.int64)
    return parents, torch.tensor([4, 3]), torch.tensor([5, 9])


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
def test_opcheck(namespace):
    ops = getattr(torch.ops, namespace)
    parents, counts, start = _sample_args()
    torch.library.opcheck(ops.tree_visibility.default, (parents, counts, start))
    torch.library.opcheck(ops.tree_attention_mask.default, (parents, counts, 3, torch.bfloat16))
    torch.library.opcheck(ops.tree_attention_mask.default,
                          (parents, counts, 3, torch.bfloat16, counts, start.clamp(max=3)))
    torch.library.opcheck(ops.tree_visibility.default, (parents.int(), counts.int(), start.int()))


def test_torch_compile_fullgraph():
    parents, counts, start = _sample_args()

    def f(p, c, s):
        vis, packed, pos = torch.ops.ddtree.tree_visibility(p, c, s)
        mask = torch.ops.ddtree.tree_attention_mask(p, c, 2, torch.float32)
        return vis.sum(-1), pos + 1, mask

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    for g, e in zip(compiled(parents, counts, start), f(parents, counts, start)):
        assert torch.equal(g, e)


# ---- bad input ----

BAD_INPUTS = [
    (lambda p, c, s: (p.float(), c, s), r"parents must be int32 or int64, got Float"),
    (lambda p, c, s: (p[0], c, s), r"parents must be a 2-D tensor \[B, N\]"),
    (lambda p, c, s: (p, c[:1], s), r"num_nodes must have shape \[B\] = \[2\]"),
    (lambda p, c, s: (p, c.float(), s), r"num_nodes must be int32 or int64"),
    (lambda p, c, s: (p, c, s[:1]), r"start must have shape \[B\] = \[2\]"),
    (lambda p, c, s: (p, torch.tensor([4, -1]), s), r"num_nodes\[1\] = -1 must be in \[0, N\]"),
    (lambda p, c, s: (p, torch.tensor([4, 6]), s), r"num_nodes\[1\] = 6 must be in \[0, N\] = \[0, 5\]"),
    (lambda p, c, s: (torch.tensor([[-1, 0, 2, 1, -1], [-1, 0, 1, -1, -1]]), c, s),
     r"parents\[0, 2\] = 2 must be smaller than its own index 2"),
    (lambda p, c, s: (torch.tensor([[-1, 0, 0, 5, -1], [-1, 0, 1, -1, -1]]), c, s),
     r"parents\[0, 3\] = 5 must be smaller than its own index 3"),
    (lambda p, c, s: (torch.tensor([[-1, 0, -7, 1, -1], [-1, 0, 1, -1, -1]]), c, s),
     r"parents\[0, 2\] = -7 is invalid"),
    (lambda p, c, s: (torch.tensor([[-1, 0, 0, 1, -1], [-1, 0, 1, 0, -1]]), c, s),
     r"parents\[1, 3\] = 0 is a padding row .* must be -1"),
]


@pytest.mark.parametrize("namespace", ["ddtree", "ddtree_emu"])
@pytest.mark.parametrize("make_bad, message", BAD_INPUTS)
def test_bad_input_is_rejected_with_a_clear_message(namespace, make_bad, message):
    ops = getattr(torch.ops, namespace)
    p, c, s = make_bad(*_sample_args())
    with pytest.raises(RuntimeError, match=message):
        ops.tree_visibility(p, c, s)
    with pytest.raises(RuntimeError, match=message):
        ops.tree_attention_mask(p, c, 1, torch.float32, None, s.clamp(0, 1))


def test_bad_mask_arguments():
    parents, counts, _ = _sample_args()
    with pytest.raises(RuntimeError, match="past must be >= 0, got -1"):
        ddtree.tree_attention_mask(parents, counts, -1)
    with pytest.raises(RuntimeError, match="dtype must be float16, bfloat16, float32 or float64"):
        ddtree.tree_attention_mask(parents, counts, 0, torch.int32)
    start = torch.zeros(parents.shape[0], dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"start must be in \[0, past\] = \[0, 2\]"):
        ddtree.tree_attention_mask(parents, counts, 2, start=start + 3)
    with pytest.raises(RuntimeError, match="start must have shape"):
        ddtree.tree_attention_mask(parents, counts, 2, start=start[:1].expand(1, 1))


def test_validation_off_never_hangs_on_cyclic_parents():
    parents = torch.tensor([[-1, 3, 1, 2]])  # 1 -> 3 -> 2 -> 1: a cycle the checks would reject
    counts = torch.tensor([4])
    ddtree.set_validation(False)
    try:
        for ops in (torch.ops.ddtree, torch.ops.ddtree_emu):
            vis, _, pos = ops.tree_visibility(parents, counts, torch.tensor([0]))
            assert vis.diagonal(dim1=1, dim2=2).all()  # finished, rows still see themselves
    finally:
        ddtree.set_validation(True)
    assert ddtree.validation_enabled()


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
def test_cuda_graph_capture_and_replay():
    parents, counts, start = (t.cuda() for t in _sample_args())
    torch.ops.ddtree.tree_visibility(parents, counts, start)  # warm up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.ddtree.tree_visibility(parents, counts, start)
    parents.copy_(torch.tensor([[-1, 0, 1, 2, 3], [-1, 0, 0, -1, -1]], device="cuda"))
    counts.copy_(torch.tensor([5, 3], device="cuda"))
    graph.replay()
    expected = reference.tree_visibility(parents.cpu(), counts.cpu(), start.cpu())
    for g, e in zip(out, expected):
        assert torch.equal(g.cpu(), e)


@pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build")
def test_device_mismatch_is_rejected():
    parents, counts, start = _sample_args()
    with pytest.raises(RuntimeError, match="num_nodes must be on cuda"):
        torch.ops.ddtree.tree_visibility(parents.cuda(), counts, start.cuda())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_mask_with_per_request_prefix(backend, dtype):
    """A batch sharing one tree start (past) whose requests have fewer committed cache rows."""
    parents = torch.tensor([[-1, 0, 0, 1, 2, 3, -1], [-1, 0, 1, 2, -1, -1, -1]])
    counts = torch.tensor([6, 4])
    prefix = torch.tensor([9, 4])
    dev = kernel_device(backend) if backend != "cpu" else "cpu"
    got = OPS[backend].tree_attention_mask(parents.to(dev), counts.to(dev), 9, dtype,
                                           prefix.to(dev)).cpu()
    assert torch.equal(got, reference.tree_attention_mask(parents, counts, 9, dtype, prefix))
    assert (got[1, 0, :, 4:9] == torch.finfo(dtype).min).all() and (got[1, 0, :, :4] == 0).all()


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_attention_mask_with_tree_start_inside_the_columns(backend):
    """A static cache of past + N columns whose tree block starts at start[b] < past: the
    columns after the block (unwritten cache rows) are blocked, the block follows the parents."""
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]])
    counts = torch.tensor([4, 3])
    committed, start = torch.tensor([5, 2]), torch.tensor([6, 3])
    dev = kernel_device(backend) if backend != "cpu" else "cpu"
    got = OPS[backend].tree_attention_mask(parents.to(dev), counts.to(dev), 10, torch.float32,
                                           committed.to(dev), start.to(dev)).cpu()
    assert torch.equal(got, reference.tree_attention_mask(parents, counts, 10, torch.float32,
                                                          committed, start))
    low = torch.finfo(torch.float32).min
    # Request 1: rows 0..1 committed, 2 padding, tree at 3..6 (node 2 sees 0, 1, 2), 7.. blocked.
    assert got[1, 0, 2].tolist() == [0, 0, low, 0, 0, 0, low] + [low] * 7
    assert (got[0, 0, :, 10:] == low).all() and got[0, 0, 3, 6:10].tolist() == [0, 0, low, 0]
