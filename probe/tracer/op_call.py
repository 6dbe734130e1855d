"""The record of one traced op call, as the tracer keeps it during a step.

Tensor metadata are plain tuples, built once per tensor on the hot path:

- an input is ``(dtype, shape, source)``: ``source`` is where the value came
  from, ``(producer op index, its output position, exact)``, or None;
- an output is ``(dtype, shape, mutated)``: ``mutated`` is True for an
  argument the op wrote in place rather than a fresh result.

``exact`` is False when only the storage matched (a read after an in-place
write through another view): the producer wrote these bytes, but its output
was another view of them.

The record itself is a plain tuple whose fields are listed once, in
:data:`OP_RECORD_FIELDS`: their order is the tuple's, their keys are the JSON
keys of ``ops.jsonl`` (``probe.rundir.op_record_json`` derives encode and decode
from the list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from probe.tracer.frames import Frame
from probe.vocabulary.op_class import OpClass
from probe.vocabulary.op_tensors import counted_writes, written_tensors

Source = tuple[int, int, bool]
InputMeta = tuple[str, tuple[int, ...], Source | None]
OutputMeta = tuple[str, tuple[int, ...], bool]

GroupMeta = tuple[int, str, tuple[int, ...]]
"""A collective's process group: ``(size, group name, global ranks)``."""

MeshMeta = tuple[tuple[int, ...], tuple[str, ...] | None, tuple[int, ...]]
"""A DTensor device mesh: ``(shape, dim names or None, global ranks in mesh order, flattened)``."""

Placements = tuple[str, ...] | None
"""One tensor's DTensor placements, one per mesh dim (``"S(0)"``, ``"R"``, ``"P(sum)"``), or
None for a plain tensor argument of a DTensor op."""

LayoutMeta = tuple[str, str, MeshMeta, tuple[Placements, ...], tuple[Placements, ...]]
"""A local op that ran for a DTensor op (``probe.tracer.dtensor_layouts``): ``(the DTensor op's
name, role, mesh, its tensor inputs' placements, its results' placements)``; role is
``"compute"`` (the local op that computes the DTensor op) or ``"redistribute"`` (a local op
DTensor ran to change an input's layout first)."""

Skipped = tuple[str, int, str]
"""A tensor the tracer could not key: ``("in" or "out", position, reason)``. It has no
source, registers no value, and gets no statistics or dump; ``reason`` is one of
:data:`SKIP_REASONS`."""

SKIP_REASONS = ("inference", "sparse", "nested", "zero", "meta", "no storage")

_REQUIRED = object()


@dataclass(frozen=True, slots=True)
class RecordField:
    """One field of an op record: its name, its ``ops.jsonl`` key and how it is encoded."""

    name: str
    key: str
    kind: str
    """The value's form, one of ``probe.rundir.op_record_json.CODECS``."""
    default: Any = _REQUIRED
    """An optional field's value when its key is absent (and it is not written when equal)."""

    @property
    def optional(self) -> bool:
        return self.default is not _REQUIRED


OP_RECORD_FIELDS: tuple[RecordField, ...] = (
    RecordField("index", "i", "int"),
    RecordField("op_id", "id", "str"),
    RecordField("name", "name", "str"),
    RecordField("phase", "phase", "str"),
    RecordField("module", "module", "str"),
    RecordField("module_call", "call", "int"),
    RecordField("module_stack", "stack", "strs"),
    RecordField("inputs", "in", "inputs"),
    RecordField("outputs", "out", "outputs"),
    RecordField("callsite", "site", "int", default=None),
    RecordField("group", "group", "group", default=None),
    RecordField("skipped", "skip", "skipped", default=()),
    RecordField("layout", "layout", "layout", default=None),
    RecordField("autocast", "amp", "int", default=0),
)
"""The op record's fields in tuple order. Adding one: append it here (optional, so older
runs still load), build it in ``Tracer._record`` in the same position."""

RECORD_FIELD_INDEX = {field.name: position for position, field in enumerate(OP_RECORD_FIELDS)}
RECORD_PHASE = RECORD_FIELD_INDEX["phase"]
RECORD_MODULE = RECORD_FIELD_INDEX["module"]
RECORD_CALLSITE = RECORD_FIELD_INDEX["callsite"]
RECORD_SKIPPED = RECORD_FIELD_INDEX["skipped"]
RECORD_LAYOUT = RECORD_FIELD_INDEX["layout"]
RECORD_AUTOCAST = RECORD_FIELD_INDEX["autocast"]

OpRecordTuple = tuple[
    int, str, str, str, str, int, tuple[str, ...], tuple[InputMeta, ...], tuple[OutputMeta, ...],
    int | None, GroupMeta | None, tuple[Skipped, ...], LayoutMeta | None, int,
]
"""What the tracer keeps of an op until the step is written, fields as in
:data:`OP_RECORD_FIELDS`. Only strings, numbers and tuples of them: the garbage
collector stops tracking such tuples, so a long step's records add little to its scans."""


class OpCall:
    """One traced op call, handed to the modes while it runs; kept as an :data:`OpRecordTuple`."""

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
