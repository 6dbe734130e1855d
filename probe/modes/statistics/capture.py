"""The capture queue: where a step's raw rows come from and live until the step's one transfer.

One queue for every user (the stats mode from its dispatch mode, the monitor from its hooks).
A tensor's raw row (``columns.RAW_COLUMNS``) comes from one of three places:

- **small tensors** are copied into a staging chunk on their device, one copy each (with
  ``stage``). A kernel call costs the same whatever the size, so reducing thousands of small
  tensors one by one is what makes naive statistics slow; a staged chunk is reduced in one
  go, segment by segment, on the writer thread (``reduce.chunk_rows``).
- **floating-point tensors** (larger than the staged ones) are queued by reference (with
  ``queue``) and reduced many at a time (``reduce.cpu_rows``, ``reduce.device_rows``) when the
  queue's bytes reach its budget, before an op writes into a queued tensor's storage
  (:meth:`StepRows.before_write`: the statistics are those of the value at capture), when the
  caller flushes (the monitor, before the optimizer changes gradients and weights in place),
  and at the end of the step. The per-tensor work is a list append; the budget bounds the
  memory the queue keeps alive.
- other tensors (integers, bool, saturating devices, tensors whose key is volatile, tensors
  read just before an op writes them) are reduced at once by one kernel call
  (``reduce.TensorStats``; floating-point CPU tensors by ``reduce.cpu_rows``, whose generated
  loop has no dynamo guards to evaluate).

One in-place strategy: a queued tensor is reduced with the value it had at capture, or not at
all. When its batch is reduced, a tensor whose version counter moved (a write nobody told the
queue about) or whose bytes were freed or moved (FSDP2's resharding, a storage ``resize_``) is
**lost**: its row has no statistics (``PendingRows.lost``; the stats mode leaves it out of its
index, the monitor writes NaN), a warning says so, and its *key* becomes volatile: tensors of
that key are reduced at capture from then on. The key is the storage (the stats mode: FSDP2
reuses a storage step after step) or the series (the monitor: an activation is a new tensor
each step). With ``learning`` (the monitor's first step) every tensor is reduced at capture
and also watched: one whose version moves before the next flush makes its key volatile, with
no value lost.

Nothing here syncs with the host: copies and kernels are queued on the device (on the CPU,
queued rows are checked in host memory, where they already are), and
``PendingRows.to_host`` (writer thread) is the step's transfer.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from probe.devices import is_accelerator, record_event
from probe.errors import warn_once
from probe.modes.statistics.reduce import (
    QUEUED_DTYPES,
    WIDTH,
    TensorStats,
    as_real,
    chunk_rows,
    compact_view,
    cpu_rows,
    device_row_blocks,
)
from probe.modes.statistics.sketch import SketchRows
from probe.npu import saturation_mode

STAGE_MAX_NUMEL = 1 << 15
"""Tensors up to this many (compact) elements are staged."""
CHUNK_NUMEL = 1 << 20
STAGE_BUDGET_NUMEL = 1 << 25
"""Staged elements per step; beyond it (128 MiB of fp32) tensors are reduced one by one."""

LOST = -2
"""The source of a row whose tensor could not be read as it was captured."""

_FP32_EXACT = frozenset({torch.float32, torch.float16, torch.bfloat16})

QUEUE_BUDGET_BYTES = {"cpu": 8 << 20}
"""Bytes of queued tensors per device before a batch is reduced. On the CPU a batch
about the size of the caches, so tensors are reduced while still warm there."""
DEFAULT_QUEUE_BUDGET_BYTES = 256 << 20
"""On accelerators: few launches per step, and at most this much memory kept alive
(a few percent of a training step's peak on a GPU that trains 7B-wide layers)."""


class StageChunk:
    """A flat buffer of small tensors' values, reduced segment by segment when written."""

    def __init__(self, device: torch.device, dtype: torch.dtype, eps: float | None = None) -> None:
        self.buffer = torch.empty(CHUNK_NUMEL, dtype=dtype, device=device)
        self.offsets: list[int] = []
        self.used = 0
        self.eps = eps

    def add(self, x: torch.Tensor) -> int | None:
        """Copy ``x`` in; its segment index, or None when the chunk is full."""
        n = x.numel()
        if self.used + n > CHUNK_NUMEL:
            return None
        # torch's copy_, never numpy: ``x.numpy()`` marks x's storage not resizable for good, and
        # FSDP2 frees its parameters' storages by resizing them to zero.
        self.buffer[self.used : self.used + n].copy_(x.reshape(-1))
        self.offsets.append(self.used)
        self.used += n
        return len(self.offsets) - 1

    def reduce(self) -> np.ndarray:
        """Raw rows of every segment, ``[segments, WIDTH]`` (on the host)."""
        data = self.buffer[: self.used].cpu().numpy()
        return chunk_rows(data, np.asarray(self.offsets, dtype=np.int64), self.eps)


class DeviceRows:
    """Rows of tensors reduced on one device, in the blocks the kernels returned them (a row
    alone is a block of one) until the step's end (one ``cat``)."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []  # [rows, columns] each
        self.size = 0

    def add_row(self, row: torch.Tensor) -> int:
        return self.add_block(row.reshape(1, -1))

    def add_block(self, block: torch.Tensor) -> int:
        """Add ``[rows, columns]`` rows; the first one's position."""
        self.parts.append(block)
        self.size += len(block)
        return self.size - len(block)

    def on_device(self) -> torch.Tensor:
        if not self.parts:
            return torch.empty((0, WIDTH), dtype=torch.float64)
        return torch.cat(self.parts).to(torch.float64)  # (one cast, not one per row)

    def reduce(self) -> np.ndarray:
        return self.on_device().cpu().numpy()


class HostRows:
    """Rows already on the host (queued batches of CPU tensors)."""

    def __init__(self) -> None:
        self.blocks: list[np.ndarray] = []
        self.size = 0

    def add_block(self, block: np.ndarray) -> int:
        self.blocks.append(block)
        self.size += len(block)
        return self.size - len(block)

    def on_device(self) -> torch.Tensor:
        return torch.from_numpy(self.reduce())

    def reduce(self) -> np.ndarray:
        if not self.blocks:
            return np.empty((0, WIDTH), dtype=np.float64)
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
        """The row ids without statistics (their tensors were written or freed before being read)."""
        return [i for i, (source, _, _, _) in enumerate(self.rows) if source == LOST]

    def counts(self) -> tuple[np.ndarray, np.ndarray]:
        """``(numel of each compact view, multiplicity)`` per row id."""
        table = np.array(self.rows, dtype=np.int64).reshape(len(self.rows), 4)
        return table[:, 2], table[:, 3]

    def to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(raw rows, numel, multiplicity)``, one row per row id (NaN rows: empty or lost)."""
        for event in self.events:  # the device work of the step is queued on other streams
            event.synchronize()
        host = [source.reduce() for source in self.sources]
        n = len(self.rows)
        table = np.array(self.rows, dtype=np.int64).reshape(n, 4)
        raw = np.full((n, WIDTH), np.nan, dtype=np.float64)
        for index, rows in enumerate(host):
            mask = table[:, 0] == index
            raw[mask] = rows[table[mask, 1]]
        return raw, table[:, 2], table[:, 3]

    def on_device(self) -> torch.Tensor:
        """The raw rows as one fp64 tensor on the rows' device (an accelerator's where there is
        one), without a sync: for collectives started on the training thread. Only for rows
        captured without staging (a staged chunk is reduced on the host)."""
        parts = []
        for source in self.sources:
            if isinstance(source, StageChunk):
                raise RuntimeError("PendingRows.on_device: staged rows are reduced on the host")
            parts.append(source.on_device())
        devices = [p.device for p in parts if is_accelerator(p.device)]
        device = devices[0] if devices else torch.device("cpu")
        out = torch.full((len(self.rows), WIDTH), np.nan, dtype=torch.float64, device=device)
        table = np.array(self.rows, dtype=np.int64).reshape(len(self.rows), 4)
        for index, rows in enumerate(parts):
            at = np.flatnonzero(table[:, 0] == index)
            if len(at):
                positions = torch.from_numpy(table[at, 1]).to(device)
                out[torch.from_numpy(at).to(device)] = rows.to(device)[positions]
        return out


class Queued(NamedTuple):
    tensor: torch.Tensor  # what is reduced (a view of ``owner``)
    row: int
    owner: torch.Tensor  # its version counter is the one writes move
    version: int  # what ``owner._version`` is once the op returns: an unseen write changes it
    data_ptr: int  # where the storage's bytes were: moved or freed (FSDP2's resharding) shows
    key: Hashable  # made volatile when the tensor is lost
    storage: int  # its ``StorageImpl`` (``_cdata``), looked up once at capture
    nbytes: int  # what holding it keeps alive


class ReductionQueue:
    """Large tensors of one step waiting to be reduced, by reference, per (device, dtype).

    Holding a tensor keeps its memory alive: the bytes held per device are bounded by
    its budget. A tensor is held until its batch is reduced, so a write into its storage
    must wait for that: :meth:`StepRows.before_write` reduces the batch first. Storages
    are known by their ``StorageImpl``, which stays the same when a program frees or
    reallocates the bytes under it (``untyped_storage().resize_``), as FSDP2 does.
    """

    def __init__(self, budget: int | None = None) -> None:
        self.budget = budget
        self.batches: dict[tuple[torch.device, torch.dtype], list[Queued]] = {}
        self.bytes: dict[torch.device, int] = {}
        self.storages: dict[int, torch.device] = {}
        """``StorageImpl`` address of each held tensor's storage -> its device."""
        self._budgets: dict[torch.device, int] = {}
        """:meth:`budget_of` each device met, looked up once: :meth:`add` runs per queued tensor."""

    def __bool__(self) -> bool:
        return bool(self.storages)

    def add(self, queued: Queued) -> bool:
        """Hold ``queued``; whether its device's budget is now spent."""
        x = queued.tensor
        device = x.device
        self.batches.setdefault((device, x.dtype), []).append(queued)
        self.storages[queued.storage] = device
        held = self.bytes.get(device, 0) + queued.nbytes
        self.bytes[device] = held
        budget = self._budgets.get(device)
        if budget is None:
            budget = self._budgets[device] = self.budget_of(device)
        return held >= budget

    def budget_of(self, device: torch.device) -> int:
        """Bytes held on ``device`` before its batches are reduced."""
        if self.budget is not None:
            return self.budget
        return QUEUE_BUDGET_BYTES.get(device.type, DEFAULT_QUEUE_BUDGET_BYTES)

    def take(self, device: torch.device) -> list[list[Queued]]:
        """The batches of ``device`` (one per dtype), no longer held."""
        taken = [self.batches.pop(key) for key in [k for k in self.batches if k[0] == device]]
        self.bytes.pop(device, None)
        for batch in taken:
            for queued in batch:
                self.storages.pop(queued.storage, None)
        return taken


