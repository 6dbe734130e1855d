"""Tensor bytes in safetensors shards, written by a thread while the step runs.

The dump mode copies each storage span it needs (a *blob*) into an *arena*: a
host buffer of one shard's size, filled back to back (pinned when it receives
asynchronous device copies). A full arena goes to the writer thread, which
writes it under a temporary name with two system calls (header, then the
arena's bytes) and hands the arena back to a free list at once, so
steady-state dumping allocates (and page-faults) nothing. Where the file
system allows, the writes bypass the page cache (``O_DIRECT``: page-aligned
arenas, header and data padded to whole pages): measured 3-4x faster than
buffered writes on this project's CI disk, and the training job's page cache
is left alone. A second thread then
fsyncs the file and renames it, so a shard file is whole or absent while the
disk flushes one shard and the writer copies the next. Each blob is one ``uint8`` tensor
``b<id>`` of its shard, so safetensors' own readers open the files;
``read_header`` and ``map_blob`` map one without copying.

Memory is bounded by ``memory_budget``, whatever the tensor sizes: at most
``budget // arena size`` arenas exist. When none is free the training thread
waits for the writer (``on_budget="wait"``) or the blob is skipped (``"skip"``).
A blob larger than an arena is *streamed*: copied one arena at a time, each
piece handed to the writer thread, which appends it to a shard of its own (one
blob, so readers see nothing different); under ``"skip"`` it is copied whole
when the budget has room for it, else skipped.

A write that fails for any reason (disk full, directory gone, a device error)
marks that shard's blobs lost and the threads go on; the training thread warns
at its next call, or with ``on_error="raise"`` raises at the step's end
(:meth:`ShardWriter.end_step`), never from inside an op: an op's exception
would be the mode's own failure, and the interrupted copies would hide the
cause. Nothing on the writer threads warns or raises.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import mmap
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from probe.devices import is_accelerator, record_event
from probe.errors import ProbeError, warn_once
from probe.rundir.confined_files import open_in_run
from probe.rundir.untrusted_reads import parse_json

BLOB_ALIGN = 64
"""Blobs start at multiples of this in an arena (and so in a shard's data)."""
PAGE = 4096
"""Direct I/O unit: arenas, the header and the data section are padded to it."""
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _round_up(n: int, unit: int) -> int:
    return n + (-n % unit)


def _page_aligned(nbytes: int) -> tuple[torch.Tensor, mmap.mmap | None]:
    """A zero-copy uint8 tensor over fresh page-aligned memory (and what keeps it alive).

    Large regions ask for transparent huge pages: first-touch page faults are
    what a fresh arena costs, and 2 MiB pages make them 2.5x cheaper (measured).
    """
    region = mmap.mmap(-1, nbytes)
    if nbytes >= 1 << 21 and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):  # no transparent huge pages here: plain pages do
            region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=torch.uint8, count=nbytes), region


@dataclass
class StepShards:
    """Where one step's blobs went: ``blob id -> (shard file name, tensor name)``, and failures."""

    located: dict[int, tuple[str, str]] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    bytes_written: int = 0
    attempted: int = 0
    """Shards tried, written or not (names stay unique when one fails)."""


class Arena:
    """A host buffer blobs are copied into back to back; written out as one shard."""

    def __init__(self, nbytes: int, pinned: bool) -> None:
        nbytes = _round_up(nbytes, PAGE)
        self._region: mmap.mmap | None = None
        if pinned:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        else:
            self.buffer, self._region = _page_aligned(nbytes)
        self.pinned = pinned
        self.reset()

    def reset(self) -> None:
        self.used = 0
        self.step = -1
        self.blobs: list[tuple[int, int, int]] = []  # (blob id, offset, nbytes)
        self.events: list[Any] = []

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    def take(self, blob_id: int, nbytes: int) -> torch.Tensor | None:
        """A view for ``nbytes`` of blob ``blob_id``, or None when the arena is full."""
        start = self.used + (-self.used % BLOB_ALIGN)
        if start + nbytes > self.capacity:
            return None
        self.used = start + nbytes
        self.blobs.append((blob_id, start, nbytes))
        return self.buffer[start : start + nbytes]


