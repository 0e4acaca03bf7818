"""Generation from several threads on one model: the hybrid embedded pair (Gated DeltaNet layers
run over the tree) and a dense target, every mode, outputs equal to serial runs; the ops' value
checks are per thread (one generation turning them off does not turn them off elsewhere)."""
import threading

import pytest
import torch

import ddtree
from ddtree import embedded
from ddtree.generate import generate
from helpers import tiny_drafter, tiny_target

THREADS = 4


def run_in_threads(jobs):
    """Runs the callables at once (released together) and returns their results in order; an
    exception in a thread is raised here."""
    results, errors = [None] * len(jobs), []
    start = threading.Barrier(len(jobs))

    def work(i):
        try:
            start.wait()
            results[i] = jobs[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.fixture(scope="module")
def pair():
    target, drafter, tokenizer = embedded.load()
    prompts = [tokenizer(t, return_tensors="pt").input_ids
               for t in embedded.heldout_prompts(THREADS)]
    return target, drafter, prompts


@pytest.mark.parametrize("mode", ["tree", "chain", "autoregressive"])
def test_concurrent_generations_on_the_hybrid_pair_equal_serial_ones(pair, mode):
    target, drafter, prompts = pair
    jobs = [lambda p=p, i=i: generate(target, drafter, p, 24, mode=mode, budget=8 + 8 * i).tokens
            for i, p in enumerate(prompts)]
    serial = [job() for job in jobs]
    for _ in range(2):
        assert run_in_threads(jobs) == serial
    assert ddtree.validation_enabled()


def test_concurrent_generations_on_a_dense_target_equal_serial_ones():
    target, drafter = tiny_target(), tiny_drafter()
    prompts = [torch.tensor([[1 + i, 7, 3 * i + 2]]) for i in range(THREADS)]
    jobs = [lambda p=p: generate(target, drafter, p, 20, budget=12).tokens for p in prompts]
    serial = [job() for job in jobs]
    assert run_in_threads(jobs) == serial


def test_validation_setting_is_per_thread_and_restored_after_errors():
    seen = {}

    def unchecked():
        with ddtree.validation(False):
            seen["inside"] = ddtree.validation_enabled()
            checker_may_run.set()
            checker_done.wait()
            raise RuntimeError("planted failure inside the block")

    def checked():
        checker_may_run.wait()
        seen["other thread"] = ddtree.validation_enabled()
        # A bad tree still gets its error here while the other thread runs without checks.
        try:
            ddtree.tree_visibility(torch.tensor([[-1, 5]]), torch.tensor([2]))
        except RuntimeError as e:
            seen["error"] = str(e)
        checker_done.set()

    checker_may_run, checker_done = threading.Event(), threading.Event()
    with pytest.raises(RuntimeError, match="planted failure"):
        run_in_threads([unchecked, checked])
    assert seen["inside"] is False and seen["other thread"] is True
    assert "parents[0, 1] = 5 must be smaller than its own index 1" in seen["error"]
    assert ddtree.validation_enabled()
    with pytest.raises(RuntimeError, match="planted"):
        with ddtree.validation(False):
            raise RuntimeError("planted")
    assert ddtree.validation_enabled()
