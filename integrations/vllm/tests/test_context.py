"""The drafter's context rows of steps without drafts, kept until the request's next drafting
step (context.py): the bookkeeping against a dictionary reference, and in a real engine the
drafter attending to the same context K/V, and proposing the same drafts, as with vLLM's
projection every step."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from ddtree.integrations.vllm.context import DeferredContext, slots_of

HERE = Path(__file__).resolve().parent
H = 4


def step_rows(req_ids, lengths, first_positions, valid, seed):
    """A step's context: request b has lengths[b] rows from position first_positions[b]."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    positions = torch.cat([torch.arange(p, p + n) for p, n in zip(first_positions, lengths)])
    hidden = torch.randn(int(sum(lengths)), H, generator=torch.Generator().manual_seed(seed))
    return starts, np.asarray(valid), positions, hidden


def test_keeps_committed_rows_and_maps_them_to_the_batch_that_drafts():
    context = DeferredContext(max_rows=100)
    starts, valid, positions, hidden = step_rows(["a", "b", "c"], [3, 2, 1], [10, 20, 30],
                                                 [2, 1, 0], seed=0)
    context.keep(["a", "b", "c"], starts, valid, positions, hidden)
    assert len(context) == 3                      # a: 10, 11; b: 20 (rejected rows cut)
    pending = context.take(["c", "b", "a"], alive={"a", "b", "c"})
    assert pending.rows.tolist() == [2, 2, 1]
    assert pending.positions.tolist() == [10, 11, 20]
    torch.testing.assert_close(pending.hidden, hidden[[0, 1, 3]], rtol=0, atol=0)
    assert len(context) == 0 and context.take(["a"], alive={"a"}) is None


def test_a_request_resumed_from_preemption_starts_again_from_its_prompt():
    context = DeferredContext(max_rows=100)
    for first, seed in ((40, 1), (41, 2)):
        context.keep(["a", "b"], *step_rows(["a", "b"], [1, 1], [first, first], [1, 1], seed))
    context.drop({"a"})                               # the engine: "a" resumed
    assert len(context) == 2
    starts, valid, positions, hidden = step_rows(["a"], [5], [0], [5], seed=3)   # recomputed
    context.keep(["a"], starts, valid, positions, hidden)
    pending = context.take(["a"], alive={"a", "b"})
    assert pending.positions.tolist() == [0, 1, 2, 3, 4]
    torch.testing.assert_close(pending.hidden, hidden, rtol=0, atol=0)
    assert context.take(["b"], alive={"b"}).positions.tolist() == [40, 41]


def test_rows_of_live_requests_outside_the_batch_stay_finished_ones_go():
    context = DeferredContext(max_rows=4)
    context.keep(["a", "b", "c"], *step_rows(["a", "b", "c"], [2, 2, 2], [0, 0, 0],
                                             [2, 2, 2], seed=4))
    assert context.full                        # 6 rows > 4
    context.prune(alive={"a", "b"})
    assert len(context) == 4 and not context.full
    pending = context.take(["b"], alive={"a", "b"})
    assert pending.rows.tolist() == [0, 0] and pending.positions.tolist() == [0, 1]
    assert len(context) == 2
    assert context.take(["d"], alive={"d"}) is None and len(context) == 0   # "a" finished


def test_random_steps_against_a_dictionary_reference():
    rng = random.Random(5)
    context = DeferredContext(max_rows=10 ** 6)
    reference = {}           # request -> {position: hidden row}, latest restart only
    lengths_so_far = {}
    for step in range(200):
        requests = rng.sample("abcdefgh", rng.randint(1, 6))
        if rng.random() < 0.4:   # a drafting step: every kept row of its batch projected
            alive = set(rng.sample("abcdefgh", 6)) | set(requests)
            pending = context.take(requests, alive)
            got = {} if pending is None else {
                (requests[r], p): h for r, p, h in zip(pending.rows.tolist(),
                                                       pending.positions.tolist(),
                                                       pending.hidden)}
            want = {(r, p): h for r in requests for p, h in reference.pop(r, {}).items()}
            assert got.keys() == want.keys()
            for k in want:
                torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
            for r in list(reference):
                if r not in alive:
                    del reference[r]
            continue
        lengths, firsts, valid = [], [], []
        for r in requests:
            restart = rng.random() < 0.05     # resumed from preemption: dropped, then from 0
            if restart:
                context.drop({r})
                reference.pop(r, None)
            first = 0 if restart or r not in lengths_so_far else lengths_so_far[r]
            n = rng.randint(1, 5)
            lengths.append(n)
            firsts.append(first)
            valid.append(rng.randint(0, n))
            lengths_so_far[r] = first + valid[-1]
        starts, valid, positions, hidden = step_rows(requests, lengths, firsts, valid, step)
        context.keep(requests, starts, valid, positions, hidden)
        for b, r in enumerate(requests):
            rows = {int(positions[starts[b] + i]): hidden[starts[b] + i] for i in range(valid[b])}
            reference.setdefault(r, {}).update(rows)
        assert len(context) == sum(len(v) for v in reference.values())


def test_slots_follow_the_block_table():
    table = torch.tensor([[7, 3, 9], [2, 5, 0]], dtype=torch.int32)
    rows, positions = torch.tensor([0, 0, 1, 1]), torch.tensor([0, 17, 15, 16])
    assert slots_of(rows, positions, table, 16).tolist() == [7 * 16, 3 * 16 + 1, 2 * 16 + 15,
                                                             5 * 16]


def test_the_drafter_attends_to_the_same_context_when_rows_wait(dense_pair, tmp_path):
    """Every 4th step drafts (8-node trees); the other steps either project their rows at once
    (vLLM's way) or keep them until the request drafts. At every drafting step, every drafter
    layer's K/V at the committed positions agree (fp32; the late projection is one larger GEMM,
    so within rounding), and the drafts and the generated tokens are the same."""
    target, drafter = dense_pair
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND",
                                                        f"0-{os.cpu_count() - 1}"))
    runs = {}
    for mode in ("eager", "deferred"):
        out = tmp_path / f"{mode}.pt"
        proc = subprocess.run([sys.executable, str(HERE / "context_run.py"), str(target),
                               str(drafter), mode, str(out)], env=env, cwd=HERE,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[mode] = torch.load(out)
    eager, deferred = runs["eager"], runs["deferred"]
    assert eager["caught_up"] == 0 and deferred["caught_up"] > 100
    assert len(eager["context"]) >= 5
    assert deferred["tokens"] == eager["tokens"]
    assert deferred["drafts"] == eager["drafts"]
    for step_e, step_d in zip(eager["context"], deferred["context"], strict=True):
        for request_e, request_d in zip(step_e, step_d, strict=True):
            for (k_e, v_e), (k_d, v_d) in zip(request_e, request_d, strict=True):
                torch.testing.assert_close(k_d, k_e, rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(v_d, v_e, rtol=1e-5, atol=1e-5)
