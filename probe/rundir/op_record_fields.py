"""The fields of one op record (a line of ``ops.jsonl``), listed once.

The tracer keeps each op of a step as a plain tuple (:data:`OpRecordTuple`) in the order of
:data:`OP_RECORD_FIELDS`; :mod:`probe.rundir.op_record_json` derives the JSON encoding and decoding
from the same list. The list is the run format's, so it lives here, in rundir, which every layer
above (the tracer, the session's writer) reads.

Tensor metadata are plain tuples, built once per tensor on the hot path:

- an input is ``(dtype, shape, source)``: ``source`` is where the value came
  from, ``(producer op index, its output position, exact)``, or None;
- an output is ``(dtype, shape, mutated)``: ``mutated`` is True for an
  argument the op wrote in place rather than a fresh result.

``exact`` is False when only the storage matched (a read after an in-place
write through another view): the producer wrote these bytes, but its output
was another view of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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

Constants = tuple[tuple[str, float | str], ...]
"""The floats and strings a call was given beside its tensors (``probe.tracer.call_constants``):
``((where, value), ...)``, where is the argument's position (``"4"``) or keyword name."""

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
    RecordField("constants", "const", "constants", default=()),
    RecordField("parameter", "param", "str", default=None),
)
"""The op record's fields in tuple order. Adding one: append it here (optional, so older
runs still load), build it in ``Tracer._record`` (``probe.tracer``) in the same position."""

RECORD_FIELD_INDEX = {field.name: position for position, field in enumerate(OP_RECORD_FIELDS)}
RECORD_PHASE = RECORD_FIELD_INDEX["phase"]
RECORD_MODULE = RECORD_FIELD_INDEX["module"]
RECORD_CALLSITE = RECORD_FIELD_INDEX["callsite"]
RECORD_SKIPPED = RECORD_FIELD_INDEX["skipped"]
RECORD_LAYOUT = RECORD_FIELD_INDEX["layout"]
RECORD_AUTOCAST = RECORD_FIELD_INDEX["autocast"]
RECORD_CONSTANTS = RECORD_FIELD_INDEX["constants"]
RECORD_PARAMETER = RECORD_FIELD_INDEX["parameter"]

OpRecordTuple = tuple[
    int, str, str, str, str, int, tuple[str, ...], tuple[InputMeta, ...], tuple[OutputMeta, ...],
    int | None, GroupMeta | None, tuple[Skipped, ...], LayoutMeta | None, int, Constants, str | None,
]
"""What the tracer keeps of an op until the step is written, fields as in
:data:`OP_RECORD_FIELDS`. Only strings, numbers and tuples of them: the garbage
collector stops tracking such tuples, so a long step's records add little to its scans."""
