"""The config of the structure mode: ``probe.mode(probe.Structure(), ...)`` (it takes no options)."""

from __future__ import annotations

from dataclasses import dataclass

from probe.modes.config import ModeConfig


@dataclass(frozen=True, kw_only=True, eq=False)
class Structure(ModeConfig):
    """The op records alone: ids, modules, phases, dtypes, shapes and the op graph."""

    mode = "structure"
