"""The options object of the monitor mode: ``probe.mode([probe.Monitor(...)], ...)``."""

from __future__ import annotations

from probe.modes.mode_options import ModeOptions


class Monitor(ModeOptions):
    """Training-state statistics of chosen modules, from hooks, with anomaly alerts."""

    mode = "monitor"
