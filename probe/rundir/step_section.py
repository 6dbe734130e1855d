"""What a mode says of one step in ``probe summary``, as its reader declares it.

A mode's reader (:class:`probe.rundir.mode_files.ModeFiles`) may return a :class:`StepSection`
from ``section()``: lines for the step's detailed view, its part of the one-line view, and
series to follow over the run. The summary gathers the sections of the modes a step's manifest
lists, and the console renders them as they are, so neither names a mode: a new mode's summary
is its reader's ``section()``. A step of no op records that has a section (a mode working from
hooks) is shown by its sections alone. Plain text with a style, no markup: the text holds names read
from the run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class SectionLine:
    text: str
    style: str | None = None
    """How it is shown: ``"red"`` (a fault found), ``"yellow"`` (a caution), ``"dim"``, None (plain)."""


@dataclass(frozen=True)
class FollowedSeries:
    """Values a mode follows step after step, shown over the run as a table with a sparkline."""

    title: str
    """The table's title (``"monitored series (norm per step)"``)."""
    values: Mapping[str, float]
    """Each series' label -> its value in this step."""
    read_all: str
    """Where all of them are read when the table shows only the first (``"run.monitor()"``)."""


@dataclass(frozen=True)
class StepSection:
    """One mode's part of a step's summary."""

    lines: tuple[SectionLine, ...] = ()
    """The step's detailed view, in order."""
    brief: str | None = None
    """Its part of the one-line view of a step (runs of many steps); None: nothing to add."""
    followed: FollowedSeries | None = None
