import json
import os
import tempfile
from pathlib import Path

import pytest
import torch

import ddtree

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


def cuda_available() -> bool:
    return ddtree.has_cuda_kernels() and torch.cuda.is_available()


# Kernel backends: the CUDA kernel source in the SIMT emulator (always), the real GPU when present.
KERNEL_BACKENDS = [
    pytest.param("emulated", id="emulated"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=pytest.mark.skipif(not cuda_available(), reason="needs a GPU and the CUDA build"),
    ),
]


def kernel_device(backend: str) -> str:
    return "cpu" if backend == "emulated" else "cuda"


def pytest_terminal_summary(terminalreporter):
    """How many trees the fuzz tests checked (tests/test_fuzz.py), per op and backend."""
    import sys

    fuzz = sys.modules.get("test_fuzz")
    if fuzz is not None and fuzz.TREES:
        total = sum(fuzz.TREES.values())
        terminalreporter.write_line(
            f"fuzzed trees: {total} (" + ", ".join(f"{k} {v}" for k, v in sorted(fuzz.TREES.items()))
            + ")")
