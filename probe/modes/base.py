"""The interface between the tracer and the per-op work of a mode.

The tracer calls, for each selected op: ``before`` (inputs live, op not yet
run), then the op itself (or ``run`` of the one mode that replaces execution),
then ``after`` (inputs and outputs live). At the end of a step the session
calls ``end_step`` on the training thread, which hands over what the step
collected and starts afresh, and later calls ``write`` on what it returned, on
the writer thread. Modes never talk to each other; a mode never holds a tensor
of the model past ``after`` (its own result buffers are its business).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Protocol

from probe.rundir.writer import StepWriter
from probe.tracer.op_call import OpCall


class StepResult(Protocol):
    """What a mode collected in one step, written on the writer thread."""

    def write(self, writer: StepWriter) -> dict[str, Any]:
        """Write the step's files; return a small summary for the step manifest."""
        ...


class Mode:
    """Base class of per-op work; subclasses set ``name`` and ``option_names``."""

    name: ClassVar[str]
    option_names: ClassVar[frozenset[str]] = frozenset()
    replaces_execution: ClassVar[bool] = False
    needs_ops: ClassVar[bool] = True
    """False for modes that work from hooks alone: a session of only such modes
    enters no dispatch mode, so training pays nothing per op."""

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

    def before(self, call: OpCall) -> None:
        """Inputs are live and unmodified; the op has not run."""

    def run(self, call: OpCall, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op in place of the tracer (only when ``replaces_execution``)."""
        raise NotImplementedError

    def after(self, call: OpCall) -> None:
        """The op ran; ``call.output_tensors`` holds its results."""

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

    def close(self) -> None:
        """Release resources at session end (remove hooks)."""
