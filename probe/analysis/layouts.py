"""Logical ops: the per-rank records of a multi-rank run folded into ops on whole tensors.

Under tensor parallelism (DTensor) each rank records the local ops DTensor ran for an op on
the whole tensor, each labelled with the DTensor op's mesh and placements (``OpRecord.layout``,
see ``probe.tracer.dtensor_layouts``). Folding turns the ranks' records of one step into one
list of ops, as one process computing the whole tensors would have recorded them:

- **layout changes are not ops**: the local ops DTensor ran to redistribute an input
  (``role == "redistribute"``), collectives (``op.group``) and the functional collectives'
  wait and wrapper are dropped; an input read through them reads the value they moved
  (its source follows them back);
- **each output is folded by its placements** (one per mesh dim): ``S(d)`` combines the ranks
  of that mesh dim (shape: their sizes along ``d`` added; statistics combined exactly:
  min of minima, max of maxima, sums and element counts added for the mean, the norm from
  the sum of squared norms, NaN/Inf counts added); ``R`` takes the lowest coordinate's
  record and checks that the replicas agree (a replica that disagrees is a
  :class:`ReplicaFinding`, not folded away); ``P(...)`` (a partial sum) has no statistics
  of its own until the collective that reduces it: the collective's result is the logical
  value's;
- an op on plain tensors (between a ``ColwiseParallel`` and a ``RowwiseParallel`` module the
  activations are local tensors) takes the placements of its first placed input when the
  output has as many dims (elementwise ops, views that keep the rank), else it is
  replicated if all ranks agree, and sharded (along its first dim) if they do not;
- inputs read the folded value of their producer; an input from outside the step (a
  weight, the data) is folded by the placement the DTensor op gave it (a replicated value
  that DTensor split or scaled locally first is folded as the replicated value it was).

A run of one rank without layouts folds to itself. What is not folded yet: dumps (the
logical ops of a folded run compare on statistics), per-tensor distributions and histograms,
data parallelism (DDP, FSDP2's compute on unsharded parameters: each rank's own batch), and
strided shards (``_S``, FSDP2 x TP); see ``docs/distributed.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from probe.errors import ProbeError
from probe.rundir.reader import OpRecord, Run, TensorRecord

_PASS_THROUGH = frozenset({"_c10d_functional.wait_tensor.default",
                           "_c10d_functional._wrap_tensor_autograd.default"})
_COUNTS = ("nan", "inf", "posinf", "neginf", "zeros")

Placements = tuple[str, ...] | None
Mesh = tuple[tuple[int, ...], tuple[int, ...]]
"""(mesh shape, global ranks in mesh order)."""


@dataclass(frozen=True)
class ReplicaFinding:
    """A value that must be the same on the ranks of a mesh dim (``Replicate``) and is not."""

    step: int
    op_id: str
    io: str
    position: int
    rank: int
    reference_rank: int
    statistic: str
    value: Any
    reference: Any

    def describe(self) -> str:
        return (f"step {self.step} rank {self.rank}: {self.op_id} {self.io} {self.position} is "
                f"replicated but its {self.statistic} = {self.value!r}; rank {self.reference_rank} "
                f"holds {self.reference!r}")


@dataclass
class LogicalStep:
    """One step of a run folded into logical ops."""

    step: int
    ops: list[OpRecord]
    layout_changes: int = 0
    """Local ops dropped as layout changes (redistributions, collectives)."""
    findings: list[ReplicaFinding] = field(default_factory=list)


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def combine_stats(parts: list[tuple[dict[str, Any] | None, tuple[int, ...]]]) -> dict[str, Any] | None:
    """The statistics of the concatenation of tensors, from each one's statistics and shape.

    Exact up to the fp64 rounding of the sums: min and max of the parts' extremes, the mean
    from the parts' sums (mean x count), the norm from their squared norms, counts added.
    None when a part has no statistics."""
    if not parts or any(stats is None for stats, _ in parts):
        return None
    counted = [(stats, _numel(shape)) for stats, shape in parts]
    filled = [(s, n) for s, n in counted if n > 0 and s.get("min") is not None]
    total = sum(n for _, n in counted)
    out: dict[str, Any] = {}
    if filled:
        out["min"] = min(s["min"] for s, _ in filled)
        out["max"] = max(s["max"] for s, _ in filled)
        means = [s.get("mean") for s, _ in filled]
        out["mean"] = None if any(m is None for m in means) else \
            sum(m * n for m, (_, n) in zip(means, filled, strict=True)) / sum(n for _, n in filled)
        norms = [s.get("norm") for s, _ in filled]
        out["norm"] = None if any(v is None for v in norms) else math.sqrt(sum(v * v for v in norms))
    else:
        out.update(min=None, max=None, mean=None, norm=None if total else 0.0)
    first = parts[0][0]
    assert first is not None
    for key in _COUNTS:
        if key in first:
            values = [s.get(key) for s, _ in parts]  # type: ignore[union-attr]
            out[key] = None if any(v is None for v in values) else sum(values)
    return out


def _stats_differ(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str | None:
    """The first statistic in which two replicas differ (bit for bit), or None."""
    if a is None or b is None:
        return None
    for key in ("min", "max", "mean", "norm", "nan", "inf"):
        x, y = a.get(key), b.get(key)
        if x != y and not (isinstance(x, float) and isinstance(y, float) and math.isnan(x) and math.isnan(y)):
            return key
    return None


def _shard_dim(placement: str) -> int | None:
    if placement.startswith("S(") and placement.endswith(")"):
        return int(placement[2:-1])
    return None


def _coordinates(mesh: Mesh) -> dict[int, tuple[int, ...]]:
    shape, ranks = mesh
    coords: dict[int, tuple[int, ...]] = {}
    for position, rank in enumerate(ranks):
        coord = []
        for size in reversed(shape):
            coord.append(position % size)
            position //= size
        coords[rank] = tuple(reversed(coord))
    return coords


class _Folder:
    """Folds one step of a run; the lead rank's records give the order, ids and modules."""

    def __init__(self, run: Run, step: int, ranks: list[int]) -> None:
        self.step = step
        self.lead = ranks[0]
        self.ranks = ranks
        self.ops = {rank: run.ops(step, rank) for rank in ranks}
        self.by_id = {rank: {op.id: op for op in ops} for rank, ops in self.ops.items()}
        self.findings: list[ReplicaFinding] = []

    def _peers(self, op: OpRecord) -> dict[int, OpRecord]:
        return {rank: found for rank in self.ranks if (found := self.by_id[rank].get(op.id)) is not None}

    def fold_tensor(self, op: OpRecord, io: str, position: int, placements: Placements,
                    mesh: Mesh | None) -> TensorRecord:
        """One tensor of ``op`` folded over the ranks by its placements."""
        peers = self._peers(op)
        records = {rank: (p.outputs if io == "output" else p.inputs)[position] for rank, p in peers.items()
                   if position < len(p.outputs if io == "output" else p.inputs)}
        lead = records[self.lead]
        if mesh is None or placements is None or len(placements) != len(mesh[0]):
            mesh = ((len(self.ranks),), tuple(self.ranks))
            placements = ("R",)
        if any(p.startswith("P") for p in placements):
            return TensorRecord(lead.dtype, lead.shape, None, mutated=lead.mutated)
        coords = _coordinates(mesh)
        sharded = {k: d % max(len(lead.shape), 1) for k, p in enumerate(placements)
                   if (d := _shard_dim(p)) is not None}
        unknown = [k for k, p in enumerate(placements) if p != "R" and k not in sharded]
        if unknown:  # a strided shard or a placement not known here: nothing is claimed
            return TensorRecord(lead.dtype, lead.shape, None, mutated=lead.mutated)
        replicated = [k for k in range(len(placements)) if k not in sharded]
        if any(rank not in records for rank in mesh[1]):
            return TensorRecord(lead.dtype, lead.shape, None, mutated=lead.mutated)  # a rank not recorded
        contributing = [r for r in mesh[1] if all(coords[r][k] == 0 for k in replicated)]
        # Replicas: each rank against the contributing rank with its coordinates on sharded dims.
        for rank in mesh[1]:
            if rank in contributing:
                continue
            reference = next(r for r in contributing if all(coords[r][k] == coords[rank][k] for k in sharded))
            differs = _stats_differ(records[rank].stats, records[reference].stats)
            if differs is not None:
                self.findings.append(ReplicaFinding(
                    self.step, op.id, io, position, rank, reference, differs,
                    records[rank].stats[differs], records[reference].stats[differs]))  # type: ignore[index]
        shape = list(lead.shape)
        for dim in set(sharded.values()):
            along = [k for k, d in sharded.items() if d == dim]
            shape[dim] = sum(records[r].shape[dim] for r in contributing
                             if all(coords[r][k] == 0 for k in sharded if k not in along))
        stats = combine_stats([(records[r].stats, records[r].shape) for r in contributing])
        return TensorRecord(lead.dtype, tuple(shape), stats, mutated=lead.mutated)

    def fold(self) -> LogicalStep:
        ops = self.ops[self.lead]
        kept: dict[int, int] = {}  # lead index -> logical index
        back: dict[int, tuple[int, int] | None] = {}  # dropped index -> the value it moved
        placed: dict[tuple[int, int], tuple[Placements, Mesh | None]] = {}
        folded: list[OpRecord] = []
        partial_results: dict[tuple[int, int], OpRecord] = {}
        external: dict[int, OpRecord] = {}  # dropped op -> itself, when it moved a value from outside

        def value_of(source: tuple[int, int] | None) -> tuple[int, int] | None:
            seen = 0
            while source is not None and source[0] in back and seen < 64:
                source, seen = back[source[0]], seen + 1
            return source

        for op in ops:
            layout = op.layout
            if (layout is not None and layout["role"] == "redistribute") or op.group is not None \
                    or op.name in _PASS_THROUGH:
                moved = value_of(op.inputs[0].source) if op.inputs else None
                back[op.index] = moved
                if op.inputs and op.inputs[0].source is None:
                    external[op.index] = op
                if moved is not None and op.group is not None and op.outputs:
                    producer = placed.get(moved)
                    if producer is not None and producer[0] and any(p.startswith("P") for p in producer[0]):
                        partial_results.setdefault(moved, op)  # the collective that reduces it
                continue
            mesh = None
            if layout is not None:
                mesh = (tuple(layout["mesh"]["shape"]), tuple(layout["mesh"]["ranks"]))
            inputs = []
            for position, t in enumerate(op.inputs):
                source = value_of(t.source)
                if source is not None and source[0] in kept:
                    inputs.append(TensorRecord(t.dtype, t.shape, None, source=(kept[source[0]], source[1])))
                    continue
                origin = external.get(t.source[0]) if t.source is not None else None
                if origin is not None:  # from outside, through a local redistribution: replicated
                    record = self.fold_tensor(origin, "input", 0, None, None)
                else:
                    given = layout["in"][position] if layout is not None and position < len(layout["in"]) \
                        else None
                    record = self.fold_tensor(op, "input", position, tuple(given) if given else None, mesh)
                inputs.append(record)
            outputs = []
            for position in range(len(op.outputs)):
                placements, out_mesh = self._output_placements(op, position, layout, mesh, placed)
                placed[(op.index, position)] = (placements, out_mesh)
                outputs.append(self.fold_tensor(op, "output", position, placements, out_mesh))
            kept[op.index] = len(folded)
            folded.append(OpRecord(
                index=len(folded), id=op.id, name=op.name, phase=op.phase, module=op.module,
                module_call=op.module_call, module_stack=op.module_stack, step=op.step, rank=op.rank,
                inputs=inputs, outputs=outputs, stack=op.stack, layout=op.layout))
        # A partial value takes the statistics of the collective that reduced it.
        for (index, position), collective in partial_results.items():
            if index in kept:
                target = folded[kept[index]].outputs[position]
                result = self._collective_result(collective)
                if result is not None and result.shape == target.shape:
                    target.stats = result.stats
        for op in folded:
            for t in op.inputs:
                if t.source is not None:
                    produced = folded[t.source[0]].outputs[t.source[1]]
                    t.shape, t.stats = produced.shape, produced.stats
        return LogicalStep(self.step, folded, len(ops) - len(folded), self.findings)

    def _output_placements(self, op: OpRecord, position: int, layout: dict[str, Any] | None,
                           mesh: Mesh | None, placed: dict) -> tuple[Placements, Mesh | None]:
        if layout is not None and position < len(layout["out"]) and layout["out"][position] is not None:
            return tuple(layout["out"][position]), mesh
        ndim = len(op.outputs[position].shape)
        for t in op.inputs:  # a plain op: its first placed input's placements
            known = placed.get(t.source) if t.source is not None else None
            if known is None or known[0] is None or known[1] is None:
                continue
            placements, known_mesh = known
            if all(p == "R" for p in placements):
                continue
            producer_ndim = len(self._output_shape(t.source))
            if producer_ndim == ndim:
                return placements, known_mesh
        peers = self._peers(op)
        records = [p.outputs[position] for p in peers.values() if position < len(p.outputs)]
        if len(records) > 1 and ndim and all(r.shape == records[0].shape for r in records) \
                and any(_stats_differ(r.stats, records[0].stats) for r in records[1:]):
            return ("S(0)",), ((len(self.ranks),), tuple(self.ranks))
        return None, None

    def _output_shape(self, source: tuple[int, int]) -> tuple[int, ...]:
        return self.ops[self.lead][source[0]].outputs[source[1]].shape

    def _collective_result(self, op: OpRecord) -> TensorRecord | None:
        """The whole value a collective's first output holds: shards after a reduce-scatter,
        the one value every rank of its group holds otherwise."""
        ranks = tuple(op.group["ranks"]) if op.group and op.group.get("ranks") else tuple(self.ranks)
        mesh = ((len(ranks),), ranks)
        placements = ("S(0)",) if "reduce_scatter" in op.name else ("R",)
        return self.fold_tensor(op, "output", 0, placements, mesh)


