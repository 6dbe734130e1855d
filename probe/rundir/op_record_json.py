"""The JSON form of one op record (a line of ``ops.jsonl``), both directions.

Both are derived from the one field list, ``probe.rundir.op_record_fields.OP_RECORD_FIELDS``:
a field's key names it in JSON, its kind picks a codec here. Tensor lists are
compact arrays (the tracer's tuples): an input is ``[dtype, shape, source]`` where
source is ``[producer index, output position, exact]`` or null; an output is
``[dtype, shape, mutated]``. Optional fields are left out at their default:
``site`` (call site id), ``group`` (a collective's ``{"size", "name", "ranks"}``)
``skip`` (``[io, position, reason]`` of tensors the tracer could not key) and ``layout`` (a
local op that ran for a DTensor op: ``{"of", "role", "mesh": {"shape", "names", "ranks"},
"in", "out"}``, placements one string per mesh dim, null for a plain tensor) and ``amp`` (a
forward op's autocast policy id into the manifest's ``autocast`` table; absent: 0, off) and
``const`` (the floats and strings the call was given beside its tensors, ``{where: value}``,
where an argument's position or keyword name; absent: none) and ``param`` (an optimizer op's
parameter, ``probe.tracer.updated_parameters``; absent: None).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from probe.errors import ProbeError
from probe.rundir.call_args import encode_float
from probe.rundir.op_record_fields import OP_RECORD_FIELDS, SKIP_REASONS, Constants, OpRecordTuple

_MISSING = object()
_REPEATED = frozenset({"name", "phase", "module"})
"""String fields that repeat from op to op: decoded as one shared string each (``sys.intern``), as
are dtypes and module stacks' names. ``json.loads`` makes a new string for every value of every
line, and a step's records (which ``probe compare`` holds whole, two runs at once) spent a fifth
of their memory on copies of a few dozen words."""
_SHAPES_KEPT = 1 << 12
_shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
"""Shapes decoded recently, each kept once (the same few shapes recur through a step's records);
emptied when it holds :data:`_SHAPES_KEPT`, so that a run of distinct shapes costs no more."""


class _BadValue(Exception):
    """A JSON value of the wrong form; :func:`decode` names the field."""


def _int(value: Any) -> int:
    if type(value) is not int:
        raise _BadValue("an integer")
    return value


def _str(value: Any) -> str:
    if type(value) is not str:
        raise _BadValue("a string")
    return value


def _strs(value: Any) -> tuple[str, ...]:
    if type(value) is not list or not all(type(v) is str for v in value):
        raise _BadValue("a list of strings")
    return tuple(map(sys.intern, value))


def _shape(value: Any) -> tuple[int, ...]:
    if type(value) is not list or not all(type(v) is int for v in value):
        raise _BadValue("tensors as [dtype, shape, ...] with a shape of integers")
    shape = tuple(value)
    if len(shape) > 8:  # the cache holds short shapes only: a hostile record's cannot fill it
        return shape
    known = _shapes.get(shape)
    if known is None:
        if len(_shapes) >= _SHAPES_KEPT:
            _shapes.clear()
        known = _shapes[shape] = shape
    return known


def _tensor(value: Any) -> tuple[str, tuple[int, ...], Any]:
    if type(value) is not list or len(value) != 3 or type(value[0]) is not str:
        raise _BadValue("tensors as [dtype, shape, source or mutated]")
    return sys.intern(value[0]), _shape(value[1]), value[2]


def _inputs(value: Any) -> tuple[Any, ...]:
    if type(value) is not list:
        raise _BadValue("a list of tensors")
    inputs = []
    for item in value:
        dtype, shape, source = _tensor(item)
        if source is not None:
            if (type(source) is not list or len(source) != 3 or type(source[0]) is not int
                    or type(source[1]) is not int or type(source[2]) is not bool):
                raise _BadValue("inputs' sources as [op index, position, exact] or null")
            source = (source[0], source[1], source[2])
        inputs.append((dtype, shape, source))
    return tuple(inputs)


def _outputs(value: Any) -> tuple[Any, ...]:
    if type(value) is not list:
        raise _BadValue("a list of tensors")
    outputs = []
    for item in value:
        dtype, shape, mutated = _tensor(item)
        if type(mutated) not in (bool, int):  # 0/1 in older runs
            raise _BadValue("outputs as [dtype, shape, mutated]")
        outputs.append((dtype, shape, bool(mutated)))
    return tuple(outputs)


def _encode_group(group: tuple[int, str, tuple[int, ...]]) -> dict[str, Any]:
    size, name, ranks = group
    return {"size": size, "name": name, "ranks": list(ranks)}


def _group(value: Any) -> tuple[int, str, tuple[int, ...]]:
    try:
        return _int(value["size"]), _str(value["name"]), tuple(_int(r) for r in value["ranks"])
    except (_BadValue, KeyError, TypeError):
        raise _BadValue('{"size": int, "name": str, "ranks": [int, ...]}') from None


def _skipped(value: Any) -> tuple[tuple[str, int, str], ...]:
    if type(value) is not list:
        raise _BadValue("a list of [io, position, reason]")
    skipped = []
    for item in value:
        if (type(item) is not list or len(item) != 3 or item[0] not in ("in", "out")
                or type(item[1]) is not int or item[2] not in SKIP_REASONS):
            raise _BadValue(f'[io ("in" or "out"), position, reason (one of {list(SKIP_REASONS)})]')
        skipped.append((item[0], item[1], item[2]))
    return tuple(skipped)


_LAYOUT_FORM = ('{"of": str, "role": "compute" or "redistribute", "mesh": {"shape": [int], "names": '
                '[str] or null, "ranks": [int]}, "in": [[str] or null], "out": [[str] or null]}')


def layout_record(layout: tuple) -> dict[str, Any]:
    """The JSON form of a layout (also what ``OpRecord.layout`` holds)."""
    of, role, (shape, names, ranks), ins, outs = layout
    return {"of": of, "role": role,
            "mesh": {"shape": list(shape), "names": None if names is None else list(names),
                     "ranks": list(ranks)},
            "in": [None if p is None else list(p) for p in ins],
            "out": [None if p is None else list(p) for p in outs]}


def _placements(value: Any) -> tuple[tuple[str, ...] | None, ...]:
    if type(value) is not list:
        raise _BadValue(_LAYOUT_FORM)
    return tuple(None if p is None else _strs(p) for p in value)


def _layout(value: Any) -> tuple:
    try:
        mesh = value["mesh"]
        names = mesh["names"]
        layout = (_str(value["of"]), _str(value["role"]),
                  (_shape(mesh["shape"]), None if names is None else _strs(names), _shape(mesh["ranks"])),
                  _placements(value["in"]), _placements(value["out"]))
    except (_BadValue, KeyError, TypeError):
        raise _BadValue(_LAYOUT_FORM) from None
    if layout[1] not in ("compute", "redistribute"):
        raise _BadValue(_LAYOUT_FORM)
    return layout


def _encode_constants(constants: Constants) -> dict[str, Any]:
    return {where: encode_float(v) if type(v) is float else v for where, v in constants}


_CONSTANTS_FORM = '{argument: number, string or {"float": "inf"}}'


def _constants(value: Any) -> Constants:
    if type(value) is not dict:
        raise _BadValue(_CONSTANTS_FORM)
    found: list[tuple[str, float | str]] = []
    for where, v in value.items():
        if type(v) is str:
            found.append((where, v))
        elif type(v) in (int, float):
            found.append((where, float(v)))
        elif type(v) is dict and len(v) == 1 and type(v.get("float")) is str:
            try:
                found.append((where, float(v["float"])))
            except ValueError:
                raise _BadValue(_CONSTANTS_FORM) from None
        else:
            raise _BadValue(_CONSTANTS_FORM)
    return tuple(found)


def _as_is(value: Any) -> Any:
    return value


CODECS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    # kind: (encode the tracer's value to JSON, decode and check a JSON value)
    "int": (_as_is, _int),
    "str": (_as_is, _str),
    "strs": (_as_is, _strs),
    "inputs": (_as_is, _inputs),
    "outputs": (_as_is, _outputs),
    "group": (_encode_group, _group),
    "skipped": (_as_is, _skipped),
    "layout": (layout_record, _layout),
    "constants": (_encode_constants, _constants),
}

_FIELDS = tuple(
    (position, field.key, field.optional, field.default, *CODECS[field.kind])
    for position, field in enumerate(OP_RECORD_FIELDS)
)


def encode(record: OpRecordTuple) -> dict[str, Any]:
    """The JSON object of one record (optional fields at their default are left out)."""
    row: dict[str, Any] = {}
    for position, key, optional, default, encode_value, _ in _FIELDS:
        value = record[position]
        if optional and value == default:
            continue
        row[key] = encode_value(value)
    return row


def decode(row: Any) -> OpRecordTuple:
    """The record of one JSON object of ``ops.jsonl``, checked field by field.

    Raises :class:`ProbeError` naming the field that is missing or of the wrong form
    (the caller adds the file).
    """
    if type(row) is not dict:
        raise ProbeError(f"an op record is a JSON object, got {type(row).__name__}")
    values = []
    for _, key, optional, default, _, decode_value in _FIELDS:
        value = row.get(key, _MISSING)
        if value is _MISSING or (optional and value is None):
            if not optional:
                raise ProbeError(f"op record {row.get('i', '?')!r} has no field {key!r}")
            values.append(default)
            continue
        try:
            values.append(sys.intern(decode_value(value)) if key in _REPEATED else decode_value(value))
        except _BadValue as e:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            raise ProbeError(f"op record field {key!r}: expected {e}, got {shown}") from None
    return tuple(values)  # type: ignore[return-value]

