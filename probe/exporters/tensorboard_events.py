"""TensorBoard scalars written as event files directly: one record per step, a native CRC.

``torch.utils.tensorboard.SummaryWriter.add_scalar`` builds two protobuf messages per
scalar and writes each as a record checksummed by TensorBoard's pure-Python CRC32C:
at a monitor's 96 series x 8 metrics that is ~800 records a step and tens of
milliseconds of Python holding the GIL against the training thread. TensorBoard reads
any number of values per ``Summary``, so :class:`ScalarEventWriter` encodes a step's
scalars as one ``Event`` (the few protobuf fields needed, by hand; each tag's bytes
encoded once per run) and checksums it with ``google-crc32c`` (the ``monitor`` extra)
when installed, TensorBoard's own CRC otherwise. The file is what TensorBoard's
``EventAccumulator`` and ``tensorboard --logdir`` read: ``events.out.tfevents.*``,
a ``brain.Event:2`` version record first, then TFRecord-framed events.

The writer is the ``"tensorboard"`` sink of the modes' sink interface (:data:`TENSORBOARD_SINK`,
``probe.modes.sinks``), which the session offers them.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from probe.exporters.tensorboard_histograms import histogram_event
from probe.exporters.tensorboard_records import (  # noqa: F401  (some imported from here too)
    FILE_VERSION,
    _event,
    _length_delimited,
    _table_crc32c,
    _varint,
    crc32c,
    masked_crc32c,
    record,
)
from probe.modes.sinks import Histogram, SinkKind


class ScalarEventWriter:
    """Scalars of many tags per step into one TensorBoard event file under ``log_dir``."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.0"
        self.path = self.log_dir / name
        self._file = open(self.path, "ab")  # noqa: SIM115 (open for the writer's lifetime)
        self._tags: dict[str, bytes] = {}
        self._layout: tuple[tuple[str, ...], bytes, np.ndarray] | None = None
        self._file.write(record(_event(time.time(), file_version=FILE_VERSION)))
        self._file.flush()

    def _value_prefix(self, tag: str) -> bytes:
        """``Summary.value`` up to its float: field 1 (a ``Value``) holding tag = 1, simple_value = 2."""
        prefix = self._tags.get(tag)
        if prefix is None:
            value_head = _length_delimited(1, tag.encode("utf-8")) + b"\x15"
            prefix = self._tags[tag] = _varint(1 << 3 | 2) + _varint(len(value_head) + 4) + value_head
        return prefix

    def _summary_layout(self, tags: tuple[str, ...]) -> tuple[bytes, np.ndarray]:
        """The ``Summary`` bytes for these tags with zeros for values, and where each value goes
        (cached: a monitor writes the same tags step after step)."""
        if self._layout is None or self._layout[0] != tags:
            parts, where, at = [], [], 0
            for tag in tags:
                prefix = self._value_prefix(tag)
                parts.append(prefix + bytes(4))
                where.append(at + len(prefix))
                at += len(prefix) + 4
            offsets = np.asarray(where, dtype=np.int64)[:, None] + np.arange(4)
            self._layout = (tags, b"".join(parts), offsets)
        return self._layout[1], self._layout[2]

    def add_scalars(self, step: int, tags: Sequence[str], values: Sequence[float] | np.ndarray,
                    wall_time: float | None = None) -> None:
        """One event at ``step`` holding each tag's value (stored as float32, as ``add_scalar`` stores
        them): the values are placed into cached bytes, not encoded one by one. A finite value past
        float32's range (a diverging run's fp64 norm) is written as float32's largest value of its
        sign, so the chart shows the climb instead of a gap (TensorBoard does not plot an Inf); the
        monitor's CSV keeps the exact value. NaN and Inf stay what they are."""
        if len(tags) != len(values):
            raise ValueError(f"add_scalars: {len(tags)} tags for {len(values)} values")
        if not len(tags):
            return
        template, offsets = self._summary_layout(tuple(tags))
        summary = np.frombuffer(template, dtype=np.uint8).copy()
        summary[offsets] = _as_float32(values).view(np.uint8).reshape(-1, 4)
        self._file.write(record(_event(time.time() if wall_time is None else wall_time, step,
                                       summary=summary.tobytes())))

    def add_histograms(self, step: int, histograms: Sequence[Histogram],
                       wall_time: float | None = None) -> None:
        """One event at ``step`` holding a log2-magnitude histogram per ``(tag, exponents, counts)``
        (``probe.exporters.tensorboard_histograms``)."""
        if histograms:
            self._file.write(histogram_event(step, histograms, wall_time))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


TENSORBOARD_SINK = SinkKind("tensorboard", reader_package="tensorboard", open=ScalarEventWriter)
"""TensorBoard event files under ``rank<R>/tensorboard/``, written when the ``tensorboard``
package (which reads them) is installed."""

_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _as_float32(values: Sequence[float] | np.ndarray) -> np.ndarray:
    """``values`` as little-endian float32, finite values past its range clipped to its largest
    (an explicit choice, where a plain cast would make them Inf with numpy's overflow warning)."""
    wide = np.asarray(values, dtype=np.float64)
    beyond = np.isfinite(wide) & (np.abs(wide) > _FLOAT32_MAX)
    if beyond.any():
        wide = np.where(beyond, np.copysign(_FLOAT32_MAX, wide), wide)
    return wide.astype("<f4")
