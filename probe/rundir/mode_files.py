"""The reader half of a mode: what one mode wrote in one step, read back.

Each mode keeps its reader beside its writer (``probe/modes/<mode>.py``) and names it on
its plug-in class (``files = StatsFiles``). :class:`probe.rundir.reader.Run` looks the
class up in the mode registry for a mode a step's manifest lists, makes one per (mode,
step, rank) when asked, keeps those of a few recent steps, and calls :meth:`ModeFiles.attach`
while decoding the step's op records. So the run reader knows no mode's files: a new mode
(a plug-in registered anywhere) is read back without touching it.

A reader reads nothing when it is made (a step's readers are made whenever its ops are
decoded); it reads its files when asked, through :mod:`probe.rundir.reading`, so damage is
a ``ProbeError`` naming the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from probe.rundir.records import OpRecord


@dataclass(frozen=True)
class StepFiles:
    """Where a mode's files of one step are, and what the step's manifest says of the mode."""

    run: Path
    """The run directory."""
    rank: int
    step: int
    directory: Path
    """The step's directory (``rankR/stepN``, or ``rankR/tailN`` for a tail)."""
    summary: dict[str, Any]
    """The mode's entry in the step manifest's ``modes`` (what its ``write`` returned)."""
    op_count: Callable[[], int]
    """How many op records the step holds (reads ``ops.jsonl`` on first use)."""


class ModeFiles:
    """One mode's files of one step. Subclasses add the accessors of their mode
    (``checks()``, ``series()``, ...) and, when the mode knows something of each op,
    :meth:`attach`."""

    def __init__(self, where: StepFiles) -> None:
        self.where = where

    def attach(self, records: dict[int, OpRecord]) -> None:
        """Add to the step's op records (op index -> record; all of them, or the few being
        decoded) what this mode recorded of them. The default adds nothing."""
