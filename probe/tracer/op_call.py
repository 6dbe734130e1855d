"""The record of one traced op call, as the tracer keeps it during a step.

The record itself is a plain tuple whose fields are listed once, in
``probe.rundir.op_record_fields.OP_RECORD_FIELDS`` (the run format's): their order is the tuple's,
their keys are the JSON keys of ``ops.jsonl`` (``probe.rundir.op_record_json`` derives encode and
decode from the list).
"""

from __future__ import annotations

from typing import Any

import torch

from probe.rundir.op_record_fields import InputMeta, OutputMeta, Skipped
from probe.tracer.frames import Frame
from probe.vocabulary.op_class import OpClass
from probe.vocabulary.op_tensors import counted_writes, written_tensors


class OpCall:
    """One traced op call, handed to the modes while it runs; kept as an ``OpRecordTuple``
    (``probe.rundir.op_record_fields``)."""

    __slots__ = (
        "_written", "args", "callsite", "frame", "func", "index", "info", "input_tensors", "inputs",
        "kwargs", "op_id", "output_tensors", "outputs", "phase", "skipped", "uninitialized",
        "writes_in_flight",
    )

    def __init__(
        self,
        index: int,
        op_id: str,
        info: OpClass,
        phase: str,
        frame: Frame,
        inputs: list[InputMeta],
        input_tensors: list[torch.Tensor],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        callsite: int | None,
        func: Any = None,
    ) -> None:
        self.func = func
        """The op overload itself (for modes that run it again)."""
        self.index = index
        """Position in the step's execution order (per rank)."""
        self.op_id = op_id
        self.info = info
        self.phase = phase
        self.frame = frame
        self.inputs = inputs
        self.outputs: list[OutputMeta] = []
        self.callsite = callsite
        self.input_tensors: list[torch.Tensor] | None = input_tensors
        self.output_tensors: list[torch.Tensor] | None = None
        self.args: tuple[Any, ...] = args
        self.kwargs: dict[str, Any] | None = kwargs
        self.uninitialized = info.uninitialized_output
        """The outputs hold memory nothing wrote yet (``empty``, or a view of such memory)."""
        self.skipped: tuple[Skipped, ...] = ()
        """Tensors the tracer could not key (inference, sparse, nested, zero, ...): modes keep
        nothing of them. Empty for almost every op: test it before asking :meth:`skip_reason`."""
        self._written: list[torch.Tensor] | None = None
        self.writes_in_flight: list[torch.Tensor] | None = None
        """Set when the modes' ``after`` runs inside another op's dispatch (a deferred
        collective): what that op writes. None: this op's own writes."""

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def module(self) -> str:
        return self.frame.origin.fqn

    def written(self) -> list[torch.Tensor]:
        """The tensor arguments the op writes (see ``written_tensors``), found once per call for
        the tracer and every mode that asks, before or after the op runs."""
        if self._written is None:
            self._written = written_tensors(self.info, self.args, self.kwargs)
        return self._written

    def written_unannounced(self) -> list[torch.Tensor]:
        """Tensors the op may write that its schema does not mark and whose version counters do
        not move: a collective's inputs (a backend may write any buffer it is given; gloo emulates
        reduce-scatter by an all-reduce of its input). A mode that keeps anything of their values
        by storage and version lets go of it here."""
        return list(self.input_tensors or ()) if self.info.is_collective else []

    def versions_moving(self) -> list[torch.Tensor]:
        """The tensors whose version counters go up by one when the op now in dispatch
        returns (see ``OpClass.counts_writes``)."""
        if self.writes_in_flight is not None:
            return self.writes_in_flight
        if self.info.uncounted_writes:
            return counted_writes(self.info, self.args, self.kwargs)
        return self.written() if self.info.counts_writes else []

    def skip_reason(self, io: str, position: int) -> str | None:
        """Why input (``io="in"``) or output (``"out"``) ``position`` is skipped; None if it is not."""
        for skipped_io, skipped_position, reason in self.skipped:
            if skipped_position == position and skipped_io == io:
                return reason
        return None

    def release(self) -> None:
        """Drop every reference to live tensors once the modes are done with the op."""
        self.input_tensors = None
        self.output_tensors = None
        self.args = ()
        self.kwargs = None
        self._written = None
        self.writes_in_flight = None
