"""The reader half of a mode: what one mode wrote in one step, read back.

Each mode keeps its reader beside its writer (``probe/modes/<mode>.py``) and names it on
its plug-in class (``files = StatsFiles``); registering the mode registers that class here
(:func:`register_mode_files`). :class:`probe.rundir.run.Run` looks the class up in this
registry for a mode a step's manifest lists, makes one per (mode,
step, rank) when asked, keeps those of a few recent steps, and calls :meth:`ModeFiles.attach`
while decoding the step's op records. So the run reader knows no mode's files: a new mode
(a plug-in registered anywhere) is read back without touching it.

Over a whole run, a mode is read through ``run.mode(name)``: a :class:`ModeReader`, or the
subclass the mode's step reader names as ``run_reader`` (the monitor's ``series()`` and
``anomalies()``, the free benchmark's ``checks()``, the stats mode's ``nonfinite_parameters()``,
the dump's ``dump()`` and ``tensor()``). A mode's file names and record types are its
own (its package); the reader declares the names as ``file_names``.

A reader reads nothing when it is made (a step's readers are made whenever its ops are
decoded); it reads its files when asked, through :mod:`probe.rundir.untrusted_reads`, so damage is
a ``ProbeError`` naming the file.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from probe.rundir.loss_scaler import ScalerStep
from probe.rundir.records import OpRecord
from probe.rundir.step_section import StepSection


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
    op: Callable[[int], OpRecord]
    """The record of op #i (decoded on first use): what a mode checks its own index against."""


T = TypeVar("T")


class RunSteps(Protocol):
    """What a :class:`ModeReader` asks of the run it reads (``probe.rundir.run.Run``)."""

    path: Path
    """The run directory."""

    def resolve(self, step: int | None, rank: int | None) -> tuple[int, int]: ...

    def op(self, op_id: str, step: int | None = None, rank: int | None = None) -> OpRecord: ...

    def mode_files(self, mode: str, step: int | None = None, rank: int | None = None) -> ModeFiles | None: ...

    def across_steps(self, read: Callable[[int, int], list[T]], by_step: bool = False) -> list[T]: ...


class ModeReader:
    """One mode's files over a whole run: what ``run.mode(name)`` returns. Subclasses (a step
    reader's ``run_reader``) add the mode's run-wide accessors, built with :meth:`gather`."""

    def __init__(self, run: RunSteps, name: str) -> None:
        self.run = run
        self.name = name

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    def files(self, step: int | None = None, rank: int | None = None) -> ModeFiles | None:
        """The mode's reader of one step (default: the first step, rank 0), or None when the step's
        manifest does not list the mode or it writes no files."""
        return self.run.mode_files(self.name, step, rank)

    def gather(self, read: Callable[[Any], list[T]], step: int | None = None, rank: int | None = None,
               by_step: bool = False) -> list[T]:
        """``read(step reader)`` of one step; of every step of every rank when ``step`` and ``rank``
        are both None (rank then step, or step then rank with ``by_step``), a damaged step passed
        over with a warning. A step without the mode's files gives nothing."""
        if step is None and rank is None:
            return self.run.across_steps(lambda s, r: self.gather(read, s, r), by_step)
        files = self.files(step, rank)
        return [] if files is None else read(files)


class ModeFiles:
    """One mode's files of one step. Subclasses add the accessors of their mode
    (``checks()``, ``series()``, ...) and, when the mode knows something of each op,
    :meth:`attach`."""

    file_names: ClassVar[tuple[str, ...]] = ()
    """The names of the files this mode writes in a step directory (its own: no other module
    names them)."""
    run_reader: ClassVar[type[ModeReader]] = ModeReader
    """What ``run.mode(name)`` returns for this mode."""

    def __init__(self, where: StepFiles) -> None:
        self.where = where

    def attach(self, records: dict[int, OpRecord]) -> None:
        """Add to the step's op records (op index -> record; all of them, or the few being
        decoded) what this mode recorded of them. The default adds nothing."""

    def read_whole(self) -> None:
        """Read every file of the step, so that damage is found now (``run.damaged_steps()``): a
        :class:`ProbeError` naming the file. The default reads nothing (what :meth:`attach` reads
        is read with the op records)."""

    def section(self) -> StepSection | None:
        """What this mode says of the step in ``probe summary`` (``probe.rundir.step_section``),
        or None: nothing (the default)."""
        return None

    # Capabilities: what the run reader's own analyses of op records ask of the step's modes
    # without naming one (``Run.outputs_nonfinite``, ``Run.loss_scaler``).

    def outputs_nonfinite(self) -> bool | None:
        """Whether an op output of the step held a NaN or Inf, as this mode's records say, read
        without decoding the op records (the stats mode's table); None: they do not say (the
        default)."""
        return None

    def loss_scaler(self) -> ScalerStep | None:
        """What ``torch.amp.GradScaler`` did in the step as this mode recorded it itself (the
        monitor's series with ``scaler=``); None: it did not (the default). The scaler's traced
        ops are read by the run (:mod:`probe.rundir.loss_scaler`)."""
        return None


# -- the registry the modes fill -------------------------------------------------------

_READERS: dict[str, type[ModeFiles] | None] = {}


def register_mode_files(mode: str, files: type[ModeFiles] | None) -> None:
    """Make ``mode`` known to :func:`probe.load`, with the class that reads its files of a step
    (None: it writes none). Called by the mode registry (``probe.modes.registry.register_mode``)
    as each mode registers, so the run reader, below the modes, imports none of them."""
    _READERS[mode] = files


BUILTIN_MODES = "probe.modes"
"""The package whose import registers the built-in modes (and so their readers)."""


def registered_mode_files() -> dict[str, type[ModeFiles] | None]:
    """Mode name -> the reader of its files (None: it writes none), for every registered mode.

    The built-in modes are imported, by name, on the first lookup: ``import probe`` binds its
    names lazily, so a process that reads a run without touching them (a spawned compare
    worker) would otherwise find no reader. The reader still names no mode's code. Always through
    ``import_module``, never a look at ``sys.modules``: a package another thread is importing is
    there half-made (a dask worker reading two pieces at once found no 'stats' reader), and
    ``import_module`` waits for it."""
    importlib.import_module(BUILTIN_MODES)
    return _READERS
