"""The per-op interface the tracer calls: an :class:`OpObserver`.

The tracer owns this interface and the modes implement it (``probe.modes.base`` builds its
``Mode`` on it), so the tracer never imports a mode: the session hands it the observers of the
selected modes.
"""

from __future__ import annotations

from typing import Any, ClassVar

from probe.tracer.op_call import OpCall


class OpObserver:
    """Per-op work, called by the tracer for each selected op."""

    replaces_execution: ClassVar[bool] = False

    def before(self, call: OpCall) -> None:
        """Inputs are live and unmodified; the op has not run."""

    def run(self, call: OpCall, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run the op in place of the tracer (only when ``replaces_execution``)."""
        raise NotImplementedError

    def after(self, call: OpCall) -> None:
        """The op ran; ``call.output_tensors`` holds its results."""
