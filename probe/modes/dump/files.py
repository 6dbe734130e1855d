"""The dump of one step, read back: the index of dumped tensors, the shards they lie in, and the
calls that made them (the reader half of the mode; ``mode.py`` is the writer); over a run,
``run.mode("dump")`` (:class:`DumpReader`)."""

from __future__ import annotations

from collections.abc import Mapping
from functools import cached_property
from pathlib import Path
from typing import Any, cast

import torch

from probe.errors import ProbeError
from probe.modes.dump.file_names import CALLS_FILE, FILE_NAMES, TENSOR_INDEX_FILE, tensors_dir
from probe.modes.dump.index_tables import BlobTable, EntryTable
from probe.modes.dump.records import DumpedPart, DumpedTensor
from probe.modes.dump.shards import map_blob, read_header
from probe.rundir import layout
from probe.rundir.mode_files import ModeFiles, ModeReader
from probe.rundir.streamed_json import read_object_streamed
from probe.rundir.tensor_layouts import STRIDED, join
from probe.rundir.untrusted_reads import INDEX_LIMIT, expect, plain_name, read_jsonl, reading

_DTYPES = {str(t).removeprefix("torch."): t for t in vars(torch).values() if isinstance(t, torch.dtype)}


def _entry(e: Any) -> DumpedTensor:
    """One checked entry of ``tensors.json`` (raises ValueError/KeyError on damage)."""
    expect(e, dict, "a tensor entry")

    def ints(key: str) -> tuple[int, ...]:
        return tuple(expect(v, int, f"an item of {key}") for v in expect(e[key], list, key))

    optional_int, optional_str = (int, type(None)), (str, type(None))
    # A tensor stored in parts (``tensor_layouts``): its layout, parts and numbers; nothing to
    # read for a strided one.
    stored = () if "layout" not in e else (
        expect(e["layout"], str, "layout"),
        {expect(name, str, "a part name"): _part(part)
         for name, part in expect(e["parts"], dict, "parts").items()},
        expect(e.get("params", {}), dict, "params"))
    # No strides: a tensor stored in parts, or one without data that has none (a sparse tensor's
    # entry before parts were stored said [], which readers before this one refused).
    has_strides = not stored and e["status"] is None
    entry = DumpedTensor(
        expect(e["op"], int, "op"), expect(e["io"], str, "io"), expect(e["position"], int, "position"),
        expect(e["dtype"], str, "dtype"), ints("shape"),
        ints("stride") if has_strides or e["stride"] is not None else (),
        expect(e["blob"], optional_int, "blob"), expect(e["offset"], int, "offset"),
        expect(e["checksum"], (*optional_int, float), "checksum"),
        expect(e["status"], optional_str, "status"),
        expect(e.get("conj", False), bool, "conj"), expect(e.get("neg", False), bool, "neg"), *stored,
    )
    if entry.io not in ("input", "output") or entry.dtype not in _DTYPES:
        raise ValueError(f"tensor entry {e!r}: io must be input or output, dtype a torch dtype")
    if (has_strides and len(entry.shape) != len(entry.stride)) or min(
            (entry.offset, entry.position, *entry.shape, *entry.stride), default=0) < 0:
        raise ValueError(f"tensor entry {e!r}: a negative or mismatched offset, position, shape or stride")
    return entry


def _part(p: Any) -> DumpedPart:
    """One checked part of an entry stored in parts (raises ValueError/KeyError on damage)."""
    expect(p, dict, "a part")
    part = DumpedPart(
        expect(p["dtype"], str, "dtype"),
        tuple(expect(v, int, "an item of shape") for v in expect(p["shape"], list, "shape")),
        tuple(expect(v, int, "an item of stride") for v in expect(p["stride"], list, "stride")),
        expect(p["blob"], (int, type(None)), "blob"), expect(p["offset"], int, "offset"),
        expect(p.get("conj", False), bool, "conj"), expect(p.get("neg", False), bool, "neg"),
    )
    if part.dtype not in _DTYPES or len(part.shape) != len(part.stride) or min(
            (part.offset, *part.shape, *part.stride), default=0) < 0:
        raise ValueError(f"part {p!r}: an unknown dtype, or a negative or mismatched offset, shape or stride")
    return part


def _add_blob(blobs: BlobTable, pair: tuple[str, Any]) -> None:
    """One item of ``blobs``: ``"id": [shard, name]``. The shard is checked when it is read, so
    one bad name costs only its tensors."""
    key, (shard, name, *_) = pair
    blobs.add(int(key), shard, expect(name, str, "a blob name"))