def shard_name(number: int) -> str:
    """The file name of a step's shard ``number``: a plain name, never a path."""
    return f"shard-{number:05d}.safetensors"


def _header(blobs: list[tuple[int, int, int]], data_len: int, metadata: dict[str, str]) -> torch.Tensor:
    """A safetensors header for ``(blob id, start, end)`` blobs, page-padded, in page-aligned memory."""
    header: dict[str, object] = {"__metadata__": metadata}
    for blob_id, start, end in blobs:
        header[f"b{blob_id}"] = {"dtype": "U8", "shape": [end - start], "data_offsets": [start, end]}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # Pad the header (safetensors allows trailing spaces) so the data starts on a
    # page: aligned for direct I/O and for every dtype (complex128 kernels fault
    # on 8-byte-aligned data).
    encoded += b" " * (-(8 + len(encoded)) % PAGE)
    head, _ = _page_aligned(8 + len(encoded))
    head.numpy()[:8] = np.frombuffer(struct.pack("<Q", len(encoded)), dtype=np.uint8)
    head.numpy()[8:] = np.frombuffer(encoded, dtype=np.uint8)
    return head


def write_shard(path: Path, arena: Arena, metadata: dict[str, str]) -> int:
    """Write the arena's blobs as a safetensors file at ``path`` (not yet fsynced); returns its size.

    Safetensors wants every data byte to belong to a tensor, so the alignment
    padding after a blob (and the page padding at the end) is counted into that
    blob's extent; readers of our index use the exact offsets.
    """
    data_len = _round_up(arena.used, PAGE)
    extents = [
        (blob_id, start, arena.blobs[i + 1][1] if i + 1 < len(arena.blobs) else data_len)
        for i, (blob_id, start, _) in enumerate(arena.blobs)
    ]
    head = _header(extents, data_len, metadata)
    try:
        fd = _open_for_write(path, arena)
        try:
            # Two regions, each written with the GIL released for its whole
            # length: a loop of small writes would wait ~5 ms for the training
            # thread between each.
            _write_fully(fd, memoryview(head.numpy()))
            _write_fully(fd, memoryview(arena.buffer[:data_len].numpy()))
        finally:
            os.close(fd)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return head.numel() + data_len


class _Stream:
    """A blob larger than an arena, arriving in pieces; its shard is open on the writer thread."""

    def __init__(self, step: int, blob_id: int, nbytes: int) -> None:
        self.step, self.blob_id, self.nbytes = step, blob_id, nbytes
        self.received = 0
        self.fd: int | None = None
        self.direct = False
        self.tmp: Path | None = None
        self.path: Path | None = None
        self.size = 0
        self.error: BaseException | None = None

    def close(self) -> None:
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


def _direct_io_fits(arena: Arena) -> bool:
    return arena.buffer.data_ptr() % PAGE == 0 and arena.capacity % PAGE == 0


def _open_for_write(path: Path, arena: Arena) -> int:
    """Open for direct I/O where the file system and the buffer allow it, else buffered."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    if _O_DIRECT and _direct_io_fits(arena):
        try:
            return os.open(path, flags | _O_DIRECT, 0o644)
        except OSError as e:
            if e.errno != errno.EINVAL:  # EINVAL: this file system has no direct I/O
                raise
    return os.open(path, flags, 0o644)


def _write_fully(fd: int, data: memoryview) -> None:
    view = data.cast("B")
    while view:
        written = os.write(fd, view)
        view = view[written:]


def commit_shard(tmp: Path, path: Path) -> None:
    """Make a written shard durable, then visible under its final name."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)
        finally:
            os.close(directory)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


