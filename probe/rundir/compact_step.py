"""One step's op records held in typed columns, decoded an op at a time when asked for.

``probe compare`` reads both runs' steps at random (a backward op's producers are forward ops
anywhere in the step) and its report keeps every compared op: held as decoded records, that is
~1.7 KB an op a run (objects, lists and a statistics dict per tensor). A :class:`CompactStep`
holds the same records as arrays of numbers (``array.array``: ids as UTF-8 bytes, names,
modules, dtypes and shapes as codes into tables of the distinct values, statistics as float64
rows), a few hundred bytes an op, and gives each op as a :class:`StoredOp`: a handle that reads
like an :class:`~probe.rundir.records.OpRecord` and decodes the record from the columns when a
field is read (the last few thousand decoded are kept, so that reading an op's fields one after
another decodes it once).

The records are the ones stored, field for field: what the columns do not hold (a collective's
group, a DTensor layout, fp8 scales, a tensor's distribution and histogram, statistics of other
types than float, int and None) is kept as it was, beside them, for the ops that have it.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Iterator, Sequence
from dataclasses import fields
from typing import Any, overload

from probe.rundir.records import OpRecord, TensorRecord

DECODED_KEPT = 1 << 14
"""How many decoded records a step keeps (its most recently read): the judge reads an op's
fields one after another, and the ops near it."""

_EXACT_INTEGERS = 1 << 53
"""Integers below this magnitude are exact in a float64 column."""

_OP_COLUMNS = ("index", "id", "name", "phase", "module", "module_call", "module_stack", "step", "rank",
               "inputs", "outputs", "stack", "autocast")
_OP_OTHER = tuple(f.name for f in fields(OpRecord) if f.name not in _OP_COLUMNS)
"""The fields kept as they are, for the ops where one is set (group, layout, fp8_scales, and
any field added later)."""
_TENSOR_COLUMNS = ("dtype", "shape", "stats", "source", "mutated", "skipped")
_TENSOR_OTHER = tuple(f.name for f in fields(TensorRecord) if f.name not in _TENSOR_COLUMNS)

_FLOAT, _INT, _NONE = 0, 1, 2
"""How a statistic was held, to give back the same type from its float64 column."""

_MUTATED, _HAS_SOURCE = 1, 2
"""Bits of a tensor's flags column."""


class _Table:
    """Distinct values, each numbered in the order it first came; the codes' index is dropped
    once the step is stored (:meth:`freeze`)."""

    __slots__ = ("codes", "values")

    def __init__(self) -> None:
        self.values: list[Any] = []
        self.codes: dict[Hashable, int] | None = {}

    def code(self, value: Hashable) -> int:
        assert self.codes is not None
        code = self.codes.get(value)
        if code is None:
            code = self.codes[value] = len(self.values)
            self.values.append(value)
        return code

    def freeze(self) -> None:
        self.codes = None

    def __getstate__(self) -> list[Any]:
        return self.values

    def __setstate__(self, values: list[Any]) -> None:
        self.values, self.codes = values, None


def _stats_layout(stats: dict[str, Any]) -> tuple[tuple[tuple[str, int], ...], list[float]] | None:
    """The keys of a statistics dict with how each value is held, and the values as floats; None
    for a dict a float64 row cannot give back exactly."""
    layout, values = [], []
    for key, value in stats.items():
        if type(value) is float:
            layout.append((key, _FLOAT))
            values.append(value)
        elif type(value) is int and -_EXACT_INTEGERS < value < _EXACT_INTEGERS:
            layout.append((key, _INT))
            values.append(float(value))
        elif value is None:
            layout.append((key, _NONE))
            values.append(0.0)
        else:
            return None
    return tuple(layout), values


