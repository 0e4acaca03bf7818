"""The ops' value checks (e.g. parent < own index), on by default: a switch and a context."""
from __future__ import annotations

from .. import _C


def set_validation(enabled: bool) -> None:
    """Turn the ops' value checks on or off. On CUDA they cost a device-to-host copy; they are
    skipped automatically while a CUDA graph is being captured."""
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
