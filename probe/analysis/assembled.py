"""Tensors assembled in place, piece by piece: a buffer (``new_empty``) whose slices ``copy_``
fills one by one, as multi-head latent attention writes ``q_nope`` and ``q_pe`` into the two
parts of one query buffer.

A later read of the whole buffer has the last write as its source, and that write's output is
the slice it filled: the statistics of a part, not of the tensor read. When the writes cover
the buffer, the statistics of the whole are the parts' combined (exactly: extremes, counts,
the sum of squares and of values), so its difference between two runs is known again. The
parts themselves are found by :mod:`probe.rundir.written_parts`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from probe.rundir.run import TensorRecord


def assembled_record(parts: Sequence[TensorRecord], record: TensorRecord) -> TensorRecord | None:
    """``record`` with the statistics of the whole tensor, combined from ``parts``
    (:func:`written_parts`) when the writes cover it exactly once, or cover part of a buffer
    filled with one value (``full(-inf)``, ``zeros``: a padded buffer), whose other elements
    still hold it; None otherwise (a tensor partly overwritten, overlapping writes). A ``record``
    that reads the buffer broadcast (a whole number of times its size: an ``expand`` over the
    batch) holds its values repeated, and their statistics so."""
    if not parts:
        return None
    total = sum(p.numel for p in parts)
    if total and record.numel % total == 0 and all(p.mutated for p in parts):  # writes alone
        whole, stats = total, combined_stats(parts)
    else:  # the buffer they wrote into holds the rest
        *written, base = parts
        whole = base.numel
        rest = whole - sum(p.numel for p in written)
        fill = _filled_with(base)
        if not written or rest <= 0 or fill is None or record.numel % whole:
            return None
        stats = combined_stats([*written, _constant(fill, rest)])
    if record.numel > whole:
        buffer = TensorRecord(record.dtype, (whole,), stats)
        stats = combined_stats([buffer] * (record.numel // whole))
    return TensorRecord(record.dtype, record.shape, stats, record.source)


def _filled_with(record: TensorRecord) -> float | None:
    """The one value every element of ``record`` holds (its minimum is its maximum), else None."""
    stats = record.stats
    if stats is None or stats.get("min") is None or stats.get("min") != stats.get("max") or stats.get("nan"):
        return None
    return float(stats["min"])


def _constant(value: float, count: int) -> TensorRecord:
    """``count`` elements of ``value``, as a record whose statistics say so."""
    infinite = int(math.isinf(value)) * count
    stats = {"min": value, "max": value, "mean": value, "norm": abs(value) * math.sqrt(count),
             "nan": 0, "inf": infinite, "posinf": infinite if value > 0 else 0,
             "neginf": infinite if value < 0 else 0}
    return TensorRecord("float32", (count,), stats)


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
