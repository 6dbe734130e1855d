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

Data parallelism (DDP, FSDP2, FSDP2 x TP) is one more mesh dim: ranks in other tensor-parallel
groups (each rank its own group without TP) compute on other slices of the batch. On that dim
the data from outside the step are sharded along dim 0 where the ranks differ, and local ops
move the shard by their shapes (``probe.analysis.local_placements``); a gradient there (what
backward computes from the loss's, not from forward values alone) is the data-parallel degree
times its slice of the logical gradient (each rank's loss is its own slice's mean, what DDP's
and FSDP2's averaging assume), a weight's gradient a partial value until its reduction. The
loss's gradient before it meets a forward value (a loss written by hand: a mean's backward
``expand`` and ``div``) is one number per rank: broadcast, it is placed as the input of the
forward reduction it undoes; it is scaled where divided by a count of the rank's slice.
DDP's ``module.`` level is dropped from names; FSDP2's copy-in/out and buffer ops are layout
changes; a strided shard (``_S``) folds as a shard. DTensor's
``from_local``/``to_local`` views are layout changes too, and the ids of the ops kept are
counted without the ops dropped.

Hand-written tensor parallelism (Megatron-style column- and row-parallel layers on plain
tensors, ``torch.distributed.all_reduce``, no DTensor) records no layout: a user mapping,
``partitions`` (module -> ``"colwise"``, ``"rowwise"`` or the weight's sharded dim), says it
(:func:`normalize_partitions`). Every rank is then one tensor-parallel group; an input from
outside the step that a mapped module's op reads and the ranks hold different values of is
that module's parameter, placed as the mapping says (colwise: ``S(0)`` for the weight and the
bias, the output's last dim sharded through the matrix product; rowwise: ``S(1)`` for the
weight, the product a partial sum that the module's all-reduce resolves, the bias
replicated); the rest follows by the shape rules, as for the ops between DTensor's modules.
A run that all-reduces forward values outside DTensor, folded without the mapping, is refused
with a message that names the option (:class:`MissingPartitions`).

A run of one rank without layouts folds to itself. Dumps fold by the same placements
(:mod:`probe.analysis.folded_dumps`: ``LogicalRun.dump``, ``LogicalRun.tensor``); an op whose
output is a partial sum its inputs are not is recorded (:attr:`LogicalStep.partial_sums`), for
compare's "reduction order" rule. What is not folded yet: per-tensor distributions and
histograms; see ``docs/distributed.md``.
"""

from __future__ import annotations

import fnmatch
import math
from collections import Counter
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import networkx as nx
import torch

from probe.analysis.folded_dumps import FoldedPiece, LogicalDump
from probe.analysis.local_placements import base_name, local_placement, shard_dim
from probe.analysis.overwrites import overwritten_inputs
from probe.errors import ProbeError
from probe.rundir.op_graph import build_graph
from probe.rundir.records import frame_module
from probe.rundir.run import OpRecord, Run, TensorRecord
from probe.vocabulary.rounding import ROUNDING_ULPS, eps

_PASS_THROUGH = frozenset({"_c10d_functional.wait_tensor.default",
                           "_c10d_functional._wrap_tensor_autograd.default"})
_ALIASES = frozenset({"view", "alias", "_unsafe_view"})
"""Ops that can be DTensor's ``from_local``/``to_local`` view of a whole local tensor."""
_UNSHARDED_VIEWS = _ALIASES | {"as_strided", "detach"}
"""Ops by which FSDP2 makes its unsharded parameter of the all-gathered buffer (under tensor
parallelism, DTensor's ``detach`` of the local tensor, labelled with the parameter's layout)."""
_COUNTS = ("nan", "inf", "posinf", "neginf", "zeros")

Placements = tuple[str, ...] | None
Mesh = tuple[tuple[int, ...], tuple[int, ...]]
"""(mesh shape, global ranks in mesh order)."""

Partitions = dict[str, int]
"""Module FQN (or glob) -> the dim of its weight that hand-written tensor parallelism shards."""
_PARTITION_NAMES = {"colwise": 0, "column": 0, "rowwise": 1, "row": 1}


def normalize_partitions(partitions: Mapping[str, str | int] | None) -> Partitions:
    """``partitions`` as module -> the weight's sharded dim: ``"colwise"`` (output features:
    the weight's dim 0, the bias sharded too, the output's last dim), ``"rowwise"`` (input
    features: the weight's dim 1, the output a partial sum until its all-reduce, the bias
    whole), or that dim as an int. Module names may be globs (``layers.*.mlp.up_proj``).
    Raises :class:`ProbeError` naming the option and the accepted values."""
    if partitions is None:
        return {}
    if not isinstance(partitions, Mapping):
        raise ProbeError(f"partitions must be a dict module -> 'colwise' | 'rowwise' | dim, "
                         f"got {partitions!r}")
    out: Partitions = {}
    for module, value in partitions.items():
        dim = _PARTITION_NAMES.get(value.lower()) if isinstance(value, str) else \
            value if type(value) is int and value >= 0 else None
        if not isinstance(module, str) or not module or dim is None:
            raise ProbeError(f"partitions: {module!r}: {value!r} is not a partition; accepted: 'colwise', "
                             "'rowwise' or the weight's sharded dim (0, 1, ...), for a module name or glob")
        out[module] = dim
    return out


def partition_of(partitions: Partitions, module: str) -> int | None:
    """The weight's sharded dim the mapping gives ``module`` (an exact name first, then globs)."""
    if not partitions or not module:
        return None
    if module in partitions:
        return partitions[module]
    return next((dim for pattern, dim in partitions.items() if fnmatch.fnmatchcase(module, pattern)), None)


def _parameter_placement(dim: int, ndim: int, agree: bool) -> str:
    """The placement of a mapped module's parameter of ``ndim`` dims on the tensor-parallel
    mesh dim: a weight sharded along ``dim``; a bias sharded with a colwise weight's rows (even
    where the shards agree: a zero-initialised bias), else whole."""
    if ndim >= 2:
        return f"S({dim})" if not agree else "R"
    if ndim == 1 and dim == 0:
        return "S(0)"
    return "R" if agree else "?"


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
    mesh_shape: tuple[int, ...] = (1,)
    pieces: dict[tuple[int, str, int], FoldedPiece | str] = field(default_factory=dict)
    """(logical op index, io, position) -> how its data folds from the ranks' dumps, or why it
    does not (:mod:`probe.analysis.folded_dumps`)."""
    origins: dict[int, int] = field(default_factory=dict)
    """Logical op index -> the lead rank's op index it was folded from."""
    partial_sums: dict[tuple[int, int], int] = field(default_factory=dict)
    """(logical op index, output position) -> how many partial sums the ranks computed it in:
    a sum or contraction whose terms the ranks split (TP's row-parallel product, a
    data-parallel rank's weight gradient), reduced by a collective or folded in fp64. Its
    order of summation is not a single process's."""


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


def _world(ops: dict[int, list[OpRecord]], ranks: list[int],
           hand_sharded: bool = False) -> tuple[Mesh, tuple[int, ...]]:
    """The mesh of every rank of the step, and its data-parallel dims (none when all ranks see
    one batch). Each rank's tensor-parallel group is the mesh of its forward DTensor ops (itself
    without); ranks in other groups compute on other slices of the batch (DDP, FSDP2, FSDP2 x
    TP): the mesh is (groups, group size), or (ranks,) when no rank has a group, or, when no
    rank has a group and DTensor ops (the optimizer's on HSDP's parameters) ran on a mesh of
    several dims over every rank, that mesh, each of its dims data-parallel. ``hand_sharded``
    (a partitions mapping applies, and no rank has a DTensor group): every rank is one
    tensor-parallel group, on one batch."""
    groups = {rank: next((tuple(op.layout["mesh"]["ranks"]) for op in ops[rank] if op.layout is not None
                          and op.phase == "forward" and len(op.layout["mesh"]["shape"]) == 1), (rank,))
              for rank in ranks}
    distinct = sorted(set(groups.values()))
    if hand_sharded and all(len(group) == 1 for group in distinct):
        return ((len(ranks),), tuple(ranks)), ()
    if len(distinct) == 1:
        return ((len(distinct[0]),), distinct[0]), ()
    flat = tuple(r for group in distinct for r in group)
    if len({len(g) for g in distinct}) != 1 or sorted(flat) != sorted(ranks):
        return ((len(ranks),), tuple(ranks)), ()  # groups that do not tile the ranks: as before
    if len(distinct[0]) == 1:
        meshes = {(tuple(op.layout["mesh"]["shape"]), tuple(op.layout["mesh"]["ranks"]))
                  for op in ops[ranks[0]] if op.layout is not None and len(op.layout["mesh"]["shape"]) > 1}
        hybrid = [mesh for mesh in meshes if sorted(mesh[1]) == sorted(ranks)]
        if len(hybrid) == 1:  # HSDP: (replicate, shard), every rank its own slice of the batch
            return hybrid[0], tuple(range(len(hybrid[0][0])))
        return ((len(flat),), flat), (0,)
    return ((len(distinct), len(distinct[0])), flat), (0,)


World = tuple[str, ...]
"""Placements of a value over the step's mesh, one per mesh dim: ``S(d)``, ``R``, ``P(sum)``,
``P(avg)``, ``P(other)``, or ``?`` (not known: nothing is claimed of it)."""


class _Folder:
    """Folds one step of a run; the lead rank's records give the order, ids and modules."""

    def __init__(self, run: Run, step: int, ranks: list[int],
                 partitions: Partitions | None = None) -> None:
        self.step = step
        self.partitions = partitions or {}
        self._values: dict[tuple, World] = {}
        """Outputs kept so far, by shape and statistics on every rank -> their placements."""
        self.lead = ranks[0]
        self.ranks = ranks
        self.ops = {rank: run.ops(step, rank) for rank in ranks}
        self.by_id = {rank: {op.id: op for op in ops} for rank, ops in self.ops.items()}
        self.findings: list[ReplicaFinding] = []
        self._pieces: dict[int, tuple[TensorRecord, FoldedPiece | str | None]] = {}
        self.mesh, self.dp = _world(self.ops, ranks, bool(self.partitions) and any(
            partition_of(self.partitions, op.module) is not None for op in self.ops[self.lead]))
        self.coords = _coordinates(self.mesh)
        self.unwrap = _ddp_wrapped(run, step, self.lead)
        lead_ops = self.ops[self.lead]
        self.seeds = {op.index for k, op in enumerate(lead_ops)
                      if op.phase == "backward" and (k == 0 or lead_ops[k - 1].phase != "backward")}
        """The first op of each backward pass (the loss's backward, reading autograd's seed)."""
        self._numbers: set[tuple[int, int]] = set()
        """Values (lead index, position) that are numbers on each rank: forward's replicated
        scalars (autograd's seed, a loss scale) and what the loss's backward makes of them alone,
        one number in every element (:meth:`_loss_gradient`)."""
        self._local_counts: dict[int, set[int]] = {}
        """Rank -> the element counts of its slices of the batch: the numel and the sharded dim's
        size of each value it holds a data-parallel shard of (what a mean over its slice divides by)."""
        self._reductions: dict[tuple[tuple[int, ...], int], dict[int, set[str]]] = {}
        """Forward reductions, (input shape, output numel) -> data-parallel dim -> the placements
        of their input there: where the backward broadcasts a replicated gradient back to."""

    def _peers(self, op: OpRecord) -> dict[int, OpRecord]:
        return {rank: found for rank in self.ranks if (found := self.by_id[rank].get(op.id)) is not None}

    def _records(self, op: OpRecord, io: str, position: int) -> dict[int, TensorRecord]:
        out = {}
        for rank, peer in self._peers(op).items():
            tensors = peer.outputs if io == "output" else peer.inputs
            if position < len(tensors):
                out[rank] = tensors[position]
        return out

    def _agree_along(self, records: dict[int, TensorRecord], dim: int) -> bool:
        """Whether ranks that differ only in their coordinate on mesh ``dim`` hold equal statistics."""
        first: dict[tuple, TensorRecord] = {}
        for rank in self.mesh[1]:
            if rank not in records:
                continue
            key = self.coords[rank][:dim] + self.coords[rank][dim + 1:]
            if key not in first:
                first[key] = records[rank]
            elif records[rank].shape != first[key].shape \
                    or _stats_differ(records[rank].stats, first[key].stats):
                return False
        return True

    def _mesh_dims(self, layout_mesh: dict[str, Any]) -> list[int] | None:
        """The step mesh's dim for each dim of a DTensor op's mesh (seen from the lead rank), or None."""
        ranks, shape = tuple(layout_mesh["ranks"]), tuple(layout_mesh["shape"])
        if ranks == self.mesh[1] and shape == self.mesh[0]:
            return list(range(len(shape)))
        if len(shape) == 1:
            for dim in range(len(self.mesh[0])):
                if ranks == self._group_along(dim):
                    return [dim]
        return None

    def _group_along(self, dim: int) -> tuple[int, ...]:
        """The lead rank and the ranks that differ from it only on mesh ``dim``, in order."""
        mine = self.coords[self.lead]
        others = [k for k in range(len(mine)) if k != dim]
        return tuple(r for r in self.mesh[1] if all(self.coords[r][k] == mine[k] for k in others))

    def _given(self, layout: dict[str, Any] | None, io: str, position: int) -> list[str | None]:
        """What the DTensor op's layout says of one tensor on each step mesh dim (None: nothing)."""
        given: list[str | None] = [None] * len(self.mesh[0])
        key = "out" if io == "output" else "in"
        if layout is None or position >= len(layout[key]) or layout[key][position] is None:
            return given
        dims = self._mesh_dims(layout["mesh"])
        if dims is None:
            return ["?"] * len(given)
        for placement, dim in zip(layout[key][position], dims, strict=False):
            given[dim] = placement
        return given

    def fold_tensor(self, op: OpRecord, io: str, position: int, placements: World,
                    scaled: bool = False, replicas: bool = False) -> TensorRecord:
        """One tensor of ``op`` folded over the ranks by its placements; ``scaled``: a gradient
        on the data-parallel dim, where each rank's loss is its own slice's mean: the rank holds
        the data-parallel degree times its slice of the logical gradient (on the dims where it
        is not replicated: a replicated gradient is one a collective averaged); ``replicas``:
        the loss's gradient before any collective (``sum / n``'s), scaled where replicated too."""
        records = self._records(op, io, position)
        lead = records[self.lead]
        blank = TensorRecord(lead.dtype, lead.shape, None, mutated=lead.mutated)
        if any(rank not in records for rank in self.mesh[1]):
            return self._with_piece(blank, "a rank did not record it")
        sharded = {k: d % max(len(lead.shape), 1) for k, p in enumerate(placements)
                   if (d := shard_dim(p)) is not None}
        partial = [k for k, p in enumerate(placements) if p.startswith("P")]
        replicated = [k for k, p in enumerate(placements) if p == "R"]
        if len(sharded) + len(partial) + len(replicated) != len(placements):
            return self._with_piece(blank, "its placement over the ranks is not known")  # nothing is claimed
        contributing = [r for r in self.mesh[1] if all(self.coords[r][k] == 0 for k in replicated)]
        for rank in self.mesh[1]:  # replicas: each rank against the contributing rank of its coordinates
            if rank in contributing:
                continue
            reference = next(r for r in contributing
                             if all(self.coords[r][k] == self.coords[rank][k] for k in (*sharded, *partial)))
            differs = _stats_differ(records[rank].stats, records[reference].stats)
            if differs is not None:
                self.findings.append(ReplicaFinding(
                    self.step, op.id, io, position, rank, reference, differs,
                    records[rank].stats[differs], records[reference].stats[differs]))  # type: ignore[index]
        shape = list(lead.shape)
        for dim in set(sharded.values()):
            along = [k for k, d in sharded.items() if d == dim]
            shape[dim] = sum(records[r].shape[dim] for r in contributing
                             if all(self.coords[r][k] == 0 for k in (*sharded, *partial) if k not in along))
        if partial and (math.prod(lead.shape) != 1 or any(placements[k] == "P(other)" for k in partial)):
            stats = None  # a partial tensor is known once a collective reduces it
        elif partial:
            stats = _partial_scalar([records[r].stats for r in contributing],
                                    math.prod(self.mesh[0][k] for k in partial if placements[k] == "P(avg)"))
        else:
            stats = combine_stats([(records[r].stats, records[r].shape) for r in contributing])
        degree = math.prod(self.mesh[0][d] for d in self.dp if placements[d] != "R" or replicas)
        if scaled and stats is not None and degree > 1:
            stats = _scaled(stats, 1 / degree)
        out = TensorRecord(lead.dtype, tuple(shape), stats, mutated=lead.mutated)
        if any(placements[k] == "P(other)" for k in partial):
            return self._with_piece(out, "a partial value of a reduction other than a sum")
        return self._with_piece(out, self._piece(op, io, position, placements, tuple(shape),
                                                 1 / degree if scaled and degree > 1 else 1.0))

    def _piece(self, op: OpRecord, io: str, position: int, placements: World, shape: tuple[int, ...],
               factor: float = 1.0) -> FoldedPiece:
        """How ``op``'s tensor folds from the ranks' dumps of it, by ``placements``."""
        sources = tuple((rank, self.by_id[rank][op.id].index) for rank in self.mesh[1])
        dtype = (op.outputs if io == "output" else op.inputs)[position].dtype
        return FoldedPiece(io, position, sources, tuple(placements), shape, dtype, factor)

    def _with_piece(self, record: TensorRecord, piece: FoldedPiece | str | None) -> TensorRecord:
        """``record``, with how its data folds from the ranks' dumps (a reason when it does not;
        None: not known)."""
        self._pieces[id(record)] = (record, piece)  # the record is kept: its id is not reused
        return record

    def _piece_of(self, record: TensorRecord) -> FoldedPiece | str | None:
        found = self._pieces.get(id(record))
        return found[1] if found is not None and found[0] is record else None

    def _same_data(self, record: TensorRecord, source: TensorRecord) -> TensorRecord:
        """``record`` holds the data of ``source`` (in its own shape: the same elements)."""
        piece = self._piece_of(source)
        if isinstance(piece, FoldedPiece):
            piece = replace(piece, shape=tuple(record.shape))
        return self._with_piece(record, piece)

    def _transposed(self, read: TensorRecord, output: TensorRecord) -> TensorRecord:
        """A transpose (``t``) of which no rank recorded statistics or data (FSDP2's unsharded
        parameter in its first step, which the recording takes for a view of memory nothing
        wrote): the elements it read, transposed."""
        piece = self._piece_of(read)
        out = TensorRecord(output.dtype, output.shape, read.stats, mutated=output.mutated)
        if isinstance(piece, FoldedPiece) and piece.shape == tuple(reversed(output.shape)):
            piece = replace(piece, shape=tuple(output.shape), transposed=not piece.transposed)
            return self._with_piece(out, piece)
        return self._with_piece(out, self._piece_of(output))

    def _fingerprint(self, records: dict[int, TensorRecord]) -> tuple | None:
        """Shape and statistics of a tensor on every rank (None where a rank lacks them)."""
        if any(rank not in records or records[rank].stats is None for rank in self.ranks):
            return None
        keys = ("min", "max", "mean", "norm")
        return tuple((records[r].shape, *(records[r].stats.get(k) for k in keys))  # type: ignore[union-attr]
                     for r in self.ranks)

    def _remember(self, op: OpRecord, position: int, placements: World) -> None:
        """Index a kept output by its shape and statistics on every rank (see :meth:`_outside`)."""
        key = self._fingerprint(self._records(op, "output", position))
        if key is not None and "?" not in placements and len(self.ranks) > 1:
            self._values[key] = placements

    def _outside(self, op: OpRecord, position: int) -> World:
        """Placements of an input from outside the step (a weight, the data), by the DTensor op's
        layout where it has one; on a dim it does not cover, replicated if the ranks agree, else
        (on the data-parallel dim) each rank's slice of the batch, along dim 0."""
        given = self._given(op.layout, "input", position)
        records = self._records(op, "input", position)
        partition = partition_of(self.partitions, op.module) if op.layout is None else None
        if partition is not None:
            earlier = self._values.get(self._fingerprint(records))
            if earlier is not None:
                # A value this step made, read where the recording lost its producer (a
                # weight's transpose made in an earlier step, the same view read again).
                return earlier
        out = []
        for dim, placement in enumerate(given):
            if placement is None and dim in self.dp and all(r.stats is None for r in records.values()):
                placement = "?"  # a buffer nothing wrote, or a value not recorded
            elif placement is None and partition is not None and dim not in self.dp:
                # A module sharded by hand: the ranks' own values of what it reads from
                # outside are its parameter's shards (its input is the same on every rank).
                placement = _parameter_placement(partition, len(op.inputs[position].shape),
                                                 self._agree_along(records, dim))
            elif placement is None:
                agree = self._agree_along(records, dim)
                placement = "R" if agree else "S(0)" if dim in self.dp else "?"
            out.append(placement)
        return tuple(out)

    def _infer(self, op: OpRecord, position: int, given: list[str | None],
               inputs: list[tuple[World, bool]], loss_gradient: bool = False) -> tuple[World, bool]:
        """An output's placements: the layout's where it has them, else from the inputs'
        (``local_placements``); whether it is a scaled gradient (see :meth:`fold_tensor`).
        ``loss_gradient``: ``op`` is in the loss's backward and reads only the loss's gradient
        made of the seed and numbers (see :meth:`_loss_gradient`)."""
        records = self._records(op, "output", position)
        out_shape = op.outputs[position].shape
        shapes = [t.shape for t in op.inputs]
        placements: list[str] = []
        scaled = any(s for _, s in inputs)
        # The loss's gradient before it meets a forward value is one number on each rank: it is
        # scaled where it is divided by the rank's own count (a mean's backward, ``sum / n``),
        # not where it is only broadcast or negated.
        numbers = loss_gradient and all(_constant(r) is not None for r in records.values())
        divides = bool(self.dp) and self._divides_by_local_count(op)
        for dim, placement in enumerate(given):
            if placement is None:
                found = local_placement(op.name, shapes, [p[dim] for p, _ in inputs], out_shape)
                if found == "R" and loss_gradient and dim in self.dp:
                    found = self._broadcast_back(op, position, dim) or found
                elif found == "P(sum)" and divides:
                    found = "P(avg)"  # a sum over the slice divided by its count: the slice's mean
                agree = self._agree_along(records, dim)
                if found is None or (found.startswith("P") and agree):
                    found = "R" if agree else "?"
                elif found == "R" and not agree:
                    # Replicated inputs by the rules (buffers without statistics, FSDP2's
                    # copy-in of each rank's shard), unequal results: not known.
                    found = "?"
                if dim in self.dp and numbers:
                    scaled = scaled or divides
                elif dim in self.dp and op.index in self.seeds and found != "R":
                    # The local loss's gradient: the rank's own slice's mean. What backward
                    # computes from it is scaled too (through the inputs); what it computes
                    # from forward values alone (a saved activation's transpose) is not.
                    scaled = True
                placement = found
            placements.append(placement)
        return tuple(placements), scaled

    def _broadcast_back(self, op: OpRecord, position: int, dim: int) -> str | None:
        """The placement on data-parallel mesh ``dim`` of the loss's replicated gradient
        broadcast back over the elements a forward reduction summed (a mean's or a sum's
        backward ``expand``): that reduction's input's; ``?`` where reductions of that shape
        had inputs placed otherwise; None: not such a broadcast."""
        out = op.outputs[position].shape
        read = max((_numel(t.shape) for t in op.inputs), default=1)
        if _numel(out) <= read:
            return None
        found = self._reductions.get((tuple(out), read), {}).get(dim, set())
        if len(found) > 1:
            return "?"
        return next(iter(found), None)

    def _divides_by_local_count(self, op: OpRecord) -> bool:
        """Whether ``op`` (a ``div`` or ``mul`` of one tensor by a number, every element of its
        input and of its result one number on each rank: a scalar, or the loss's gradient)
        divides by the rank's own count of the batch's elements: the numel, or the size along
        the sharded dim, of a value it holds a slice of, on every rank, within rounding."""
        if base_name(op.name) not in ("div", "mul") or len(op.inputs) != 1 or len(op.outputs) != 1:
            return False
        dtype = getattr(torch, op.outputs[0].dtype, None)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            return False
        inputs, outputs = self._records(op, "input", 0), self._records(op, "output", 0)
        for rank in self.ranks:
            before = _constant(inputs.get(rank))
            after = _constant(outputs.get(rank))
            if before is None or after is None or after == 0.0:
                return False
            ratio = abs(before / after)
            count = round(ratio)
            if count < 2 or abs(ratio - count) > ROUNDING_ULPS * eps(dtype) * count \
                    or count not in self._local_counts.get(rank, set()):
                return False
        return True

    def _note_forward(self, op: OpRecord, known: list[tuple[World, bool]], placed: list[World]) -> None:
        """What the loss's backward is folded by: each rank's counts of its slice of the batch
        (:attr:`_local_counts`), and the reductions (:attr:`_reductions`); ``known``: the
        placements of ``op``'s inputs, ``placed``: of its outputs."""
        for position, placements in enumerate(placed):
            for dim in self.dp:
                d = shard_dim(placements[dim])
                if d is None:
                    continue
                for rank, record in self._records(op, "output", position).items():
                    if record.shape:
                        counts = self._local_counts.setdefault(rank, set())
                        counts.update((_numel(record.shape), record.shape[d % len(record.shape)]))
        if op.inputs and known and op.outputs and _numel(op.outputs[0].shape) < _numel(op.inputs[0].shape):
            key = (tuple(op.inputs[0].shape), _numel(op.outputs[0].shape))
            by_dim = self._reductions.setdefault(key, {})
            for dim in self.dp:
                if known[0][0][dim] != "?":
                    by_dim.setdefault(dim, set()).add(known[0][0][dim])

    def _loss_gradient(self, op: OpRecord, sources: list[tuple[int, int] | None]) -> bool:
        """Whether ``op`` computes the loss's gradient from autograd's seed and numbers alone: the
        first op of a backward pass, or a backward op reading only numbers (``sources``: its
        inputs' producers; :attr:`_numbers`)."""
        if op.phase != "backward" or not op.inputs:
            return False
        return op.index in self.seeds or all(s in self._numbers for s in sources)

    def fold(self) -> LogicalStep:
        ops = self.ops[self.lead]
        kept: dict[int, int] = {}  # lead index -> logical index
        back: dict[int, tuple[int, int] | None] = {}  # dropped index -> the value it moved
        placed: dict[tuple[int, int], tuple[World, bool]] = {}
        folded: list[OpRecord] = []
        partial_results: dict[tuple[int, int], OpRecord] = {}
        external: dict[int, OpRecord] = {}  # dropped op -> itself, when it moved a value from outside
        layout_changes: dict[tuple[int, int], TensorRecord] = {}  # outputs of FSDP2's buffer ops, folded
        # A layout change's output (or a buffer FSDP2 filled) -> the op output whose statistics
        # hold its elements: the all-gather's copy-out that filled it (see :meth:`_unsharded`).
        filled_by: dict[tuple[int, int], tuple[OpRecord, int]] = {}
        reduced_in_place: dict[tuple[int, int], OpRecord] = {}  # value -> the collective reducing it in place
        origins: dict[int, int] = {}  # logical index -> lead index
        reshaped_reads: set[tuple[int, int]] = set()  # (logical index, input) reading its producer reshaped
        partial_sums: dict[tuple[int, int], int] = {}

        def value_of(source: tuple[int, int] | None) -> tuple[int, int] | None:
            seen = 0
            while source is not None and source[0] in back and seen < 64:
                source, seen = back[source[0]], seen + 1
            return source

        read_by_dtensor_ops = {t.source[0] for op in ops if op.layout is not None for t in op.inputs
                               if t.source is not None}
        dropped: Counter[str] = Counter()  # id without its count -> layout changes dropped so far
        completing = self._completions(ops)

        for op in ops:
            layout = op.layout
            if op.index in completing:
                # A backend's own ops that finish a collective (gloo's emulated reduce-scatter:
                # the split of the reduced input, the copy_ of this rank's chunk into the output):
                # part of the collective's layout change; its result is the collective's value.
                dropped[op.id.rsplit(":", 1)[0]] += 1
                collective = completing[op.index]
                back[op.index] = back.get(collective) if collective is not None else None
                continue
            if (layout is not None and layout["role"] == "redistribute") or op.group is not None \
                    or op.name in _PASS_THROUGH or self._wraps(op, ops, read_by_dtensor_ops):
                dropped[op.id.rsplit(":", 1)[0]] += 1
                moved = value_of(op.inputs[0].source) if op.inputs else None
                back[op.index] = moved
                if op.inputs and op.inputs[0].source is None:
                    external[op.index] = op
                if moved is not None and op.group is not None and op.outputs and op.outputs[0].mutated:
                    reduced_in_place.setdefault(moved, op)
                if moved is not None and op.group is not None and op.outputs:
                    producer = placed.get(moved)
                    if producer is not None and any(p.startswith("P") for p in producer[0]):
                        partial_results.setdefault(moved, op)  # the collective that reduces it
                continue
            inputs = []
            known: list[tuple[World, bool]] = []
            for position, t in enumerate(op.inputs):
                source = value_of(t.source)
                if source is not None and source[0] in kept \
                        and self._output_shape(source) == t.shape:  # else an alias of other storage
                    given = self._given(layout, "input", position)
                    placement, scaled = placed[source]
                    if "?" in placement and None not in given and "?" not in given:
                        # Not known at its producer (FSDP2's gradient views after the
                        # reduce-scatter); the DTensor op that reads it says.
                        placement, scaled = tuple(given), False  # type: ignore[arg-type]
                        produced = folded[kept[source[0]]]
                        produced.outputs[source[1]] = self.fold_tensor(
                            ops[source[0]], "output", source[1], placement)
                        placed[source] = (placement, scaled)
                    inputs.append(TensorRecord(t.dtype, t.shape, None, source=(kept[source[0]], source[1])))
                    known.append((placement, scaled))
                    continue
                if source is not None and source[0] in kept \
                        and math.prod(self._output_shape(source)) == math.prod(t.shape):
                    # The producer's value read in another shape (a view the recording keys to
                    # the producer's storage): placed as a reshape of it, the same elements.
                    from_shape = self._output_shape(source)
                    placement = tuple("?" if p == "?" else
                                      local_placement("aten.view.default", [from_shape], [p], t.shape) or "?"
                                      for p in placed[source][0])
                    record = self.fold_tensor(op, "input", position, placement)
                    # Still the producer's value (as the run's own record says): computed in the
                    # step, not read from outside it.
                    record.source = (kept[source[0]], source[1])
                    reshaped_reads.add((len(folded), position))
                    inputs.append(record)
                    known.append((placement, placed[source][1]))
                    continue
                origin = external.get(t.source[0]) if t.source is not None else None
                moved_value = layout_changes.get(t.source) if t.source is not None else None
                if moved_value is not None and moved_value.stats is not None \
                        and math.prod(moved_value.shape) == math.prod(t.shape):
                    # FSDP2's unsharded parameter, a view of the all-gathered buffer it copied
                    # out: the same elements, read in this op's shape.
                    placement = placed[t.source][0]
                    record = TensorRecord(t.dtype, t.shape, moved_value.stats)
                    if all(p == "R" for p in placement):
                        # Its data as this op read it: FSDP2 refills the buffer outside any op
                        # (a re-gather for backward), after the layout change's dump.
                        self._with_piece(record, self._piece(op, "input", position, placement, t.shape))
                    else:
                        self._same_data(record, moved_value)
                elif (unsharded := self._unsharded(op, position, ops, back, filled_by, placed)) is not None:
                    placement, record = unsharded
                elif origin is not None:  # from outside, through a local redistribution: as it was
                    placement = self._outside(origin, 0)
                    record = self.fold_tensor(origin, "input", 0, placement)
                else:
                    placement = self._outside(op, position)
                    record = self.fold_tensor(op, "input", position, placement)
                inputs.append(record)
                known.append((placement, False))
            outputs = []
            loss_gradient = self._loss_gradient(op, [value_of(t.source) for t in op.inputs])
            for position in range(len(op.outputs)):
                placement, scaled = self._infer(op, position, self._given(layout, "output", position), known,
                                                loss_gradient)
                placed[(op.index, position)] = (placement, scaled)
                outputs.append(self.fold_tensor(op, "output", position, placement, scaled, loss_gradient))
                numbers = loss_gradient or (op.phase == "forward" and _numel(op.outputs[position].shape) == 1
                                            and all(p == "R" for p in placement))
                if numbers and all(_constant(r) is not None
                                   for r in self._records(op, "output", position).values()):
                    self._numbers.add((op.index, position))
            if op.inputs and op.outputs and "?" in known[0][0] and op.inputs[0].source is None \
                    and op.outputs[0].mutated and op.inputs[0].shape == op.outputs[0].shape \
                    and "?" not in placed[(op.index, 0)][0]:
                # What an in-place op wrote is its first input (an optimizer's update of a
                # parameter sharded by hand): the input is placed as the result is.
                inputs[0] = self.fold_tensor(op, "input", 0, placed[(op.index, 0)][0])
            if base_name(op.name) == "t" and len(op.inputs) == 1 and len(outputs) == 1 \
                    and outputs[0].stats is None \
                    and all(r.stats is None for r in self._records(op, "output", 0).values()):
                read = inputs[0].source
                outputs[0] = self._transposed(inputs[0] if read is None else folded[read[0]].outputs[read[1]],
                                              outputs[0])
            reduced = self._read_after_reduction(op, reduced_in_place, value_of, placed)
            if reduced is not None:
                placed[(op.index, 0)], outputs[0] = reduced
            unknown = [k for k in range(len(op.outputs)) if "?" in placed[(op.index, k)][0]
                       or op.outputs[k].stats is None]
            # FSDP2's unsharded parameter made of the all-gathered buffer (its first step: an
            # as_strided view, then under TP DTensor's detach), which the recording left without
            # statistics (a view of the buffer FSDP2 allocated, written through other views).
            unsharded_view = layout is not None and base_name(op.name) in _UNSHARDED_VIEWS and op.inputs \
                and op.inputs[0].source in filled_by and len(unknown) == len(op.outputs)
            if op.name.startswith("fsdp.") or unsharded_view or (layout is None and op.outputs
                                                                 and len(unknown) == len(op.outputs)):
                for position, record in enumerate(outputs):
                    layout_changes[(op.index, position)] = record
                self._note_filled(op, ops, filled_by)
                dropped[op.id.rsplit(":", 1)[0]] += 1
                # A buffer nothing wrote, or a value whose layout is not known (FSDP2's copy-in,
                # all-gather and reduce-scatter buffers and their views): a layout change, not
                # an op of the model; what reads it reads it as a value from outside.
                continue
            kept[op.index] = len(folded)
            origins[len(folded)] = op.index
            if op.phase == "forward" and self.dp:
                self._note_forward(op, known, [placed[(op.index, k)][0] for k in range(len(op.outputs))])
            for position in range(len(op.outputs)):
                self._remember(op, position, placed[(op.index, position)][0])
                parts = self._partial_sums(placed[(op.index, position)][0], known)
                if parts > 1:
                    partial_sums[(len(folded), position)] = parts
            # Counted as if the dropped ops were not there: ids count ops per module call,
            # phase and name, and a plan's layout changes (RowwiseParallel's div of its bias)
            # would shift the ids of the model's own ops of that name.
            base, count = op.id.rsplit(":", 1)
            op_id, module, stack = f"{base}:{int(count) - dropped[base]}", op.module, op.module_stack
            parameter = op.parameter
            if self.unwrap:
                op_id, module, stack = _unwrapped(op_id, op.module, op.module_stack)
                parameter = None if parameter is None else _unwrap_name(parameter)
            folded.append(OpRecord(
                index=len(folded), id=op_id, name=op.name, phase=op.phase, module=module,
                module_call=op.module_call, module_stack=stack, step=op.step, rank=op.rank,
                inputs=inputs, outputs=outputs, stack=op.stack, layout=op.layout, parameter=parameter))
        # A partial value takes the statistics of the collective that reduced it.
        for (index, position), collective in partial_results.items():
            if index in kept:
                target = folded[kept[index]].outputs[position]
                result = self._collective_result(collective, placed[(index, position)])
                if result is None or result.shape != target.shape:
                    continue
                target.stats = result.stats
                self._same_data(target, result)
                # A partial sum reshaped before its reduction (a 3-D linear's addmm, then its
                # view back): the reshape's input is the same partial value.
                source: tuple[int, int] | None = (index, position)
                while source is not None and base_name(ops[source[0]].name) in _ALIASES \
                        and ops[source[0]].inputs:
                    source = value_of(ops[source[0]].inputs[0].source)
                    if source is None or source[0] not in kept \
                            or not any(p.startswith("P") for p in placed[source][0]):
                        break
                    earlier = folded[kept[source[0]]].outputs[source[1]]
                    if earlier.stats is not None or math.prod(earlier.shape) != math.prod(target.shape):
                        break
                    earlier.stats = result.stats
                    self._same_data(earlier, result)
        _adopt_detached_gradients(folded)
        pieces: dict[tuple[int, str, int], FoldedPiece | str] = {}
        for op in folded:
            for position, t in enumerate(op.outputs):
                pieces[(op.index, "output", position)] = self._piece_of(t) or "not folded"
        for op in folded:
            for position, t in enumerate(op.inputs):
                if t.source is not None:
                    produced = folded[t.source[0]].outputs[t.source[1]]
                    piece = pieces[(t.source[0], "output", t.source[1])]
                    if (op.index, position) in reshaped_reads:
                        t.stats = produced.stats  # read in its own shape (placed as a reshape)
                        if isinstance(piece, FoldedPiece) and math.prod(t.shape) == math.prod(piece.shape):
                            piece = replace(piece, shape=tuple(t.shape))
                        elif isinstance(piece, FoldedPiece):
                            piece = "its placement over the ranks is not known"
                    else:
                        t.shape, t.stats = produced.shape, produced.stats
                    pieces[(op.index, "input", position)] = piece
                else:
                    pieces[(op.index, "input", position)] = self._piece_of(t) or "not folded"
        return LogicalStep(self.step, folded, len(ops) - len(folded), self.findings, self.mesh[0], pieces,
                           origins, partial_sums)

    def _completions(self, ops: list[OpRecord]) -> dict[int, int | None]:
        """The ops that complete a collective rather than compute (index -> the collective's
        index, None for the ops that only feed them): an op overwriting a collective's result
        (``copy_``'s destination, an ``out=`` argument) with the value the collective recorded
        as its result, on every rank (the backend filling the output it returned: a program's
        own write after a collective would change it), and the ops after the collective whose
        results only those completions read (the split that cuts this rank's chunk)."""
        completions: dict[int, int | None] = {}
        for op in ops:
            if op.group is not None:
                continue
            written_outputs = [k for k, t in enumerate(op.outputs) if t.mutated] or [0]
            for nth, position in enumerate(sorted(overwritten_inputs(op))):
                source = op.inputs[position].source
                if source is None or ops[source[0]].group is None or not op.outputs:
                    continue
                written = written_outputs[min(nth, len(written_outputs) - 1)]
                result = self._fingerprint(self._records(ops[source[0]], "output", source[1]))
                if result is not None and result == self._fingerprint(self._records(op, "output", written)):
                    completions[op.index] = source[0]
                    break
        readers: dict[int, set[int]] = {}
        for op in ops:
            for position, t in enumerate(op.inputs):
                if t.source is not None and position not in overwritten_inputs(op):
                    readers.setdefault(t.source[0], set()).add(op.index)
        for index, collective in list(completions.items()):
            assert collective is not None
            for feeder in range(index - 1, collective, -1):
                read_by = readers.get(feeder)
                if read_by and ops[feeder].group is None and read_by <= completions.keys():
                    completions[feeder] = None
        return completions

    @staticmethod
    def _note_filled(op: OpRecord, ops: list[OpRecord],
                     filled_by: dict[tuple[int, int], tuple[OpRecord, int]]) -> None:
        """Note which op output holds the elements of a layout change's outputs: a view of a
        filled buffer holds its filler's; an op that writes its trailing arguments (FSDP2's
        ``split_with_sizes_copy`` of the all-gathered buffer into the unsharded parameters)
        fills them and the buffers they are views of."""
        if base_name(op.name) in _UNSHARDED_VIEWS:
            found = filled_by.get(op.inputs[0].source) if op.inputs and len(op.outputs) == 1 else None
            if found is not None and _numel(found[0].outputs[found[1]].shape) == _numel(op.outputs[0].shape):
                filled_by[(op.index, 0)] = found
            return
        arguments = op.inputs[len(op.inputs) - len(op.outputs):] if len(op.inputs) >= len(op.outputs) else []
        for k, (written, argument) in enumerate(zip(op.outputs, arguments, strict=False)):
            if not written.mutated or argument.shape != written.shape:
                continue
            filled_by[(op.index, k)] = (op, k)
            source = argument.source
            for _ in range(8):  # the argument, then the buffer it views, and so on
                if source is None or _numel(ops[source[0]].outputs[source[1]].shape) != _numel(written.shape):
                    break
                filled_by[source] = (op, k)
                viewer = ops[source[0]]
                if base_name(viewer.name) not in _UNSHARDED_VIEWS or not viewer.inputs:
                    break
                source = viewer.inputs[0].source

    def _unsharded(self, op: OpRecord, position: int, ops: list[OpRecord],
                   back: dict[int, tuple[int, int] | None],
                   filled_by: dict[tuple[int, int], tuple[OpRecord, int]],
                   placed: dict[tuple[int, int], tuple[World, bool]]) -> tuple[World, TensorRecord] | None:
        """FSDP2's unsharded tensor-parallel parameter, read by a DTensor op (directly, or through
        a local redistribution: RowwiseParallel's ``div`` of its bias): its placements on the
        mesh dims the DTensor op covers are the op's, on the others (data-parallel) the
        all-gathered buffer's (replicated); its data as the DTensor op (or the redistribution)
        read it, its statistics those of the copy-out that filled the buffer (the same
        elements; the reading op's own records of it have none). None: not such a read."""
        reader, at, source = op, position, op.inputs[position].source
        while source is not None and source[0] in back:
            moving = ops[source[0]]
            if moving.layout is None or moving.layout["role"] != "redistribute" or not moving.inputs:
                return None  # through a collective: another value
            reader, at, source = moving, 0, moving.inputs[0].source
        found = filled_by.get(source) if source is not None else None
        if found is None or reader.layout is None:
            return None
        filler, k = found
        given = self._given(reader.layout, "input", at)
        buffer = placed[(filler.index, k)][0]
        placement = tuple(p if g is None else g for g, p in zip(given, buffer, strict=True))
        if "?" in placement:
            return None
        record = self.fold_tensor(reader, "input", at, placement)
        if record.stats is None and _numel(filler.outputs[k].shape) == _numel(reader.inputs[at].shape):
            record.stats = self.fold_tensor(filler, "output", k, placement).stats
        return placement, record

    def _partial_sums(self, placements: World, inputs: list[tuple[World, bool]]) -> int:
        """How many partial sums an output placed ``placements`` was computed in: the ranks of
        the mesh dims where it is a partial sum (or mean) and none of its inputs is (1: none)."""
        dims = [k for k, p in enumerate(placements) if p in ("P(sum)", "P(avg)")
                and not any(k < len(given) and given[k].startswith("P") for given, _ in inputs)]
        return math.prod(self.mesh[0][k] for k in dims)

    def _read_after_reduction(self, op: OpRecord, reduced_in_place: dict[tuple[int, int], OpRecord],
                              value_of: Any, placed: dict[tuple[int, int], tuple[World, bool]]
                              ) -> tuple[tuple[World, bool], TensorRecord] | None:
        """A view of a partial value that a collective reduced in place before it (a
        row-parallel layer's output after ``torch.distributed.all_reduce``): the reduced
        value, its placements and statistics the collective's (the view reads the collective's
        output; the value's placements are those of the partial value the collective reduced)."""
        if base_name(op.name) not in _ALIASES or not op.inputs or len(op.outputs) != 1:
            return None
        value = value_of(op.inputs[0].source)
        collective = reduced_in_place.get(value) if value is not None else None
        if collective is None or collective.index > op.index or value not in placed \
                or not any(p.startswith("P") for p in placed[value][0]):
            return None
        result = self._collective_result(collective, placed[value])
        if result is None or math.prod(result.shape) != math.prod(op.outputs[0].shape):
            return None
        placements = tuple("R" if p.startswith("P") else p for p in placed[value][0])
        output = op.outputs[0]
        return (placements, placed[value][1]), self._same_data(
            TensorRecord(output.dtype, output.shape, result.stats), result)

    @staticmethod
    def _wraps(op: OpRecord, ops: list[OpRecord], read_by_dtensor_ops: set[int]) -> bool:
        """Whether ``op`` is the view of a whole tensor that DTensor's ``from_local`` or
        ``to_local`` makes around a DTensor op (the parallel styles' input and output hooks):
        a layout change a single process does not make."""
        if op.layout is not None or base_name(op.name) not in _ALIASES or len(op.inputs) != 1 \
                or len(op.outputs) != 1 or op.inputs[0].shape != op.outputs[0].shape:
            return False
        source = op.inputs[0].source
        if op.index in read_by_dtensor_ops:
            return True
        if source is None:
            return False
        producer = ops[source[0]]
        # A view of what a collective wrote in place (torch.distributed.all_reduce's tensor) is the
        # program's own view, which a single process makes too; DTensor's collectives write none.
        collective = producer.group is not None and not any(t.mutated for t in producer.outputs)
        return producer.layout is not None or collective or producer.name in _PASS_THROUGH

    def _output_shape(self, source: tuple[int, int]) -> tuple[int, ...]:
        return self.ops[self.lead][source[0]].outputs[source[1]].shape

    def _collective_result(self, op: OpRecord, value: tuple[World, bool]) -> TensorRecord | None:
        """The whole value a collective's first output holds: the reduced value's placements
        with the collective's mesh dims replicated (sharded along dim 0 after a reduce-scatter)."""
        ranks = tuple(op.group["ranks"]) if op.group and op.group.get("ranks") else tuple(self.ranks)
        dims = [dim for dim in range(len(self.mesh[0])) if self._group_along(dim) == ranks]
        if ranks == self.mesh[1]:
            dims = list(range(len(self.mesh[0])))
        if not dims:
            return None
        reduced = "S(0)" if "reduce_scatter" in op.name else "R"
        placements = tuple(reduced if dim in dims else p for dim, p in enumerate(value[0]))
        return self.fold_tensor(op, "output", 0, placements, value[1])


def _constant(record: TensorRecord | None) -> float | None:
    """The one finite number every element of a recorded tensor holds; None when not so or not known."""
    stats = record.stats if record is not None and _numel(record.shape) else None
    if stats is None or stats.get("min") is None or stats["min"] != stats["max"] \
            or not math.isfinite(stats["min"]):  # type: ignore[arg-type]
        return None
    return float(stats["min"])  # type: ignore[arg-type]


def _adopt_detached_gradients(folded: list[OpRecord]) -> None:
    """A gradient's ``detach`` (AccumulateGrad) that the recording left outside any module is
    named after the module whose op produced the gradient, as a plain run names it: FSDP2's
    post-backward hook closes the module's backward before AccumulateGrad runs."""
    counts = Counter((op.phase, op.module, op.module_call, op.name) for op in folded)
    for op in folded:
        if op.phase != "backward" or op.module or op.name != "aten.detach.default" or not op.inputs \
                or op.inputs[0].source is None:
            continue
        producer = folded[op.inputs[0].source[0]]
        if not producer.module:
            continue
        key = (op.phase, producer.module, producer.module_call, op.name)
        op.id = f"{op.phase}:{producer.module}[{producer.module_call}]:{op.name}:{counts[key]}"
        counts[key] += 1
        op.module, op.module_call = producer.module, producer.module_call
        op.module_stack = producer.module_stack


def _partial_scalar(parts: list[dict[str, Any] | None], divisor: int) -> dict[str, Any] | None:
    """The statistics of a one-element partial value: its parts added (and averaged over the
    ``P(avg)`` dims: a loss that is each rank's mean over its slice)."""
    if any(p is None or p.get("mean") is None for p in parts) or not parts:
        return None
    value = sum(p["mean"] for p in parts) / divisor  # type: ignore[index]
    out: dict[str, Any] = dict(parts[0])  # type: ignore[arg-type]
    out.update(min=value, max=value, mean=value, norm=abs(value))
    for key in _COUNTS:
        if key in out:
            values = [p.get(key) for p in parts]  # type: ignore[union-attr]
            out[key] = None if any(v is None for v in values) else max(values)
    return out


def _scaled(stats: dict[str, Any], factor: float) -> dict[str, Any]:
    out = dict(stats)
    for key in ("min", "max", "mean", "norm"):
        if out.get(key) is not None:
            out[key] = out[key] * factor
    return out


def _ddp_wrapped(run: Run, step: int, rank: int) -> bool:
    """Whether the model the run recorded is wrapped in ``DistributedDataParallel`` (its
    modules are ``module.<name>``: logical ops are named after the model it wraps)."""
    try:
        return run.module_types(step, rank).get("") == "DistributedDataParallel"
    except (ProbeError, AttributeError):
        return False


def _unwrap_name(module: str) -> str:
    if module == "module":
        return ""
    return module[len("module."):] if module.startswith("module.") else module


def _unwrapped(op_id: str, module: str, module_stack: list[str]) -> tuple[str, str, list[str]]:
    """An op's id, module and module stack without DDP's ``module.`` level."""
    phase, rest = op_id.split(":", 1)
    frame, name, n = rest.rsplit(":", 2)
    unwrapped = _unwrap_name(module)
    op_id = f"{phase}:{unwrapped}{frame[len(module):]}:{name}:{n}"
    module = unwrapped
    names = [(entry, frame_module(entry)) for entry in module_stack]
    stack = [_unwrap_name(name) + entry[len(name):] for entry, name in names if name != ""]
    return op_id, module, stack


def _first_ops(run: Run) -> Sequence[OpRecord]:
    """The lead rank's first step's ops (none for an empty run)."""
    if not run.ranks:
        return []
    rank = run.ranks[0]
    steps = run.steps_of(rank)
    return run.ops(steps[0], rank) if steps else []


def _plan(run: Run, first_ops: Sequence[OpRecord]) -> tuple:
    """The run's parallel layout, as far as compare needs it: its ranks and the placements its
    lead rank's first step (``first_ops``) recorded (op id -> results' placements)."""
    placed = tuple((op.id, str(op.layout["mesh"]), str(op.layout["out"]))
                   for op in first_ops if op.layout is not None)
    return tuple(run.ranks), placed


def _reducing_forward_modules(ops: list[OpRecord]) -> list[str]:
    """Modules that all-reduce a value computed in the step during forward, in a step with no
    DTensor op in forward: hand-written tensor parallelism (a row-parallel layer's partial
    output). Data parallelism reduces in backward, DTensor's styles record their layouts."""
    if any(op.layout is not None and op.phase == "forward" for op in ops):
        return []
    found = [op.module for op in ops if op.phase == "forward" and op.group is not None
             and "reduce" in op.name and any(t.source is not None for t in op.inputs)]
    return sorted(set(found))


class MissingPartitions(ProbeError):
    """A run sharded by hand (no DTensor) folded without the partitions that say how."""


def _computes_on_shards(plan: tuple) -> bool:
    """Whether forward ops ran on DTensors (tensor parallelism): a collective there carries one
    rank's difference into the others' values, so even twin plans are compared folded, where
    the difference enters at the op of the rank that made it. FSDP2's DTensor ops (the
    optimizer's on its sharded parameters) leave the compute rank by rank."""
    return any(op_id.startswith("forward:") for op_id, _, _ in plan[1])


def fold_step(run: Run, step: int, partitions: Mapping[str, str | int] | None = None) -> LogicalStep:
    """One step of ``run`` as logical ops (see the module docstring); ranks that lack the step
    are left out. ``partitions``: how modules sharded by hand are (:func:`normalize_partitions`)."""
    ranks = [rank for rank in run.ranks if run.has_step(step, rank)]
    if not ranks:
        raise ProbeError(f"{str(run.path)!r} has no rank with step {step}")
    return _Folder(run, step, ranks, normalize_partitions(partitions)).fold()


class LogicalRun:
    """A run seen as one process computing whole tensors: ``ops(step)`` are its logical ops
    (folded once per step), under its lowest rank; its dump (``dump``, ``tensor``) holds their
    tensors folded from the ranks' dumps (:mod:`probe.analysis.folded_dumps`). Everything else
    is the run's own."""

    def __init__(self, run: Run, partitions: Mapping[str, str | int] | None = None) -> None:
        self.run = run
        self.lead = run.ranks[0]
        self.partitions = normalize_partitions(partitions)
        self._steps: dict[int, LogicalStep] = {}
        self._by_id: dict[int, dict[str, OpRecord]] = {}
        """Per folded step, its logical ops by id (the first op of an id when several share it)."""

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
            self._steps[step] = fold_step(self.run, step, self.partitions)
        return self._steps[step]

    def ops(self, step: int | None = None, rank: int | None = None) -> list[OpRecord]:
        step = self.steps[0] if step is None else step
        return self.logical_step(step).ops

    def iter_ops(self, step: int | None = None, rank: int | None = None) -> Iterator[OpRecord]:
        """The logical ops of ``step``, as :meth:`ops` (the fold holds them; the run's own
        ``iter_ops`` would give the lead rank's local ops)."""
        return iter(self.ops(step, rank))

    def op_count(self, step: int | None = None, rank: int | None = None) -> int:
        """How many logical ops ``step`` holds."""
        return len(self.ops(step, rank))

    def graph(self, step: int | None = None, rank: int | None = None,
              phases: Collection[str] | None = None) -> nx.DiGraph:
        """The logical ops' graph (the run's own is of the lead rank's local ops, whose indices
        and ids are not the logical ones)."""
        return build_graph(self.ops(step, rank), phases)

    def op(self, op_id: str, step: int | None = None, rank: int | None = None) -> OpRecord:
        """The logical op ``op_id`` of ``step`` (default: the first), looked up by id: replaying
        each op of a step is linear, not a pass over the step per op."""
        step = self.steps[0] if step is None else step
        if step not in self._by_id:
            self._by_id[step] = {op.id: op for op in reversed(self.ops(step))}
        found = self._by_id[step].get(op_id)
        if found is None:
            raise ProbeError(f"no logical op {op_id!r} in step {self.steps[0] if step is None else step} "
                             f"of {str(self.path)!r}")
        return found

    def has_dump(self, step: int | None = None, rank: int | None = None) -> bool:
        """Whether every rank dumped the step (its tensors then fold into the logical ops')."""
        step = self.steps[0] if step is None else step
        ranks = [r for r in self.run.ranks if self.run.has_step(step, r)]
        return bool(ranks) and all(self.run.has_dump(step, r) for r in ranks)

    def dump(self, step: int | None = None, rank: int | None = None) -> LogicalDump:
        """The step's logical tensors, folded from the ranks' dumps (:class:`LogicalDump`)."""
        step = self.steps[0] if step is None else step
        if not self.has_dump(step):
            raise ProbeError(f"step {step} of {str(self.path)!r} has no dump on every rank: its "
                             f"logical tensors cannot be folded")
        folded = self.logical_step(step)
        return LogicalDump(self.run, step, folded.mesh_shape, folded.pieces, folded.origins, self.lead)

    def tensor(self, op_id: str, io: str = "output", index: int = 0,
               step: int | None = None, rank: int | None = None) -> torch.Tensor:
        """A logical op's tensor, the whole one, folded from the ranks' dumps."""
        if io not in ("input", "output"):
            raise ProbeError(f"io must be 'input' or 'output', got {io!r}")
        op = self.op(op_id, step)
        return self.dump(op.step).tensor(op.index, io, index)

    def partial_sums(self, step: int) -> dict[tuple[int, int], int]:
        """(logical op index, output position) -> the partial sums the ranks computed it in
        (:attr:`LogicalStep.partial_sums`)."""
        return self.logical_step(step).partial_sums

    def findings(self, data: bool = True) -> list[ReplicaFinding]:
        """Replicas that disagree, over every step (folding each): by their statistics, and
        where every rank dumped the step and ``data``, by their bytes (each replicated part
        read from both ranks' dumps)."""
        found = []
        for step in self.steps:
            folded = self.logical_step(step)
            found += folded.findings
            if data and len(self.run.ranks) > 1 and self.has_dump(step):
                for (index, io, position), rank, reference, count in self.dump(step).disagreeing_replicas():
                    if not any(f.rank == rank and f.op_id == folded.ops[index].id and f.io == io
                               and f.position == position for f in folded.findings):
                        found.append(ReplicaFinding(step, folded.ops[index].id, io, position, rank, reference,
                                                    "elements differing", count, 0))
        return found


def partial_sums(run: Run, step: int) -> dict[tuple[int, int], int]:
    """(op index, output position) -> how many partial sums the ranks of a folded run computed
    it in (:attr:`LogicalStep.partial_sums`); empty for a run compared as it is."""
    return run.partial_sums(step) if isinstance(run, LogicalRun) else {}


def logical_pair(run_a: Run, run_b: Run,
                 partitions: Mapping[str, str | int] | None = None) -> tuple[Run, Run]:
    """The two runs to compare op by op: both folded into logical ops when their layouts differ
    (other ranks, or other placements: another parallel plan; a single-process run folds to
    itself) or when they compute on shards (tensor parallelism, DTensor's or by hand as
    ``partitions`` says), else as they are, rank by rank (DDP, FSDP2 twins: each rank against
    its twin). Raises :class:`MissingPartitions` when a run to fold all-reduces forward values
    outside DTensor in modules ``partitions`` does not name, and :class:`ProbeError` when
    ``partitions`` names no module of either run."""
    mapping = normalize_partitions(partitions)
    try:
        first = {"A": _first_ops(run_a), "B": _first_ops(run_b)}
        plan_a, plan_b = _plan(run_a, first["A"]), _plan(run_b, first["B"])
    except ProbeError:  # a damaged first step: compared rank by rank, where it is reported
        return run_a, run_b
    mapped = {label: any(partition_of(mapping, op.module) is not None for op in ops)
              for label, ops in first.items()}
    if mapping and not any(mapped.values()):
        modules = sorted({op.module for ops in first.values() for op in ops if op.module})
        raise ProbeError(f"partitions name no module of either run: {sorted(mapping)}; modules: "
                         f"{', '.join(modules[:12])}{' ...' if len(modules) > 12 else ''}")
    hand_sharded = any(mapped[label] and len(run.ranks) > 1 for label, run in (("A", run_a), ("B", run_b)))
    if plan_a == plan_b and not _computes_on_shards(plan_a) and not hand_sharded:
        return run_a, run_b
    for label, run in (("A", run_a), ("B", run_b)):
        if len(run.ranks) < 2:
            continue
        unmapped = [m for m in _reducing_forward_modules(first[label]) if partition_of(mapping, m) is None]
        if unmapped:
            raise MissingPartitions(
                f"run {label} ({str(run.path)!r}) all-reduces forward values outside DTensor in "
                f"{', '.join(unmapped)}: tensor parallelism written by hand, whose shards cannot be "
                f"folded into whole tensors without knowing which dim each layer splits. Name "
                f"them: probe.compare(a, b, partitions={{'<column-parallel module>': 'colwise', "
                f"{unmapped[0]!r}: 'rowwise', ...}}), or on the command line "
                f"--partition {unmapped[0]}=rowwise --partition <module>=colwise")
    return LogicalRun(run_a, mapping), LogicalRun(run_b, mapping)  # type: ignore[return-value]


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