class DumpReader(ModeReader):
    """The dump over a run (``run.mode("dump")``): each step's :class:`DumpIndex`, and a dumped
    tensor by its op's id."""

    def has_dump(self, step: int | None = None, rank: int | None = None) -> bool:
        """Whether the step holds a dump (its manifest lists the dump mode)."""
        return self.files(step, rank) is not None

    def dump(self, step: int | None = None, rank: int | None = None) -> DumpIndex:
        """The dump index of one step (default: the first step, rank 0), read now: its damage is
        this call's :class:`ProbeError`, as is a step without a dump."""
        step, rank = self.run.resolve(step, rank)
        index = cast("DumpIndex | None", self.files(step, rank))
        if index is None:
            manifest = layout.step_dir(self.run.path, rank, step) / layout.MANIFEST_FILE
            raise ProbeError(f"step {step} of rank {rank} has no dump (its manifest lists no "
                             f"dump: {str(manifest)!r})")
        index.complete  # noqa: B018  (read the index now: its damage is this call's error)
        return index

    def tensor(self, op_id: str, io: str = "output", index: int = 0,
               step: int | None = None, rank: int | None = None) -> torch.Tensor:
        """A dumped tensor, memory-mapped: ``io`` is "input" or "output", ``index`` its position."""
        if io not in ("input", "output"):
            raise ProbeError(f"io must be 'input' or 'output', got {io!r}")
        op = self.run.op(op_id, step, rank)
        return self.dump(op.step, op.rank).tensor(op.index, io, index)


