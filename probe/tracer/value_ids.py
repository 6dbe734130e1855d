"""Which traced op produced the value a tensor holds (the graph's edges).

A value is a storage in a version: in-place writes bump ``_version`` and make a
new value. Views share storage and version, so the exact key also holds offset,
shape and stride; when only the storage matches (a view of a buffer written in
place), the last writer of that storage version is the producer. A storage is
remembered by weak reference: a freed storage whose address is reused never
links to a stale producer.
"""

from __future__ import annotations

import weakref

import torch

from probe.tracer.op_call import Source

ValueKey = tuple[int, int, tuple[int, ...], tuple[int, ...], int]


def value_key(t: torch.Tensor) -> tuple[ValueKey, torch.UntypedStorage] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested, meta-less tensors
        return None
    ptr = storage.data_ptr()
    if ptr == 0:
        return None
    return (ptr, t.storage_offset(), tuple(t.shape), t.stride(), t._version), storage


class ValueIndex:
    """Per-step map from values to the (op index, output position) that produced them."""

    def __init__(self) -> None:
        self._exact: dict[ValueKey, tuple[int, int, weakref.ref]] = {}
        self._storage: dict[tuple[int, int], tuple[int, int, weakref.ref]] = {}

    def clear(self) -> None:
        self._exact.clear()
        self._storage.clear()

    def source(self, t: torch.Tensor) -> Source | None:
        found = value_key(t)
        if found is None:
            return None
        key, storage = found
        hit = self._exact.get(key)
        if hit is not None and hit[2]() is storage:
            return hit[0], hit[1], True
        hit = self._storage.get((key[0], key[4]))
        if hit is not None and hit[2]() is storage:
            return hit[0], hit[1], False
        return None

    def produced(self, t: torch.Tensor, op_index: int, position: int, wrote: bool) -> None:
        """Register ``t`` as output ``position`` of op ``op_index``.

        ``wrote`` is False for views: they expose a value, they do not write one.
        """
        found = value_key(t)
        if found is None:
            return
        key, storage = found
        entry = (op_index, position, weakref.ref(storage))
        self._exact[key] = entry
        if wrote:
            self._storage[(key[0], key[4])] = entry
