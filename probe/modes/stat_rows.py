"""Where a step's statistics rows live until the writer thread moves them to the host.

A tensor's raw row (see ``tensor_stats.RAW_COLUMNS``) comes from one of two places:

- **large tensors** are reduced at once by one kernel call (``TensorStats``),
  whose row tensor stays on the device;
- **small tensors** are copied into a staging chunk on their device, one copy
  each. A kernel call costs the same whatever the size, so reducing thousands of
  small tensors one by one is what makes naive statistics slow; a staged chunk is
  reduced in one go, segment by segment, on the writer thread.

Nothing here syncs with the host: copies and kernels are queued on the device,
and ``PendingRows.to_host`` (writer thread) is the step's transfer.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from probe.devices import is_accelerator, record_event
from probe.modes.tensor_stats import RAW_COLUMNS, TensorStats, as_real, compact_view
from probe.npu import saturation_mode

STAGE_MAX_NUMEL = 1 << 15
"""Tensors up to this many (compact) elements are staged."""
CHUNK_NUMEL = 1 << 20
STAGE_BUDGET_NUMEL = 1 << 25
"""Staged elements per step; beyond it (128 MiB of fp32) tensors are reduced one by one."""

_FP32_EXACT = frozenset({torch.float32, torch.float16, torch.bfloat16})


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
        """Raw rows of every segment, ``[segments, len(RAW_COLUMNS)]`` (on the host)."""
        data = self.buffer[: self.used].cpu().numpy()
        offsets = np.asarray(self.offsets, dtype=np.int64)
        wide = data.astype(np.float64, copy=False)
        out = np.empty((len(offsets), len(RAW_COLUMNS)), dtype=np.float64)
        with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in a sum is a NaN row
            out[:, 0] = np.minimum.reduceat(data, offsets)  # propagates NaN, like amin
            out[:, 1] = np.maximum.reduceat(data, offsets)
            out[:, 2] = np.add.reduceat(wide, offsets)
            out[:, 3] = np.add.reduceat(wide * wide, offsets)
            out[:, 4] = np.add.reduceat(np.isnan(data), offsets)
            out[:, 5] = np.add.reduceat(np.isinf(data), offsets)
        return out


class PendingRows:
    """One step's rows, handed from the training thread to the writer thread."""

    def __init__(
        self,
        sources: list[list[torch.Tensor] | StageChunk],
        rows: list[tuple[int, int, int, int]],
        events: list[Any],
    ) -> None:
        self.sources, self.rows, self.events = sources, rows, events

    def __len__(self) -> int:
        return len(self.rows)

    def to_host(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(raw rows, numel, multiplicity)``, one row per unique row id."""
        for event in self.events:  # the device work of the step is queued on other streams
            event.synchronize()
        host = [
            source.reduce() if isinstance(source, StageChunk)
            else torch.stack(source).to("cpu", torch.float64).numpy()
            for source in self.sources
        ]
        n = len(self.rows)
        table = np.array(self.rows, dtype=np.int64).reshape(n, 4)
        raw = np.full((n, len(RAW_COLUMNS)), np.nan, dtype=np.float64)
        for index, rows in enumerate(host):
            mask = table[:, 0] == index
            raw[mask] = rows[table[mask, 1]]
        return raw, table[:, 2], table[:, 3]


class StepRows:
    """Hands out a row id per reduced tensor and keeps the row until the step is written."""

    def __init__(self, stats: TensorStats, stage: bool, saturation: bool | str = "auto") -> None:
        self._stats = stats
        self._stage = stage
        self._saturation = saturation
        self._saturates: dict[torch.device, bool] = {}
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
        self._sources: list[list[torch.Tensor] | StageChunk] = []
        self._device_rows: dict[torch.device, int] = {}  # device -> its source index
        self._chunks: dict[tuple[torch.device, torch.dtype], int] = {}  # open chunk per kind
        self._staged = 0
        # (source index or -1 for an empty tensor, position in the source, numel, multiplicity)
        self._rows: list[tuple[int, int, int, int]] = []

    def add(self, t: torch.Tensor) -> int | None:
        """Reduce ``t`` (or stage it); its row id, or None for tensors without values."""
        # Meta, sparse, nested and zero tensors never get here (the tracer skips them).
        if t.is_quantized:
            return None
        x, multiplicity = compact_view(as_real(t))
        numel = x.numel()
        if numel == 0:
            self._rows.append((-1, 0, 0, multiplicity))
        elif self._saturation is not False and self._saturated(x.device):
            # Staged chunks widen every dtype to one: +-max would no longer be recognisable.
            self._rows.append((*self._append_device_row(self._stats.row(x, saturated=True)), numel,
                               multiplicity))
        elif self._stage and numel <= STAGE_MAX_NUMEL and self._staged + numel <= STAGE_BUDGET_NUMEL:
            self._rows.append((*self._stage_into_chunk(x), numel, multiplicity))
            self._staged += numel
        else:
            self._rows.append((*self._append_device_row(self._stats.row(x)), numel, multiplicity))
        return len(self._rows) - 1

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

    def _append_device_row(self, row: torch.Tensor) -> tuple[int, int]:
        source = self._device_rows.get(row.device)
        if source is None:
            self._sources.append([])
            self._device_rows[row.device] = source = len(self._sources) - 1
        rows = self._sources[source]
        assert isinstance(rows, list)
        rows.append(row)
        return source, len(rows) - 1

    def end_step(self) -> PendingRows:
        """Hand the step's rows over and start afresh (no sync: accelerator work is marked by events)."""
        events = []
        devices = {key[0] for key in self._chunks} | set(self._device_rows)
        for device in devices:
            if is_accelerator(device):
                events.append(record_event(device))
        pending = PendingRows(self._sources, self._rows, events)
        self._reset()
        return pending
