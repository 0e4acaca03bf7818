"""CUDA graph capture shared by the target's verify step and the drafter's step."""
from __future__ import annotations

import torch


def capture_graph(step, prepare=lambda: None, pool=None):
    """Runs prepare(); step() twice on a side stream (lazy initialisations, library handles,
    allocator pools), then captures step() into a CUDA graph, its memory from `pool` (another
    graph's pool(): the two may then reuse each other's scratch memory, so replay one only
    once the other's outputs are no longer read). Returns (graph, step's outputs, which every
    replay overwrites)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            prepare()
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    prepare()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step()
    return graph, outputs


def check_graph_device(device) -> None:
    """cuda_graph=True captures CUDA graphs: the target must be on a CUDA device."""
    if device.type != "cuda":
        raise ValueError(f"generate: cuda_graph=True needs the target on a CUDA device, "
                         f"got {device}")
