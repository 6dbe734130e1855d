"""The options object of the free_benchmark mode: ``probe.mode([probe.FreeBenchmark(...)], ...)``."""

from __future__ import annotations

from probe.modes.mode_options import ModeOptions


class FreeBenchmark(ModeOptions):
    """Each op re-run perturbed: fragile ops found without a reference run."""

    mode = "free_benchmark"
