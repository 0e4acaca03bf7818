"""Small helpers of the model layer: the text part of a transformers config, and files written
whole or not at all."""
from __future__ import annotations

import contextlib
import os
import uuid


def text_config(config):
    """The text-model part of a transformers config (multimodal configs nest it)."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@contextlib.contextmanager
def atomic_path(final: str):
    """A temporary path next to `final` to write; renamed onto `final` when the block succeeds,
    removed when it fails."""
    directory, name = os.path.split(os.path.abspath(final))
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        yield tmp
        os.replace(tmp, final)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
