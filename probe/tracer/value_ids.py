"""Which traced op produced the value a tensor holds (the graph's edges).

A value is a storage region in a version: in-place writes bump ``_version``.
A value's exact key is (data pointer, shape, stride, version); views share
storage and version, so shape and stride tell them apart. An in-place op's
version bump happens after its dispatch returns (in the ADInplaceOrView kernel
above the Python key), so a written tensor cannot be keyed by its new version
here; instead each storage remembers its latest traced writer, the producer of
any later read that has no exact match.

Freed memory is reused: an exact entry holds a weak reference to the tensor it
describes, and a storage entry one to the storage, so an address that now
belongs to a value no traced op produced never links to a stale producer.
"""

from __future__ import annotations

import weakref

import torch

from probe.tracer.op_call import Source

ExactKey = tuple[int, torch.Size, tuple[int, ...], int]


class ValueIndex:
    """Per-step map from values to the (op index, output position) that produced them."""

    def __init__(self) -> None:
        self._exact: dict[ExactKey, tuple[int, int, weakref.ref]] = {}
        self._latest_write: dict[int, tuple[int, int, int, weakref.ref]] = {}

    def clear(self) -> None:
        self._exact.clear()
        self._latest_write.clear()

    def source(self, t: torch.Tensor) -> Source | None:
        ptr = t.data_ptr()
        if ptr == 0:  # empty or storage-less: no value to follow
            return None
        version = t._version
        hit = self._exact.get((ptr, t.shape, t.stride(), version))
        if hit is not None and hit[2]() is not None:
            return hit[0], hit[1], True
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        latest = self._latest_write.get(storage.data_ptr())
        if latest is not None and latest[3]() is storage and version >= latest[2]:
            return latest[0], latest[1], False
        return None

    def produced(self, t: torch.Tensor, op_index: int, position: int, kind: str) -> None:
        """Register ``t`` as output ``position`` of op ``op_index``.

        ``kind`` is "fresh" (a new value), "view" (exposes a value, writes
        nothing) or "written" (an argument the op wrote in place).
        """
        ptr = t.data_ptr()
        if ptr == 0:
            return
        if kind != "written":
            self._exact[(ptr, t.shape, t.stride(), t._version)] = (
                op_index, position, weakref.ref(t)
            )
        if kind != "view":
            try:
                storage = t.untyped_storage()
            except (RuntimeError, NotImplementedError):
                return
            self._latest_write[storage.data_ptr()] = (
                op_index, position, t._version, weakref.ref(storage)
            )