class DumpIndex(ModeFiles):
    """The dump of one (step, rank), as :class:`DumpStep` wrote it: ``tensors.json`` lists every
    dumped tensor with its blob, byte offset, dtype, shape and stride; blobs live in safetensors
    shards under ``rankR/tensors/stepN/``; ``calls.jsonl`` holds each op's call.

    A tensor is rebuilt as a strided view of its memory-mapped blob, so it loads bitwise-equal
    with the original layout and nothing is read from disk until it is used. Damage to
    ``tensors.json`` or ``calls.jsonl`` is a :class:`ProbeError` naming the file; a tensor whose
    bytes cannot be read (a shard missing, cut short, or named outside the run), or whose entry
    disagrees with its op's record (dtype, shape, or an extent past its blob), is a
    ``ProbeError`` from :meth:`tensor` only, so the rest of the step stays usable.
    """

    file_names = FILE_NAMES
    run_reader = DumpReader

    @property
    def complete(self) -> bool:
        """Whether every blob of the step was written."""
        return self._index[0]

    def read_whole(self) -> None:
        self._index  # noqa: B018  (the index: a tensor's bytes are read when it is asked for)

    @property
    def entries(self) -> Mapping[tuple[int, str, int], DumpedTensor]:
        """(op index, "input"/"output", position) -> its entry."""
        return self._index[2]

    @cached_property
    def _index_path(self) -> Path:
        return self.where.directory / TENSOR_INDEX_FILE

    @cached_property
    def _index(self) -> tuple[bool, BlobTable, EntryTable]:
        path = self._index_path
        if not path.exists():
            raise ProbeError(f"step {self.where.step} of rank {self.where.rank} has no dump "
                             f"({str(path)!r} is missing)")
        # Streamed into columns: the index of a step may list millions of tensors.
        entries, blobs = EntryTable(), BlobTable()
        index = read_object_streamed(path, {"tensors": (list, lambda e: entries.add(_entry(e))),
                                            "blobs": (dict, lambda pair: _add_blob(blobs, pair))},
                                     run=self.where.run, limit=INDEX_LIMIT)
        with reading(path):
            missing = sorted({"complete", "blobs", "tensors"} - index.keys())
            if missing:
                raise KeyError(missing[0])
            complete = expect(index["complete"], bool, "complete")
            entries.freeze()
            blobs.freeze()
        return complete, blobs, entries

    @cached_property
    def _headers(self) -> dict[str, tuple[int, dict[str, dict]]]:
        return {}  # shard -> its parsed header

    @cached_property
    def _calls(self) -> dict[int, dict[str, Any]]:
        path = self.where.directory / CALLS_FILE
        if not path.exists():
            raise ProbeError(f"cannot read {str(path)!r}: the file is missing")
        rows = read_jsonl(path, run=self.where.run)
        with reading(path):
            calls = {expect(row.pop("i"), int, "i"): row for row in rows}
            for row in calls.values():
                expect(row["args"], list, "args"), expect(row["kwargs"], dict, "kwargs")
        return calls

    def tensor(self, op: int, io: str, position: int) -> torch.Tensor:
        """The dumped ``io`` ("input"/"output") ``position`` of op #``op``, memory-mapped."""
        entry = self.entries.get((op, io, position))
        if entry is None:
            raise ProbeError(f"{io} {position} of op #{op} was not dumped")
        if entry.status is not None:
            raise ProbeError(f"{io} {position} of op #{op} has no data: {entry.status}")
        self._check_against_record(entry)
        what = f"{io} {position} of op #{op}"
        if entry.layout == STRIDED:
            return self._view(entry, what)
        parts = {name: self._view(part, f"{what}, its {name}") for name, part in entry.parts.items()}
        with reading(self._index_path):
            try:
                return join(entry.layout, parts, entry.params, entry.shape, _DTYPES[entry.dtype])
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{what}, stored as {entry.layout}: {e}") from None

    def _view(self, entry: DumpedTensor | DumpedPart, what: str) -> torch.Tensor:
        """The strided view an entry (or a part of one) describes, over its memory-mapped blob."""
        dtype = _DTYPES[entry.dtype]
        if entry.blob is None:  # an empty tensor
            if all(entry.shape):  # a damaged index: memory nothing wrote is no dumped value
                raise ProbeError(f"{str(self._index_path)!r}: {what} has no blob, but {list(entry.shape)} "
                                 "elements")
            return torch.empty_strided(entry.shape, entry.stride, dtype=dtype)
        blobs = self._index[1]
        if entry.blob not in blobs:
            raise ProbeError(f"{what}: blob {entry.blob} is in no shard of {str(self._index_path)!r}")
        shard, name = blobs[entry.blob]
        with reading(self._index_path):
            shard = plain_name(shard, f"the shard of blob {entry.blob}")
        path = tensors_dir(self.where.run, self.where.rank, self.where.step) / shard
        with reading(path):
            if shard not in self._headers:
                self._headers[shard] = read_header(path, self.where.run)
            data_start, header = self._headers[shard]
            raw = map_blob(path, data_start, header[name], self.where.run)
            itemsize = dtype.itemsize
            # The view must lie within the blob: a damaged index must not read past it.
            extent = 1 + sum((n - 1) * s for n, s in zip(entry.shape, entry.stride, strict=True)) \
                if all(entry.shape) else 0
            if entry.offset + extent * itemsize > raw.numel():
                raise ValueError(f"{what} reaches past the end of blob {name}")
        if entry.offset % itemsize:  # a view at an odd byte offset: realign by copying
            raw = raw[entry.offset :].clone()
            offset = 0
        else:
            offset = entry.offset // itemsize
        typed = torch.empty(0, dtype=dtype).set_(raw.untyped_storage(), offset, entry.shape, entry.stride)
        if entry.conj:
            typed = typed.conj()
        return torch._neg_view(typed) if entry.neg else typed

    def _check_against_record(self, entry: DumpedTensor) -> None:
        """Refuse an entry whose dtype or shape is not its op record's: the index of a damaged or
        edited run must not make a tensor of another shape than the op produced."""
        record = self.where.op(entry.op)
        tensors = record.inputs if entry.io == "input" else record.outputs
        where = f"{str(self._index_path)!r}: {entry.io} {entry.position} of op #{entry.op} ({record.id})"
        if entry.position >= len(tensors):
            raise ProbeError(f"{where} is not in its op record, which has {len(tensors)} {entry.io}s")
        expected = tensors[entry.position]
        if entry.dtype != expected.dtype or entry.shape != tuple(expected.shape):
            raise ProbeError(f"{where} is dumped as {entry.dtype} {list(entry.shape)}, its op record "
                             f"says {expected.dtype} {list(expected.shape)}: the dump index disagrees "
                             "with the op record")

    def call(self, op: int) -> dict[str, Any]:
        """The recorded ``{"args": ..., "kwargs": ...}`` of op #``op``."""
        if op not in self._calls:
            raise ProbeError(f"op #{op} has no recorded call in "
                             f"{str(self.where.directory / CALLS_FILE)!r}")
        return self._calls[op]
