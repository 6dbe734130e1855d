"""Mode "dump": the tensors of selected ops to safetensors shards, and each op's full call.

For every selected op the mode captures the inputs (before the op runs, so
in-place ops are seen as they were) and/or the outputs, and records the call's
non-tensor arguments (``probe.rundir.call_args``) so the op can be re-executed.

A storage is copied once per version per step: a tensor is the byte span of its
storage that it reaches (views, broadcasts and repeated uses of weights become
references into the same blob, with offset, shape and stride), and the copy goes
to a host buffer (pinned, asynchronous from devices) that the shard writer
thread packs into safetensors files. A copy larger than the memory budget's
buffers goes in pieces (``ShardWriter.put``), so the budget holds for any size.
Optional checksums are computed on the device and moved with the step, so two
runs can be compared bit for bit without dumping everything.

An async collective's result is there only once it completes (the tracer runs the modes'
``after`` of it then, ``probe.tracer.collectives``); ops may touch its buffer before (the
functional collectives' wrapper, a view, ``wait_tensor``'s input), and what they read is the
collective's result, as their records say. Blobs copied from the buffer in that time are
copied again when the collective completes, and their entries point to the copy
(:meth:`DumpMode._recopy_in_flight`).

Conjugate and negative views (``x.conj()``, ``torch._neg_view``) share their
base's bytes: the blob holds those bytes, and the index entry records the view's
bit, so the tensor reads back as the values it held. Sparse, nested, quantized and
zero tensors have no single view of bytes: each is stored as its strided parts
(``probe.rundir.tensor_layouts``), every part copied afresh. What has no bytes to
copy (inference tensors: no version counter to tell a storage's values apart; meta
tensors; wrappers without storage) or a layout the dump cannot store faithfully is
recorded with a ``not dumpable: <reason>`` status and no bytes.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.modes.base import Mode
from probe.modes.dump.file_names import CALLS_FILE, TENSOR_INDEX_FILE, tensors_dir
from probe.modes.dump.files import DumpIndex
from probe.modes.dump.options import Dump
from probe.modes.dump.shards import ShardWriter, StepShards
from probe.modes.registry import register_mode
from probe.rundir.call_args import encode_args
from probe.rundir.tensor_layouts import InParts, split
from probe.rundir.writer import StepWriter
from probe.tracer.dispatch_mode import dtype_name
from probe.tracer.op_call import OpCall
from probe.tracer.value_ids import unkeyable

INPUT, OUTPUT = 0, 1
# Index entry bits of a view whose values are its bytes conjugated / negated.
CONJ, NEG = 1, 2
# A view's span is widened to its whole storage when that costs at most this
# factor more bytes: later views of the same storage then need no copy.
_WHOLE_STORAGE_FACTOR = 2


def not_dumpable(t: torch.Tensor) -> str | None:
    """Why ``t`` is not dumped (its entry's status), or None when its bytes are.

    Whatever the tracer cannot key is not dumped either (no version counter to
    tell one value of a storage from the next, or no plain strided bytes).
    """
    reason = unkeyable(t)
    if reason is None and t.is_quantized:
        reason = "quantized"
    if reason is None:
        try:  # a wrapper subclass (the functional collectives' AsyncCollectiveTensor) has no bytes of its own
            t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            reason = "no storage"
    return None if reason is None else f"not dumpable: {reason}"


def _layout_of(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """Shape and stride where the tensor has them: else ``()`` (a nested tensor's ragged shape)
    and None (no strides: sparse, nested, mkldnn tensors), written as null."""
    try:
        shape = tuple(t.shape)
    except RuntimeError:
        shape = ()
    try:
        stride = tuple(t.stride())
    except RuntimeError:
        stride = None
    return shape, stride


def _in_parts(t: torch.Tensor) -> InParts | str | None:
    """``t`` as the parts the dump stores (``tensor_layouts.split``), or why it cannot be; never raises
    into training (a layout this torch builds otherwise is a reason, not an error)."""
    if t.is_inference() or t.is_meta:  # no version counter / no bytes: nothing of it can be copied
        return None
    try:
        stored = split(t)
    except Exception as e:  # whatever it is, the tensor is recorded as not dumpable
        return f"{t.layout}: {type(e).__name__}: {e}"
    if isinstance(stored, InParts):
        for name, part in stored.parts.items():
            why = not_dumpable(part)
            if why is not None:
                return f"{stored.layout}: its {name} are {why.removeprefix('not dumpable: ')}"
    return stored


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)``: the bytes of its storage a (dense, strided) tensor reaches."""
    itemsize = t.element_size()
    reach = zip(t.shape, t.stride(), strict=True)
    extent = 1 + sum((size - 1) * stride for size, stride in reach if size > 1)
    lo = t.storage_offset() * itemsize
    return lo, lo + extent * itemsize


_CHECKSUM_CHUNK = 1 << 22  # words per kernel call: bounds the temporaries (32 MiB of int64)


def checksum(t: torch.Tensor) -> torch.Tensor:
    """A position-weighted wrapping sum of the tensor's bytes in logical order, on its device.

    Equal for bitwise-equal tensors; a change of any one word changes it (the
    weights are odd). Not cryptographic. Large tensors are summed in chunks so
    the int64 temporaries stay small. A conjugate or negative view is summed as
    the values it holds.
    """
    data = t.detach().resolve_conj().resolve_neg().contiguous().view(-1).view(torch.uint8)
    if data.numel() % 4 == 0:
        data = data.view(torch.int32)
    total = torch.zeros((), dtype=torch.int64, device=data.device)
    for start in range(0, data.numel(), _CHECKSUM_CHUNK):
        words = data[start : start + _CHECKSUM_CHUNK].to(torch.int64)
        positions = torch.arange(start, start + words.numel(), device=data.device, dtype=torch.int64)
        total += (words * ((positions * 2654435761 + 1) | 1)).sum()
    return total


def _view_of(storage: torch.UntypedStorage, byte_offset: int, entry: tuple[Any, ...]) -> torch.Tensor:
    """The tensor an index entry describes, at ``byte_offset`` of ``storage`` (its math bits too)."""
    dtype = getattr(torch, entry[5])
    view = torch.empty(0, dtype=dtype, device=storage.device).set_(
        storage, byte_offset // dtype.itemsize, entry[6], entry[7])
    if entry[10] & CONJ:
        view = view.conj()
    return torch._neg_view(view) if entry[10] & NEG else view


def _bits(t: torch.Tensor) -> int:
    return (CONJ if t.is_conj() else 0) | (NEG if t.is_neg() else 0)


def _part_entry(blob: int, dtype: str, shape: tuple[int, ...], stride: tuple[int, ...], bits: int
                ) -> dict[str, Any]:
    """A part's object in its tensor's index entry (``docs/format.md``)."""
    entry = {"dtype": dtype, "shape": shape, "stride": stride, "blob": blob if blob >= 0 else None,
             "offset": 0}
    if bits:
        entry["conj"], entry["neg"] = bool(bits & CONJ), bool(bits & NEG)
    return entry


@register_mode
class DumpMode(Mode):
    """Tensors of the selected ops to sharded safetensors, with the calls that made them."""

    name = "dump"
    config_class = Dump
    files = DumpIndex

    def __init__(self, config: Dump) -> None:
        super().__init__(config)
        self.tensors = config.tensors
        self.shard_size = config.shard_size
        self.memory_budget = config.memory_budget
        self.on_budget = config.on_budget
        self.on_error = config.on_error
        self.checksum = config.checksum
        self._dump_inputs = self.tensors in ("all", "inputs")
        self._dump_outputs = self.tensors in ("all", "outputs")
        self._writer: ShardWriter | None = None
        self._next_blob = 0
        self._reset()

    def start(self, out: Path, rank: int) -> None:
        self._writer = ShardWriter(
            lambda step: tensors_dir(out, rank, step),
            self.shard_size,
            self.memory_budget,
            self.on_budget,
            self.on_error,
            {"format": "probe-dump", "rank": str(rank)},
        )

    def begin_step(self, step: int) -> None:
        self._reset()
        if self._writer is not None:
            self._writer.begin_step(step)

    def _reset(self) -> None:
        # storage address -> (weak ref to the storage, version, written by the op that made the
        # blobs, [(lo, hi, blob id)]). An in-place op bumps the version only after its dispatch
        # returns, so blobs of a written value are valid at the version seen then and the next.
        self._blobs: dict[int, tuple[weakref.ref, int, bool, list[tuple[int, int, int]]]] = {}
        # (op index, INPUT/OUTPUT, position, blob id or -1, byte offset in blob, dtype, shape,
        #  stride, checksum index or -1, status or None, CONJ/NEG bits, parts or None); parts:
        #  (layout, params, {name: (blob id or -1, dtype, shape, stride, CONJ/NEG bits)}), each
        #  part the view of its blob's bytes from byte 0
        self._entries: list[tuple[Any, ...]] = []
        # blob id -> (storage address, lo, hi): the bytes it copied
        self._spans: dict[int, tuple[int, int, int]] = {}
        # collective op index -> len(self._entries) once its inputs were captured; the latest op index called
        self._collectives: dict[int, int] = {}
        self._latest = -1
        self._calls: list[tuple[int, dict[str, Any]]] = []
        self._checksums: list[torch.Tensor] = []

    # -- per op -----------------------------------------------------------------

    def before(self, call: OpCall) -> None:
        inputs = call.input_tensors or []
        tensor_ids = {id(t): position for position, t in enumerate(inputs)}
        self._calls.append((call.index, encode_args(call.args, call.kwargs or {}, tensor_ids)))
        self._latest = max(self._latest, call.index)
        if self._dump_inputs:
            for position, t in enumerate(inputs):
                self._entries.append((call.index, INPUT, position, *self._capture(t)))
        if call.info.is_collective:
            self._collectives[call.index] = len(self._entries)
        for t in call.written_unannounced():  # a later read finds no blob of the value before
            if not_dumpable(t) is None:
                self._blobs.pop(t.untyped_storage().data_ptr(), None)

    def after(self, call: OpCall) -> None:
        if call.info.is_collective:
            since = self._collectives.pop(call.index, len(self._entries))
            if call.index < self._latest:  # later ops ran while it was in flight
                self._recopy_in_flight(call, since)
        if not self._dump_outputs or call.uninitialized:
            return
        for position, t in enumerate(call.output_tensors or ()):
            written = call.outputs[position][2]
            self._entries.append((call.index, OUTPUT, position, *self._capture(t, written)))

    def _recopy_in_flight(self, call: OpCall, since: int) -> None:
        """The collective ``call`` completed after later ops touched its outputs' buffers: what
        they read there is its result (as their records say), but the blobs their entries point
        to were copied before it was there (during the flight, or before the collective, and
        found again by storage and version). Those blobs are copied again now, and the entries
        made since the collective's call point to the copies (their checksums taken again)."""
        outputs = {t.untyped_storage().data_ptr(): t
                   for t in call.output_tensors or () if not_dumpable(t) is None}
        replaced: dict[int, int | None] = {}  # blob read in flight -> its copy (None: skipped)
        for k in range(since, len(self._entries)):
            entry = self._entries[k]
            span = self._spans.get(entry[3])
            if span is None or span[0] not in outputs:
                continue
            address, lo, hi = span
            t = outputs[address]
            if entry[3] not in replaced:
                replaced[entry[3]] = self._copy_out(t, t.untyped_storage(), lo, hi)
                self._blobs.pop(address, None)  # its blobs hold the bytes from before the result
            copy = replaced[entry[3]]
            if copy is None:
                entry = (*entry[:3], -1, entry[4], *entry[5:9], "skipped: memory budget", *entry[10:])
            else:
                entry = (*entry[:3], copy, *entry[4:])
            if entry[8] >= 0:
                self._checksums[entry[8]] = checksum(_view_of(t.untyped_storage(), lo + entry[4], entry))
            self._entries[k] = entry

    def _capture(self, t: torch.Tensor, written: bool = False) -> tuple[Any, ...]:
        """Copy (or find already copied) the bytes of ``t``; its index entry fields.

        ``written``: ``t`` is an argument the op just wrote in place, a new value
        whatever its (not yet bumped) version says.
        """
        why = not_dumpable(t)
        if why is not None:
            stored = _in_parts(t)
            if isinstance(stored, InParts):
                return self._capture_parts(t, stored)
            if stored is not None:
                why = f"not dumpable: {stored}"
            return (-1, 0, dtype_name(t.dtype), *_layout_of(t), -1, why, 0, None)
        meta = (dtype_name(t.dtype), tuple(t.shape), t.stride())
        bits = _bits(t)
        if t.numel() == 0:
            return (-1, 0, *meta, -1, None, bits, None)
        check = -1
        if self.checksum:
            self._checksums.append(checksum(t))
            check = len(self._checksums) - 1
        storage = t.untyped_storage()
        lo, hi = byte_span(t)
        version = t._version
        known = self._blobs.get(storage.data_ptr())
        valid = (
            known is not None
            and not written
            and known[0]() is storage
            and (known[1] == version or (known[2] and known[1] + 1 == version))
        )
        if not valid:
            known = (weakref.ref(storage), version, written, [])
            self._blobs[storage.data_ptr()] = known
        assert known is not None
        for blob_lo, blob_hi, blob_id in known[3]:
            if blob_lo <= lo and hi <= blob_hi:
                return (blob_id, lo - blob_lo, *meta, check, None, bits, None)
        blob_lo, blob_hi = lo, hi
        if storage.nbytes() <= _WHOLE_STORAGE_FACTOR * (hi - lo):
            blob_lo, blob_hi = 0, storage.nbytes()
        blob_id = self._copy_out(t, storage, blob_lo, blob_hi)
        if blob_id is None:
            return (-1, 0, *meta, check, "skipped: memory budget", bits, None)
        known[3].append((blob_lo, blob_hi, blob_id))
        return (blob_id, lo - blob_lo, *meta, check, None, bits, None)

    def _capture_parts(self, t: torch.Tensor, stored: InParts) -> tuple[Any, ...]:
        """Copy each part of a tensor stored in parts (sparse, nested, quantized, zero); its entry fields.

        Parts are copied afresh at every capture, never found among the step's blobs: some are
        made for the dump (a nested tensor's buffer, a quantized tensor's integers) with a version
        counter of their own that no write to the tensor bumps.
        """
        parts: dict[str, tuple[Any, ...]] = {}
        status = None
        for name, part in stored.parts.items():
            blob: int | None = -1
            if part.numel():  # the blob is the part's byte span: the part is the view at its byte 0
                blob = self._copy_out(part, part.untyped_storage(), *byte_span(part))
                if blob is None:
                    status, blob = "skipped: memory budget", -1
            parts[name] = (blob, dtype_name(part.dtype), tuple(part.shape), part.stride(), _bits(part))
        check = -1
        if self.checksum:  # of the parts in order, each weighted apart: equal parts, equal checksums
            total = torch.zeros((), dtype=torch.int64, device=t.device)
            for k, part in enumerate(stored.parts.values()):
                total = total + checksum(part).to(t.device) * (2 * k + 1)
            self._checksums.append(total)
            check = len(self._checksums) - 1
        return (-1, 0, dtype_name(t.dtype), _layout_of(t)[0], None, check, status, 0,
                (stored.layout, stored.params, parts))

    def _copy_out(self, t: torch.Tensor, storage: torch.UntypedStorage, lo: int, hi: int) -> int | None:
        """Copy bytes ``[lo, hi)`` of ``t``'s storage as a new blob; its id, or None when skipped."""
        assert self._writer is not None
        source = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage).narrow(0, lo, hi - lo)
        if not self._writer.put(self._next_blob, source):
            return None
        self._spans[self._next_blob] = (storage.data_ptr(), lo, hi)
        self._next_blob += 1
        return self._next_blob - 1

    # -- step end -----------------------------------------------------------------

    def end_step(self, step: int) -> DumpStep | None:
        if self._writer is None:
            return None
        result = DumpStep(
            self._writer.end_step(step), self._entries, self._calls, self._checksums, self.on_error,
            self._writer.peak_allocated,
        )
        self._reset()
        return result

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class DumpStep:
    """One step's dump: tensor entries and calls now, shard locations once written."""

    def __init__(
        self,
        shards: Any,
        entries: list[tuple[Any, ...]],
        calls: list[tuple[int, dict[str, Any]]],
        checksums: list[torch.Tensor],
        on_error: str,
        host_buffer_peak: int,
    ) -> None:
        self.shards, self.entries, self.calls, self.checksums = shards, entries, calls, checksums
        self.on_error = on_error
        self.host_buffer_peak = host_buffer_peak

    @property
    def stops_training_on_write_failure(self) -> bool:
        """Asked of every step result by the session (``probe.modes.base.StepResult``)."""
        return self.on_error == "raise"

    def write(self, writer: StepWriter) -> dict[str, Any]:
        written: StepShards = self.shards()
        sums = torch.stack(self.checksums).cpu().tolist() if self.checksums else []
        tensors = []
        skipped = 0
        for op, io, position, blob, offset, dtype, shape, stride, check, status, bits, parts in self.entries:
            for b in (blob, *(part[0] for part in parts[2].values())) if parts else (blob,):
                if b in written.lost:
                    status = f"lost: {written.lost[b]}"
            if status is not None and status.startswith("skipped"):
                skipped += 1
            entry = {
                "op": op, "io": "input" if io == INPUT else "output", "position": position,
                "dtype": dtype, "shape": shape, "stride": stride,
                "blob": blob if blob >= 0 and status is None else None,
                "offset": offset, "checksum": sums[check] if check >= 0 else None,
                "status": status,
            }
            if bits:  # present only on conjugate / negative views (older runs have neither)
                entry["conj"], entry["neg"] = bool(bits & CONJ), bool(bits & NEG)
            if parts is not None and status is None:  # stored in parts: absent on strided tensors
                entry["layout"], entry["params"] = parts[0], parts[1]
                entry["parts"] = {name: _part_entry(*part) for name, part in parts[2].items()}
            tensors.append(entry)
        complete = not written.lost
        writer.write_json(
            TENSOR_INDEX_FILE,
            {
                "complete": complete,
                "shards": written.shards,
                "blobs": {str(b): list(where) for b, where in written.located.items()},
                "tensors": tensors,
            },
        )
        writer.write_jsonl(CALLS_FILE, ({"i": i, **enc} for i, enc in self.calls))
        if written.lost and self.on_error == "raise":
            first = next(iter(written.lost.values()))
            raise ProbeError(f"dump: {len(written.lost)} tensor blobs could not be written ({first})")
        return {
            "complete": complete,
            "tensors": len(tensors),
            "blobs": len(written.located),
            "lost": len(written.lost),
            "skipped": skipped,
            "shards": len(written.shards),
            "bytes": written.bytes_written,
            "host_buffer_peak": self.host_buffer_peak,
        }
