"""The config of the checksums mode: ``probe.mode("checksums", model=...)``. It declares no options of
its own: what it records is the session's ``checksums=`` and ``steps=``."""

from __future__ import annotations

from dataclasses import dataclass

from probe.modes.config import ModeConfig


@dataclass(frozen=True, kw_only=True, eq=False)
class Checksums(ModeConfig):
    """Checksums of the parameters, the model's inputs and the RNG states at each step."""

    mode = "checksums"
