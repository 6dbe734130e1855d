"""Reading a step's dump: which tensor is where, and the recorded calls.

``tensors.json`` (written by the dump mode) lists every dumped tensor with its
blob, byte offset, dtype, shape and stride; blobs live in safetensors shards
under ``rankR/tensors/stepN/``. A tensor is rebuilt as a strided view of its
memory-mapped blob, so it loads bitwise-equal with the original layout and
nothing is read from disk until it is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.rundir import layout
from probe.rundir.reading import expect, plain_name, read_json, read_jsonl, reading
from probe.rundir.shards import map_blob, read_header

_DTYPES = {str(t).removeprefix("torch."): t for t in vars(torch).values() if isinstance(t, torch.dtype)}


@dataclass(frozen=True)
class DumpedTensor:
    """One entry of a step's dump index."""

    op: int
    io: str
    position: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    blob: int | None
    offset: int
    checksum: int | None
    status: str | None
    """None when the bytes are on disk; otherwise why not (skipped, lost, not dumpable)."""
    conj: bool = False
    neg: bool = False
    """A conjugate / negative view: its values are its bytes conjugated / negated (dump mode)."""


def _entry(e: Any) -> DumpedTensor:
    """One checked entry of ``tensors.json`` (raises ValueError/KeyError on damage)."""
    expect(e, dict, "a tensor entry")

    def ints(key: str) -> tuple[int, ...]:
        return tuple(expect(v, int, f"an item of {key}") for v in expect(e[key], list, key))

    optional_int, optional_str = (int, type(None)), (str, type(None))
    entry = DumpedTensor(
        expect(e["op"], int, "op"), expect(e["io"], str, "io"), expect(e["position"], int, "position"),
        expect(e["dtype"], str, "dtype"), ints("shape"), ints("stride"),
        expect(e["blob"], optional_int, "blob"), expect(e["offset"], int, "offset"),
        expect(e["checksum"], (*optional_int, float), "checksum"),
        expect(e["status"], optional_str, "status"),
        expect(e.get("conj", False), bool, "conj"), expect(e.get("neg", False), bool, "neg"),
    )
    if entry.io not in ("input", "output") or entry.dtype not in _DTYPES:
        raise ValueError(f"tensor entry {e!r}: io must be input or output, dtype a torch dtype")
    if len(entry.shape) != len(entry.stride) or min(
            (entry.offset, entry.position, *entry.shape, *entry.stride), default=0) < 0:
        raise ValueError(f"tensor entry {e!r}: a negative or mismatched offset, position, shape or stride")
    return entry


class DumpIndex:
    """The dump of one (step, rank).

    Damage to ``tensors.json`` or ``calls.jsonl`` is a :class:`ProbeError` naming the file;
    a tensor whose bytes cannot be read (a shard missing, cut short, or named outside the
    run) is a ``ProbeError`` from :meth:`tensor` only, so the rest of the step stays usable.
    """

    def __init__(self, out: Path, rank: int, step: int) -> None:
        self._step_dir = layout.step_dir(out, rank, step)
        self._tensor_dir = layout.tensors_dir(out, rank, step)
        path = self._step_dir / layout.TENSOR_INDEX_FILE
        if not path.exists():
            raise ProbeError(f"step {step} of rank {rank} has no dump ({str(path)!r} is missing)")
        index = read_json(path)
        with reading(path):
            self.complete: bool = expect(index["complete"], bool, "complete")
            # A blob's shard is checked when it is read, so one bad name costs only its tensors.
            self._blobs: dict[int, tuple[Any, str]] = {
                int(k): (v[0], expect(v[1], str, "a blob name"))
                for k, v in expect(index["blobs"], dict, "blobs").items()
            }
            self.entries: dict[tuple[int, str, int], DumpedTensor] = {}
            for e in expect(index["tensors"], list, "tensors"):
                entry = _entry(e)
                self.entries[(entry.op, entry.io, entry.position)] = entry
        self._calls: dict[int, dict[str, Any]] | None = None
        self._headers: dict[str, tuple[int, dict[str, dict]]] = {}  # shard -> parsed header

    def tensor(self, op: int, io: str, position: int) -> torch.Tensor:
        entry = self.entries.get((op, io, position))
        if entry is None:
            raise ProbeError(f"{io} {position} of op #{op} was not dumped")
        dtype = _DTYPES[entry.dtype]
        if entry.status is not None:
            raise ProbeError(f"{io} {position} of op #{op} has no data: {entry.status}")
        if entry.blob is None:  # an empty tensor
            return torch.empty_strided(entry.shape, entry.stride, dtype=dtype)
        if entry.blob not in self._blobs:
            raise ProbeError(f"{io} {position} of op #{op}: blob {entry.blob} is in no shard of "
                             f"{str(self._step_dir / layout.TENSOR_INDEX_FILE)!r}")
        shard, name = self._blobs[entry.blob]
        with reading(self._step_dir / layout.TENSOR_INDEX_FILE):
            shard = plain_name(shard, f"the shard of blob {entry.blob}")
        path = self._tensor_dir / shard
        with reading(path):
            if shard not in self._headers:
                self._headers[shard] = read_header(path)
            data_start, header = self._headers[shard]
            raw = map_blob(path, data_start, header[name])
            itemsize = dtype.itemsize
            # The view must lie within the blob: a damaged index must not read past it.
            extent = 1 + sum((n - 1) * s for n, s in zip(entry.shape, entry.stride, strict=True)) \
                if all(entry.shape) else 0
            if entry.offset + extent * itemsize > raw.numel():
                raise ValueError(f"{io} {position} of op #{op} reaches past the end of blob {name}")
        if entry.offset % itemsize:  # a view at an odd byte offset: realign by copying
            raw = raw[entry.offset :].clone()
            offset = 0
        else:
            offset = entry.offset // itemsize
        typed = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), offset, entry.shape, entry.stride)
        if entry.conj:
            typed = typed.conj()
        return torch._neg_view(typed) if entry.neg else typed

    def call(self, op: int) -> dict[str, Any]:
        """The recorded ``{"args": ..., "kwargs": ...}`` of op #``op``."""
        if self._calls is None:
            path = self._step_dir / layout.CALLS_FILE
            if not path.exists():
                raise ProbeError(f"cannot read {str(path)!r}: the file is missing")
            rows = read_jsonl(path)
            with reading(path):
                calls = {expect(row.pop("i"), int, "i"): row for row in rows}
                for row in calls.values():
                    expect(row["args"], list, "args"), expect(row["kwargs"], dict, "kwargs")
            self._calls = calls
        if op not in self._calls:
            raise ProbeError(f"op #{op} has no recorded call in {str(self._step_dir / layout.CALLS_FILE)!r}")
        return self._calls[op]
