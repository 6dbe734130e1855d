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
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

FILE_VERSION = b"brain.Event:2"

_MASK_DELTA = 0xA282EAD8


def _crc32c_function() -> Callable[[bytes], int]:
    """The fastest CRC32C at hand: google-crc32c's C extension, else TensorBoard's Python one."""
    try:
        import google_crc32c

        if google_crc32c.implementation == "c":
            return google_crc32c.value
    except ImportError:
        pass
    try:
        from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import crc32c  # type: ignore[attr-defined]

        return crc32c
    except ImportError:
        return _table_crc32c


_TABLE: list[int] = []


def _table_crc32c(data: bytes) -> int:
    """CRC32C (Castagnoli, reflected 0x82F63B78), one table lookup per byte: the last resort."""
    if not _TABLE:
        for n in range(256):
            c = n
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
            _TABLE.append(c)
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


crc32c: Callable[[bytes], int] = _crc32c_function()


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC of ``data``."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _length_delimited(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _event(wall_time: float, step: int | None = None, file_version: bytes | None = None,
           summary: bytes | None = None) -> bytes:
    """An ``Event`` message: wall_time = 1 (double), step = 2 (int64), file_version = 3, summary = 5."""
    out = b"\x09" + struct.pack("<d", wall_time)
    if step is not None:
        out += b"\x10" + _varint(step & 0xFFFFFFFFFFFFFFFF)
    if file_version is not None:
        out += _length_delimited(3, file_version)
    if summary is not None:
        out += _length_delimited(5, summary)
    return out


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
        them): the values are placed into cached bytes, not encoded one by one."""
        if len(tags) != len(values):
            raise ValueError(f"add_scalars: {len(tags)} tags for {len(values)} values")
        if not len(tags):
            return
        template, offsets = self._summary_layout(tuple(tags))
        summary = np.frombuffer(template, dtype=np.uint8).copy()
        summary[offsets] = np.asarray(values, dtype="<f4").view(np.uint8).reshape(-1, 4)
        self._file.write(record(_event(time.time() if wall_time is None else wall_time, step,
                                       summary=summary.tobytes())))

    def add_histograms(self, step: int, histograms: Sequence[tuple[str, np.ndarray, np.ndarray]],
                       wall_time: float | None = None) -> None:
        """One event at ``step`` holding a log2-magnitude histogram per ``(tag, exponents, counts)``
        (``probe.exporters.tensorboard_histograms``)."""
        from probe.exporters.tensorboard_histograms import histogram_event

        if histograms:
            self._file.write(histogram_event(step, histograms, wall_time))

    def flush(self) -> None:
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()
