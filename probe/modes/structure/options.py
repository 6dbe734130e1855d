"""The options object of the structure mode: ``probe.mode([probe.Structure(...)], ...)``."""

from __future__ import annotations

from probe.modes.mode_options import ModeOptions


class Structure(ModeOptions):
    """The op records alone: ids, modules, phases, dtypes, shapes and the op graph."""

    mode = "structure"