MAX_HEADER = 100_000_000
"""The longest safetensors header read (safetensors' own limit)."""


def read_header(path: Path, run: Path | None = None) -> tuple[int, dict[str, dict]]:
    """(offset of the data section, the safetensors header) of a shard, a regular file inside
    the run directory ``run`` (see :mod:`probe.rundir.confined_files`).

    A damaged shard raises ValueError (or OSError): a header length past the end of
    the file, or past safetensors' limit, is refused before anything that size is read;
    a header whose tensors do not tile the data section is refused as safetensors refuses it
    (:func:`check_data_offsets`).
    """
    with open_in_run(path, run) as f:
        (header_len,) = struct.unpack("<Q", f.file.read(8))
        if header_len > f.size - 8 or header_len > MAX_HEADER:
            raise ValueError(f"its header length {header_len} is past the end of the file ({f.size} bytes) "
                             f"or safetensors' limit ({MAX_HEADER} bytes)")
        header = parse_json(f.file.read(header_len), "its header")
        size = f.size
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    check_data_offsets(header, 8 + header_len, size)
    return 8 + header_len, header


_SAFETENSORS_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "I16": 2,
                         "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "C64": 8, "F64": 8,
                         "I64": 8, "U64": 8}


def check_data_offsets(header: dict[str, Any], data_start: int, file_size: int) -> None:
    """Refuse (ValueError) a header whose tensors do not tile the data section, the checks
    safetensors makes before it reads a file: sorted by offset, each tensor starts where the one
    before ends (no overlap, no gap, the first at 0), holds exactly its dtype and shape's bytes,
    and the last ends at the end of the file. Tensors whose bytes overlap would read as aliases
    of each other (two dumped tensors with one value); one past the end, as bytes not there.
    """
    spans = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(entry, dict):
            raise ValueError(f"its header's entry for {name!r} is not an object")
        offsets, shape, dtype = entry.get("data_offsets"), entry.get("shape"), entry.get("dtype")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ValueError(f"tensor {name!r}: data_offsets {offsets!r} are not a range [begin, end]")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)) \
                or dtype not in _SAFETENSORS_ITEMSIZE:
            raise ValueError(f"tensor {name!r}: shape {shape!r} / dtype {dtype!r} is not a safetensors "
                             "tensor's")
        if math.prod(shape) * _SAFETENSORS_ITEMSIZE[dtype] != offsets[1] - offsets[0]:
            raise ValueError(f"tensor {name!r}: {dtype} {shape} does not fill its data_offsets {offsets}")
        spans.append((offsets[0], offsets[1], name))
    spans.sort()
    reached, before = 0, None
    for begin, end, name in spans:
        if begin != reached:
            how = f"overlaps tensor {before!r}" if begin < reached else \
                f"leaves bytes {reached}-{begin} in no tensor"
            raise ValueError(f"tensor {name!r} (data_offsets [{begin}, {end}]) {how}: safetensors refuses "
                             "such a file")
        reached, before = end, name
    if data_start + reached > file_size:
        raise ValueError(f"tensor {before!r} ends at byte {data_start + reached}, past the end of the file "
                         f"({file_size} bytes)")
    if data_start + reached < file_size:
        raise ValueError(f"its tensors end at byte {data_start + reached}, before the end of the file "
                         f"({file_size} bytes): safetensors refuses such a file")


def map_blob(path: Path, data_start: int, entry: dict, run: Path | None = None) -> torch.Tensor:
    """A uint8 tensor over one blob, memory-mapped copy-on-write (nothing read until used).

    A blob that reaches past the end of the file (a truncated shard) raises ValueError.
    """
    begin, end = entry["data_offsets"]
    if not (isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end):
        raise ValueError(f"blob offsets {entry['data_offsets']!r} are not a range")
    with open_in_run(path, run) as f:
        if data_start + end > f.size:
            raise ValueError(f"the blob ends at byte {data_start + end}, past the end of the file "
                             f"({f.size} bytes)")
        if begin == end:
            return torch.empty(0, dtype=torch.uint8)
        mapped = f.map(data_start + begin, end - begin)
    return torch.from_numpy(mapped)


