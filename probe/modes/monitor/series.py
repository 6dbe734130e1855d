"""The monitor's series: one step's rows over the statistics engine (:class:`SeriesRows`), and the
series derived from others: Adam's update over the weight (``update_ratio``, :func:`add_update_ratios`)
and the loss scale in force with whether the scaler skipped the step (``loss_scale``,
``loss_scale_skipped``: :func:`copy_scale`, :func:`loss_scale_series`), which says which
non-finite gradients were an overflow the scaler handled (:func:`overflow_handled`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from probe.modes.monitor.anomaly import Series
from probe.modes.monitor.records import LOSS_SCALE_SKIPPED
from probe.modes.statistics.capture import StepRows
from probe.modes.statistics.columns import MONITOR_COLUMNS
from probe.tracer.mode_stack import untraced

COUNT_COLUMNS = [MONITOR_COLUMNS.index(c) for c in ("zeros", "nan", "inf", "posinf", "neginf")]
"""The columns that count elements (zeros, NaN, Inf, ...)."""


class SeriesRows:
    """One step's series over the statistics engine's queue (row ``i`` is series ``i``), with
    the ranks holding each (``MonitorMode._replicas``) and, for ``on_anomaly="dump"``, its tensor."""

    def __init__(self, engine: StepRows, hold: bool) -> None:
        self.engine = engine
        self.series: list[Series] = []
        self.replicas: list[int] = []
        self.held: dict[int, torch.Tensor] | None = {} if hold else None

    def __len__(self) -> int:
        return len(self.series)

    def capture(self, series: Series, tensor: torch.Tensor, replicas: int) -> int:
        """Record ``tensor``'s statistics as they are now (reduced now or in a later batch); its row.
        Run untraced and without autograd."""
        index = len(self.series)
        # Keyed by series: one changed in place after capture is reduced at capture from then on.
        row = self.engine.add(tensor.detach(), key=(series.kind, series.name, series.slot))
        assert row == index, "monitored tensors are floating-point: each has a row"
        self.series.append(series)
        self.replicas.append(replicas)
        if self.held is not None:
            self.held[index] = tensor
        self.engine.settle()  # a spent budget: the hook runs after the op returned
        return index

    def add_row(self, series: Series, row: torch.Tensor, numel: int, replicas: int) -> None:
        """A series whose raw row was computed already (Adam's update)."""
        self.engine.add_row(row, numel)
        self.series.append(series)
        self.replicas.append(replicas)


def add_update_ratios(series: list[Series], values: np.ndarray) -> np.ndarray:
    """``update_ratio`` series: the norm of Adam's update over the norm of the weight, appended to
    ``series`` (in place) and to ``values`` (returned)."""
    norm = MONITOR_COLUMNS.index("norm")
    weights = {s.name: values[i, norm] for i, s in enumerate(series) if s.kind == "weight"}
    extra = []
    for i, s in enumerate(series):
        if s.kind == "update" and s.name in weights:
            row = np.full(len(MONITOR_COLUMNS), np.nan)
            row[norm] = values[i, norm] / weights[s.name] if weights[s.name] else np.inf
            row[COUNT_COLUMNS[1:]] = 0  # NaN, Inf, +Inf, -Inf: none (zeros: not a tensor's)
            row[MONITOR_COLUMNS.index("numel")] = 1
            extra.append((Series("update_ratio", s.name), row))
    if extra:
        series.extend(s for s, _ in extra)
        values = np.vstack([values, np.stack([row for _, row in extra])])
    return values


def copy_scale(scaler: Any) -> torch.Tensor | None:
    """A device copy of the loss scaler's scale (no host sync); None without an enabled
    scaler, or before its first ``scale()`` (the scale does not exist yet)."""
    if scaler is None or not scaler.is_enabled():
        return None
    # The scale tensor itself: get_scale() would read it to the host, a sync every step.
    scale = scaler._get_scale_async()
    if scale is None:
        return None
    with torch.no_grad(), untraced():
        return scale.detach().clone()


def loss_scale_series(scaler: Any, in_force: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The values of ``loss_scale/scaler``, the scale in force during the step (the scaler's update
    at the step's end changed the tensor in place: ``in_force`` is :func:`copy_scale`'s copy from its
    start), and ``loss_scale_skipped/scaler``: whether that update lowered it, which GradScaler does
    exactly when the step's gradients overflowed and it skipped the optimizer step. None without an
    enabled scaler or a scaled loss."""
    if scaler is None or not scaler.is_enabled():
        return None
    scale = scaler._get_scale_async()
    if scale is None:  # no loss scaled yet
        return None
    with torch.no_grad(), untraced():
        if in_force is None:  # created in this step, at its initial value
            in_force = torch.full((), float(scaler._init_scale), dtype=scale.dtype, device=scale.device)
        skipped = (scale < in_force).to(scale.dtype)
    return in_force, skipped


def _is_gradient(series: Series) -> bool:
    return series.kind == "weight_grad" or (series.kind == "activation" and series.slot.endswith("_grad"))


def overflow_handled(series: list[Series], values: np.ndarray) -> np.ndarray | None:
    """Per series, whether its non-finite values are an overflow the loss scaler handled: a
    gradient in a step the scaler skipped (``loss_scale_skipped`` is 1). None when it did not
    skip the step, or is not monitored."""
    mean = MONITOR_COLUMNS.index("mean")
    if not any(s.kind == LOSS_SCALE_SKIPPED and values[i, mean] > 0 for i, s in enumerate(series)):
        return None
    return np.array([_is_gradient(s) for s in series], dtype=bool)
