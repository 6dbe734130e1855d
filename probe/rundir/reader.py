"""Reading a run directory: ``probe.load(path)`` returns a :class:`Run`.

Steps are loaded lazily and cached per (step, rank). Statistics rows written by
the stats mode are attached to the tensor records; an input that was produced
by a traced op in the same step shares that op's output statistics even when
input statistics were not collected.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from probe.errors import ProbeError
from probe.rundir import layout
from probe.rundir.dump_index import DumpIndex

if TYPE_CHECKING:
    import networkx as nx

_STAT_NAMES = ("min", "max", "mean", "norm", "nan", "inf")


@dataclass(slots=True)
class TensorRecord:
    """A tensor argument or result of a recorded op."""

    dtype: str
    shape: tuple[int, ...]
    stats: dict[str, float | int | None] | None = None
    """min, max, mean, norm (floats; None for empty tensors), nan, inf (counts)."""
    source: tuple[int, int] | None = None
    """For inputs: (index of the producing op in this step, its output position)."""
    mutated: bool = False
    """For outputs: an argument the op wrote in place."""

    @property
    def finite(self) -> bool | None:
        """False if the tensor held a NaN or Inf; None without statistics."""
        if self.stats is None:
            return None
        return self.stats["nan"] == 0 and self.stats["inf"] == 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def abs_max(self) -> float | None:
        """max(|min|, |max|); None without statistics or for an empty tensor."""
        if self.stats is None or self.stats["min"] is None or self.stats["max"] is None:
            return None
        return max(abs(self.stats["min"]), abs(self.stats["max"]))

    @property
    def nonfinite(self) -> int | None:
        """How many elements were NaN or Inf; None without statistics."""
        if self.stats is None:
            return None
        return int(self.stats["nan"]) + int(self.stats["inf"])


@dataclass(slots=True)
class OpRecord:
    """One traced op call, as loaded from a run."""

    index: int
    id: str
    name: str
    phase: str
    module: str
    module_call: int
    module_stack: list[str]
    step: int
    rank: int
    inputs: list[TensorRecord]
    outputs: list[TensorRecord]
    stack: list[str] | None = None
    """Python call site, outermost frame first (when recorded with ``stack=True``)."""
    group: dict[str, Any] | None = None
    """Collectives: their process group, ``{"size", "name", "ranks"}`` (global ranks)."""

    @property
    def inputs_finite(self) -> bool | None:
        """Whether every input with known statistics was finite; None if none are known."""
        known = [t.finite for t in self.inputs if t.finite is not None]
        if not known:
            return None
        return all(known)

    @property
    def outputs_finite(self) -> bool | None:
        known = [t.finite for t in self.outputs if t.finite is not None]
        if not known:
            return None
        return all(known)

    def __repr__(self) -> str:
        return f"OpRecord({self.id!r}, step={self.step}, rank={self.rank})"


@dataclass(slots=True)
class CheckRecord:
    """One free-benchmark check of one op output (``run.checks()``)."""

    step: int
    rank: int
    op_index: int
    op_id: str
    name: str
    module: str
    phase: str
    perturb: str
    verdict: str
    """"pass", "fail" or "skip"."""
    output: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    ratio: float | None = None
    """Largest output deviation, relative to ``max(|original|, rms(original))``."""
    threshold: float | None = None
    input_change: float | None = None
    nonfinite_mismatch: int = 0
    sign_flips: int = 0
    reason: str | None = None
    """Why a check was skipped."""


@dataclass(slots=True)
class MonitorRecord:
    """One monitored series at one step (``run.monitor()``): metrics in fp64."""

    step: int
    rank: int
    kind: str
    """activation, weight_grad, weight, exp_avg, exp_avg_sq, update or update_ratio."""
    name: str
    """Module FQN (activations) or parameter name."""
    slot: str
    """input, output, input_grad or output_grad for activations; "" otherwise."""
    call: int
    min: float
    max: float
    mean: float
    norm: float
    zeros: float
    nans: float
    infs: float
    numel: float


@dataclass(slots=True)
class AnomalyRecord:
    """One monitor alert (``run.anomalies()``)."""

    step: int
    rank: int
    module: str
    metric: str
    """``<slot or kind>.<metric>``, e.g. ``output_grad.norm``."""
    value: float
    baseline: float | None
    rule: str
    """nonfinite, turbulence or ``rule:<name>`` of a user rule."""
    kind: str
    call: int = 0
    reason: str = ""

    def describe(self) -> str:
        base = "" if self.baseline is None else f" (baseline {self.baseline:.4g})"
        why = f": {self.reason}" if self.reason else ""
        return (f"step {self.step} rank {self.rank} {self.rule}: {self.module} {self.metric} = "
                f"{self.value:.4g}{base}{why}")


@dataclass
class StepInfo:
    """The manifest of one flushed step."""

    step: int
    rank: int
    complete: bool
    reason: str | None
    manifest: dict[str, Any] = field(repr=False)


_EMPTY_STATS = {"min": None, "max": None, "mean": None, "norm": 0.0, "nan": 0, "inf": 0}


def _stats_dict(row: list[float]) -> dict[str, float | int | None]:
    return {
        name: int(value) if name in ("nan", "inf") else float(value)
        for name, value in zip(_STAT_NAMES, row)
    }


class Run:
    """A run directory: its steps, ranks, op records, graphs and findings."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        run_file = self.path / layout.RUN_FILE
        if not run_file.is_file():
            raise ProbeError(f"{str(self.path)!r} is not a probe run directory (no {layout.RUN_FILE})")
        try:
            self.info: dict[str, Any] = json.loads(run_file.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProbeError(f"cannot read {str(run_file)!r}: {e}") from None
        version = self.info.get("format_version")
        if not isinstance(version, int) or version > layout.FORMAT_VERSION:
            raise ProbeError(
                f"{str(run_file)!r} has format version {version!r}; this probe reads versions "
                f"up to {layout.FORMAT_VERSION}: upgrade probe to read it"
            )
        self._ops: dict[tuple[int, int], list[OpRecord]] = {}
        self._step_info: dict[tuple[int, int], StepInfo] = {}
        self._dumps: dict[tuple[int, int], DumpIndex] = {}

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}, steps={self.steps}, ranks={self.ranks})"

    # -- what is there -----------------------------------------------------------

    @cached_property
    def ranks(self) -> list[int]:
        return layout.list_ranks(self.path)

    @cached_property
    def _steps_by_rank(self) -> dict[int, tuple[list[int], list[int]]]:
        return {rank: layout.list_steps(self.path, rank) for rank in self.ranks}

    @property
    def steps(self) -> list[int]:
        """Every step flushed on at least one rank."""
        return sorted({s for flushed, _ in self._steps_by_rank.values() for s in flushed})

    def steps_of(self, rank: int) -> list[int]:
        """The steps flushed on one rank."""
        return list(self._steps_by_rank.get(rank, ([], []))[0])

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
        return self._read_json(path) if path.exists() else {}

    def step_info(self, step: int, rank: int = 0) -> StepInfo:
        key = (step, rank)
        if key not in self._step_info:
            path = self._step_path(step, rank) / layout.MANIFEST_FILE
            manifest = self._read_json(path)
            self._step_info[key] = StepInfo(
                step, rank, bool(manifest.get("complete")), manifest.get("reason"), manifest
            )
        return self._step_info[key]

    # -- records -----------------------------------------------------------------

    def ops(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]:
        """Op records of one step and rank in execution order (default: first step, rank 0)."""
        step, rank = self.resolve(step, rank)
        key = (step, rank)
        if key not in self._ops:
            self._ops[key] = self._load_ops(step, rank)
        return self._ops[key]

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
        from probe.analysis.op_graph import build_graph

        return build_graph(self.ops(step, rank), phases)

    def checks(self, step: int | None = None, rank: int | None = None) -> list[CheckRecord]:
        """Free-benchmark checks, in execution order (every step and rank when not given)."""
        if step is None and rank is None:
            return [c for r in self.ranks for s in self.steps_of(r) for c in self.checks(s, r)]
        step, rank = self.resolve(step, rank)
        rows = _read_jsonl(self._step_path(step, rank) / layout.CHECKS_FILE)
        return [
            CheckRecord(
                step=step, rank=rank, op_index=row["op"], op_id=row["op_id"], name=row["name"],
                module=row["module"], phase=row["phase"], perturb=row["perturb"], verdict=row["verdict"],
                output=row.get("output"), dtype=row.get("dtype"),
                shape=tuple(row["shape"]) if row.get("shape") is not None else None,
                ratio=row.get("ratio"), threshold=row.get("threshold"), input_change=row.get("input_change"),
                nonfinite_mismatch=row.get("nonfinite_mismatch", 0), sign_flips=row.get("sign_flips", 0),
                reason=row.get("reason"),
            )
            for row in rows
        ]

    def monitor(self, step: int | None = None, rank: int | None = None) -> list[MonitorRecord]:
        """The monitor's series, per step in collection order (every step and rank when not given)."""
        if step is None and rank is None:
            return [m for r in self.ranks for s in self.steps_of(r) for m in self.monitor(s, r)]
        step, rank = self.resolve(step, rank)
        path = self._step_path(step, rank) / layout.MONITOR_FILE
        if not path.exists():
            return []
        try:
            with open(path, newline="") as f:
                rows = list(csv.DictReader(f))
            return [
                MonitorRecord(step, rank, row["kind"], row["name"], row["slot"], int(row["call"]),
                              *(float(row[c]) for c in ("min", "max", "mean", "norm", "zeros", "nans", "infs",
                                                        "numel")))
                for row in rows
            ]
        except (OSError, KeyError, ValueError) as e:
            raise ProbeError(f"cannot read {str(path)!r}: {e}") from None

    def anomalies(self) -> list[AnomalyRecord]:
        """The monitor's alerts, in step order, then rank, then detection order."""
        return [a for step in self.steps for rank in self.ranks if step in self.steps_of(rank)
                for a in self.anomalies_of(step, rank)]

    def anomalies_of(self, step: int, rank: int) -> list[AnomalyRecord]:
        """The monitor's alerts of one step and rank, in detection order."""
        rows = _read_jsonl(self._step_path(step, rank) / layout.ANOMALIES_FILE)
        for row in rows:
            for key in ("value", "baseline"):
                if isinstance(row.get(key), str):
                    row[key] = float(row[key])
        return [AnomalyRecord(**row) for row in rows]

    def module_types(self, step: int | None = None, rank: int | None = None) -> dict[str, str]:
        """Module FQN -> class name for the modules of one step."""
        step, rank = self.resolve(step, rank)
        path = self._step_path(step, rank) / layout.MODULES_FILE
        return self._read_json(path) if path.exists() else {}

    def has_dump(self, step: int | None = None, rank: int | None = None) -> bool:
        step, rank = self.resolve(step, rank)
        return (self._step_path(step, rank) / layout.TENSOR_INDEX_FILE).exists()

    def dump(self, step: int | None = None, rank: int | None = None) -> DumpIndex:
        """The dump index of one step (dump mode)."""
        step, rank = self.resolve(step, rank)
        if (step, rank) not in self._dumps:
            self._dumps[(step, rank)] = DumpIndex(self.path, rank, step)
        return self._dumps[(step, rank)]

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
        """The earliest op whose output holds a NaN or Inf (see analysis.nonfinite)."""
        from probe.analysis.nonfinite import first_nonfinite

        return first_nonfinite(self, step=step, rank=rank)

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

    def _read_json(self, path: Path) -> Any:
        try:
            return json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ProbeError(f"cannot read {str(path)!r}: {e}") from None

    def _load_ops(self, step: int, rank: int) -> list[OpRecord]:
        directory = self._step_path(step, rank)
        ops_path = directory / layout.OPS_FILE
        sites_path = directory / layout.CALLSITES_FILE
        sites = self._read_json(sites_path) if sites_path.exists() else {}
        records: list[OpRecord] = []
        try:
            with open(ops_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        except (OSError, json.JSONDecodeError) as e:
            raise ProbeError(f"cannot read {str(ops_path)!r}: {e}") from None
        for row in rows:
            records.append(
                OpRecord(
                    index=row["i"],
                    id=row["id"],
                    name=row["name"],
                    phase=row["phase"],
                    module=row["module"],
                    module_call=row["call"],
                    module_stack=row["stack"],
                    step=step,
                    rank=rank,
                    inputs=[
                        TensorRecord(d, tuple(s), source=(src[0], src[1]) if src else None)
                        for d, s, src in row["in"]
                    ],
                    outputs=[TensorRecord(d, tuple(s), mutated=bool(m)) for d, s, m in row["out"]],
                    stack=sites.get(str(row["site"])) if "site" in row else None,
                    group=row.get("group"),
                )
            )
        self._attach_stats(directory, records, [row["in"] for row in rows])
        return records

    def _attach_stats(
        self, directory: Path, records: list[OpRecord], raw_inputs: list[list[Any]]
    ) -> None:
        stats_path = directory / layout.STATS_FILE
        if not stats_path.exists():
            return
        try:
            stats = np.load(stats_path, allow_pickle=False)
            index = np.load(directory / layout.STATS_INDEX_FILE, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise ProbeError(f"cannot read statistics in {str(directory)!r}: {e}") from None
        rows = [_stats_dict(r) for r in stats.tolist()]
        for op_index, io, position, row in index.tolist():
            record = records[op_index]
            tensor = (record.inputs if io == 0 else record.outputs)[position]
            tensor.stats = dict(_EMPTY_STATS) if tensor.numel == 0 else rows[row]
        # Inputs without their own row share their exact producer's output row.
        for record, inputs in zip(records, raw_inputs):
            for tensor, (_, _, src) in zip(record.inputs, inputs):
                if tensor.stats is None and src and src[2]:
                    tensor.stats = records[src[0]].outputs[src[1]].stats


def load(path: str | Path) -> Run:
    """Open a run directory written by ``probe.mode(..., out=path)``."""
    return Run(path)


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The objects of a JSON-lines file of a step; none when the mode did not write it."""
    if not path.exists():
        return []
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except (OSError, json.JSONDecodeError) as e:
        raise ProbeError(f"cannot read {str(path)!r}: {e}") from None
