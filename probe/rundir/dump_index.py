"""Reading a step's dump: which tensor is where, and the recorded calls.

``tensors.json`` (written by the dump mode) lists every dumped tensor with its
blob, byte offset, dtype, shape and stride; blobs live in safetensors shards
under ``rankR/tensors/stepN/``. A tensor is rebuilt as a strided view of its
memory-mapped blob, so it loads bitwise-equal with the original layout and
nothing is read from disk until it is used.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from probe.errors import ProbeError
from probe.rundir import layout
from probe.rundir.shards import map_blob, read_header


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


class DumpIndex:
    """The dump of one (step, rank)."""

    def __init__(self, out: Path, rank: int, step: int) -> None:
        self._step_dir = layout.step_dir(out, rank, step)
        self._tensor_dir = layout.tensors_dir(out, rank, step)
        path = self._step_dir / layout.TENSOR_INDEX_FILE
        try:
            index = json.loads(path.read_text())
        except FileNotFoundError:
            raise ProbeError(f"step {step} of rank {rank} has no dump ({str(path)!r} is missing)") from None
        except (OSError, json.JSONDecodeError) as e:
            raise ProbeError(f"cannot read {str(path)!r}: {e}") from None
        self.complete: bool = index["complete"]
        self._blobs: dict[int, tuple[str, str]] = {int(k): tuple(v) for k, v in index["blobs"].items()}
        self.entries: dict[tuple[int, str, int], DumpedTensor] = {}
        for e in index["tensors"]:
            entry = DumpedTensor(
                e["op"], e["io"], e["position"], e["dtype"], tuple(e["shape"]), tuple(e["stride"]),
                e["blob"], e["offset"], e["checksum"], e["status"],
            )
            self.entries[(entry.op, entry.io, entry.position)] = entry
        self._calls: dict[int, dict[str, Any]] | None = None
        self._headers: dict[str, tuple[int, dict[str, dict]]] = {}  # shard -> parsed header

    def tensor(self, op: int, io: str, position: int) -> torch.Tensor:
        entry = self.entries.get((op, io, position))
        if entry is None:
            raise ProbeError(f"{io} {position} of op #{op} was not dumped")
        dtype = getattr(torch, entry.dtype)
        if entry.status is not None:
            raise ProbeError(f"{io} {position} of op #{op} has no data: {entry.status}")
        if entry.blob is None:  # an empty tensor
            return torch.empty_strided(entry.shape, entry.stride, dtype=dtype)
        shard, name = self._blobs[entry.blob]
        path = self._tensor_dir / shard
        try:
            if shard not in self._headers:
                self._headers[shard] = read_header(path)
            data_start, header = self._headers[shard]
            raw = map_blob(path, data_start, header[name])
        except (OSError, KeyError, ValueError, json.JSONDecodeError, struct.error) as e:
            raise ProbeError(f"cannot read blob {name} of {str(path)!r}: {e}") from None
        itemsize = torch.empty((), dtype=dtype).element_size()
        if entry.offset % itemsize:  # a view at an odd byte offset: realign by copying
            raw = raw[entry.offset :].clone()
            offset = 0
        else:
            offset = entry.offset // itemsize
        typed = torch.empty(0, dtype=dtype)
        return typed.set_(raw.untyped_storage(), offset, entry.shape, entry.stride)

    def call(self, op: int) -> dict[str, Any]:
        """The recorded ``{"args": ..., "kwargs": ...}`` of op #``op``."""
        if self._calls is None:
            path = self._step_dir / layout.CALLS_FILE
            try:
                with open(path) as f:
                    rows = [json.loads(line) for line in f if line.strip()]
            except (OSError, json.JSONDecodeError) as e:
                raise ProbeError(f"cannot read {str(path)!r}: {e}") from None
            self._calls = {row.pop("i"): row for row in rows}
        if op not in self._calls:
            raise ProbeError(f"op #{op} has no recorded call")
        return self._calls[op]
