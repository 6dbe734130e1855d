"""The options object of the upcast mode: ``probe.mode([probe.Upcast(...)], ...)``."""

from __future__ import annotations

from probe.modes.mode_options import ModeOptions


class Upcast(ModeOptions):
    """Modules computed in higher precision, carried across their ops."""

    mode = "upcast"
