"""Tensor bytes in safetensors shards, written by a thread while the step runs.

The dump mode copies each storage span it needs into a host buffer (a *blob*)
and hands it here. A thread packs blobs into shards of about ``shard_size``
bytes: a shard is written to a temporary name, fsynced and renamed, so a shard
file is whole or absent. Each blob is one ``uint8`` tensor named ``b<id>`` in
its shard, so safetensors' own readers open the files; ``read_blob`` maps them
without copying.

Host memory is bounded: ``put`` blocks while the blobs not yet written exceed
``memory_budget`` (or reports that the blob should be skipped, with
``on_budget="skip"``), and asks the thread to close the current shard early
so its memory is released. A write that fails (disk full, directory gone)
marks the step's blobs in that shard as lost and, with ``on_error="warn"``,
lets training go on; with ``"raise"`` the error reaches the training thread at
its next call.
"""

from __future__ import annotations

import json
import os
import queue
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from probe.errors import ProbeError
from probe.tracer.compat import warn_once

BLOB_ALIGN = 64
"""Blob sizes are padded to this, so every blob starts aligned for any dtype."""


@dataclass
class Blob:
    id: int
    data: torch.Tensor
    """A 1-D uint8 host tensor (pinned when it receives a device copy)."""
    ready: torch.cuda.Event | None = None
    """Set when the device-to-host copy was queued asynchronously."""


@dataclass
class StepShards:
    """Where one step's blobs went: ``blob id -> (shard file name, tensor name)``, and failures."""

    located: dict[int, tuple[str, str]] = field(default_factory=dict)
    lost: dict[int, str] = field(default_factory=dict)
    shards: list[str] = field(default_factory=list)
    bytes_written: int = 0
    attempted: int = 0
    """Shards tried, written or not (names stay unique when one fails)."""


def write_shard(path: Path, blobs: list[Blob], metadata: dict[str, str]) -> int:
    """Write ``blobs`` as a safetensors file at ``path`` atomically; returns its size."""
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for blob in blobs:
        n = blob.data.numel()
        header[f"b{blob.id}"] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    encoded = json.dumps(header, separators=(",", ":")).encode()
    # Pad the header (safetensors allows trailing spaces) so the data starts on
    # a BLOB_ALIGN boundary: complex128 kernels fault on 8-byte-aligned data.
    encoded += b" " * (-(8 + len(encoded)) % BLOB_ALIGN)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(encoded)))
            f.write(encoded)
            for blob in blobs:
                f.write(memoryview(blob.data.numpy()))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return 8 + len(encoded) + offset


def read_blob(path: Path, name: str) -> torch.Tensor:
    """A uint8 tensor over one blob of a shard, memory-mapped copy-on-write (no read, no copy)."""
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    begin, end = header[name]["data_offsets"]
    mapped = np.memmap(path, dtype=np.uint8, mode="c", offset=8 + header_len + begin, shape=(end - begin,))
    return torch.from_numpy(mapped)


class ShardWriter:
    """The dump's writer thread: blobs in, shards out."""

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
        self._shard_size = shard_size
        self._budget = memory_budget
        self._on_budget = on_budget
        self._on_error = on_error
        self._metadata = metadata
        self._queue: queue.Queue[tuple[str, object]] = queue.Queue()
        self._memory = threading.Condition()
        self._in_flight = 0
        self._error: BaseException | None = None
        self._step = 0
        self._shards: dict[int, StepShards] = {}
        self._thread = threading.Thread(target=self._run, name="probe-shards", daemon=True)
        self._thread.start()

    # -- training thread -----------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self._step = step

    def reserve(self, nbytes: int) -> bool:
        """Make room for ``nbytes`` more in flight; False if the blob must be skipped."""
        self._raise_pending()
        with self._memory:
            while self._in_flight and self._in_flight + nbytes > self._budget:
                if self._on_budget == "skip":
                    return False
                self._queue.put(("close", None))
                self._memory.wait(timeout=1.0)
                self._raise_pending()
            self._in_flight += nbytes
        return True

    def put(self, blob: Blob) -> None:
        self._queue.put(("blob", (self._step, blob)))

    def end_step(self, step: int) -> Callable[[], StepShards]:
        """Mark the end of ``step``'s blobs; the returned call waits until they are written."""
        done = threading.Event()
        self._queue.put(("finish", (step, done)))

        def wait() -> StepShards:
            done.wait()
            return self._shards.pop(step, StepShards())

        return wait

    def close(self) -> None:
        self._queue.put(("stop", None))
        self._thread.join()

    def _raise_pending(self) -> None:
        if self._error is not None and self._on_error == "raise":
            error, self._error = self._error, None
            raise ProbeError(f"dump: writing tensors failed: {error}") from error

    # -- writer thread -------------------------------------------------------------

    def _run(self) -> None:
        pending: list[tuple[int, Blob]] = []
        pending_bytes = 0
        while True:
            kind, payload = self._queue.get()
            if kind == "blob":
                step, blob = payload  # type: ignore[misc]
                pending.append((step, blob))
                pending_bytes += blob.data.numel()
                if pending_bytes >= self._shard_size:
                    self._write(pending)
                    pending, pending_bytes = [], 0
            elif kind == "close":
                if pending:
                    self._write(pending)
                    pending, pending_bytes = [], 0
            elif kind == "finish":
                step, done = payload  # type: ignore[misc]
                if pending:
                    self._write(pending)
                    pending, pending_bytes = [], 0
                done.set()
            elif kind == "stop":
                if pending:
                    self._write(pending)
                return

    def _write(self, pending: list[tuple[int, Blob]]) -> None:
        by_step: dict[int, list[Blob]] = {}
        for step, blob in pending:
            by_step.setdefault(step, []).append(blob)
        for step, blobs in by_step.items():
            record = self._shards.setdefault(step, StepShards())
            name = f"shard-{record.attempted:05d}.safetensors"
            record.attempted += 1
            for blob in blobs:
                if blob.ready is not None:
                    blob.ready.synchronize()
            directory = self._directory(step)
            try:
                directory.mkdir(parents=True, exist_ok=True)
                size = write_shard(directory / name, blobs, self._metadata)
            except OSError as e:
                for blob in blobs:
                    record.lost[blob.id] = f"{name}: {e}"
                self._error = e
                warn_once(f"dump-write-{type(e).__name__}", f"dump: could not write {directory / name} "
                          f"({e}); training goes on and the step's index marks the lost tensors")
            else:
                record.shards.append(name)
                record.bytes_written += size
                for blob in blobs:
                    record.located[blob.id] = (name, f"b{blob.id}")
        freed = sum(blob.data.numel() for _, blob in pending)
        with self._memory:
            self._in_flight -= freed
            self._memory.notify_all()
