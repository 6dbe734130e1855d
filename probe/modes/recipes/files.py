"""The whatif mode's files of one step, read back: ``whatif.npy`` (operands x recipes x
:data:`~probe.modes.recipes.quantize.STAT_COLUMNS`) and ``whatif_index.npy`` (op index, argument
position, role of each operand)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from probe.modes.recipes.formats import Recipe
from probe.modes.recipes.operands import ROLES
from probe.modes.recipes.quantize import STAT_COLUMNS
from probe.rundir.mode_files import ModeFiles
from probe.rundir.untrusted_reads import read_npy, reading

STATS_FILE = "whatif.npy"
_COLUMNS_BEFORE_PRODUCTS = 6
"""Runs written before the product columns hold the first six :data:`STAT_COLUMNS`."""
INDEX_FILE = "whatif_index.npy"


class QuantizationLosses:
    """The shares and ratios of the counts and sums of
    :data:`~probe.modes.recipes.quantize.STAT_COLUMNS`, for the classes that hold them."""

    nonzero: int
    underflow: int
    saturated: int
    error_sq: float
    signal_sq: float

    @property
    def underflow_share(self) -> float:
        """Nonzero values that quantize to 0, as a share of the nonzero values."""
        return self.underflow / self.nonzero if self.nonzero else 0.0

    @property
    def saturation_share(self) -> float:
        return self.saturated / self.nonzero if self.nonzero else 0.0

    @property
    def relative_mse(self) -> float:
        """Squared quantize-dequantize error over squared values (1/SNR)."""
        return self.error_sq / self.signal_sq if self.signal_sq else 0.0

    @property
    def snr_db(self) -> float:
        return float(-10 * np.log10(self.relative_mse)) if self.relative_mse > 0 else float("inf")


@dataclass(frozen=True)
class OperandWhatIf(QuantizationLosses):
    """One matmul operand of one step under one recipe."""

    op_index: int
    position: int
    """The operand's argument position in the op."""
    role: str
    """``"input"``, ``"weight"`` or ``"grad_output"``."""
    recipe: str
    nonzero: int
    underflow: int
    saturated: int
    error_sq: float
    signal_sq: float
    block_range_log2: float
    output_error_sq: float = math.nan
    """The expected squared error this operand's rounding alone puts into the op's output; NaN
    where it was not measured (its operands do not pair up, or a run written before)."""
    output_sq: float = math.nan
    """The op's output's sum of squares (NaN: not measured)."""


class WhatIfFiles(ModeFiles):
    """The what-if statistics of one step."""

    def recipes(self) -> list[Recipe]:
        return [Recipe(**r) for r in self.where.summary.get("recipes", [])]

    def operands(self) -> list[OperandWhatIf]:
        """Every operand under every recipe, in the order the step read them."""
        stats_path = self.where.directory / STATS_FILE
        index_path = self.where.directory / INDEX_FILE
        stats = read_npy(stats_path, run=self.where.run)
        index = read_npy(index_path, run=self.where.run)
        recipes = self.recipes()
        with reading(stats_path):
            expected = (len(index), len(recipes), len(STAT_COLUMNS))
            if stats.shape != expected and stats.shape != (*expected[:2], _COLUMNS_BEFORE_PRODUCTS):
                raise ValueError(f"what-if statistics of shape {stats.shape}, expected {expected} (operands, "
                                 "recipes, columns)")
        with reading(index_path):
            if index.ndim != 2 or index.shape[1] != 3 or (index.size and not set(index[:, 2]) <= {0, 1, 2}):
                raise ValueError(f"the index is an array of shape {index.shape}, expected (operands, 3) "
                                 "with roles 0-2")
        rows = []
        for (op, position, role), per_recipe in zip(index.tolist(), stats.tolist(), strict=True):
            for recipe, values in zip(recipes, per_recipe, strict=True):
                counts = (int(value) for value in values[:3])
                rows.append(OperandWhatIf(op, position, ROLES[role], recipe.name, *counts, *values[3:]))
        return rows
