"""The options object of the stats mode: ``probe.mode([probe.Stats(...)], ...)``."""

from __future__ import annotations

from probe.modes.mode_options import ModeOptions


class Stats(ModeOptions):
    """Statistics of every op's outputs (and its inputs from outside the step)."""

    mode = "stats"
