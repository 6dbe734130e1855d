"""TensorBoard's event-file framing, by hand: protobuf varints and fields, the ``Event`` message,
and TFRecord framing with TensorBoard's masked CRC32C. Shared by the scalar writer
(:mod:`probe.exporters.tensorboard_events`) and the histograms
(:mod:`probe.exporters.tensorboard_histograms`), which import it and not each other.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

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
