"""Tensors assembled in place, piece by piece: a buffer (``new_empty``) whose slices ``copy_``
fills one by one, as multi-head latent attention writes ``q_nope`` and ``q_pe`` into the two
parts of one query buffer.

A later read of the whole buffer has the last write as its source, and that write's output is
the slice it filled: the statistics of a part, not of the tensor read. When the writes cover
the buffer, the statistics of the whole are the parts' combined (exactly: extremes, counts,
the sum of squares and of values), so its difference between two runs is known again.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from probe.rundir.run import OpRecord, TensorRecord
from probe.vocabulary.op_class import creates_uninitialized, returns_view

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
    parts: list[TensorRecord] = []
    covered = 0
    source = record.source
    for _ in range(_WALK_LIMIT):
        output = _output(ops, source)
        if output is None or source is None:
            return None
        op = ops[source[0]]
        if output.numel >= record.numel:  # the tensor itself, before these writes
            if covered < record.numel and not creates_uninitialized(op.name):
                parts.append(output)
            break
        if output.mutated:
            parts.append(output)
            covered += output.numel
        elif not (returns_view(op.name) and op.inputs):
            return None
        source = op.inputs[0].source if op.inputs else None  # up the written view to its base
    else:
        return None
    if any(p.stats is None for p in parts) or (covered < record.numel and parts[-1].numel < record.numel):
        return None
    return parts


def assembled_record(parts: Sequence[TensorRecord], record: TensorRecord) -> TensorRecord | None:
    """``record`` with the statistics of the whole tensor, combined from ``parts``
    (:func:`written_parts`) when the writes cover it exactly once; None otherwise (a tensor
    partly overwritten, overlapping writes)."""
    if not parts or sum(p.numel for p in parts) != record.numel:
        return None
    return TensorRecord(record.dtype, record.shape, combined_stats(parts), record.source)


def combined_stats(pieces: Sequence[TensorRecord]) -> dict[str, float | int | None]:
    """The statistics of the tensor made of ``pieces`` (disjoint parts of it, each with
    statistics): min and max of theirs, the mean weighted by size, the norm from the sum of
    squares, NaN and Inf counts summed (a count unknown in one part is unknown)."""
    stats = [p.stats for p in pieces]
    assert all(s is not None for s in stats)
    total = sum(p.numel for p in pieces)

    def extreme(key: str, pick: type[min] | type[max]) -> float | None:
        values = [s[key] for s in stats if s is not None]
        return None if any(v is None for v in values) else pick(values)  # type: ignore[type-var]

    def summed(key: str) -> float | int | None:
        values = [s.get(key) for s in stats if s is not None]
        return None if any(v is None for v in values) else sum(values)  # type: ignore[arg-type]

    means = [(s["mean"], p.numel) for s, p in zip(stats, pieces, strict=True) if s is not None]
    norms = [s["norm"] for s in stats if s is not None]
    return {
        "min": extreme("min", min), "max": extreme("max", max),
        "mean": None if any(m is None for m, _ in means) or not total
        else sum(m * n for m, n in means) / total,  # type: ignore[operator]
        "norm": None if any(n is None for n in norms) else math.sqrt(sum(n * n for n in norms)),  # type: ignore[operator]
        **{key: summed(key) for key in ("nan", "inf", "posinf", "neginf")},
    }


def _output(ops: Sequence[OpRecord], source: tuple[int, int] | None) -> TensorRecord | None:
    if source is None or not 0 <= source[0] < len(ops) or source[1] >= len(ops[source[0]].outputs):
        return None
    return ops[source[0]].outputs[source[1]]
