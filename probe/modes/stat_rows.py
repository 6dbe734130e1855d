"""Where a step's statistics rows live until the writer thread moves them to the host.

A tensor's raw row (see ``tensor_stats.RAW_COLUMNS``) comes from one of three places:

- **small tensors** are copied into a staging chunk on their device, one copy
  each. A kernel call costs the same whatever the size, so reducing thousands of
  small tensors one by one is what makes naive statistics slow; a staged chunk is
  reduced in one go, segment by segment, on the writer thread.
- **large floating-point tensors** are queued by reference (:class:`ReductionQueue`)
  and reduced many at a time (``batch_stats``) when the queue's bytes reach its
  budget, before an op writes into a queued tensor's storage (the statistics are
  those of the value the op produced), and at the end of the step. The per-op work
  is a list append; the budget bounds the memory the queue keeps alive.
- other tensors (integers, bool, saturating devices, ``stats_backend`` "compiled"
  or "eager") are reduced at once by one kernel call (``TensorStats``).

Nothing here syncs with the host: copies and kernels are queued on the device
(on the CPU, queued rows are checked in host memory, where they already are),
and ``PendingRows.to_host`` (writer thread) is the step's transfer.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch

from probe.devices import is_accelerator, record_event
from probe.errors import warn_once
from probe.modes.batch_stats import QUEUED_DTYPES, cpu_rows, device_rows
from probe.modes.tensor_stats import RAW_COLUMNS, TensorStats, as_real, compact_view
from probe.npu import saturation_mode

STAGE_MAX_NUMEL = 1 << 15
"""Tensors up to this many (compact) elements are staged."""
CHUNK_NUMEL = 1 << 20
STAGE_BUDGET_NUMEL = 1 << 25
"""Staged elements per step; beyond it (128 MiB of fp32) tensors are reduced one by one."""

LOST = -2
"""The source of a row whose tensor could not be read when its batch was reduced."""

_FP32_EXACT = frozenset({torch.float32, torch.float16, torch.bfloat16})

QUEUE_BUDGET_BYTES = {"cpu": 8 << 20}
"""Bytes of queued tensors per device before a batch is reduced. On the CPU a batch
about the size of the caches, so tensors are reduced while still warm there."""
DEFAULT_QUEUE_BUDGET_BYTES = 256 << 20
"""On accelerators: few launches per step, and at most this much memory kept alive
(a few percent of a training step's peak on a GPU that trains 7B-wide layers)."""


class StageChunk:
    """A flat buffer of small tensors' values, reduced segment by segment when written."""

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        self.buffer = torch.empty(CHUNK_NUMEL, dtype=dtype, device=device)
        self.offsets: list[int] = []
        self.used = 0

    def add(self, x: torch.Tensor) -> int | None:
        """Copy ``x`` in; its segment index, or None when the chunk is full."""
        n = x.numel()
        if self.used + n > CHUNK_NUMEL:
            return None
        self.buffer[self.used : self.used + n].copy_(x.reshape(-1))
        self.offsets.append(self.used)
        self.used += n
        return len(self.offsets) - 1

    def reduce(self) -> np.ndarray:
        """Raw rows of every segment, ``[segments, len(RAW_COLUMNS)]`` (on the host); sums in
        fp64 (segments are at most ``STAGE_MAX_NUMEL`` long: ``reduceat``'s sequential sums
        stay within 1e-11 relative)."""
        data = self.buffer[: self.used].cpu().numpy()
        offsets = np.asarray(self.offsets, dtype=np.int64)
        out = np.empty((len(offsets), len(RAW_COLUMNS)), dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in a sum is a NaN row
            wide = data.astype(np.float64, copy=False)
            out[:, 0] = np.minimum.reduceat(data, offsets)  # propagates NaN, like amin
            out[:, 1] = np.maximum.reduceat(data, offsets)
            out[:, 2] = np.add.reduceat(wide, offsets)
            out[:, 3] = np.add.reduceat(wide * wide, offsets)
        # Counted only in segments whose sum is not finite: a NaN or an Inf makes it so (fp64
        # sums of at most STAGE_MAX_NUMEL fp32 values cannot overflow), and finite ones are
        # the rule, so three passes over the whole chunk are saved.
        out[:, 4:] = 0
        ends = [*offsets[1:].tolist(), len(data)]
        for i in np.flatnonzero(~np.isfinite(out[:, 2])).tolist():
            segment = data[offsets[i]:ends[i]]
            out[i, 4:] = (np.count_nonzero(np.isnan(segment)), np.count_nonzero(np.isinf(segment)),
                          np.count_nonzero(np.isneginf(segment)))
        return out


class DeviceRows:
    """Rows of tensors reduced one by one, or blocks of rows of queued batches, on one device."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []  # a row, or a [rows, columns] block
        self.size = 0

    def add_row(self, row: torch.Tensor) -> int:
        self.parts.append(row.reshape(1, -1))
        self.size += 1
        return self.size - 1

    def add_block(self, block: torch.Tensor) -> int:
        self.parts.append(block)
        self.size += block.shape[0]
        return self.size - block.shape[0]

    def reduce(self) -> np.ndarray:
        if not self.parts:
            return np.empty((0, len(RAW_COLUMNS)), dtype=np.float64)
        return torch.cat(self.parts).to("cpu", torch.float64).numpy()


class HostRows:
    """Rows already on the host (queued batches of CPU tensors)."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []
        self.size = 0

    def add_block(self, block: np.ndarray) -> int:
        self.blocks.append(block)
        self.size += len(block)
        return self.size - len(block)

    def reduce(self) -> np.ndarray:
        if not self.blocks:
            return np.empty((0, len(RAW_COLUMNS)), dtype=np.float64)
        return np.concatenate(self.blocks)


Source = StageChunk | DeviceRows | HostRows


class PendingRows:
    """One step's rows, handed from the training thread to the writer thread."""

    def __init__(
        self,
        sources: list[Source],
        rows: list[tuple[int, int, int, int]],
        events: list[Any],
    ) -> None:
        self.sources, self.rows, self.events = sources, rows, events

    def __len__(self) -> int:
        return len(self.rows)

    def lost(self) -> list[int]:
        """The row ids without statistics (their tensors' memory was freed before being read)."""
        return [i for i, (source, _, _, _) in enumerate(self.rows) if source == LOST]

    def to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(raw rows, numel, multiplicity)``, one row per unique row id."""
        for event in self.events:  # the device work of the step is queued on other streams
            event.synchronize()
        host = [source.reduce() for source in self.sources]
        n = len(self.rows)
        table = np.array(self.rows, dtype=np.int64).reshape(n, 4)
        raw = np.full((n, len(RAW_COLUMNS)), np.nan, dtype=np.float64)
        for index, rows in enumerate(host):
            mask = table[:, 0] == index
            raw[mask] = rows[table[mask, 1]]
        return raw, table[:, 2], table[:, 3]


class Queued(NamedTuple):
    tensor: torch.Tensor  # what is reduced (a view of ``owner`` made in dispatch)
    row: int
    owner: torch.Tensor  # the op's result: its version counter is the one writes move
    version: int  # what ``owner._version`` is once the op returns: an unseen write changes it
    data_ptr: int  # where the storage's bytes were: moved or freed (FSDP2's resharding) shows


class ReductionQueue:
    """Large tensors of one step waiting to be reduced, by reference, per (device, dtype).

    Holding a tensor keeps its memory alive: the bytes held per device are bounded by
    its budget. A tensor is held until its batch is reduced, so a write into its storage
    must wait for that: :meth:`StepRows.before_write` reduces the batch first. Storages
    are known by their ``StorageImpl``, which stays the same when a program frees or
    reallocates the bytes under it (``untyped_storage().resize_``), as FSDP2 does.
    """

    def __init__(self) -> None:
        self.batches: dict[tuple[torch.device, torch.dtype], list[Queued]] = {}
        self.bytes: dict[torch.device, int] = {}
        self.storages: dict[int, torch.device] = {}
        """``StorageImpl`` address of each held tensor's storage -> its device."""

    def __bool__(self) -> bool:
        return bool(self.storages)

    def add(self, x: torch.Tensor, row: int, owner: torch.Tensor, version: int) -> bool:
        """Hold ``x`` (a view of ``owner``) for row ``row``; whether its device's budget is now spent."""
        device = x.device
        storage = x.untyped_storage()
        queued = Queued(x, row, owner, version, storage.data_ptr())
        self.batches.setdefault((device, x.dtype), []).append(queued)
        self.storages[storage._cdata] = device
        held = self.bytes.get(device, 0) + x.numel() * x.element_size()
        self.bytes[device] = held
        return held >= QUEUE_BUDGET_BYTES.get(device.type, DEFAULT_QUEUE_BUDGET_BYTES)

    def take(self, device: torch.device) -> list[list[Queued]]:
        """The batches of ``device`` (one per dtype), no longer held."""
        taken = [self.batches.pop(key) for key in [k for k in self.batches if k[0] == device]]
        self.bytes.pop(device, None)
        for batch in taken:
            for queued in batch:
                self.storages.pop(queued.tensor.untyped_storage()._cdata, None)
        return taken


def _still_there(queued: Queued) -> bool:
    """Whether the queued tensor's bytes are where they were and all of them are allocated."""
    x = queued.tensor
    storage = x.untyped_storage()
    if storage.data_ptr() != queued.data_ptr:
        return False
    last = x.storage_offset() + sum((n - 1) * stride for n, stride in zip(x.shape, x.stride(), strict=True))
    return (last + 1) * x.element_size() <= storage.nbytes()


class StepRows:
    """Hands out a row id per reduced tensor and keeps the row until the step is written."""

    def __init__(self, stats: TensorStats, stage: bool, saturation: bool | str = "auto") -> None:
        self._stats = stats
        self._stage = stage
        self._saturation = saturation
        self._saturates: dict[torch.device, bool] = {}
        self._queue = ReductionQueue()
        self.due: set[torch.device] = set()
        """Devices whose queue spent its budget: reduced by :meth:`settle`, before the next op."""
        self._unstable: set[int] = set()
        """``StorageImpl`` addresses whose bytes the program frees or moves outside any op
        (FSDP2's unsharded parameters): tensors on them are reduced at once, never queued."""
        self._reset()

    def _saturated(self, device: torch.device) -> bool:
        """Whether overflow on ``device`` writes +-max (see ``probe.npu``); asked once per device."""
        if isinstance(self._saturation, bool):
            return self._saturation
        known = self._saturates.get(device)
        if known is None:
            known = self._saturates[device] = saturation_mode(device)
        return known

    def _reset(self) -> None:
        self._sources: list[Source] = []
        self._device_rows: dict[torch.device, int] = {}  # device -> its DeviceRows source index
        self._host_rows: int | None = None  # the HostRows source index
        self._chunks: dict[tuple[torch.device, torch.dtype], int] = {}  # open chunk per kind
        self._staged = 0
        # (source index or -1 for an empty tensor, position in the source, numel, multiplicity);
        # a queued tensor's row gets its source and position when its batch is reduced.
        self._rows: list[tuple[int, int, int, int]] = []

    def add(self, t: torch.Tensor, version_moves: bool = False, now: bool = False,
            counter: torch.Tensor | None = None) -> int | None:
        """Reduce ``t`` (or stage or queue it); its row id, or None for tensors without values.
        ``version_moves``: the op in dispatch writes ``t`` (see ``OpCall.versions_moving``);
        ``now``: read its values before returning (it is about to be written), never queue it;
        ``counter``: the tensor whose version counter ``t`` has once the op returns (a view's
        base: autograd gives the view its base's counter after the dispatch modes ran)."""
        # Meta, sparse, nested and zero tensors never get here (the tracer skips them).
        if t.is_quantized:
            return None
        x, multiplicity = compact_view(as_real(t))
        numel = x.numel()
        rows = self._rows
        if numel == 0:
            rows.append((-1, 0, 0, multiplicity))
        elif self._saturation is not False and self._saturated(x.device):
            # Staged chunks widen every dtype to one: +-max would no longer be recognisable.
            rows.append((*self._append_device_row(self._stats.row(x, saturated=True)), numel,
                         multiplicity))
        elif self._stage and numel <= STAGE_MAX_NUMEL and self._staged + numel <= STAGE_BUDGET_NUMEL:
            rows.append((*self._stage_into_chunk(x), numel, multiplicity))
            self._staged += numel
        elif (self._stage and not now and x.dtype in QUEUED_DTYPES
              and x.untyped_storage()._cdata not in self._unstable):
            rows.append((-1, 0, numel, multiplicity))  # filled in when its batch is reduced
            owner = t if counter is None else counter
            if self._queue.add(x, len(rows) - 1, owner, owner._version + version_moves):
                # Reduced before the next op (settle): the op in dispatch has not returned, and
                # autograd counts its in-place writes only then.
                self.due.add(x.device)
        else:
            rows.append((*self._append_device_row(self._stats.row(x)), numel, multiplicity))
        return len(rows) - 1

    def unstable(self, tensors: list[torch.Tensor]) -> None:
        """The program frees or moves the memory of ``tensors`` outside any op: reduce
        them, and every later tensor on the same storages, at once."""
        for t in tensors:
            self._unstable.add(t.untyped_storage()._cdata)

    def before_write(self, tensors: list[torch.Tensor]) -> None:
        """An op is about to write ``tensors``: reduce the queued tensors sharing their storage
        (with their batch) first, so that statistics stay those of the value at op time."""
        queue = self._queue
        if not queue:
            return
        for t in tensors:
            try:
                device = queue.storages.get(t.untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):  # no storage (a subclass, a meta tensor)
                continue
            if device is not None:
                self.flush(device)

    def settle(self) -> None:
        """Reduce the queues that spent their budget during the previous op (it has returned)."""
        for device in list(self.due):
            self.flush(device)

    def flush(self, device: torch.device | None = None) -> None:
        """Reduce the queued tensors of ``device`` (None: of every device)."""
        devices = [device] if device is not None else list(self._queue.bytes)
        if device is None:
            self.due.clear()
        else:
            self.due.discard(device)
        for d in devices:
            for batch in self._queue.take(d):
                self._reduce_batch(batch)

    def _reduce_batch(self, batch: list[Queued]) -> None:
        table = self._rows
        kept, lost = [], []
        for queued in batch:
            (kept if _still_there(queued) else lost).append(queued)
        if lost:
            # Reading them would read freed memory: their rows are lost, never made up.
            warn_once("stats-freed-while-queued",
                      f"statistics of {len(lost)} tensor(s) not measured: their memory "
                      "was freed or moved outside any op (FSDP2 resharding, a storage resize_) "
                      "before they were reduced; they are recorded without statistics")
            for queued in lost:
                _, _, numel, multiplicity = table[queued.row]
                table[queued.row] = (LOST, 0, numel, multiplicity)
            self.unstable([queued.tensor for queued in lost])  # not again in later steps
            if not kept:
                return
        xs = [queued.tensor for queued in kept]
        changed = sum(queued.owner._version != queued.version for queued in kept)
        if changed:
            warn_once("stats-written-while-queued",
                      f"statistics of {changed} tensor(s) are those of a later value: an op the "
                      "stats mode does not see (filtered out, or run outside the traced step) "
                      "wrote into them before they were reduced")
        device = xs[0].device
        if device.type == "cpu":
            if self._host_rows is None:
                self._sources.append(HostRows())
                self._host_rows = len(self._sources) - 1
            source = self._host_rows
            host = self._sources[source]
            assert isinstance(host, HostRows)
            first = host.add_block(cpu_rows(xs))
        else:
            source = self._device_source(device)
            rows = self._sources[source]
            assert isinstance(rows, DeviceRows)
            first = rows.add_block(device_rows(xs))
        for i, queued in enumerate(kept):
            _, _, numel, multiplicity = table[queued.row]
            table[queued.row] = (source, first + i, numel, multiplicity)

    def _stage_into_chunk(self, x: torch.Tensor) -> tuple[int, int]:
        dtype = torch.float32 if x.dtype in _FP32_EXACT else torch.float64
        key = (x.device, dtype)
        source = self._chunks.get(key)
        if source is not None:
            segment = self._sources[source].add(x)  # type: ignore[union-attr]
            if segment is not None:
                return source, segment
        chunk = StageChunk(x.device, dtype)
        self._sources.append(chunk)
        self._chunks[key] = source = len(self._sources) - 1
        segment = chunk.add(x)
        assert segment is not None  # a staged tensor always fits an empty chunk
        return source, segment

    def _device_source(self, device: torch.device) -> int:
        source = self._device_rows.get(device)
        if source is None:
            self._sources.append(DeviceRows())
            self._device_rows[device] = source = len(self._sources) - 1
        return source

    def _append_device_row(self, row: torch.Tensor) -> tuple[int, int]:
        source = self._device_source(row.device)
        rows = self._sources[source]
        assert isinstance(rows, DeviceRows)
        return source, rows.add_row(row)

    def end_step(self) -> PendingRows:
        """Hand the step's rows over and start afresh (no sync: accelerator work is marked by events)."""
        self.flush()
        events = []
        devices = {key[0] for key in self._chunks} | set(self._device_rows)
        for device in devices:
            if is_accelerator(device):
                events.append(record_event(device))
        pending = PendingRows(self._sources, self._rows, events)
        self._reset()
        return pending
