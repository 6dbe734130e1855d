"""Pluggable per-op work. Importing this package registers the built-in modes."""

from probe.modes import (  # noqa: F401  (register them)
    checksums,
    dump,
    free_benchmark,
    monitor,
    stats,
    structure,
    upcast,
)
from probe.modes.base import Mode
from probe.modes.registry import MODES, register_mode

__all__ = ["MODES", "Mode", "register_mode"]
