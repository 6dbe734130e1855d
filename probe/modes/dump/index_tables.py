"""A step's dump index held in typed columns: ~100 bytes a tensor instead of ~1 KB of objects.

A step of a large model dumps millions of tensors. One :class:`DumpedTensor` with its tuples,
ints and strings, in a dict keyed by tuples, costs several times the ~130 bytes of its entry
in ``tensors.json``; so does a blob's ``(shard, name)``. :class:`EntryTable` keeps each entry's
fields in arrays and makes its ``DumpedTensor`` when it is asked for; :class:`BlobTable` does
the same for the blob -> (shard, name) map. Both are filled one item at a time while the
index is read (:mod:`probe.rundir.streamed_json`), then :meth:`~EntryTable.freeze` sorts their
keys, and they are read-only mappings, in which a key met twice holds its last value (as a
dict built from the file would).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator, Mapping
from dataclasses import MISSING, fields
from typing import Any

import numpy as np

from probe.modes.dump.records import DumpedTensor

_IO = ("input", "output")
_CONJ, _NEG, _NO_BLOB = 1, 2, 4
_NONE, _INT, _FLOAT = 0, 1, 2  # the kinds of checksum
_COLUMNS = ("op", "io", "position", "dtype", "shape", "stride", "blob", "offset", "checksum", "status",
            "conj", "neg")
# Fields of DumpedTensor beyond the columns (a layout and its parts): an entry that sets any of
# them (a sparse tensor stored in parts; rare) is kept whole.
_OTHER_DEFAULTS = [(f.name, f.default if f.default is not MISSING else f.default_factory())  # type: ignore[misc]
                   for f in fields(DumpedTensor) if f.name not in _COLUMNS]


_INDEX_END = 1 << 31
"""Op indices and positions are below this (a step of 2**31 ops would be terabytes of records)."""


def _key(op: int, io: str, position: int) -> int:
    """One int64 for (op, io, position), ordered as the tuple: op, then position, then io."""
    return op << 32 | position << 1 | _IO.index(io)


class _Interned:
    """Each distinct string once, numbered in order of appearance."""

    def __init__(self) -> None:
        self.values: list[Any] = []
        self._codes: dict[str, int] = {}

    def code(self, value: str) -> int:
        code = self._codes.get(value)
        if code is None:
            code = self._codes[value] = len(self.values)
            self.values.append(value)
        return code

    def forget_codes(self) -> None:
        """Keep the values only (the table is full)."""
        self._codes = {}


class _SortedKeys:
    """The rows of a table ordered by their int64 keys, the last of equal keys kept."""

    def __init__(self, keys: array) -> None:
        column = np.frombuffer(keys, dtype=np.int64) if len(keys) else np.zeros(0, dtype=np.int64)
        order = np.argsort(column, kind="stable")  # equal keys stay in file order
        ordered = column[order]
        last = np.ones(len(order), dtype=bool)
        last[:-1] = ordered[1:] != ordered[:-1]
        self.rows, self.keys = order[last], ordered[last]

    def find(self, key: int) -> int | None:
        """The row of ``key``, or None."""
        at = int(np.searchsorted(self.keys, key))
        return int(self.rows[at]) if at < len(self.keys) and self.keys[at] == key else None


class EntryTable(Mapping[tuple[int, str, int], DumpedTensor]):
    """(op index, "input"/"output", position) -> :class:`DumpedTensor`, filled by :meth:`add`."""

    def __init__(self) -> None:
        self._key = array("q")  # see _key
        self._dtype, self._status, self._whole = array("H"), array("i"), array("i")
        self._dims_at, self._ndim, self._dims = array("q"), array("H"), array("q")
        self._blob, self._offset, self._bits = array("q"), array("q"), array("b")
        self._checksum_kind, self._checksum = array("b"), array("q")
        self._dtypes, self._statuses = _Interned(), _Interned()
        self._objects: list[DumpedTensor] = []  # entries kept whole
        self._keys: _SortedKeys | None = None

    def add(self, entry: DumpedTensor) -> None:
        """Append a checked entry (before :meth:`freeze`)."""
        assert self._keys is None, "the table is frozen"
        if not (0 <= entry.op < _INDEX_END and 0 <= entry.position < _INDEX_END):
            raise ValueError(f"tensor entry of op {entry.op}, position {entry.position}: no op has that "
                             "index or that many tensors")
        self._key.append(_key(entry.op, entry.io, entry.position))
        if any(getattr(entry, name) != default for name, default in _OTHER_DEFAULTS):
            self._whole.append(len(self._objects))
            self._objects.append(entry)
            for column in (self._dtype, self._status, self._dims_at, self._ndim, self._blob, self._offset,
                           self._bits, self._checksum_kind, self._checksum):
                column.append(0)
            return
        self._whole.append(-1)
        self._dtype.append(self._dtypes.code(entry.dtype))
        self._status.append(-1 if entry.status is None else self._statuses.code(entry.status))
        self._dims_at.append(len(self._dims))
        self._ndim.append(len(entry.shape))
        self._dims.extend(entry.shape)
        self._dims.extend(entry.stride)
        self._blob.append(0 if entry.blob is None else entry.blob)
        self._offset.append(entry.offset)
        self._bits.append((_CONJ if entry.conj else 0) | (_NEG if entry.neg else 0)
                          | (_NO_BLOB if entry.blob is None else 0))
        checksum = entry.checksum
        if checksum is None:
            self._checksum_kind.append(_NONE)
            self._checksum.append(0)
        elif isinstance(checksum, float):  # kept bit for bit in the int64 column
            self._checksum_kind.append(_FLOAT)
            self._checksum.append(struct.unpack("<q", struct.pack("<d", checksum))[0])
        else:
            self._checksum_kind.append(_INT)
            self._checksum.append(checksum)

    def freeze(self) -> None:
        """Sort the keys: the table is complete and can be read."""
        self._keys = _SortedKeys(self._key)
        self._key = array("q")  # the sorted keys hold them now
        self._dtypes.forget_codes()
        self._statuses.forget_codes()

    def _frozen(self) -> _SortedKeys:
        assert self._keys is not None, "read before freeze()"
        return self._keys

    def __getitem__(self, key: tuple[int, str, int]) -> DumpedTensor:
        op, io, position = key
        if io not in _IO or not isinstance(op, int) or not isinstance(position, int) or not (
                0 <= op < _INDEX_END and 0 <= position < _INDEX_END):
            raise KeyError(key)
        row = self._frozen().find(_key(op, io, position))
        if row is None:
            raise KeyError(key)
        if self._whole[row] >= 0:
            return self._objects[self._whole[row]]
        at, ndim = self._dims_at[row], self._ndim[row]
        dims = self._dims[at : at + 2 * ndim].tolist()
        bits, kind, checksum = self._bits[row], self._checksum_kind[row], self._checksum[row]
        status = self._status[row]
        return DumpedTensor(
            op, io, position, self._dtypes.values[self._dtype[row]], tuple(dims[:ndim]), tuple(dims[ndim:]),
            None if bits & _NO_BLOB else self._blob[row], self._offset[row],
            None if kind == _NONE else checksum if kind == _INT
            else struct.unpack("<d", struct.pack("<q", checksum))[0],
            None if status < 0 else self._statuses.values[status], bool(bits & _CONJ), bool(bits & _NEG),
        )

    def __iter__(self) -> Iterator[tuple[int, str, int]]:
        for key in self._frozen().keys.tolist():
            yield key >> 32, _IO[key & 1], (key >> 1) & (_INDEX_END - 1)

    def __len__(self) -> int:
        return len(self._frozen().rows)


class BlobTable(Mapping[int, tuple[Any, str]]):
    """Blob id -> (its shard's name as the index gives it, unchecked; its name in the shard)."""

    def __init__(self) -> None:
        self._id, self._shard = array("q"), array("i")
        self._names: list[str] = []
        self._shards = _Interned()
        self._keys: _SortedKeys | None = None

    def add(self, blob: int, shard: Any, name: str) -> None:
        """Append a blob (before :meth:`freeze`); a shard that is no string is kept as it is, to
        be refused when a tensor of it is read (one bad name costs only its tensors)."""
        assert self._keys is None, "the table is frozen"
        self._id.append(blob)
        if isinstance(shard, str):
            self._shard.append(self._shards.code(shard))
        else:
            self._shard.append(len(self._shards.values))
            self._shards.values.append(shard)
        self._names.append(name)

    def freeze(self) -> None:
        """Sort the ids: the table is complete and can be read."""
        self._keys = _SortedKeys(self._id)
        self._shards.forget_codes()

    def __getitem__(self, blob: int) -> tuple[Any, str]:
        assert self._keys is not None, "read before freeze()"
        row = self._keys.find(blob) if isinstance(blob, int) and -(1 << 63) <= blob < 1 << 63 else None
        if row is None:
            raise KeyError(blob)
        return self._shards.values[self._shard[row]], self._names[row]

    def __iter__(self) -> Iterator[int]:
        assert self._keys is not None, "read before freeze()"
        return iter(self._keys.keys.tolist())

    def __len__(self) -> int:
        assert self._keys is not None, "read before freeze()"
        return len(self._keys.rows)
