"""The stats mode's files of one step, read back: ``stats.npy`` and ``stats_index.npy``, attached to
the step's op records (the reader half of the mode; ``mode.py`` is the writer); over a run,
``run.mode("stats")`` (:class:`StatsReader`)."""

from __future__ import annotations

from collections.abc import Collection
from typing import cast

import numpy as np

import probe.modes.stats.distribution_files as distribution_files
import probe.modes.stats.fp8_scales as fp8_files
import probe.modes.stats.sketch_files as sketch_files
from probe.modes.statistics.columns import COUNTS, STATS_FILE_COLUMNS
from probe.modes.stats.file_names import FILE_NAMES, STATS_FILE, STATS_INDEX_FILE
from probe.modes.stats.records import NonfiniteParameterRecord, row_tensors
from probe.rundir import layout
from probe.rundir.mode_files import ModeFiles, ModeReader
from probe.rundir.records import OpRecord
from probe.rundir.untrusted_reads import expect, read_npy, reading

INPUT, OUTPUT = 0, 1


STAT_NAMES = STATS_FILE_COLUMNS
"""The columns of ``stats.npy`` (the engine's names); an empty tensor's min, max and mean are NaN
there, None when read. ``inf`` counts both signs (``posinf`` + ``neginf``)."""


_SIGNLESS_COLUMNS = 6
"""Runs of format version 2 and before: ``stats.npy`` without ``posinf`` and ``neginf``."""


_EMPTY_STATS = {"min": None, "max": None, "mean": None, "norm": 0.0,
                "nan": 0, "inf": 0, "posinf": 0, "neginf": 0}


def _row_stats(values: list[float]) -> dict[str, float | int | None]:
    """One row of ``stats.npy`` as ``TensorRecord.stats``. A row of a run before format version 3
    has no ``posinf``/``neginf``: both 0 when it holds no Inf, None (unknown) when it does."""
    if len(values) == _SIGNLESS_COLUMNS:
        unknown = None if values[5] else 0.0
        values = [*values, unknown, unknown]
    return {name: (None if value is None else int(value)) if name in COUNTS else float(value)
            for name, value in zip(STAT_NAMES, values, strict=True)}