class CompactStep(Sequence[OpRecord]):
    """A step's op records in columns (:func:`CompactStep.of`): ``step[i]`` is op #i's
    :class:`StoredOp`, the same object each time (the judge keeps ops by identity)."""

    def __init__(self) -> None:
        self._words, self._shapes, self._stacks, self._policies, self._places = (
            _Table(), _Table(), _Table(), _Table(), _Table())
        # per op
        self._index = array("q")
        self._id_ends = array("q")
        self._ids = bytearray()
        self._name, self._phase, self._module = array("i"), array("i"), array("i")
        self._module_stack, self._call_site, self._autocast, self._place = (
            array("i"), array("i"), array("i"), array("i"))
        self._module_call = array("q")
        self._tensor_start = array("q", [0])
        self._input_count = array("i")
        self._op_other: dict[int, dict[str, Any]] = {}
        # per tensor
        self._dtype, self._shape, self._skipped = array("i"), array("i"), array("i")
        self._flags = array("b")
        self._source_op, self._source_position = array("q"), array("q")
        self._stats_row = array("q")
        self._tensor_other: dict[int, dict[str, Any]] = {}
        # per statistics row
        self._stats_layouts = _Table()
        self._stats_layout = array("i")
        self._stats_start = array("q", [0])
        self._stats_values = array("d")
        self._stats_other: dict[int, dict[str, Any]] = {}
        self._stats_key_cache: dict[int, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}
        self._decoded: OrderedDict[int, OpRecord] = OrderedDict()
        self._ops: list[StoredOp] = []

    @classmethod
    def of(cls, records: Iterable[OpRecord]) -> CompactStep:
        """The records (of one step, in order), stored; they are not kept."""
        step = cls()
        for record in records:
            step._append(record)
        tables = (step._words, step._shapes, step._stacks, step._policies, step._places, step._stats_layouts)
        for table in tables:
            table.freeze()
        step._ops = [StoredOp._of(step, number) for number in range(len(step._index))]
        return step

    # -- storing -------------------------------------------------------------------

    def _append(self, op: OpRecord) -> None:
        number = len(self._index)
        words = self._words.code
        self._index.append(op.index)
        self._ids += op.id.encode("utf-8", "surrogatepass")
        self._id_ends.append(len(self._ids))
        self._name.append(words(op.name))
        self._phase.append(words(op.phase))
        self._module.append(words(op.module))
        self._module_call.append(op.module_call)
        self._module_stack.append(self._stacks.code(tuple(op.module_stack)))
        self._call_site.append(-1 if op.stack is None else self._stacks.code(tuple(op.stack)))
        self._autocast.append(-1 if op.autocast is None else self._policies.code(tuple(op.autocast.items())))
        self._place.append(self._places.code((op.step, op.rank)))
        other = {name: value for name in _OP_OTHER if (value := getattr(op, name)) is not None}
        if other:
            self._op_other[number] = other
        for tensor in op.inputs:
            self._append_tensor(tensor, shared=self._producer_row(tensor))
        for tensor in op.outputs:
            self._append_tensor(tensor, shared=None)
        self._input_count.append(len(op.inputs))
        self._tensor_start.append(len(self._dtype))

    def _producer_row(self, tensor: TensorRecord) -> int | None:
        """The statistics row of the output an input was read from (an input without a row of
        its own shares its producer's), when the step stored it already."""
        if tensor.source is None:
            return None
        producer, position = tensor.source
        if not 0 <= producer < len(self._index) or self._index[producer] != producer:
            return None
        start = self._tensor_start[producer] + self._input_count[producer]
        if not 0 <= position < self._tensor_start[producer + 1] - start:
            return None
        row = self._stats_row[start + position]
        return row if row >= 0 else None

    def _append_tensor(self, tensor: TensorRecord, shared: int | None) -> None:
        number = len(self._dtype)
        self._dtype.append(self._words.code(tensor.dtype))
        self._shape.append(self._shapes.code(tensor.shape))
        self._skipped.append(self._words.code(tensor.skipped))
        source = tensor.source
        self._flags.append((_MUTATED if tensor.mutated else 0) | (_HAS_SOURCE if source is not None else 0))
        self._source_op.append(source[0] if source is not None else 0)
        self._source_position.append(source[1] if source is not None else 0)
        self._stats_row.append(-1 if tensor.stats is None else self._store_stats(tensor.stats, shared))
        other = {name: value for name in _TENSOR_OTHER if (value := getattr(tensor, name)) is not None}
        if other:
            self._tensor_other[number] = other

    def _store_stats(self, stats: dict[str, Any], shared: int | None) -> int:
        row = len(self._stats_layout)
        held = _stats_layout(stats)
        if held is None:  # not a float64 row: kept as it is
            self._stats_other[row] = dict(stats)
            self._stats_layout.append(-1)
            self._stats_start.append(self._stats_start[-1])
            return row
        layout, values = held
        code = self._stats_layouts.code(layout)
        if shared is not None and self._stats_layout[shared] == code:  # the producer's row, bit for bit
            start, end = self._stats_start[shared], self._stats_start[shared + 1]
            if self._stats_values[start:end].tobytes() == array("d", values).tobytes():
                return shared
        self._stats_layout.append(code)
        self._stats_values.extend(values)
        self._stats_start.append(len(self._stats_values))
        return row

    # -- reading -------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._ops)

    @overload
    def __getitem__(self, number: int) -> OpRecord: ...

    @overload
    def __getitem__(self, number: slice) -> list[OpRecord]: ...

    def __getitem__(self, number: int | slice) -> OpRecord | list[OpRecord]:
        return self._ops[number]  # type: ignore[return-value]

    def __iter__(self) -> Iterator[OpRecord]:
        return iter(self._ops)  # type: ignore[arg-type]

    def tensors(self, number: int) -> tuple[list[TensorRecord], list[TensorRecord]]:
        """Op #``number``'s inputs and outputs, decoded (the same objects while kept among the
        :data:`DECODED_KEPT` ops last read)."""
        decoded = self._decoded
        found = decoded.get(number)
        if found is not None:
            decoded.move_to_end(number)
            return found
        start, end = self._tensor_start[number], self._tensor_start[number + 1]
        tensors = [self._tensor(k) for k in range(start, end)]
        inputs = self._input_count[number]
        found = decoded[number] = (tensors[:inputs], tensors[inputs:])
        if len(decoded) > DECODED_KEPT:
            decoded.popitem(last=False)
        return found

    def record(self, number: int) -> OpRecord:
        """Op #``number`` as a plain record."""
        op = self._ops[number]
        return OpRecord(**{name: getattr(op, name) for name in _OP_FIELDS})

    def id(self, number: int) -> str:
        return self._ids[self._id_ends[number - 1] if number else 0:self._id_ends[number]].decode(
            "utf-8", "surrogatepass")

    def word(self, column: array, number: int) -> str:
        return self._words.values[column[number]]

    def stack(self, column: array, number: int) -> list[str] | None:
        code = column[number]
        return None if code < 0 else list(self._stacks.values[code])

    def place(self, number: int) -> tuple[int, int]:
        return self._places.values[self._place[number]]

    def autocast(self, number: int) -> dict[str, str] | None:
        code = self._autocast[number]
        return None if code < 0 else dict(self._policies.values[code])

    def other(self, number: int, name: str) -> Any:
        return self._op_other.get(number, {}).get(name)

    def _tensor(self, number: int) -> TensorRecord:
        flags, row, words = self._flags[number], self._stats_row[number], self._words.values
        tensor = TensorRecord(  # positional: the judge's passes decode every tensor of a step
            words[self._dtype[number]], self._shapes.values[self._shape[number]],
            None if row < 0 else self._stats(row),
            (self._source_op[number], self._source_position[number]) if flags & _HAS_SOURCE else None,
            bool(flags & _MUTATED), words[self._skipped[number]])
        other = self._tensor_other.get(number)
        if other is not None:
            for name, value in other.items():
                setattr(tensor, name, value)
        return tensor

    def _stats(self, row: int) -> dict[str, Any]:
        code = self._stats_layout[row]
        if code < 0:
            return dict(self._stats_other[row])
        keys, integers, nones = self._stats_keys(code)
        start, end = self._stats_start[row], self._stats_start[row + 1]
        stats: dict[str, Any] = dict(zip(keys, self._stats_values[start:end], strict=True))
        for key in integers:
            stats[key] = int(stats[key])
        for key in nones:
            stats[key] = None
        return stats

    def _stats_keys(self, code: int) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
        """A statistics layout's keys, and those held as int and as None."""
        found = self._stats_key_cache.get(code)
        if found is None:
            layout = self._stats_layouts.values[code]
            found = self._stats_key_cache[code] = (
                tuple(key for key, _ in layout), tuple(key for key, held in layout if held == _INT),
                tuple(key for key, held in layout if held == _NONE))
        return found

    # -- pickling (a piece of compare's work is judged in another process) -----------

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_decoded": OrderedDict(), "_ops": len(self._ops)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        count = state.pop("_ops")
        self.__dict__.update(state)
        self._ops = [StoredOp._of(self, number) for number in range(count)]


