"""Loading models from local directories, one way for the CLI, the embedded pair and the drafter
trainer. Paths are local: nothing is fetched from the Hugging Face Hub (`local_files_only`)."""
from __future__ import annotations

from typing import Optional

import torch

from .packed_linear import use_packed_linears, use_packed_lm_head


def load_target(path: str, dtype: torch.dtype = torch.float32, device="cpu"):
    """A transformers causal LM from a local directory, in eval mode on `device`, its LM head's
    CPU fp32 inference products on a packed weight (use_packed_lm_head), and its other
    linears' of several rows (use_packed_linears)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype,
                                                 local_files_only=True).to(device).eval()
    use_packed_lm_head(model)
    use_packed_linears(model)
    return model


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_drafter(path: Optional[str], dtype: torch.dtype = torch.float32, device="cpu"):
    """A DFlash drafter (the published checkpoint format), or None without a path; its linears'
    CPU fp32 inference products of several rows on packed weights (use_packed_linears)."""
    if path is None:
        return None
    from .dflash import DFlashDrafter

    drafter = DFlashDrafter.from_pretrained(str(path), dtype=dtype).to(device)
    use_packed_linears(drafter)
    return drafter
