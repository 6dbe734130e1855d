"""Reading a run directory: ``probe.load(path)`` returns a :class:`Run`.

Steps are loaded lazily, and only the few most recently used steps stay in
memory (:data:`STEPS_KEPT`), so reading a run of any length takes the memory of a
few steps. Statistics rows written by the stats mode are attached to the tensor
records; an input that was produced by a traced op in the same step shares that
op's output statistics even when input statistics were not collected.

Every file is read through :mod:`probe.rundir.reading`: damage to a run's metadata
is a :class:`ProbeError` naming the file, never another exception.
"""

from __future__ import annotations

import csv
import io
import json
from collections import OrderedDict
from collections.abc import Callable, Collection
from functools import cached_property
from pathlib import Path
from typing import Any, Generic, TypeVar

import networkx as nx
import numpy as np
import torch

from probe.errors import ProbeError, warn_once
from probe.rundir import layout
from probe.rundir.dump_index import DumpIndex
from probe.rundir.op_graph import build_graph
from probe.rundir.op_records import decode as decode_op_record
from probe.rundir.reading import expect, read_json, read_jsonl, reading, record_from_row
from probe.rundir.records import (
    AnomalyRecord,
    CheckRecord,
    MonitorRecord,
    OpRecord,
    StepInfo,
    TensorRecord,
    first_nonfinite_in,
)

__all__ = ["AnomalyRecord", "CheckRecord", "MonitorRecord", "OpRecord", "Run", "StepInfo", "TensorRecord",
           "load"]

STEPS_KEPT = 8
"""How many (step, rank) entries of each per-step cache a Run keeps (least recently used goes)."""

_STAT_NAMES = ("min", "max", "mean", "norm", "nan", "inf")
_EMPTY_STATS = {"min": None, "max": None, "mean": None, "norm": 0.0, "nan": 0, "inf": 0}

# The modes whose files this reader knows. A step written by a newer probe may list
# others: their files are left alone, with a warning naming the mode.
KNOWN_MODES = frozenset({"structure", "stats", "dump", "free_benchmark", "monitor", "upcast"})

K = TypeVar("K")
V = TypeVar("V")


class _Recent(Generic[K, V]):
    """A cache of the ``size`` most recently used values, loaded on a miss."""

    def __init__(self, load: Callable[[K], V], size: int = STEPS_KEPT) -> None:
        self._load, self._size = load, size
        self._values: OrderedDict[K, V] = OrderedDict()

    def __call__(self, key: K) -> V:
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = self._load(key)
        self._values[key] = value
        if len(self._values) > self._size:
            self._values.popitem(last=False)
        return value

    def peek(self, key: K) -> V | None:
        """The value when it is cached, without loading it or changing the order."""
        return self._values.get(key)

    def __len__(self) -> int:
        return len(self._values)


def _stats_dict(row: list[float]) -> dict[str, float | int | None]:
    return {
        name: int(value) if name in ("nan", "inf") else float(value)
        for name, value in zip(_STAT_NAMES, row, strict=True)
    }


def _check_version(path: Path, version: Any) -> None:
    if type(version) is not int or not 1 <= version <= layout.FORMAT_VERSION:
        hint = ": upgrade probe to read it" if type(version) is int and version > 0 else ""
        raise ProbeError(f"{str(path)!r} has format version {version!r}; this probe reads versions "
                         f"1 to {layout.FORMAT_VERSION}{hint}")


