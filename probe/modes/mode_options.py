"""The former name of a mode's config, kept working: ``probe.ModeOptions`` is
:class:`probe.modes.config.ModeConfig`, the base of ``probe.Stats``, ``probe.Monitor``, ..."""

from __future__ import annotations

from probe.modes.config import ModeConfig as ModeOptions

__all__ = ["ModeOptions"]
