"""Finalize: raw rows moved to the host (the step's one transfer) -> the statistics of the
table (``columns.STATISTICS``), for files, records and TensorBoard alike."""

from __future__ import annotations

import numpy as np

from probe.modes.statistics.columns import RAW_COLUMNS, REPEATS, STATISTICS


def whole(raw: np.ndarray, numel: np.ndarray, multiplicity: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Raw rows of compact views (see ``reduce.compact_view``) -> the raw rows and element counts
    of the whole tensors (each column with ``repeats`` multiplied by the repetitions)."""
    m = np.asarray(multiplicity, dtype=np.float64)
    scale = np.where(REPEATS[None, :], m[:, None], 1.0)
    return raw * scale, np.asarray(numel, dtype=np.float64) * m


def finalize(raw: np.ndarray, numel: np.ndarray, names: tuple[str, ...]) -> np.ndarray:
    """Whole-tensor raw rows ``[rows, len(RAW_COLUMNS)]`` and element counts -> rows of the
    statistics ``names`` (fp64). A row of an empty tensor (numel 0) has min, max and mean NaN,
    norm and counts 0."""
    out = np.empty((raw.shape[0], len(names)), dtype=np.float64)
    if raw.shape[0] == 0:
        return out
    columns = {name: raw[:, i] for i, name in enumerate(RAW_COLUMNS)}
    numel = np.asarray(numel, dtype=np.float64)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for j, name in enumerate(names):
            out[:, j] = STATISTICS[name].compute(columns, numel)
    empty = numel == 0
    if empty.any():
        for j, name in enumerate(names):
            if name in ("min", "max", "mean"):
                out[empty, j] = np.nan
            elif name != "numel":
                out[empty, j] = 0.0
    return out
