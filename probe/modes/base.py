"""The interface between the tracer and the per-op work of a mode.

The tracer calls, for each selected op: ``before`` (inputs live, op not yet
run), then the op itself (or ``run`` of the one mode that replaces execution),
then ``after`` (inputs and outputs live). At the end of a step it calls
``flush`` with the step's writer. Modes never talk to each other; a mode never
holds a tensor past ``after``.
"""

from __future__ import annotations

from typing import Any, ClassVar

from probe.rundir.writer import StepWriter
from probe.tracer.op_call import OpCall


class Mode:
    """Base class of per-op work; subclasses set ``name`` and ``option_names``."""

    name: ClassVar[str]
    option_names: ClassVar[frozenset[str]] = frozenset()
    needs_inputs: ClassVar[bool] = False
    """Whether ``before``/``after`` need the live input tensors."""
    replaces_execution: ClassVar[bool] = False

    def before(self, call: OpCall) -> None:
        """Inputs are live and unmodified; the op has not run."""

    def run(self, call: OpCall, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op in place of the tracer (only when ``replaces_execution``)."""
        raise NotImplementedError

    def after(self, call: OpCall) -> None:
        """The op ran; ``call.output_tensors`` holds its results."""

    def flush(self, step: int, writer: StepWriter) -> dict[str, Any]:
        """Write the step's results; return a small summary for the step manifest."""
        return {}

    def close(self) -> None:
        """Release resources at session end."""
