"""The constants of an op call: the numbers and words it was given beside its tensors.

An eps, a scale, a fill value, a dropout probability, an approximation's name: what the program
says at that call, the same in any two runs of one computation whatever their precision. Two
runs that call an op with other constants compute something else there (``probe.compare``'s rule
*arguments*). Recorded for every op, so the statistics mode tells it too; only floats and
strings: integers are sizes, dims and counts, which a routing of values may choose.
"""

from __future__ import annotations

from typing import Any

from probe.rundir.op_record_fields import Constants
from probe.vocabulary.op_class import OpClass


def call_constants(info: OpClass, args: tuple, kwargs: dict[str, Any]) -> Constants:
    """The float and string arguments of one call, in the slots its schema may hold them in
    (:attr:`OpClass.constant_args`): ``()`` for most calls, which pass tensors only.

    On every recorded op's path: no builtin called where nothing is found (each is a call the
    per-op budget counts, ``benchmarks.overhead --calls``)."""
    found: list[tuple[str, float | str]] = []
    try:
        for position, where in info.constant_args:
            value = args[position]
            if type(value) is float or type(value) is str:
                found.append((where, value))
    except IndexError:  # trailing arguments left at their defaults
        pass
    if kwargs and info.constant_kwargs:
        for name in info.constant_kwargs:
            value = kwargs.get(name)
            if type(value) is float or type(value) is str:
                found.append((name, value))
    return tuple(found) if found else ()
