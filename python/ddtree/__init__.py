"""ddtree: tree speculative decoding (DDTree) for block-diffusion drafters, as torch ops.

The native ops live in ``torch.ops.ddtree``; ``ddtree.ops`` holds typed Python wrappers and
``ddtree.reference`` pure-PyTorch versions written from the spec (the test oracles).
"""
from .version import __version__


def _load_native():
    import torch

    try:
        from . import _C
    except ImportError as err:
        raise ImportError(
            f"ddtree's native extension ddtree._C is missing or failed to load ({err}); it is built "
            f"for one torch version (this is torch {torch.__version__}): build it with "
            "`pip install --no-build-isolation .` or `make build`"
        ) from err
    built = _C.built_with_torch()
    if built != torch.__version__:
        raise ImportError(
            f"ddtree._C was built against torch {built} but torch {torch.__version__} is "
            "installed; rebuild it: `pip install --no-build-isolation .` (or `make build`)"
        )
    return _C


_C = _load_native()

from . import _fake  # noqa: E402,F401  (registers the fake kernels)
from .eagle import EagleVerifyInputs, to_eagle_format  # noqa: E402
from .ops import (  # noqa: E402
    DraftTree,
    GreedyVerdict,
    TreeVisibility,
    Verdict,
    build_tree,
    chain_to_tree,
    chain_tree,
    commit_kv_,
    commit_recurrent_,
    draft_attention,
    draft_to_tree,
    gather_accepted,
    tree_attention,
    tree_attention_mask,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    tree_topk,
    tree_topk_merge,
    tree_topk_shard,
    tree_visibility,
    verify_greedy,
    verify_sample,
    expected_accepts,
)


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels were compiled into ddtree._C."""
    return bool(_C.has_cuda_kernels())


def set_validation(enabled: bool) -> None:
    """Turn the ops' value checks (e.g. parent < own index) on or off. On CUDA they cost a
    device-to-host copy; they are skipped automatically while a CUDA graph is being captured."""
    _C.set_validation(bool(enabled))


def validation_enabled() -> bool:
    return bool(_C.validation_enabled())


class validation:
    """`with ddtree.validation(False):` runs the block with the ops' value checks off (the
    speculative loop's rounds, whose inputs were checked once at the API boundary), then restores
    the previous setting."""

    def __init__(self, enabled: bool):
        self.enabled = bool(enabled)

    def __enter__(self):
        self.previous = validation_enabled()
        set_validation(self.enabled)

    def __exit__(self, *exc):
        set_validation(self.previous)


__all__ = [
    "__version__",
    "has_cuda_kernels",
    "set_validation",
    "validation_enabled",
    "validation",
    "tree_visibility",
    "tree_attention_mask",
    "tree_attention",
    "draft_attention",
    "TreeVisibility",
    "build_tree",
    "expected_accepts",
    "verify_greedy",
    "verify_sample",
    "commit_kv_",
    "tree_causal_conv1d",
    "tree_gated_delta_rule",
    "commit_recurrent_",
    "tree_topk",
    "tree_topk_shard",
    "tree_topk_merge",
    "draft_to_tree",
    "chain_tree",
    "chain_to_tree",
    "DraftTree",
    "to_eagle_format",
    "EagleVerifyInputs",
    "gather_accepted",
    "Verdict",
    "GreedyVerdict",
]
