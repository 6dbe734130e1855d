"""The monitor's per-tensor metrics, reduced on the tensor's device without a host sync.

One raw row per tensor (:data:`RAW_COLUMNS`): min, max, sum, sum of squares,
NaN count, Inf count, and the count of "zeros" (``|x| < eps``); the element
count is known on the host and travels beside it. Rows are in the
accumulation dtype of :mod:`probe.modes.tensor_stats` (values are widened
before they are reduced; never reduced in bf16/fp16). Rows of a step are
stacked on the device and moved to the host once; :func:`finalize` turns them
into :data:`METRIC_COLUMNS`. Like the stats mode, large tensors go through one
compiled pass and small ones through a few eager reductions.
"""

from __future__ import annotations

import numpy as np
import torch

from probe.compiled import CompiledKernel
from probe.modes.tensor_stats import (
    COMPILED_MAX_NUMEL,
    COMPILED_MIN_NUMEL,
    accumulation_dtype,
    as_real,
    compact_view,
)

RAW_COLUMNS = ("min", "max", "sum", "sumsq", "nan", "inf", "zeros")
METRIC_COLUMNS = ("min", "max", "mean", "norm", "zeros", "nans", "infs", "numel")


def _raw(flat: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """One pass over a 1-D tensor once compiled (the counts as in tensor_stats._fused_raw)."""
    x = flat if flat.dtype == torch.float64 else flat.to(torch.float32)
    wide = x.to(torch.float64)
    diff = x - x
    nan = (x != x).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    nonfinite = (diff != diff).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    zeros = (x.abs() < eps).to(torch.int32).sum(dtype=torch.int32).to(torch.float64)
    return torch.stack([x.amin().to(torch.float64), x.amax().to(torch.float64), wide.sum(),
                        (wide * wide).sum(), nan, nonfinite - nan, zeros])


_COMPILED = CompiledKernel(_raw)


def _adam_update_raw(m: torch.Tensor, v: torch.Tensor, coefficients: torch.Tensor, eps: torch.Tensor
                     ) -> torch.Tensor:
    """The raw row of Adam's update ``lr * (m / c1) / (sqrt(v / c2) + adam_eps)`` without
    materializing it; ``coefficients`` = [lr / c1, 1 / c2, adam_eps]."""
    update = coefficients[0] * m.to(torch.float32) / ((v.to(torch.float32) * coefficients[1]).sqrt()
                                                       + coefficients[2])
    return _raw(update, eps)


_ADAM_UPDATE = CompiledKernel(_adam_update_raw)


def adam_update_row(m: torch.Tensor, v: torch.Tensor, lr: float, beta1: float, beta2: float, adam_eps: float,
                    step: torch.Tensor | float, eps: float) -> tuple[torch.Tensor, int]:
    """The raw row of the step Adam took from its moments (decoupled weight decay not included).

    ``step`` is Adam's counter: a host number, or a device tensor (capturable and
    fused Adam), which is then used where it is, without a sync.
    """
    if isinstance(step, torch.Tensor) and step.device.type != "cpu":
        t = step.to(device=m.device, dtype=torch.float32)
        coefficients = torch.stack([lr / (1 - beta1**t), 1 / (1 - beta2**t), torch.full_like(t, adam_eps)])
    else:
        t = float(step)
        coefficients = torch.tensor([lr / (1 - beta1**t), 1 / (1 - beta2**t), adam_eps],
                                    dtype=torch.float32, device=m.device)
    threshold = torch.full((), eps, dtype=torch.float32, device=m.device)
    acc = accumulation_dtype(m.device)
    flat_m, flat_v = m.detach().reshape(-1), v.detach().reshape(-1)
    if COMPILED_MIN_NUMEL <= m.numel() < COMPILED_MAX_NUMEL and _ADAM_UPDATE.usable(m.device):
        return _ADAM_UPDATE(flat_m, flat_v, coefficients, threshold).to(acc), m.numel()
    return _adam_update_raw(flat_m, flat_v, coefficients, threshold).to(acc), m.numel()


def raw_row(t: torch.Tensor, eps: float) -> tuple[torch.Tensor, int]:
    """The raw row of ``t`` on its device and its element count (broadcast elements
    counted once per repetition: the metrics are those of the tensor the program sees)."""
    x, multiplicity = compact_view(as_real(t.detach()))
    acc = accumulation_dtype(x.device)
    numel = x.numel() * multiplicity
    if x.numel() == 0:
        return torch.tensor([np.nan, np.nan, 0, 0, 0, 0, 0], dtype=acc, device=x.device), 0
    threshold = torch.full((), eps, dtype=torch.float32 if x.dtype != torch.float64 else x.dtype,
                           device=x.device)
    if COMPILED_MIN_NUMEL <= x.numel() < COMPILED_MAX_NUMEL and _COMPILED.usable(x.device):
        flat = (x if x.is_contiguous() else x.contiguous()).view(-1)
        row = _COMPILED(flat, threshold).to(acc)
    else:
        xa = x.to(acc)
        mn, mx = torch.aminmax(xa)
        nan = torch.isnan(xa).sum().to(acc)
        inf = torch.isinf(xa).sum().to(acc)
        zeros = (xa.abs() < threshold.to(acc)).sum().to(acc)
        row = torch.stack([mn, mx, xa.sum(), xa.square().sum(), nan, inf, zeros])
    if multiplicity == 1:
        return row, numel
    m = multiplicity
    return row * torch.tensor([1, 1, m, m, m, m, m], dtype=acc, device=x.device), numel


def finalize(raw: np.ndarray, numel: np.ndarray) -> np.ndarray:
    """Raw rows and element counts -> ``[min, max, mean, norm, zeros, nans, infs, numel]`` (fp64).

    Means and norms are of the finite and non-finite values alike (NaN in, NaN out),
    as the tensor holds them.
    """
    out = np.empty((raw.shape[0], len(METRIC_COLUMNS)), dtype=np.float64)
    if raw.shape[0] == 0:
        return out
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        out[:, 0] = raw[:, 0]
        out[:, 1] = raw[:, 1]
        out[:, 2] = np.where(numel > 0, raw[:, 2] / np.where(numel > 0, numel, 1), np.nan)
        out[:, 3] = np.sqrt(raw[:, 3])
    out[:, 4] = raw[:, 6]
    out[:, 5] = raw[:, 4]
    out[:, 6] = raw[:, 5]
    out[:, 7] = numel
    return out
