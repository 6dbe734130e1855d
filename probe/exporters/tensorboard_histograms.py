"""TensorBoard histograms of log2 magnitudes, encoded without the tensorboard package.

A monitored series' log2-magnitude histogram (``probe.modes.statistics.distribution``) becomes a
``HistogramProto`` over the binary exponent: the bucket ``[e, e + 1)`` counts the elements
with ``2**e <= |x| < 2**(e + 1)``, so TensorBoard's "Histograms" and "Distributions" tabs
show where a tensor's magnitudes sit against its dtype's range, step after step. Zeros and
NaN/Inf have no exponent: they are left out here (the series' ``zeros`` share and
``nan``/``inf`` counts are scalars).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Iterable

import numpy as np

from probe.exporters.tensorboard_records import _event, _length_delimited, _varint, record


def _double(field: int, value: float) -> bytes:
    return _varint(field << 3 | 1) + struct.pack("<d", value)


def _packed_doubles(field: int, values: np.ndarray) -> bytes:
    return _length_delimited(field, np.asarray(values, dtype="<f8").tobytes())


def histogram_proto(exponents: np.ndarray, counts: np.ndarray) -> bytes:
    """A ``HistogramProto`` (min = 1, max = 2, num = 3, sum = 4, sum_squares = 5, bucket_limit = 6,
    bucket = 7) of elements at binary ``exponents`` with ``counts``; every exponent is a bucket."""
    order = np.argsort(exponents)
    e = np.asarray(exponents, dtype=np.float64)[order]
    c = np.asarray(counts, dtype=np.float64)[order]
    if not len(e):
        return _double(3, 0.0)
    # A leading empty bucket ends where the first one starts: buckets are [previous limit, limit).
    limits = np.concatenate([[e[0]], e + 1])
    buckets = np.concatenate([[0.0], c])
    return (_double(1, float(e[0])) + _double(2, float(e[-1] + 1)) + _double(3, float(c.sum()))
            + _double(4, float((e * c).sum())) + _double(5, float((e * e * c).sum()))
            + _packed_doubles(6, limits) + _packed_doubles(7, buckets))


def histogram_event(step: int, histograms: Iterable[tuple[str, np.ndarray, np.ndarray]],
                    wall_time: float | None = None) -> bytes:
    """One TFRecord holding an ``Event`` at ``step`` with a histogram value per ``(tag, exponents,
    counts)`` (``Summary.Value``: tag = 1, histo = 5)."""
    summary = b"".join(
        _length_delimited(1, _length_delimited(1, tag.encode("utf-8"))
                          + _length_delimited(5, histogram_proto(exponents, counts)))
        for tag, exponents, counts in histograms)
    return record(_event(time.time() if wall_time is None else wall_time, step, summary=summary))