def _plan(run: Run) -> tuple:
    """The run's parallel layout, as far as compare needs it: its ranks and the placements its
    lead rank's first step recorded (op id -> results' placements)."""
    if not run.ranks:
        return ((), ())
    rank = run.ranks[0]
    steps = run.steps_of(rank)
    ops = run.ops(steps[0], rank) if steps else []
    placed = tuple((op.id, str(op.layout["mesh"]), str(op.layout["out"]))
                   for op in ops if op.layout is not None)
    return tuple(run.ranks), placed


def _computes_on_shards(plan: tuple) -> bool:
    """Whether forward ops ran on DTensors (tensor parallelism): a collective there carries one
    rank's difference into the others' values, so even twin plans are compared folded, where
    the difference enters at the op of the rank that made it. FSDP2's DTensor ops (the
    optimizer's on its sharded parameters) leave the compute rank by rank."""
    return any(op_id.startswith("forward:") for op_id, _, _ in plan[1])


def fold_step(run: Run, step: int) -> LogicalStep:
    """One step of ``run`` as logical ops (see the module docstring); ranks that lack the step
    are left out."""
    ranks = [rank for rank in run.ranks if run.has_step(step, rank)]
    if not ranks:
        raise ProbeError(f"{str(run.path)!r} has no rank with step {step}")
    return _Folder(run, step, ranks).fold()