class StatsReader(ModeReader):
    """The stats mode over a run (``run.mode("stats")``): what it found of one step beyond the
    statistics it attaches to the op records (``run.ops()``)."""

    def nonfinite_parameters(self, step: int | None = None, rank: int | None = None
                             ) -> NonfiniteParameterRecord | None:
        """The parameters that held NaN or Inf at the step's start and the gradients that did
        before its optimizer step, by name (with ``model=``); None when the step has no statistics."""
        files = cast("StatsFiles | None", self.files(step, rank))
        return None if files is None else files.nonfinite_parameters()

    def output_stats(self, step: int | None = None, rank: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """The rows of one step's op outputs, without decoding the op records: ``(op index per row,
        rows)``, rows of min, max, mean, norm, nan, inf (an empty tensor's min, max and mean are
        NaN). None when the step has no statistics."""
        files = cast("StatsFiles | None", self.files(step, rank))
        return None if files is None else files.output_stats()


class StatsFiles(ModeFiles):
    """``stats.npy`` (rows of :data:`STAT_NAMES`) and ``stats_index.npy`` (rows of op index,
    INPUT/OUTPUT, position, stats row) of one step, read back and attached to its op records."""

    file_names = FILE_NAMES
    run_reader = StatsReader

    _arrays: tuple[np.ndarray, np.ndarray] | None = None
    _by_op: np.ndarray | None = None
    """The index's row positions sorted by op (stable), and the ops in that order."""
    _sorted_ops: np.ndarray

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(stats rows, index rows), checked against each other and the step's op count."""
        if self._arrays is None:
            self._arrays = self._read()
        return self._arrays

    def _read(self) -> tuple[np.ndarray, np.ndarray]:
        stats_path = self.where.directory / STATS_FILE
        index_path = self.where.directory / STATS_INDEX_FILE
        op_count = self.where.op_count()
        stats = read_npy(stats_path, run=self.where.run)
        with reading(stats_path):
            if (stats.ndim != 2 or stats.shape[1] not in (len(STAT_NAMES), _SIGNLESS_COLUMNS)
                    or stats.dtype.kind != "f"):
                raise ValueError(f"statistics are an array of shape {stats.shape} and dtype {stats.dtype}, "
                                 f"expected (rows, {len(STAT_NAMES)}) floats")
        index = read_npy(index_path, run=self.where.run)
        with reading(index_path):
            if index.ndim != 2 or index.shape[1] != 4 or index.dtype.kind not in "iu":
                raise ValueError(f"the index is an array of shape {index.shape} and dtype {index.dtype}, "
                                 "expected (entries, 4) integers")
            if index.size and (index.min() < 0 or index[:, 0].max() >= op_count or index[:, 1].max() > 1
                               or index[:, 3].max() >= len(stats)):
                raise ValueError(f"the index points past the {op_count} ops of {layout.OPS_FILE} or the "
                                 f"{len(stats)} rows of {STATS_FILE}")
        return stats, index

    def _rows_of(self, ops: Collection[int]) -> np.ndarray:
        """The positions in the index of the rows of ``ops``, in file order, found by binary
        search: decoding a few ops at a time (``probe summary``'s largest values, ``Run.iter_ops``)
        costs what those ops hold, not a pass over the step's index each time."""
        _, index = self.arrays()
        if self._by_op is None:
            self._by_op = np.argsort(index[:, 0], kind="stable")
            self._sorted_ops = index[self._by_op, 0]
        wanted = np.fromiter(ops, dtype=np.int64, count=len(ops))
        first = np.searchsorted(self._sorted_ops, wanted, "left")
        counts = np.searchsorted(self._sorted_ops, wanted, "right") - first
        # first[i], first[i] + 1, ... for counts[i] of each op, in one array
        starts = np.repeat(first - np.cumsum(counts) + counts, counts)
        return np.sort(self._by_op[starts + np.arange(int(counts.sum()))])

    def nonfinite_parameters(self) -> NonfiniteParameterRecord:
        """The parameters and gradients the step found holding NaN or Inf (from the manifest)."""
        with reading(self.where.directory / layout.MANIFEST_FILE):
            # Steps written before these checks have no entry: nothing was checked.
            checks = expect(self.where.summary.get("nonfinite_parameters", {}), dict, "nonfinite_parameters")
            found: dict[str, tuple[list[str], int] | None] = {}
            for key in ("parameters", "gradients"):
                check = expect(checks.get(key), (dict, type(None)), f"nonfinite_parameters.{key}")
                found[key] = None if check is None else (
                    [expect(n, str, f"a name in nonfinite_parameters.{key}")
                     for n in expect(check.get("names"), list, f"nonfinite_parameters.{key}.names")],
                    expect(check.get("count"), int, f"nonfinite_parameters.{key}.count"))
        return NonfiniteParameterRecord(self.where.step, self.where.rank, found["parameters"],
                                        found["gradients"])

    def output_stats(self) -> tuple[np.ndarray, np.ndarray]:
        """(op index per row, rows) of the op outputs, without decoding any op record."""
        stats, index = self.arrays()
        outputs = index[index[:, 1] == OUTPUT]
        return outputs[:, 0], stats[outputs[:, 3]]

    def outputs_nonfinite(self) -> bool:
        """Whether an op output of the step held a NaN or Inf (its ``nan`` or ``inf`` count)."""
        _, rows = self.output_stats()
        counts = rows[:, [STAT_NAMES.index("nan"), STAT_NAMES.index("inf")]]
        return bool((counts > 0).any())

    def attach(self, records: dict[int, OpRecord]) -> None:
        stats, index = self.arrays()
        if len(records) < self.where.op_count():
            index = index[self._rows_of(records)]
        with reading(self.where.directory / STATS_INDEX_FILE):
            rows: dict[int, dict[str, float | int | None]] = {}  # a row shared by tensors is one dict
            for row, tensor in row_tensors(index, records):
                if tensor.numel == 0:
                    tensor.stats = dict(_EMPTY_STATS)
                    continue
                if row not in rows:
                    rows[row] = _row_stats(stats[row].tolist())
                tensor.stats = rows[row]
        distribution_files.attach_files(self.where.directory, index, records, len(stats), self.where.run)
        sketch_files.attach_file(self.where.directory, index, records, len(stats), self.where.run)
        fp8_files.attach_file(self.where.directory, records, self.where.run)
