import json
import os
import tempfile
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
# budget="auto" caches measured cost profiles on disk: the tests keep theirs apart.
os.environ.setdefault("DDTREE_CACHE_DIR", tempfile.mkdtemp(prefix="ddtree-test-cache-"))


def golden_dir() -> Path:
    """The published-reference golden vectors in the repository (tests/data/golden;
    DDTREE_GOLDEN_DIR points elsewhere)."""
    env = os.environ.get("DDTREE_GOLDEN_DIR")
    candidates = [Path(env)] if env else []
    candidates += [ROOT / "tests" / "data" / "golden"]
    for path in candidates:
        if (path / "ddtree_reference_trees.json").exists():
            return path
    raise FileNotFoundError(
        "golden vectors not found: expected tests/data/golden/ddtree_reference_trees.json in the "
        "repository (or set DDTREE_GOLDEN_DIR)"
    )


@pytest.fixture(scope="session")
def golden():
    """(cases from the JSON, tensors from the safetensors file)."""
    from safetensors.torch import load_file

    path = golden_dir()
    cases = json.loads((path / "ddtree_reference_trees.json").read_text())["cases"]
    return cases, load_file(str(path / "ddtree_reference_trees.safetensors"))


# Whole modules by what they cost; single slow tests carry @pytest.mark.slow themselves.
MODULE_MARKS = {
    "test_parallel_tensor_parallel.py": "distributed",
    "test_generate_long_runs.py": "long",
    "test_train_embedded_pair.py": "slow",
    "test_generate_threads.py": "slow",
    "test_budget_policy.py": "slow",
    "test_train_drafter.py": "slow",
    "test_ops_fuzz.py": "slow",
}


# Single tests of other modules that take many seconds.
SLOW_TESTS = (
    "test_cli.py::test_demo_runs_and_is_lossless",
    "test_generate_loop.py::test_sampling_is_distributed_as_target_sampling",
    "test_generate_loop.py::test_lossless_hybrid_target[autoregressive-qwen3_next]",
    "test_generate_loop.py::test_lossless_hybrid_target[tree-qwen3_next]",
    "test_generate_loop.py::test_budget_above_the_vocabulary",
    "test_ops_topk.py::test_cpu_baseline_isa_loops",
    "test_ops_draft_attention.py::test_cpu_loops_of_every_instruction_set",
    "test_generate_loop.py::test_lossless_with_the_packed_lm_head[head+linears-tree-auto]",
    "test_generate_loop.py::test_lossless_with_the_packed_lm_head[head-tree-auto]",
    "test_budget_replay.py::test_command_line_records_from_a_given_prompt_and_replays_stored_records",
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        mark = MODULE_MARKS.get(item.path.name)
        if mark:
            item.add_marker(getattr(pytest.mark, mark))
        test_id = f"{item.path.name}::{item.name}"
        # an id names one parametrisation; an id without "[" names all of them
        if test_id in SLOW_TESTS or test_id.split("[")[0] in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


def pytest_terminal_summary(terminalreporter):
    """How many trees the fuzz tests checked (tests/test_ops_fuzz.py), per op and backend."""
    import sys

    fuzz = sys.modules.get("test_ops_fuzz")
    if fuzz is not None and fuzz.TREES:
        total = sum(fuzz.TREES.values())
        terminalreporter.write_line(
            f"fuzzed trees: {total} (" + ", ".join(f"{k} {v}" for k, v in sorted(fuzz.TREES.items()))
            + ")")