class LogicalRun:
    """A run seen as one process computing whole tensors: ``ops(step)`` are its logical ops
    (folded once per step), under its lowest rank; it holds no dump (dumps are not folded).
    Everything else is the run's own."""

    def __init__(self, run: Run) -> None:
        self.run = run
        self.lead = run.ranks[0]
        self._steps: dict[int, LogicalStep] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.run, name)

    @property
    def path(self) -> Path:
        return self.run.path

    @property
    def ranks(self) -> list[int]:
        return [self.lead]

    def steps_of(self, rank: int) -> list[int]:
        return sorted(set.intersection(*(set(self.run.steps_of(r)) for r in self.run.ranks)))

    @property
    def steps(self) -> list[int]:
        return self.steps_of(self.lead)

    def logical_step(self, step: int) -> LogicalStep:
        if step not in self._steps:
            self._steps[step] = fold_step(self.run, step)
        return self._steps[step]

    def ops(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]:
        step = self.steps[0] if step is None else step
        return self.logical_step(step).ops

    def has_dump(self, step: int | None = None, rank: int | None = None) -> bool:
        return False

    def findings(self) -> list[ReplicaFinding]:
        """Replicas that disagree, over every step (folding each)."""
        return [f for step in self.steps for f in self.logical_step(step).findings]