class ShardWriter:
    """The dump's arenas and writer thread: blobs in, shards out."""

    def __init__(
        self,
        directory: Callable[[int], Path],
        shard_size: int,
        memory_budget: int,
        on_budget: str,
        on_error: str,
        metadata: dict[str, str],
    ) -> None:
        self._directory = directory
        # Two arenas at least fit the budget: one filling while the other is written.
        # Whole pages, so a streamed blob's pieces stay page-aligned in its file (direct I/O).
        self.arena_size = _round_up(max(1, min(shard_size, memory_budget // 2)), PAGE)
        self._budget = max(memory_budget, self.arena_size)
        self._on_budget = on_budget
        self._on_error = on_error
        self._metadata = metadata
        self._queue: queue.Queue[tuple[str, object]] = queue.Queue()
        self._lock = threading.Condition()
        self._free: list[Arena] = []
        self._allocated = 0  # bytes of all arenas in existence
        self.peak_allocated = 0
        """The most bytes of host buffers that existed at once (bounded by the budget)."""
        self._current: Arena | None = None
        self._error: BaseException | None = None  # a failed write the training thread has not reported
        self._step = 0
        self._shards: dict[int, StepShards] = {}
        self._commits: queue.Queue[tuple[str, object]] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="probe-shards", daemon=True)
        self._committer = threading.Thread(target=self._commit_loop, name="probe-fsync", daemon=True)
        self._thread.start()
        self._committer.start()

    # -- training thread -----------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self._step = step

    def put(self, blob_id: int, source: torch.Tensor) -> bool:
        """Copy the bytes of ``source`` (1-D ``uint8``, any device) as blob ``blob_id``.

        On return the bytes are in host memory, or (from an accelerator) their
        copy is queued on the device's stream ahead of any later op, so training
        cannot change them first. False: skipped for the memory budget.
        """
        self._report_pending(at_step_end=False)
        nbytes = source.numel()
        on_device = is_accelerator(source.device)
        if nbytes > self.arena_size and self._on_budget == "wait":
            self._stream(blob_id, source, on_device)
            return True
        taken = self._take(blob_id, nbytes, on_device)
        if taken is None:
            return False
        _copy_into(*taken, source, on_device)
        return True

    def _take(self, blob_id: int, nbytes: int, pinned: bool) -> tuple[torch.Tensor, Arena] | None:
        """Host memory for a blob of ``nbytes``; None when it must be skipped (budget)."""
        current = self._current
        if current is not None and current.pinned == pinned:
            view = current.take(blob_id, nbytes)
            if view is not None:
                return view, current
        self._release_current()
        arena = self._new_arena(max(nbytes, self.arena_size), pinned)
        if arena is None:
            return None
        arena.step = self._step
        self._current = arena
        view = arena.take(blob_id, nbytes)
        assert view is not None
        return view, arena

    def _stream(self, blob_id: int, source: torch.Tensor, on_device: bool) -> None:
        """Copy a blob larger than an arena one arena at a time, each piece on to the writer."""
        self._release_current()  # its memory may be what the pieces need
        stream = _Stream(self._step, blob_id, source.numel())
        try:
            for start in range(0, stream.nbytes, self.arena_size):
                arena = self._new_arena(self.arena_size, on_device)
                assert arena is not None  # pieces fit the budget: waiting frees an arena
                arena.step = self._step
                piece = source[start : start + self.arena_size]
                view = arena.take(blob_id, piece.numel())
                assert view is not None
                _copy_into(view, arena, piece, on_device)
                self._queue.put(("piece", (stream, arena)))
        finally:  # also when interrupted: the writer closes the shard, or drops it if incomplete
            self._queue.put(("stream end", stream))

    def _release_current(self) -> None:
        """Hand the filling arena to the writer, or back to the free list when it holds nothing."""
        current, self._current = self._current, None
        if current is None:
            return
        if current.blobs:
            self._queue.put(("arena", current))
        else:
            with self._lock:
                self._free.append(current)

    def _new_arena(self, nbytes: int, pinned: bool) -> Arena | None:
        capacity = _round_up(nbytes, PAGE)
        with self._lock:
            while True:
                for i, arena in enumerate(self._free):
                    if arena.capacity >= capacity and arena.pinned == pinned:
                        return self._free.pop(i)
                if self._allocated + capacity <= self._budget:
                    self._allocated += capacity
                    self.peak_allocated = max(self.peak_allocated, self._allocated)
                    return Arena(capacity, pinned)
                if self._free:  # wrong size or kind: release one and try again
                    released = self._free.pop()
                    self._allocated -= released.capacity
                    continue
                if self._on_budget == "skip" or capacity > self._budget:
                    return None
                # Every arena is in flight: the writer hands one back.
                self._lock.wait(timeout=1.0)
                self._report_pending(at_step_end=False)

    def end_step(self, step: int) -> Callable[[], StepShards]:
        """Close ``step``'s last arena; the returned call waits until its blobs are written."""
        self._report_pending()
        self._release_current()
        done = threading.Event()
        self._queue.put(("finish", (step, done)))

        def wait() -> StepShards:
            done.wait()
            return self._shards.pop(step, StepShards())

        return wait

    def close(self) -> None:
        """Stop the threads once every handed-over arena is written; warn of a failure (never raise)."""
        self._release_current()
        self._queue.put(("stop", None))
        self._thread.join()
        self._committer.join()
        with self._lock:
            self._free.clear()
            self._allocated = 0
        self._report_pending(may_raise=False)

    def _report_pending(self, may_raise: bool = True, at_step_end: bool = True) -> None:
        """Tell the user of a failed write, on the training thread: warn once, or raise (only at a
        step's end: inside an op, the failure waits there)."""
        error = self._error
        if error is None:
            return
        raising = may_raise and self._on_error == "raise"
        if raising and not at_step_end:
            return
        self._error = None
        if raising:
            raise ProbeError(f"dump: writing tensors failed: {error}") from error
        # Once per run directory (this writer's), not per process: a later session is told too.
        warn_once(f"dump-write:{self._directory(0).parent}", f"dump: could not write tensors ({error}); "
                  "training goes on and the step's index marks the lost tensors")

    # -- writer thread -------------------------------------------------------------

    def _run(self) -> None:
        # Writer thread: arenas to temporary files; commits and markers go on, in order.
        # It never raises: a failure loses the shard, and the thread goes on.
        while True:
            kind, payload = self._queue.get()
            if kind == "arena":
                self._write(payload)  # type: ignore[arg-type]
            elif kind == "piece":
                self._write_piece(*payload)  # type: ignore[misc]
            elif kind == "stream end":
                self._end_stream(payload)  # type: ignore[arg-type]
            else:
                self._commits.put((kind, payload))
                if kind == "stop":
                    return

    def _next_shard(self, step: int) -> tuple[StepShards, Path, Path]:
        """The step's record, and the temporary and final paths of its next shard."""
        record = self._shards.setdefault(step, StepShards())
        name = shard_name(record.attempted)
        record.attempted += 1
        directory = self._directory(step)
        return record, directory / f".{name}.tmp", directory / name

    def _write(self, arena: Arena) -> None:
        record, tmp, path = self._next_shard(arena.step)
        blob_ids = [blob_id for blob_id, _, _ in arena.blobs]
        try:
            for event in arena.events:
                event.synchronize()
            path.parent.mkdir(parents=True, exist_ok=True)
            size = write_shard(tmp, arena, self._metadata)
        except Exception as e:  # any failure loses this shard, never the thread
            self._lose(record, blob_ids, path.name, e)
        else:
            self._commits.put(("commit", (record, blob_ids, tmp, path, size)))
        finally:
            self._recycle(arena)

    def _write_piece(self, stream: _Stream, arena: Arena) -> None:
        try:
            for event in arena.events:
                event.synchronize()
            if stream.error is None:
                if stream.path is None:
                    _, stream.tmp, stream.path = self._next_shard(stream.step)
                    stream.path.parent.mkdir(parents=True, exist_ok=True)
                    stream.fd = _open_for_write(stream.tmp, arena)
                    stream.direct = _O_DIRECT != 0 and fcntl.fcntl(stream.fd, fcntl.F_GETFL) & _O_DIRECT != 0
                    data_len = _round_up(stream.nbytes, PAGE)
                    head = _header([(stream.blob_id, 0, data_len)], data_len, self._metadata)
                    _write_fully(stream.fd, memoryview(head.numpy()))
                    stream.size = head.numel() + data_len
                assert stream.fd is not None
                if stream.direct and not _direct_io_fits(arena):
                    fcntl.fcntl(stream.fd, fcntl.F_SETFL, fcntl.fcntl(stream.fd, fcntl.F_GETFL) & ~_O_DIRECT)
                    stream.direct = False
                # Pieces before the last are whole pages; the last is padded to one.
                _write_fully(stream.fd, memoryview(arena.buffer[: _round_up(arena.used, PAGE)].numpy()))
        except Exception as e:  # any failure loses this blob, never the thread
            stream.error = e
            self._drop_stream(stream)
        finally:
            stream.received += arena.used
            self._recycle(arena)

    def _end_stream(self, stream: _Stream) -> None:
        record = self._shards.setdefault(stream.step, StepShards())
        if stream.error is None and stream.received < stream.nbytes:
            stream.error = OSError(errno.ECANCELED, "the copy was interrupted")
        if stream.error is None:
            try:
                stream.close()
            except OSError as e:
                stream.error = e
        if stream.error is not None or stream.path is None:
            self._drop_stream(stream)
            where = stream.path.name if stream.path is not None else "streamed shard"
            self._lose(record, [stream.blob_id], where, stream.error)
            return
        self._commits.put(("commit", (record, [stream.blob_id], stream.tmp, stream.path, stream.size)))

    def _drop_stream(self, stream: _Stream) -> None:
        with contextlib.suppress(OSError):
            stream.close()
        if stream.tmp is not None:
            with contextlib.suppress(OSError):
                stream.tmp.unlink(missing_ok=True)

    def _recycle(self, arena: Arena) -> None:
        arena.reset()
        with self._lock:
            self._free.append(arena)
            self._lock.notify_all()

    def _commit_loop(self) -> None:
        while True:
            kind, payload = self._commits.get()
            if kind == "commit":
                record, blob_ids, tmp, path, size = payload  # type: ignore[misc]
                try:
                    commit_shard(tmp, path)
                except Exception as e:  # any failure loses this shard, never the thread
                    self._lose(record, blob_ids, path.name, e)
                else:
                    record.shards.append(path.name)
                    record.bytes_written += size
                    for blob_id in blob_ids:
                        record.located[blob_id] = (path.name, f"b{blob_id}")
            elif kind == "finish":
                _, done = payload  # type: ignore[misc]
                done.set()
            elif kind == "stop":
                return

    def _lose(self, record: StepShards, blob_ids: list[int], where: str, error: BaseException | None) -> None:
        for blob_id in blob_ids:
            record.lost[blob_id] = f"{where}: {error}"
        if self._error is None and error is not None:
            self._error = error


def _copy_into(view: torch.Tensor, arena: Arena, source: torch.Tensor, on_device: bool) -> None:
    """Copy ``source`` into ``view`` of ``arena``; from a device asynchronously, with an event to wait on."""
    view.copy_(source, non_blocking=on_device)
    if on_device:
        arena.events.append(record_event(source.device))
