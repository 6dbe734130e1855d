"""The statistics table: every column the engine computes, how, how partial results combine,
and what each statistic depends on (TransformerEngine's debug ``STATS`` table is the model).

Two levels:

- **raw columns** (:data:`RAW`): what a kernel reduces a tensor to, on its device, in the
  accumulation dtype (fp64 on CPU and CUDA). Each says how it is computed from the tensor's
  values (``compute``: the eager form every fused kernel must equal), how two partial rows of
  the same tensor combine (``combine``: ``min``, ``max`` or ``sum``; what the cross-rank
  reduction and a split tensor use), and whether it grows with a broadcast dimension's
  repetitions (``repeats``: sums and counts do, extremes do not).
- **statistics** (:data:`STATISTICS`): what files, records and TensorBoard show, computed on
  the host from raw columns after the step's one transfer (``compute``), with the raw columns
  each needs (``depends``).

One name per statistic everywhere: ``nan`` and ``inf`` (the monitor wrote ``nans``/``infs``
before run format 4; :data:`LEGACY_NAMES` reads them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RawColumn:
    """One raw column: ``compute(x, eps)`` reduces a real tensor ``x`` already widened to the
    accumulation dtype (``eps``: the zeros threshold in ``x``'s dtype) to a 0-d tensor."""

    name: str
    compute: Callable[[torch.Tensor, float], torch.Tensor]
    combine: str
    """``min``, ``max`` or ``sum``: how partial rows of one tensor (or of its shards) combine."""
    repeats: bool
    """Multiplied by a broadcast dimension's repetitions (``compact_view``'s multiplicity)."""


def _count(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum()


RAW: tuple[RawColumn, ...] = (
    RawColumn("min", lambda x, eps: x.amin(), "min", False),  # NaN propagates, like amin
    RawColumn("max", lambda x, eps: x.amax(), "max", False),
    RawColumn("sum", lambda x, eps: x.sum(), "sum", True),
    RawColumn("sumsq", lambda x, eps: (x * x).sum(), "sum", True),
    RawColumn("nan", lambda x, eps: _count(torch.isnan(x)), "sum", True),
    RawColumn("inf", lambda x, eps: _count(torch.isinf(x)), "sum", True),  # +Inf and -Inf alike
    RawColumn("ninf", lambda x, eps: _count(torch.isneginf(x)), "sum", True),
    # |x| < eps: the monitor's; 0 where no eps is asked for (the stats mode).
    RawColumn("zeros", lambda x, eps: _count(x.abs() < eps), "sum", True),
)
RAW_COLUMNS = tuple(c.name for c in RAW)
RAW_INDEX = {name: i for i, name in enumerate(RAW_COLUMNS)}
REPEATS = np.array([c.repeats for c in RAW], dtype=bool)
"""Per raw column, whether a broadcast dimension's repetitions multiply it."""


def raw_row(x: torch.Tensor, eps: float | None = None) -> torch.Tensor:
    """The raw row of a non-empty widened tensor by the table's eager forms (a reference, and
    the path of tensors no fused kernel takes)."""
    return torch.stack([c.compute(x, 0.0 if eps is None else eps).to(x.dtype) for c in RAW])


Raw = dict[str, np.ndarray]
"""Raw columns of many rows by name (whole-tensor values: repetitions applied)."""


@dataclass(frozen=True)
class Statistic:
    """One statistic: ``compute(raw, numel)`` from the raw columns it ``depends`` on and the
    element counts, for many rows at once (fp64 arrays on the host)."""

    name: str
    compute: Callable[[Raw, np.ndarray], np.ndarray]
    depends: tuple[str, ...]
    count: bool = False
    """An element count (read back as an int in stats records)."""


def _mean(raw: Raw, numel: np.ndarray) -> np.ndarray:
    return np.where(numel > 0, raw["sum"] / np.where(numel > 0, numel, 1), np.nan)


STATISTICS: dict[str, Statistic] = {s.name: s for s in (
    Statistic("min", lambda raw, n: raw["min"], ("min",)),
    Statistic("max", lambda raw, n: raw["max"], ("max",)),
    Statistic("mean", _mean, ("sum",)),
    Statistic("norm", lambda raw, n: np.sqrt(raw["sumsq"]), ("sumsq",)),
    Statistic("zeros", lambda raw, n: raw["zeros"], ("zeros",), count=True),
    Statistic("nan", lambda raw, n: raw["nan"], ("nan",), count=True),
    Statistic("inf", lambda raw, n: raw["inf"], ("inf",), count=True),
    Statistic("posinf", lambda raw, n: raw["inf"] - raw["ninf"], ("inf", "ninf"), count=True),
    Statistic("neginf", lambda raw, n: raw["ninf"], ("ninf",), count=True),
    Statistic("numel", lambda raw, n: n.astype(np.float64), (), count=True),
)}

STATS_FILE_COLUMNS = ("min", "max", "mean", "norm", "nan", "inf", "posinf", "neginf")
"""The columns of the stats mode's ``stats.npy`` (``docs/format.md``)."""
MONITOR_COLUMNS = ("min", "max", "mean", "norm", "zeros", "nan", "inf", "posinf", "neginf", "numel")
"""The columns of the monitor's ``monitor.csv`` (run format 4; see :data:`LEGACY_NAMES`)."""
COUNTS = frozenset(s.name for s in STATISTICS.values() if s.count)

LEGACY_NAMES = {"nans": "nan", "infs": "inf"}
"""The monitor's names before run format 4 (``monitor.csv`` headers, ``metrics`` option values,
alert metrics), read as today's."""


def canonical(name: str) -> str:
    """Today's name of statistic ``name`` (a legacy name read as its successor)."""
    return LEGACY_NAMES.get(name, name)


def depends(names: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """The raw columns the statistics ``names`` need, in table order."""
    needed = {column for name in names for column in STATISTICS[name].depends}
    return tuple(c for c in RAW_COLUMNS if c in needed)


def combine_ops() -> tuple[list[int], list[int], list[int]]:
    """The raw column indices that combine by min, by max and by sum (the cross-rank reduction)."""
    by: dict[str, list[int]] = {"min": [], "max": [], "sum": []}
    for i, c in enumerate(RAW):
        by[c.combine].append(i)
    return by["min"], by["max"], by["sum"]
