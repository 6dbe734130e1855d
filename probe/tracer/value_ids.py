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
belongs to a value no traced op produced never links to a stale producer. A live
tensor's memory can move too: FSDP2 frees and reallocates its unsharded parameters'
storages (``UntypedStorage.resize_``, which no dispatch mode sees) while autograd
holds views of them, so a hit also needs the registered tensor to be at the address
still; otherwise another parameter reallocated there reads as that view.

Some tensors cannot be keyed: inference tensors have no version counter, sparse,
mkldnn and nested tensors no plain storage or shape, ZeroTensors and meta tensors
no memory. Telling them apart costs several attribute reads per tensor, so the
tracer does not ask up front: the key's own reads fail on them (or, for memory-less
tensors, :meth:`ValueIndex.source` and :meth:`ValueIndex.produced` raise
:class:`Unkeyable`), and only then does the tracer classify each tensor of the op
with :func:`unkeyable`. Try blocks cost nothing until they catch.
"""

from __future__ import annotations

import weakref

import torch

from probe.rundir.op_record_fields import InputMeta, OutputMeta, Source

ExactKey = tuple[int, tuple[int, ...], tuple[int, ...], int] | tuple[
    int, tuple[int, ...], tuple[int, ...], int, bool, bool
]


class Unkeyable(Exception):
    """A tensor without memory that is not merely empty (a ZeroTensor, a meta tensor)."""


UNKEYABLE_ERRORS = (RuntimeError, NotImplementedError, Unkeyable)
"""What reading a key raises on a tensor :func:`unkeyable` names."""


def unkeyable(t: torch.Tensor) -> str | None:
    """Why ``t`` has no value key (one of ``probe.rundir.op_record_fields.SKIP_REASONS``), or None
    for a plain tensor."""
    if t.is_inference():
        return "inference"
    if t.is_nested:
        return "nested"
    if t.layout is not torch.strided:
        return "sparse" if t.is_sparse or t.layout in _SPARSE_COMPRESSED else "no storage"
    if t._is_zerotensor():
        return "zero"
    if t.is_meta:
        return "meta"
    try:
        t.untyped_storage()
        t._version  # noqa: B018 - reading it is the check
        t.data_ptr()
    except (RuntimeError, NotImplementedError):
        return "no storage"
    return None


_SPARSE_COMPRESSED = frozenset(
    {torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc}
)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


DTYPE_NAMES = {
    dtype: dtype_name(dtype) for dtype in vars(torch).values() if isinstance(dtype, torch.dtype)
}
"""``torch.float32 -> "float32"``: a dict lookup per tensor instead of a string operation."""


class ValueIndex:
    """Per-step map from values to the (op index, output position) that produced them."""

    def __init__(self) -> None:
        # Entries hold what a hit returns, built once when the value is registered: the Source
        # tuple, and the whole input metadata for a reader of the registered dtype.
        self._exact: dict[ExactKey, tuple[Source, weakref.ref, torch.dtype, InputMeta]] = {}
        self._latest_write: dict[int, tuple[Source, int, weakref.ref]] = {}
        self._math_bits = False

    def clear(self) -> None:
        self._exact.clear()
        self._latest_write.clear()

    def track_math_bits(self) -> None:
        """From now on (for good) tell conjugate and negative views from their base.

        Such a view has its base's memory, shape, stride and version but other values,
        so its key must also hold the conjugate and negative bits. Reading them costs
        two calls per tensor, so they join the key only once the program has an op that
        makes such views (the tracer calls this when it first meets ``_conj`` or
        ``_neg_view``); until then no tensor can carry them.
        """
        self._math_bits = True

    def source(self, t: torch.Tensor) -> Source | None:
        """Where ``t``'s value came from; raises one of :data:`UNKEYABLE_ERRORS` when ``t``
        cannot be keyed."""
        return self.describe_inputs([t])[0][2]

    def describe_inputs(self, tensors: list[torch.Tensor]) -> list[InputMeta]:
        """Each input's ``(dtype, shape, source)``, ``source`` as :meth:`source` finds it: one call
        per op, the shape read once for the metadata and the key. Raises one of
        :data:`UNKEYABLE_ERRORS` when a tensor cannot be keyed."""
        exact = self._exact
        math_bits = self._math_bits
        found: list[InputMeta] = []
        for t in tensors:
            shape = t.shape
            ptr = t.data_ptr()
            if ptr == 0:  # empty: no value to follow
                if unkeyable(t) is not None:
                    raise Unkeyable
                found.append((DTYPE_NAMES[t.dtype], tuple(shape), None))
                continue
            version = t._version
            # (The key is spelled out here and in ``register_outputs``: a helper call costs more.)
            key: ExactKey = (
                (ptr, shape, t.stride(), version, t.is_conj(), t.is_neg()) if math_bits
                else (ptr, shape, t.stride(), version)
            )
            hit = exact.get(key)
            # (The same tensor is at ``ptr``, read above: the address is asked of another only.)
            if hit is not None and ((registered := hit[1]()) is t
                                    or (registered is not None and registered.data_ptr() == ptr)):
                dtype = t.dtype
                # A dtype view of the same bytes (``view(torch.int32)``) has the same key.
                found.append(hit[3] if dtype is hit[2] else (DTYPE_NAMES[dtype], tuple(shape), hit[0]))
            else:
                found.append((DTYPE_NAMES[t.dtype], tuple(shape), self._storage_source(t, version)))
        return found

    def _storage_source(self, t: torch.Tensor, version: int) -> Source | None:
        """No exact match: the latest traced write of ``t``'s storage, if not older than ``t``."""
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return None
        latest = self._latest_write.get(storage.data_ptr())
        if latest is not None and latest[2]() is storage and version >= latest[1]:
            return latest[0]
        return None

    def produced(self, t: torch.Tensor, op_index: int, position: int, kind: str) -> None:
        """Register ``t`` as output ``position`` of op ``op_index``.

        ``kind`` is "fresh" (a new value), "view" (exposes a value, writes
        nothing), "written" (an argument the op wrote in place: autograd moves its
        version counter once the op returns) or "rewritten" (written in place without
        a version bump, by ``_foreach_*``, ``_fused_*`` and ``_amp_*`` ops: the new value
        takes the key of the value it replaced).
        """
        written = [t] if kind in ("written", "rewritten") else []
        self.register_outputs([t], op_index, kind == "view", written,
                              written if kind == "rewritten" else (), first=position)

    def register_outputs(
        self, results: list[torch.Tensor], op_index: int, view: bool,
        written: list[torch.Tensor], rewritten: list[torch.Tensor] | tuple[()], first: int = 0,
    ) -> list[OutputMeta]:
        """Register each of ``results`` as an output of op ``op_index`` (positions from
        ``first``) and return their ``(dtype, shape, mutated)``. Each is "fresh", or a "view"
        for a view op, or "written" / "rewritten" (see :meth:`produced`) when it is in
        ``written`` / ``rewritten``. Raises one of :data:`UNKEYABLE_ERRORS` when a result
        cannot be keyed (the results before it are registered)."""
        exact = self._exact
        latest_write = self._latest_write
        math_bits = self._math_bits
        outputs: list[OutputMeta] = []
        for position, t in enumerate(results, first):
            shape = t.shape
            mutated = False
            for w in written:  # (a loop, not any() over a generator: two calls per output)
                if t is w:
                    mutated = True
                    break
            ptr = t.data_ptr()
            if ptr == 0:
                if unkeyable(t) is not None:
                    raise Unkeyable
                outputs.append((DTYPE_NAMES[t.dtype], tuple(shape), mutated))
                continue
            # A written argument's version moves once the op returns, unless the op writes
            # without a version bump ("rewritten"): its new value takes the old value's key.
            counted = mutated and not (rewritten and any(t is r for r in rewritten))
            version = t._version
            dtype = t.dtype
            name, dims = DTYPE_NAMES[dtype], tuple(shape)
            if not counted:
                # Keyed by the plain tuple ``dims`` (equal to the shape, and hashed alike): a key of
                # ints and tuples leaves the collector's lists at the first young collection it
                # meets, where one holding a ``torch.Size`` is walked by every collection after.
                key: ExactKey = (
                    (ptr, dims, t.stride(), version, t.is_conj(), t.is_neg()) if math_bits
                    else (ptr, dims, t.stride(), version)
                )
                source = (op_index, position, True)
                exact[key] = (source, weakref.ref(t), dtype, (name, dims, source))
            if mutated or not view:
                try:
                    storage = t.untyped_storage()
                except (RuntimeError, NotImplementedError):
                    outputs.append((name, dims, mutated))
                    continue
                latest_write[storage.data_ptr()] = (
                    (op_index, position, False), version, weakref.ref(storage)
                )
            outputs.append((name, dims, mutated))
        return outputs
