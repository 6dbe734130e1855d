"""The parts of a buffer assembled in place: a buffer (``new_empty``, ``full(-inf)``) whose slices
``copy_`` fills one by one. A later read of the whole buffer has the last write as its source,
whose output is the part it filled; the writes before it and the buffer they wrote into hold
the rest. Read by the comparison (the whole's statistics, :mod:`probe.analysis.assembled`) and
by the search for where non-finite values start (the kinds the whole may hold)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from probe.vocabulary.op_class import creates_uninitialized, returns_view

if TYPE_CHECKING:  # records reads the parts (where non-finite values start): no import cycle
    from probe.rundir.records import OpRecord, TensorRecord

_WALK_LIMIT = 64
"""Writes and views followed up one buffer before giving up (its difference then unknown)."""


def partial_write(ops: Sequence[OpRecord], record: TensorRecord) -> bool:
    """Whether ``record`` (an op's input) reads a tensor whose recorded source is an in-place
    write into a part of it: the source's statistics are the part's, not the input's."""
    output = _output(ops, record.source)
    return output is not None and output.mutated and output.numel < record.numel


def written_parts(ops: Sequence[OpRecord], record: TensorRecord) -> list[TensorRecord] | None:
    """The parts of the tensor ``record`` reads (:func:`partial_write`): the in-place writes into
    it, last first, then the tensor they wrote into when they leave some of it as it was (its
    producer's output, which holds the rest); None when a part is not recorded or the walk up
    the writes and views does not reach the tensor."""
    found = written_part_sources(ops, record)
    if found is None:
        return None
    parts = [_output(ops, source) for source in found]
    if any(p is None or p.stats is None for p in parts):
        return None
    return parts  # type: ignore[return-value]


def written_part_sources(ops: Sequence[OpRecord], record: TensorRecord) -> list[tuple[int, int]] | None:
    """Where the parts :func:`written_parts` finds were recorded, ``(op index, output position)``
    each, whether or not their statistics were (None when the walk does not reach the tensor)."""
    parts: list[tuple[int, int]] = []
    last_numel = 0
    covered = 0
    whole = record.numel
    source = record.source
    for _ in range(_WALK_LIMIT):
        output = _output(ops, source)
        if output is None or source is None:
            return None
        op = ops[source[0]]
        base = output.numel >= record.numel  # the tensor itself, before these writes
        if not base and not output.mutated and not (returns_view(op.name) and op.inputs):
            # A smaller tensor no view of which it is: the buffer ``record`` reads broadcast (an
            # ``expand`` of positions filled piece by piece over the batch), its values repeated.
            if output.numel == 0 or record.numel % output.numel:
                return None
            base, whole = True, output.numel
        if base:
            if covered < whole and not creates_uninitialized(op.name):
                parts.append((source[0], source[1]))
                last_numel = output.numel
            break
        if output.mutated:
            parts.append((source[0], source[1]))
            covered += output.numel
            last_numel = output.numel
        source = op.inputs[0].source if op.inputs else None  # up the written view to its base
    else:
        return None
    if covered < whole and last_numel < whole:
        return None
    return parts


def _output(ops: Sequence[OpRecord], source: tuple[int, int] | None) -> TensorRecord | None:
    if source is None or not 0 <= source[0] < len(ops) or source[1] >= len(ops[source[0]].outputs):
        return None
    return ops[source[0]].outputs[source[1]]