class StoredOp:
    """Op #n of a :class:`CompactStep`: reads as its :class:`OpRecord` (every field and property;
    names, ids and codes read from the columns, the tensors decoded when first read);
    :func:`dataclasses.replace` of it gives a plain record. Read-only: the stored record is the
    run's."""

    __slots__ = ("_number", "_step")
    __dataclass_fields__ = OpRecord.__dataclass_fields__  # type: ignore[misc]
    __hash__ = None  # type: ignore[assignment]  # as OpRecord's

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # dataclasses.replace(op, ...) calls the op's class with every field: a plain record.
        return OpRecord(*args, **kwargs)

    @classmethod
    def _of(cls, step: CompactStep, number: int) -> StoredOp:
        op = object.__new__(cls)
        op._step, op._number = step, number
        return op

    @property
    def record(self) -> OpRecord:
        """The decoded record."""
        return self._step.record(self._number)

    index = property(lambda op: op._step._index[op._number])
    id = property(lambda op: op._step.id(op._number))
    name = property(lambda op: op._step.word(op._step._name, op._number))
    phase = property(lambda op: op._step.word(op._step._phase, op._number))
    module = property(lambda op: op._step.word(op._step._module, op._number))
    module_call = property(lambda op: op._step._module_call[op._number])
    module_stack = property(lambda op: op._step.stack(op._step._module_stack, op._number))
    step = property(lambda op: op._step.place(op._number)[0])
    rank = property(lambda op: op._step.place(op._number)[1])
    inputs = property(lambda op: op._step.tensors(op._number)[0])
    outputs = property(lambda op: op._step.tensors(op._number)[1])
    stack = property(lambda op: op._step.stack(op._step._call_site, op._number))
    autocast = property(lambda op: op._step.autocast(op._number))

    def __getattr__(self, name: str) -> Any:  # methods OpRecord gains later
        if name.startswith("__") or name in StoredOp.__slots__:
            raise AttributeError(name)
        return getattr(self.record, name)

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if isinstance(other, StoredOp):
            if other._step is self._step:  # two ops of one step
                return False
            other = other.record
        return self.record == other

    def __repr__(self) -> str:
        return repr(self.record)

    def __reduce__(self) -> tuple[Any, ...]:
        return _stored_op, (self._step, self._number)


def _stored_op(step: CompactStep, number: int) -> StoredOp:
    return step._ops[number]


_OP_FIELDS = tuple(f.name for f in fields(OpRecord))
for _name in _OP_OTHER:  # the fields kept as they are, for the ops that have them
    setattr(StoredOp, _name, property(lambda op, name=_name: op._step.other(op._number, name)))
for _name, _value in vars(OpRecord).items():  # OpRecord's properties, read through the handle's fields
    if isinstance(_value, property) and not hasattr(StoredOp, _name):
        setattr(StoredOp, _name, property(_value.fget, doc=_value.__doc__))