class Run:
    """A run directory: its steps, ranks, op records, graphs and findings."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        run_file = self.path / layout.RUN_FILE
        if not run_file.is_file():
            raise ProbeError(f"{str(self.path)!r} is not a probe run directory (no {layout.RUN_FILE})")
        self.info: dict[str, Any] = read_json(run_file)
        if self.info.get("format") != layout.FORMAT_NAME:
            raise ProbeError(f"{str(run_file)!r} is not a probe run (format {self.info.get('format')!r}, "
                             f"expected {layout.FORMAT_NAME!r})")
        _check_version(run_file, self.info.get("format_version"))
        with reading(run_file):
            expect(self.info.get("modes", []), list, "modes")
        self._ops = _Recent[tuple[int, int], list[OpRecord]](lambda key: self._load_ops(*key))
        self._step_info = _Recent[tuple[int, int], StepInfo](lambda key: self._load_step_info(*key))
        self._dumps = _Recent[tuple[int, int], DumpIndex](lambda key: DumpIndex(self.path, key[1], key[0]))
        self._lines = _Recent[tuple[int, int], tuple[Path, list[str]]](lambda key: self._read_op_lines(*key))
        self._stats = _Recent[tuple[int, int], tuple[np.ndarray, np.ndarray] | None](
            lambda key: self._stats_arrays(*key))

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, steps={self.steps}, ranks={self.ranks})"

    # -- what is there -----------------------------------------------------------

    @cached_property
    def ranks(self) -> list[int]:
        with reading(self.path):
            return layout.list_ranks(self.path)

    @cached_property
    def _steps_by_rank(self) -> dict[int, tuple[list[int], list[int]]]:
        with reading(self.path):
            return {rank: layout.list_steps(self.path, rank) for rank in self.ranks}

    @cached_property
    def _step_sets(self) -> dict[int, frozenset[int]]:
        return {rank: frozenset(flushed) for rank, (flushed, _) in self._steps_by_rank.items()}

    @property
    def steps(self) -> list[int]:
        """Every step flushed on at least one rank."""
        return sorted({s for flushed, _ in self._steps_by_rank.values() for s in flushed})

    def steps_of(self, rank: int) -> list[int]:
        """The steps flushed on one rank."""
        return list(self._steps_by_rank.get(rank, ([], []))[0])

    def has_step(self, step: int, rank: int) -> bool:
        """Whether rank ``rank`` flushed step ``step``."""
        return step in self._step_sets.get(rank, ())

    @property
    def unfinished_steps(self) -> list[tuple[int, int]]:
        """(step, rank) pairs whose flush never finished (the process died while writing)."""
        return sorted(
            (s, r) for r, (_, unfinished) in self._steps_by_rank.items() for s in unfinished
        )

    def process(self, rank: int) -> dict[str, Any]:
        """What rank ``rank`` recorded about its process (``rank.json``): world size, backend,
        host, pid, device; empty for runs written before it existed."""
        path = layout.rank_dir(self.path, rank) / layout.RANK_FILE
        return read_json(path) if path.exists() else {}

    def step_info(self, step: int, rank: int = 0) -> StepInfo:
        """The manifest of one flushed step: complete or not, why, and what each mode wrote."""
        return self._step_info((step, rank))

    def _load_step_info(self, step: int, rank: int) -> StepInfo:
        path = self._step_path(step, rank) / layout.MANIFEST_FILE
        manifest = read_json(path)
        _check_version(path, manifest.get("format_version"))
        with reading(path):
            complete = expect(manifest.get("complete"), bool, "complete")
            reason = expect(manifest.get("reason"), (str, type(None)), "reason")
            modes = expect(manifest.get("modes", {}), dict, "modes")
        for name in sorted(set(modes) - KNOWN_MODES):
            warn_once(f"unknown-mode-{name}", f"{str(path)!r} lists mode {name!r}, whose files this probe "
                      "does not read (written by a newer probe?): reading the rest of the step")
        return StepInfo(step, rank, complete, reason, manifest)

    # -- records -----------------------------------------------------------------

    def ops(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]:
        """Op records of one step and rank in execution order (default: first step, rank 0)."""
        return self._ops(self.resolve(step, rank))

    def op(self, op_id: str, step: int | None = None, rank: int | None = None) -> OpRecord:
        """The record of ``op_id`` (default: the first step and rank)."""
        step, rank = self.resolve(step, rank)
        for record in self.ops(step, rank):
            if record.id == op_id:
                return record
        raise ProbeError(f"no op {op_id!r} in step {step} rank {rank} of {str(self.path)!r}")

    def graph(
        self, step: int | None = None, rank: int | None = None, phases: Collection[str] | None = None
    ) -> nx.DiGraph:
        """The step's op graph: nodes keyed by op id, edges producer -> consumer.

        ``phases`` (e.g. ``["forward"]``) keeps only the ops of those phases.
        """
        return build_graph(self.ops(step, rank), phases)

    def checks(self, step: int | None = None, rank: int | None = None) -> list[CheckRecord]:
        """Free-benchmark checks, in execution order (every step and rank when not given)."""
        if step is None and rank is None:
            return [c for r in self.ranks for s in self.steps_of(r) for c in self.checks(s, r)]
        step, rank = self.resolve(step, rank)
        path = self._step_path(step, rank) / layout.CHECKS_FILE
        rows = read_jsonl(path)
        with reading(path):
            return [record_from_row(CheckRecord, row, {"op": "op_index"}, step=step, rank=rank)
                    for row in rows]

    def monitor(self, step: int | None = None, rank: int | None = None) -> list[MonitorRecord]:
        """The monitor's series, per step in collection order (every step and rank when not given)."""
        if step is None and rank is None:
            return [m for r in self.ranks for s in self.steps_of(r) for m in self.monitor(s, r)]
        step, rank = self.resolve(step, rank)
        path = self._step_path(step, rank) / layout.MONITOR_FILE
        if not path.exists():
            return []
        with reading(path):
            rows = list(csv.DictReader(io.StringIO(path.read_bytes().decode("utf-8"), newline="")))
            return [
                MonitorRecord(step, rank, row["kind"], row["name"], row["slot"], int(row["call"]),
                              *(float(row[c]) for c in ("min", "max", "mean", "norm", "zeros", "nans", "infs",
                                                        "numel")))
                for row in rows
            ]

    def anomalies(self) -> list[AnomalyRecord]:
        """The monitor's alerts, in step order, then rank, then detection order."""
        return [a for step in self.steps for rank in self.ranks if self.has_step(step, rank)
                for a in self.anomalies_of(step, rank)]

    def anomalies_of(self, step: int, rank: int) -> list[AnomalyRecord]:
        """The monitor's alerts of one step and rank, in detection order."""
        path = self._step_path(step, rank) / layout.ANOMALIES_FILE
        rows = read_jsonl(path)
        with reading(path):
            return [record_from_row(AnomalyRecord, row) for row in rows]

    def module_types(self, step: int | None = None, rank: int | None = None) -> dict[str, str]:
        """Module FQN -> class name for the modules of one step."""
        step, rank = self.resolve(step, rank)
        path = self._step_path(step, rank) / layout.MODULES_FILE
        if not path.exists():
            return {}
        types = read_json(path)
        with reading(path):
            for name, kind in types.items():
                expect(kind, str, f"the class of module {name!r}")
        return types

    def has_dump(self, step: int | None = None, rank: int | None = None) -> bool:
        step, rank = self.resolve(step, rank)
        return (self._step_path(step, rank) / layout.TENSOR_INDEX_FILE).exists()

    def dump(self, step: int | None = None, rank: int | None = None) -> DumpIndex:
        """The dump index of one step (dump mode)."""
        return self._dumps(self.resolve(step, rank))

    def tensor(
        self, op_id: str, io: str = "output", index: int = 0,
        step: int | None = None, rank: int | None = None,
    ) -> torch.Tensor:
        """A dumped tensor, memory-mapped: ``io`` is "input" or "output", ``index`` its position."""
        if io not in ("input", "output"):
            raise ProbeError(f"io must be 'input' or 'output', got {io!r}")
        op = self.op(op_id, step, rank)
        return self.dump(op.step, op.rank).tensor(op.index, io, index)

    def first_nonfinite(self, step: int | None = None, rank: int | None = None) -> OpRecord | None:
        """The earliest op whose output holds a NaN or Inf, or None.

        "Earliest" is execution order within a step (forward before the backward of the
        same step), the earliest step first; across ranks, the lowest rank at that step.
        Ops without statistics are not considered.
        """
        for s in self.steps if step is None else [step]:
            for r in self.ranks if rank is None else [rank]:
                if self.has_step(s, r):
                    found = first_nonfinite_in(self.ops(s, r))
                    if found is not None:
                        return found
        return None

    # -- loading -------------------------------------------------------------------

    def resolve(self, step: int | None, rank: int | None) -> tuple[int, int]:
        """The (step, rank) that ``step``, ``rank`` name: the first of each when None.

        Raises :class:`ProbeError` naming what the run holds when either is absent.
        """
        if rank is None:
            if not self.ranks:
                raise ProbeError(f"{str(self.path)!r} holds no rank directories")
            rank = self.ranks[0]
        flushed = self._steps_by_rank.get(rank)
        if flushed is None:
            raise ProbeError(f"rank {rank} is not in {str(self.path)!r}; ranks: {self.ranks}")
        if step is None:
            if not flushed[0]:
                raise ProbeError(f"rank {rank} of {str(self.path)!r} holds no flushed step")
            step = flushed[0][0]
        if step not in flushed[0]:
            raise ProbeError(
                f"step {step} of rank {rank} is not in {str(self.path)!r}; steps: {flushed[0]}"
            )
        return step, rank

    def _step_path(self, step: int, rank: int) -> Path:
        return layout.step_dir(self.path, rank, step)

    def _load_ops(self, step: int, rank: int) -> list[OpRecord]:
        return list(self._decode_ops(step, rank, None).values())

    def _read_op_lines(self, step: int, rank: int) -> tuple[Path, list[str]]:
        """``ops.jsonl`` of a step and its records' lines (op #i is line i, blank lines aside)."""
        path = self._step_path(step, rank) / layout.OPS_FILE
        with reading(path):
            return path, [line for line in path.read_bytes().decode("utf-8").split("\n") if line.strip()]

    def _decode_ops(self, step: int, rank: int, only: Collection[int] | None) -> dict[int, OpRecord]:
        """Op #i -> its record with statistics attached: every op, or ``only`` these and the
        producers of their inputs (whose output statistics those inputs share)."""
        self.step_info(step, rank)  # a step is read only under a readable manifest (written last)
        directory = self._step_path(step, rank)
        sites_path = directory / layout.CALLSITES_FILE
        sites = read_json(sites_path) if sites_path.exists() else {}
        ops_path, lines = self._lines((step, rank))
        records: dict[int, OpRecord] = {}
        exact: dict[int, list[bool]] = {}  # per input: shares its producer's statistics row

        def decode(number: int) -> OpRecord:
            if not 0 <= number < len(lines):
                raise ProbeError(f"{str(ops_path)!r} holds {len(lines)} op records: there is no op #{number}")
            with reading(f"{ops_path}, line {number + 1}"):
                row = json.loads(lines[number])
            try:  # decode checks every field and names the one that is wrong
                index, op_id, name, phase, module, call, stack, ins, outs, site, group, skipped = \
                    decode_op_record(row)
            except ProbeError as e:
                raise ProbeError(f"cannot read {str(ops_path)!r}, line {number + 1}: {e}") from None
            why = {(io, position): reason for io, position, reason in skipped}
            exact[number] = [bool(src and src[2]) for _, _, src in ins]
            return OpRecord(
                index=index,
                id=op_id,
                name=name,
                phase=phase,
                module=module,
                module_call=call,
                module_stack=list(stack),
                step=step,
                rank=rank,
                inputs=[
                    TensorRecord(d, s, source=(src[0], src[1]) if src else None,
                                 skipped=why.get(("in", i)))
                    for i, (d, s, src) in enumerate(ins)
                ],
                outputs=[TensorRecord(d, s, mutated=m, skipped=why.get(("out", i)))
                         for i, (d, s, m) in enumerate(outs)],
                stack=sites.get(str(site)) if site is not None else None,
                group=None if group is None else {"size": group[0], "name": group[1],
                                                  "ranks": list(group[2])},
            )

        for number in range(len(lines)) if only is None else sorted(set(only)):
            records[number] = decode(number)
        if only is not None:
            producers = {t.source[0] for r in list(records.values()) for t in r.inputs if t.source}
            for number in sorted(p for p in producers - set(records) if 0 <= p < len(lines)):
                records[number] = decode(number)
        with reading(ops_path):
            _check_references(records)
        self._attach_stats(step, rank, records)
        # Inputs without their own row share their exact producer's output row.
        for number, record in records.items():
            for tensor, shares in zip(record.inputs, exact[number], strict=True):
                if tensor.stats is None and shares and tensor.source and tensor.source[0] in records:
                    tensor.stats = records[tensor.source[0]].outputs[tensor.source[1]].stats
        return dict(sorted(records.items())) if only is not None else records

    def ops_at(self, indices: Collection[int], step: int | None = None, rank: int | None = None
               ) -> list[OpRecord]:
        """The records of ops #``indices`` of a step, decoding only those (and the producers of
        their inputs, for their statistics): for scans of long runs that need a few ops a step."""
        step, rank = self.resolve(step, rank)
        cached = self._ops.peek((step, rank))
        if cached is not None:
            if any(not 0 <= i < len(cached) for i in indices):
                raise ProbeError(f"step {step} rank {rank} holds {len(cached)} ops: no op #{max(indices)}")
            return [cached[i] for i in indices]
        records = self._decode_ops(step, rank, indices)
        return [records[i] for i in indices]

    def output_stats(self, step: int | None = None, rank: int | None = None
                     ) -> tuple[np.ndarray, np.ndarray] | None:
        """The stats mode's rows of one step's op outputs, without decoding the op records:
        ``(op index per row, rows)``, rows of min, max, mean, norm, nan, inf (an empty tensor's
        min, max and mean are NaN). None when the step has no statistics."""
        step, rank = self.resolve(step, rank)
        arrays = self._stats((step, rank))
        if arrays is None:
            return None
        stats, index = arrays
        outputs = index[index[:, 1] == 1]
        return outputs[:, 0], stats[outputs[:, 3]]

    def _stats_arrays(self, step: int, rank: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(stats rows, index rows of [op, io (0 in, 1 out), position, row]), checked; None without."""
        directory = self._step_path(step, rank)
        op_count = len(self._lines((step, rank))[1])
        stats_path = directory / layout.STATS_FILE
        if not stats_path.exists():
            return None
        index_path = directory / layout.STATS_INDEX_FILE
        with reading(stats_path):
            stats = np.load(stats_path, allow_pickle=False)
            if stats.ndim != 2 or stats.shape[1] != len(_STAT_NAMES) or stats.dtype.kind != "f":
                raise ValueError(f"statistics are an array of shape {stats.shape} and dtype {stats.dtype}, "
                                 f"expected (rows, {len(_STAT_NAMES)}) floats")
        with reading(index_path):
            index = np.load(index_path, allow_pickle=False)
            if index.ndim != 2 or index.shape[1] != 4 or index.dtype.kind not in "iu":
                raise ValueError(f"the index is an array of shape {index.shape} and dtype {index.dtype}, "
                                 "expected (entries, 4) integers")
            if index.size and (index.min() < 0 or index[:, 0].max() >= op_count or index[:, 1].max() > 1
                               or index[:, 3].max() >= len(stats)):
                raise ValueError(f"the index points past the {op_count} ops of ops.jsonl or the "
                                 f"{len(stats)} rows of stats.npy")
        return stats, index

    def _attach_stats(self, step: int, rank: int, records: dict[int, OpRecord]) -> None:
        arrays = self._stats((step, rank))
        if arrays is None:
            return
        stats, index = arrays
        if len(records) < len(self._lines((step, rank))[1]):
            index = index[np.isin(index[:, 0], list(records))]
        with reading(self._step_path(step, rank) / layout.STATS_INDEX_FILE):
            rows: dict[int, dict[str, float | int | None]] = {}
            for op_index, io, position, row in index.tolist():
                record = records.get(op_index)
                if record is None:
                    continue
                tensor = (record.inputs if io == 0 else record.outputs)[position]
                if tensor.numel == 0:
                    tensor.stats = dict(_EMPTY_STATS)
                    continue
                if row not in rows:
                    rows[row] = _stats_dict(stats[row].tolist())
                tensor.stats = rows[row]


def load(path: str | Path) -> Run:
    """Open a run directory written by ``probe.mode(..., out=path)``."""
    return Run(path)


def _check_references(records: dict[int, OpRecord]) -> None:
    """Op #i has index i, and an input's source is an output of an earlier op."""
    for number, record in records.items():
        if record.index != number:
            raise ValueError(f"op record {number} has index {record.index}")
        for tensor in record.inputs:
            if tensor.source is None:
                continue
            producer, output = tensor.source
            known = records.get(producer)
            if not (0 <= producer < number and (known is None or 0 <= output < len(known.outputs))):
                raise ValueError(f"op #{number} reads output {output} of op #{producer}, "
                                 "which is not an earlier op's output")
