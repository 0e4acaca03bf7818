"""Linear layers whose CPU fp32 inference products run on a oneDNN weight packed once: the LM
head (every row count) and the larger linears of a target or drafter (products of several rows:
verify trees, draft blocks, batches)."""
from __future__ import annotations

import torch


def lm_head(model):
    """The model's output embeddings (its LM head), or None where it has none."""
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


class PackedLinear(torch.nn.Linear):
    """An nn.Linear whose inference products on the CPU in fp32 run on a oneDNN copy of its
    weight packed once (torch's `mkldnn._linear_pointwise`), instead of one BLAS call per product:
    for an LM head 1.6-3.4x as fast at 2-32 rows on a 2-core CPU (docs/generation.md). Everything else (grad mode with
    anything requiring grad, other devices or dtypes, tensor subclasses such as a sharded
    weight) is nn.Linear's own forward. The module keeps its parameters (state
    dict, tied embeddings unchanged). The packed copy (as large as the weight) is a plain
    attribute, made on the first product and again when the weight is another tensor or was
    changed in place through the parameter (its version; changes through `.data` are not seen,
    as autograd does not see them); dropped by `.to()` / `.float()` / `.cuda()` and the like,
    and left out of copies and pickles (an opaque oneDNN tensor has no storage to copy).
    `packed_min_rows` (instance attribute, default 1): products of fewer rows are nn.Linear's
    (use_packed_linears)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if x.numel() < self.__dict__.get("packed_min_rows", 1) * w.shape[1] or \
                type(x) is not torch.Tensor or type(w.data) is not torch.Tensor or \
                x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32 or \
                (torch.is_grad_enabled() and (w.requires_grad or x.requires_grad)) or \
                x.shape[-1] != w.shape[1] or x.numel() == 0:
            return super().forward(x)
        # (the weight it was packed from, kept alive so no other tensor takes its address; its
        # version then; the packed copy)
        packed = self.__dict__.get("_packed")
        if packed is None or packed[0].data_ptr() != w.data_ptr() or \
                packed[0].shape != w.shape or packed[1] != w._version:
            source = w.detach()
            packed = (source, w._version, torch.ops.mkldnn._reorder_linear_weight(source, None))
            self.__dict__["_packed"] = packed
        bias = None if self.bias is None else self.bias.detach()
        out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed[2], bias,
                                                 "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    def _apply(self, fn, *args, **kwargs):
        self.__dict__.pop("_packed", None)  # another device or dtype: packed again when used
        return super()._apply(fn, *args, **kwargs)

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_packed", None)
        return state


def use_packed_lm_head(model) -> bool:
    """The model's LM head (an nn.Linear) becomes a PackedLinear: the same module and
    parameters, faster CPU fp32 inference products (the verify pass's tree rows, the drafter's
    block rows). Idempotent; False (nothing changed) where the head is not an nn.Linear or torch
    has no oneDNN."""
    head = lm_head(model)
    if isinstance(head, PackedLinear):
        return True
    if type(head) is not torch.nn.Linear or not torch.backends.mkldnn.is_available():
        return False
    head.__class__ = PackedLinear
    return True


# use_packed_linears' defaults, chosen in the decoding loop of the embedded pair on a 2-core
# x86-64 CPU (bench/bench_packed_linears.py, docs/generation.md): its 768 x 256 / 256 x 768
# weights packed for products of 2 rows or more, generation 1.00-1.11x as fast at batch 1-4
# (autoregressive at batch 1 1.00x, trees 1.07-1.10x); with its 512 x 256 / 256 x 512 ones too,
# batch 4's trees no faster (tree 8 1.00x, tree 16 0.97x, an in-process run); every linear at
# every row count (1 row included), autoregressive decoding 0.78x.
PACKED_MIN_ROWS = 2
PACKED_MIN_ELEMENTS = 768 * 256


def use_packed_linears(model, min_rows: int = PACKED_MIN_ROWS,
                       min_elements: int = PACKED_MIN_ELEMENTS) -> int:
    """Every plain nn.Linear of `model` whose weight is a CPU fp32 one of at least
    `min_elements` elements becomes a PackedLinear for products of at least `min_rows` rows (a
    tree's verify rows, a drafter's block rows, a batch's autoregressive rows; fewer rows keep
    nn.Linear's product): the same modules and parameters. Models on a GPU or in another dtype
    are left as they are (no check per product there). The LM head is use_packed_lm_head's
    (every row count). Returns how many modules changed; 0 where torch has no oneDNN.
    Idempotent."""
    if type(min_rows) is not int or min_rows < 1:
        raise ValueError(f"use_packed_linears: min_rows must be an int >= 1, got {min_rows!r}")
    if type(min_elements) is not int or min_elements < 0:
        raise ValueError(f"use_packed_linears: min_elements must be an int >= 0, got "
                         f"{min_elements!r}")
    if not torch.backends.mkldnn.is_available():
        return 0
    head = lm_head(model)
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module is not head and \
                module.weight.device.type == "cpu" and module.weight.dtype == torch.float32 and \
                module.weight.numel() >= min_elements:
            module.__class__ = PackedLinear
            module.packed_min_rows = min_rows
            changed += 1
    return changed
