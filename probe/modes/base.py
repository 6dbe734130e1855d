"""What a mode is, in two parts: a session plug-in and, for per-op modes, an op observer.

A :class:`SessionPlugin` is what the registry names and the session drives: it starts
with the session, may install its own hooks (the monitor works from hooks alone), and at
the end of each step hands over what the step collected (``end_step``, on the training
thread); the writer thread later calls ``write`` on what it returned. An
:class:`OpObserver` is what the tracer calls for each selected op: ``before`` (inputs
live, op not yet run), then the op itself (or ``run`` of the one observer that replaces
execution), then ``after`` (inputs and outputs live). A :class:`Mode` is both: a plug-in
that observes ops itself. A plug-in without an observer costs training nothing per op: a
session of only such plug-ins enters no dispatch mode.

Modes never talk to each other; a mode never holds a tensor of the model past ``after``
(its own result buffers are its business).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar, Protocol

from probe.modes.config import ModeConfig
from probe.modes.sinks import SinkKind
from probe.rundir.mode_files import ModeFiles
from probe.rundir.writer import StepWriter
from probe.tracer.observer import OpObserver


class StepResult(Protocol):
    """What a mode collected in one step, written on the writer thread.

    A result may set ``stops_training_on_write_failure = True`` (the dump's ``on_error="raise"``):
    then a step its files could not be written stops training at the next ``session.step()``."""

    def write(self, writer: StepWriter) -> dict[str, Any]:
        """Write the step's files; return a small summary for the step manifest."""
        ...


@dataclass(frozen=True)
class Incident:
    """The start of an incident a plug-in detected, as the escalation learns of it."""

    step: int
    """The step it began at."""
    record: dict[str, Any]
    """What the traced steps' manifests list for it (JSON: the monitor's root alert, as in
    ``anomalies.jsonl``, with the threshold in force)."""


@dataclass(frozen=True)
class TraceRequest:
    """What a plug-in asks of the session's escalation (``probe/escalation.py``): turn the per-op
    ``modes`` on for ``steps`` steps after each incident the plug-in reports to ``listeners``."""

    modes: tuple[str, ...]
    options: Mapping[str, Any]
    """Options of the trace modes."""
    steps: int
    limit: int | None
    """The most windows one session opens (None: no limit)."""
    listeners: list[Callable[[Incident], None]]
    """Where the escalation adds its callback: called with the start of each new incident (not
    with alerts that join an incident going on), on the writer thread."""


class SessionPlugin:
    """A registered mode's session side; subclasses set ``name`` and ``config_class`` and are made
    from a config of that class."""

    name: ClassVar[str]
    config_class: ClassVar[type[ModeConfig]]
    """The mode's config (``probe.Stats``, ...): its options, declared once as dataclass fields."""
    option_names: ClassVar[frozenset[str]] = frozenset()
    """The config's option names (set by ``register_mode`` from :attr:`config_class`)."""
    files: ClassVar[type[ModeFiles] | None] = None
    """The reader of the files this mode writes in a step (beside its writer), for ``probe.load``;
    None when it writes none."""
    sinks: Mapping[str, SinkKind] = MappingProxyType({})
    """The live-output sinks the session offers this plug-in, by name (``"tensorboard"``), set
    before :meth:`start`; a plug-in opens those its config asks for (``probe.modes.sinks``).
    Empty outside a session."""
    implicit: bool = False
    """Added by the session itself, not asked for (the checksums of ``model=``): it writes only
    into steps the other modes write, never a step of its own."""

    def __init__(self, config: ModeConfig) -> None:
        self.config = config
        """The validated options this plug-in was made with."""

    @classmethod
    def added_by_session(cls, options: Any, selected: list[SessionPlugin]) -> SessionPlugin | None:
        """A plug-in of this mode the session adds itself, not selected (``implicit``), given the
        validated :class:`~probe.vocabulary.session_options.Options` and the ``selected`` plug-ins;
        None by default (the checksums: one for ``model=``)."""
        return None

    def trace_request(self) -> TraceRequest | None:
        """Per-op modes this plug-in asks the session to turn on after an incident it detects
        (the monitor's ``on_anomaly="trace"``); None by default."""
        return None

    def observer(self) -> OpObserver | None:
        """The per-op half of this mode, or None when it works from hooks alone."""
        return None

    @property
    def collective_each_step(self) -> bool:
        """Whether the mode joins a collective every step (then every rank must record)."""
        return False

    def start(self, out: Path, rank: int) -> None:
        """The session starts writing this rank's files under ``out``."""

    def attach(self, model: Any, out: Path, rank: int) -> None:
        """Install the mode's own hooks on ``model`` (the session's ``model=``); on recorded ranks."""

    def begin_step(self, step: int) -> None:
        """A step starts (called on every rank, recorded or not)."""

    def end_step(self, step: int) -> StepResult | None:
        """Hand over the step's results and start the next step afresh.

        Runs on the training thread between steps: cheap, no file I/O, no sync.
        """
        return None

    def ending_alone(self) -> None:
        """The step about to end (``end_step`` comes next) ends on this rank alone: the block
        raised, or it is the tail after the last ``session.step()``. Join no collective for it."""

    def has_pending(self) -> bool:
        """Whether the current step holds results of this mode that no op record accounts for."""
        return False

    def after_step(self) -> None:
        """``session.step()`` handed the step over; may raise to stop training."""

    def rewound(self, out: Path, step: int, verdict: str) -> None:
        """A rewind (``probe.rewind``) classified the written ``step`` of this rank under ``out``
        (``verdict``: one of ``probe.rewind.verdict.KINDS``); a mode that writes series per step adds
        it to them. Called on the training thread, with every ended step on disk."""

    def pause(self) -> None:
        """``session.pause()``: collect nothing from hooks until :meth:`resume` (the tracer already
        stops calling observers). A pause that spans ``step()`` is said again after ``begin_step``."""

    def resume(self) -> None:
        """``session.resume()``: collect again, as :meth:`begin_step` had decided for this step."""

    def close(self) -> None:
        """Release resources at session end (remove hooks)."""


class Mode(SessionPlugin, OpObserver):
    """A mode with per-op work: a session plug-in that observes ops itself."""

    def observer(self) -> OpObserver:
        return self
