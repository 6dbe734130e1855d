"""The options object of the dump mode: ``probe.mode([probe.Dump(...)], ...)``."""

from __future__ import annotations

from probe.modes.mode_options import ModeOptions


class Dump(ModeOptions):
    """The tensors themselves, to safetensors shards, with the calls that made them."""

    mode = "dump"
