"""Fake (meta) kernels: output shapes from input shapes only, for torch.compile / opcheck."""
import torch


def _register(namespace: str) -> None:
    @torch.library.register_fake(f"{namespace}::tree_visibility")
    def _tree_visibility(parents, num_nodes, start):
        b, n = parents.shape
        return (
            parents.new_empty((b, n, n), dtype=torch.bool),
            parents.new_empty((b, n, (n + 31) // 32), dtype=torch.int32),
            parents.new_empty((b, n), dtype=torch.int64),
        )

    @torch.library.register_fake(f"{namespace}::tree_attention_mask")
    def _tree_attention_mask(parents, num_nodes, past, dtype):
        b, n = parents.shape
        return parents.new_empty((b, 1, n, past + n), dtype=dtype)


for _ns in ("ddtree", "ddtree_emu"):
    _register(_ns)
