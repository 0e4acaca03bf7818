"""ddtree: tree speculative decoding (DDTree) for block-diffusion drafters, as torch ops.

Loads the native extension (``torch.ops.ddtree``) and re-exports the ops' typed wrappers. The
layers, each importing only those before it: ``ops`` (wrappers, fakes, reference), ``parallel``
(tensor parallelism), ``models`` (drafter, attention, hybrid layers, loading), ``budget``
(cost-aware tree sizes), ``generate`` (the speculative loop), ``train``, ``integrations``
(serving engines), then ``embedded``, ``demo`` and ``cli`` on top (docs/architecture.md).
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

from .integrations.sglang import EagleVerifyInputs, to_eagle_format  # noqa: E402
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
    expected_accepts,
    gather_accepted,
    set_validation,
    tree_attention,
    tree_attention_mask,
    tree_causal_conv1d,
    tree_gated_delta_rule,
    tree_topk,
    tree_topk_merge,
    tree_topk_shard,
    tree_visibility,
    validation,
    validation_enabled,
    verify_greedy,
    verify_sample,
)


def has_cuda_kernels() -> bool:
    """True when the CUDA kernels were compiled into ddtree._C."""
    return bool(_C.has_cuda_kernels())


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