def logical_pair(run_a: Run, run_b: Run) -> tuple[Run, Run]:
    """The two runs to compare op by op: both folded into logical ops when their layouts differ
    (other ranks, or other placements: another parallel plan; a single-process run folds to
    itself) or when they compute on shards (tensor parallelism), else as they are, rank by rank
    (DDP, FSDP2 twins: each rank against its twin)."""
    try:
        plan_a, plan_b = _plan(run_a), _plan(run_b)
    except ProbeError:  # a damaged first step: compared rank by rank, where it is reported
        return run_a, run_b
    if plan_a == plan_b and not _computes_on_shards(plan_a):
        return run_a, run_b
    return LogicalRun(run_a), LogicalRun(run_b)  # type: ignore[return-value]


def layout_notes(run_a: Run, run_b: Run) -> list[str]:
    """What :func:`compare` says of folded runs: each replica that disagrees (the first few)."""
    notes = []
    for label, run in (("A", run_a), ("B", run_b)):
        if isinstance(run, LogicalRun) and len(run.run.ranks) > 1:
            found = run.findings()
            notes += [f"run {label}: replicas disagree: {f.describe()}" for f in found[:5]]
            if len(found) > 5:
                notes.append(f"run {label}: {len(found) - 5} more replicas disagree")
    return notes
