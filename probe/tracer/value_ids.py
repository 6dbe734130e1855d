"""Which traced op produced the value a tensor holds (the graph's edges).

A value is a storage in a version: in-place writes bump ``_version``. Views
share storage and version, so a value's exact key also holds offset, shape and
stride. An in-place op's version bump happens after its dispatch returns (in
the ADInplaceOrView kernel above the Python key), so a written tensor cannot
be keyed by its new version here; instead each storage remembers its latest
traced writer, which is the producer of any later read that has no exact
match. Storages are held by weak reference: a freed storage whose address is
reused never links to a stale producer.
"""

from __future__ import annotations

import weakref

import torch

from probe.tracer.op_call import Source

ValueKey = tuple[int, int, tuple[int, ...], tuple[int, ...], int]
_Entry = tuple[int, int, weakref.ref]


def value_key(t: torch.Tensor) -> tuple[ValueKey, torch.UntypedStorage] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, storage-less tensors
        return None
    ptr = storage.data_ptr()
    if ptr == 0:
        return None
    return (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t._version), storage


class ValueIndex:
    """Per-step map from values to the (op index, output position) that produced them."""

    def __init__(self) -> None:
        self._exact: dict[ValueKey, _Entry] = {}
        self._latest_write: dict[int, tuple[_Entry, int]] = {}

    def clear(self) -> None:
        self._exact.clear()
        self._latest_write.clear()

    def source(self, t: torch.Tensor) -> Source | None:
        found = value_key(t)
        if found is None:
            return None
        key, storage = found
        hit = self._exact.get(key)
        if hit is not None and hit[2]() is storage:
            return hit[0], hit[1], True
        latest = self._latest_write.get(key[0])
        if latest is not None:
            entry, version = latest
            if entry[2]() is storage and key[4] >= version:
                return entry[0], entry[1], False
        return None

    def produced(self, t: torch.Tensor, op_index: int, position: int, kind: str) -> None:
        """Register ``t`` as output ``position`` of op ``op_index``.

        ``kind`` is "fresh" (a new value), "view" (exposes a value, writes
        nothing) or "written" (an argument the op wrote in place).
        """
        found = value_key(t)
        if found is None:
            return
        key, storage = found
        entry = (op_index, position, weakref.ref(storage))
        if kind != "written":
            self._exact[key] = entry
        if kind != "view":
            self._latest_write[key[0]] = (entry, key[4])
