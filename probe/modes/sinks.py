"""Where a mode's live series go besides its step files: the sink interface (issue 34).

A mode writes its step files through the run directory's :class:`~probe.rundir.writer.StepWriter`;
series meant to be watched while training runs (TensorBoard's charts) go to a :class:`SeriesSink`.
The modes own this interface and implement none of it: the exporters do (TensorBoard event files:
``probe.exporters.tensorboard_events``), and the session hands the kinds it offers to each
plug-in (:attr:`probe.modes.base.SessionPlugin.sinks`, by name) before the plug-in attaches.
So a mode imports no exporter (the exporters sit above the modes), and a new sink (a CSV
stream, a logger) is one exporter and one entry in the session's offer, no mode touched.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

Histogram = tuple[str, np.ndarray, np.ndarray]
"""A tag, the log2 exponents of magnitudes and their counts (``probe.modes.statistics.distribution``)."""


class SeriesSink(Protocol):
    """An open sink: each written step's values, by tag (``<kind>/<name>[/<slot>][#call]/<metric>``)."""

    def add_scalars(self, step: int, tags: Sequence[str], values: Sequence[float] | np.ndarray) -> None:
        """One value per tag at ``step``."""
        ...

    def add_histograms(self, step: int, histograms: Sequence[Histogram]) -> None:
        """A log2-magnitude histogram per tag at ``step``."""
        ...

    def flush(self) -> None:
        """Make what was added readable now (a step's values are written together)."""
        ...

    def close(self) -> None:
        ...


@dataclass(frozen=True)
class SinkKind:
    """A kind of sink the session offers: how to open one, and what reads what it writes."""

    name: str
    """What a mode asks for (``"tensorboard"``), and the folder it writes in under ``rank<R>/``."""
    reader_package: str | None
    """The package that reads the files, without which writing them serves no one (``tensorboard``);
    None: none needed."""
    open: Callable[[Path], SeriesSink]
    """Open a sink writing in this directory (made if missing)."""

    def available(self) -> bool:
        """Whether what reads this sink's output is installed."""
        return self.reader_package is None or importlib.util.find_spec(self.reader_package) is not None