def _still_there(queued: Queued) -> bool:
    """Whether the queued tensor's bytes are where they were and all of them are allocated."""
    x = queued.tensor
    storage = x.untyped_storage()
    if storage.data_ptr() != queued.data_ptr:
        return False
    if x.is_contiguous():  # most queued tensors (compact views): the last element is numel - 1 on
        end = x.storage_offset() + x.numel()
    else:
        last = sum((n - 1) * stride for n, stride in zip(x.shape, x.stride(), strict=True))
        end = x.storage_offset() + last + 1
    return end * x.element_size() <= storage.nbytes()


def _version(t: torch.Tensor) -> int | None:
    """The version counter of ``t``, or None where there is none (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _stats_mode_changed(rows: list[int]) -> None:
    warn_once("stats-written-while-queued",
              f"statistics of {len(rows)} tensor(s) not measured: an op the stats mode does not see "
              "(filtered out, or run outside the traced step) wrote into them before they were "
              "reduced; they are recorded without statistics")


class StepRows:
    """Hands out a row id per captured tensor and keeps its row until the step is written.

    ``stage``: stage small tensors (see the module docstring); ``queue``: queue floating-point
    ones (default: as ``stage``); ``eps``: count ``|x| < eps`` (the ``zeros`` column);
    ``budget``: bytes held per device before a batch is reduced (default: per device type);
    ``on_changed``: told the row ids lost to a write after capture (default: the stats
    mode's warning); ``sketches``: the stats mode's (``sketch=True``): a row it leaves for
    later (:meth:`queued`) is sketched with its batch, by the multi-tensor kernel's same read
    where that reduces it. The caller
    runs every method where its own ops stay untraced and autograd records nothing (the stats
    mode's handler; the monitor's ``untraced()``).
    """

    def __init__(self, stats: TensorStats, stage: bool, saturation: bool | str = "auto", *,
                 queue: bool | None = None, eps: float | None = None, budget: int | None = None,
                 on_changed: Callable[[list[int]], None] = _stats_mode_changed,
                 sketches: SketchRows | None = None) -> None:
        self._stats = stats
        self._stage = stage
        self._queue_on = stage if queue is None else queue
        self._saturation = saturation
        self._saturates: dict[torch.device, bool] = {}
        self._eps = eps
        self._on_changed = on_changed
        self._sketches = sketches
        self._queue = ReductionQueue(budget)
        self.due: set[torch.device] = set()
        """Devices whose queue spent its budget: reduced by :meth:`settle`, before the next op."""
        self.volatile: set[Hashable] = set()
        """Keys whose tensors change outside what the queue is told (FSDP2's unsharded
        parameters' storages, an activation changed in place): reduced at capture, never queued."""
        self.learning = False
        """Reduce every tensor at capture and watch it: a write before the next flush makes its
        key volatile (the monitor's first step)."""
        self._held: list[Queued] | None = None
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
        self._watched: list[tuple[torch.Tensor, int, Hashable]] = []
        self._watched_bytes = 0

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, t: torch.Tensor, version_moves: bool = False, now: bool = False,
            counter: torch.Tensor | None = None, key: Hashable | None = None) -> int | None:
        """Capture ``t`` (reduce, stage or queue it); its row id, or None for tensors without values.
        ``version_moves``: the op in dispatch writes ``t`` (see ``OpCall.versions_moving``);
        ``now``: read its values before returning (it is about to be written), never queue it;
        ``counter``: the tensor whose version counter ``t`` has once the op returns (a view's
        base: autograd gives the view its base's counter after the dispatch modes ran);
        ``key``: what a change after capture makes volatile (default: ``t``'s storage)."""
        # Meta, sparse, nested and zero tensors never get here (the tracer skips them).
        if t.is_quantized:
            return None
        if t.is_complex() or t.is_neg() or not t.is_contiguous() or not t.dim():
            x, multiplicity = compact_view(as_real(t))
            numel = x.numel()
        else:  # most tensors, as compact_view(as_real(t)) returns them, without its three calls
            x, multiplicity, numel = t, 1, t.numel()
        rows = self._rows
        if numel == 0:
            rows.append((-1, 0, 0, multiplicity))
            return len(rows) - 1
        # Only an NPU saturates (probe.npu): "auto" never asks on the CPU.
        if self._saturation is not False and (self._saturation is True or not x.is_cpu) \
                and self._saturated(x.device):
            # Staged chunks widen every dtype to one: +-max would no longer be recognisable.
            rows.append((*self._append_device_row(self._stats.row(x, saturated=True, eps=self._eps)), numel,
                         multiplicity))
            return len(rows) - 1
        owner = t if counter is None else counter
        if self.learning and not now:
            version = _version(owner)
            if key is None:
                key = x.untyped_storage()._cdata
            if version is not None and key not in self.volatile:
                self._watch(x, owner, version + version_moves, key)
            now = True
        # The multi-tensor kernel (CUDA with Triton) reduces a batch in one launch whatever its
        # tensors' sizes and dtypes: small ones and integers join batches there instead of a
        # staging copy each (one launch per tensor).
        multi = not x.is_cpu and self._stats.uses_multi_tensor(x)  # (is_cpu first: the hot path)
        batched = multi and (self._held is not None if now else self._queue_on)
        if self._stage and numel <= STAGE_MAX_NUMEL and self._staged + numel <= STAGE_BUDGET_NUMEL \
                and not batched:
            rows.append((*self._stage_into_chunk(x), numel, multiplicity))
            self._staged += numel
        elif (now and self._held is not None and (multi or x.dtype in QUEUED_DTYPES)
              and (version := _version(owner)) is not None):
            rows.append((-1, 0, numel, multiplicity))  # filled in by release()
            storage = x.untyped_storage()
            self._held.append(Queued(x, len(rows) - 1, owner, version, storage.data_ptr(),
                                     storage._cdata if key is None else key, storage._cdata,
                                     numel * x.element_size()))
        elif (self._queue_on and not now and (multi or x.dtype in QUEUED_DTYPES)
              and (storage := x.untyped_storage()) is not None
              and (key := storage._cdata if key is None else key) not in self.volatile
              and (version := _version(owner)) is not None):
            rows.append((-1, 0, numel, multiplicity))  # filled in when its batch is reduced
            queued = Queued(x, len(rows) - 1, owner, version + version_moves, storage.data_ptr(), key,
                            storage._cdata, numel * x.element_size())
            if self._queue.add(queued):
                # Reduced before the next op (settle): the op in dispatch has not returned, and
                # autograd counts its in-place writes only then.
                self.due.add(x.device)
        elif x.is_cpu and x.dtype in QUEUED_DTYPES and self._stats.backend == "auto":
            # Read now (about to be written) or volatile: the standalone kernel, as a queued
            # batch would be; the compiled TensorStats kernel costs 100 us and more of dynamo
            # guards per call, which the optimizer's in-place writes paid for every tensor.
            rows.append((*self._append_host_rows(cpu_rows([x], eps=self._eps)), numel, multiplicity))
        else:
            rows.append((*self._append_device_row(self._stats.row(x, eps=self._eps)), numel, multiplicity))
        return len(rows) - 1

    def queued(self, row: int) -> bool:
        """Whether ``row``'s values are read later, with a batch: queued or held, not reduced or
        staged at capture."""
        source, _, numel, _ = self._rows[row]
        return source == -1 and numel > 0

    def hold(self) -> None:
        """Until :meth:`release`, tensors read ``now`` are collected instead of reduced one by one
        (the inputs an op is about to write: a foreach optimizer op's 32 moments or weights)."""
        self._held = []

    def release(self) -> None:
        """Reduce the tensors collected since :meth:`hold` together, one batch per device (the op
        that writes them has not run yet)."""
        held, self._held = self._held, None
        if not held:
            return
        for device in {queued.tensor.device for queued in held}:
            self._reduce_batch([queued for queued in held if queued.tensor.device == device])

    def add_row(self, row: torch.Tensor, numel: int) -> int:
        """A row computed by the caller (``reduce.adam_update_row``) for a tensor of ``numel`` elements."""
        self._rows.append((*self._append_device_row(row), numel, 1))
        return len(self._rows) - 1

    def _watch(self, x: torch.Tensor, owner: torch.Tensor, version: int, key: Hashable) -> None:
        self._watched.append((owner, version, key))
        self._watched_bytes += x.numel() * x.element_size()
        # Held only to be checked: bounded as the queue is.
        if self._watched_bytes >= self._queue.budget_of(x.device):
            self._check_watched()

    def _check_watched(self) -> None:
        for owner, version, key in self._watched:
            if owner._version != version:
                self.volatile.add(key)
        self._watched, self._watched_bytes = [], 0

    def unstable(self, tensors: list[torch.Tensor]) -> None:
        """The program frees or moves the memory of ``tensors`` outside any op: reduce
        them, and every later tensor on the same storages, at once."""
        for t in tensors:
            self.volatile.add(t.untyped_storage()._cdata)

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
        """Reduce the queued tensors of ``device`` (None: of every device, and check the watched)."""
        devices = [device] if device is not None else list(self._queue.bytes)
        if device is None:
            self.due.clear()
            self._check_watched()
        else:
            self.due.discard(device)
        for d in devices:
            for batch in self._queue.take(d):
                self._reduce_batch(batch)

    def _lose(self, lost: list[Queued]) -> None:
        table = self._rows
        for queued in lost:
            _, _, numel, multiplicity = table[queued.row]
            table[queued.row] = (LOST, 0, numel, multiplicity)
            self.volatile.add(queued.key)  # reduced at capture from now on

    def _reduce_batch(self, batch: list[Queued]) -> None:
        table = self._rows
        kept, freed, changed = [], [], []
        for queued in batch:
            if not _still_there(queued):
                freed.append(queued)
            elif queued.owner._version != queued.version:
                changed.append(queued)
            else:
                kept.append(queued)
        if freed:
            # Reading them would read freed memory: their rows are lost, never made up.
            warn_once("stats-freed-while-queued",
                      f"statistics of {len(freed)} tensor(s) not measured: their memory "
                      "was freed or moved outside any op (FSDP2 resharding, a storage resize_) "
                      "before they were reduced; they are recorded without statistics")
            self._lose(freed)
        if changed:
            self._lose(changed)
            self._on_changed([queued.row for queued in changed])
        if not kept:
            return
        xs = [queued.tensor for queued in kept]
        ids = [queued.row for queued in kept]
        sketches = self._sketches
        device = xs[0].device
        if self._on_host(device):
            source, first = self._append_host_rows(cpu_rows(xs, eps=self._eps))
            positions: Sequence[int] = range(first, first + len(kept))
        else:
            source = self._device_source(device)
            rows = self._sources[source]
            assert isinstance(rows, DeviceRows)
            at = [0] * len(kept)
            signs = sketches.signs_for(xs, ids) if sketches is not None else None
            for indices, block in device_row_blocks(xs, eps=self._eps, stats=self._stats, signs=signs):
                if block.shape[1] > WIDTH:  # the sketches of the same read
                    sketches.take([ids[i] for i in indices], block[:, WIDTH:])  # type: ignore[union-attr]
                    block = block[:, :WIDTH]
                for position, i in enumerate(indices, rows.add_block(block)):
                    at[i] = position
            positions = at
        if sketches is not None:
            sketches.add_batch(xs, ids)  # those no kernel sketched
        for queued, position in zip(kept, positions, strict=True):
            _, _, numel, multiplicity = table[queued.row]
            table[queued.row] = (source, position, numel, multiplicity)

    @staticmethod
    def _on_host(device: torch.device) -> bool:
        """Whether a batch on ``device`` is reduced by the host loops (the accelerator path is
        taken for the CPU in tests)."""
        return device.type == "cpu"

    def _stage_into_chunk(self, x: torch.Tensor) -> tuple[int, int]:
        dtype = torch.float32 if x.dtype in _FP32_EXACT else torch.float64
        key = (x.device, dtype)
        source = self._chunks.get(key)
        if source is not None:
            segment = self._sources[source].add(x)  # type: ignore[union-attr]
            if segment is not None:
                return source, segment
        chunk = StageChunk(x.device, dtype, self._eps)
        self._sources.append(chunk)
        self._chunks[key] = source = len(self._sources) - 1
        segment = chunk.add(x)
        assert segment is not None  # a staged tensor always fits an empty chunk
        return source, segment

    def _append_host_rows(self, block: np.ndarray) -> tuple[int, int]:
        """Add rows already on the host; (their source, the first one's position in it)."""
        if self._host_rows is None:
            self._sources.append(HostRows())
            self._host_rows = len(self._sources) - 1
        host = self._sources[self._host_rows]
        assert isinstance(host, HostRows)
        return self._host_rows, host.add_block(block)

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
        """Hand the step's rows over and start afresh (no sync: accelerator work is marked by
        events); a learning step is over."""
        self.flush()
        self.learning = False
        events = []
        devices = {key[0] for key in self._chunks} | set(self._device_rows)
        for device in devices:
            if is_accelerator(device):
                events.append(record_event(device))
        pending = PendingRows(self._sources, self._rows, events)
        self._reset()
        return pending
