"""A monitored step's series: captured at hook time, reduced later in batches.

A hook only enqueues its tensor (a reference and the tensor's version counter: a
few microseconds). The queue is reduced by :func:`probe.modes.monitor_metrics.raw_rows`,
many tensors per launch, when the optimizer's hooks have recorded their series,
when the tensors held exceed :data:`PENDING_BYTES` (holding them longer would raise
peak memory: an activation's gradient is otherwise freed within the backward pass),
and at the step's end. Rows stay on the device; the step's rows are gathered into
one tensor there, to be moved to the host once.

The statistics are those of the value at capture. A tensor changed in place before
its batch is reduced (``out += identity``, ``ReLU(inplace=True)`` on a monitored
output) would be reported after the change, so the first collected step reduces every
tensor at once, and also checks which ones changed by the time the others are reduced:
those series are reduced at capture from then on. A series first changed in place in
a later step is detected the same way: its row for that step is unknown (NaN, said
once) and it is reduced at capture afterwards.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from probe.errors import warn_once
from probe.modes.anomaly import Series
from probe.modes.monitor_metrics import RAW_COLUMNS, raw_row, raw_row_batches

PENDING_BYTES = 256 << 20
"""Tensors held for a batch before it is reduced, in bytes (per step; the bound on the
memory the monitor adds)."""


@dataclass
class _Captured:
    index: int
    tensor: torch.Tensor
    version: int
    reduced: bool
    """Its row was computed at capture; it is held only to see whether it changes."""


def _version(t: torch.Tensor) -> int | None:
    """The version counter of ``t``'s storage, or None where there is none (inference tensors)."""
    try:
        return t._version
    except RuntimeError:
        return None


@dataclass
class Volatility:
    """What the monitor learned across steps: series whose tensors change in place after capture."""

    learning: bool = True
    """The first collected step: every tensor reduced at capture, and checked."""
    series: set[tuple[str, str, str]] = field(default_factory=set)


class StepRows:
    """One step's series and their raw rows (on the device), in collection order."""

    def __init__(self, eps: float, volatility: Volatility, held: dict[int, torch.Tensor] | None = None,
                 budget: int = PENDING_BYTES,
                 untraced: Callable[[], AbstractContextManager[Any]] = nullcontext) -> None:
        """``untraced``: the context the monitor's own ops run in (out of sight of a dispatch mode);
        the caller of :meth:`flush` and :meth:`end` provides it and ``no_grad`` itself."""
        self.eps, self.volatility, self.budget, self._untraced = eps, volatility, budget, untraced
        self.series: list[Series] = []
        self.numel: list[int] = []
        self.replicas: list[int] = []
        """Per series: how many ranks hold each of its elements (see ``MonitorMode._replicas``)."""
        self.held = held
        """Row index -> tensor, kept for ``on_anomaly="dump"``."""
        self._chunks: list[tuple[list[int], torch.Tensor]] = []
        self._pending: list[_Captured] = []
        self._pending_bytes = 0
        self._unknown: list[int] = []

    def __len__(self) -> int:
        return len(self.series)

    def capture(self, series: Series, tensor: torch.Tensor, replicas: int = 1) -> None:
        """Record ``tensor``'s statistics as they are now (reduced now or in a later batch)."""
        index = len(self.series)
        self.series.append(series)
        self.numel.append(tensor.numel() * (2 if tensor.is_complex() else 1))  # as raw_row counts
        self.replicas.append(replicas)
        if self.held is not None:
            self.held[index] = tensor
        version = _version(tensor)
        now = version is None or self.volatility.learning or \
            (series.kind, series.name, series.slot) in self.volatility.series
        if now:
            with torch.no_grad(), self._untraced():
                self._chunks.append(([index], raw_row(tensor, self.eps)[0][None]))
            if version is None or not self.volatility.learning:
                return
        with self._untraced():  # detached: holding it must not hold its autograd graph
            self._pending.append(_Captured(index, tensor.detach(), version, now))
        # Counted when only checked too: the learning step's flushes fall where later steps' will.
        self._pending_bytes += tensor.numel() * tensor.element_size()
        if self._pending_bytes > self.budget:
            with torch.no_grad(), self._untraced():
                self.flush()

    def add_row(self, series: Series, row: torch.Tensor, numel: int, replicas: int = 1) -> None:
        """A series whose raw row was computed already (Adam's update)."""
        with self._untraced():
            self._chunks.append(([len(self.series)], row[None]))
        self.series.append(series)
        self.numel.append(numel)
        self.replicas.append(replicas)

    def flush(self) -> None:
        """Reduce the tensors captured since the last flush, in batches by device."""
        pending, self._pending, self._pending_bytes = self._pending, [], 0
        batches: dict[torch.device, list[_Captured]] = {}
        for c in pending:
            changed = c.tensor._version != c.version
            if changed:
                s = self.series[c.index]
                self.volatility.series.add((s.kind, s.name, s.slot))
            if c.reduced:
                continue
            if changed:
                s = self.series[c.index]
                warn_once(f"monitor-inplace:{s.kind}:{s.name}:{s.slot}",
                          f"monitor: {s.kind} {s.name} {s.slot} was changed in place after its hook saw it, "
                          "before the monitor reduced it; its statistics at this step are unknown (NaN) and "
                          "it is reduced at capture from now on")
                self._unknown.append(c.index)
                continue
            batches.setdefault(c.tensor.device, []).append(c)
        for batch in batches.values():
            for at, rows in raw_row_batches([c.tensor for c in batch], self.eps):
                self._chunks.append(([batch[i].index for i in at], rows))

    def end(self) -> None:
        """The step is over: reduce what is left; later steps reduce at capture only what changed."""
        self.flush()
        self.volatility.learning = False

    def device_rows(self) -> list[tuple[list[int], torch.Tensor]]:
        """The reduced rows, gathered per device into one tensor each (with their row indices)."""
        by_device: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for indices, rows in self._chunks:
            by_device.setdefault(rows.device, []).append((indices, rows))
        gathered = []
        for chunks in by_device.values():
            indices = [i for chunk_indices, _ in chunks for i in chunk_indices]
            rows = torch.cat([r.to(torch.float64) for _, r in chunks]) if len(chunks) > 1 \
                else chunks[0][1].to(torch.float64)
            gathered.append((indices, rows))
        return gathered

    def stacked(self) -> torch.Tensor:
        """All rows in collection order as one fp64 device tensor (for the cross-rank reduction)."""
        gathered = self.device_rows()
        if not gathered:
            return torch.zeros((0, len(RAW_COLUMNS)), dtype=torch.float64)
        device = gathered[0][1].device
        rows = torch.full((len(self.series), len(RAW_COLUMNS)), math.nan, dtype=torch.float64, device=device)
        for indices, chunk in gathered:
            rows[torch.tensor(indices, device=device)] = chunk.to(device)
        return rows

    def host_rows(self) -> np.ndarray:
        """All raw rows in collection order, on the host: one transfer per device (one in all on
        a single-device model)."""
        raw = np.full((len(self.series), len(RAW_COLUMNS)), np.nan)
        for indices, rows in self.device_rows():
            raw[indices] = rows.cpu().numpy()
        if self._unknown:
            raw[self._unknown, 4:] = 0  # no NaN or Inf counted: not an alert, an unknown
        return raw
