"""Dumps of a folded run: each logical tensor's data put together from the ranks' dumps.

Folding (``probe.analysis.layouts``) says, for each tensor of a logical op, which op of each
rank holds a part of it and how the parts make the whole: its placement on each mesh dim. A
:class:`FoldedPiece` keeps that; :class:`LogicalDump` reads a folded step's tensors by it, as
a step's dump is read (``mode_records.StepDump``: ``entries``, ``tensor``, ``call``), so what reads a dump
(compare's tensor metrics, the fp64 replay, ``run.tensor``) reads a folded run's too:

- ``S(d)``: the parts concatenated along ``d`` in mesh order (the ranks' coordinates on that
  mesh dim); a strided shard ``_S(d,f)`` (``f`` outer blocks of ``d``, each sharded) block by
  block;
- ``R``: the lowest coordinate's part; the other replicas must hold the same bytes, and one
  that does not is a :class:`~probe.analysis.layouts.ReplicaFinding` (statistic
  ``"elements differing"``), not folded away;
- ``P(sum)`` / ``P(avg)``: a partial value no collective reduced where the fold could read it
  (a weight's gradient on a data-parallel rank before its reduce-scatter): the parts summed (or
  averaged) in fp64 in mesh order, then rounded once to the recorded dtype (:meth:`FoldedPiece.describe`
  says so). A partial value that a collective reduced reads the collective's result instead,
  as its statistics do: that is the value the program went on with.

Dims are undone from the last mesh dim to the first: DTensor applies placements in mesh-dim
order, so the last mesh dim's parts are the innermost.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from probe.analysis.local_placements import shard_dim
from probe.analysis.mode_records import StepDump
from probe.errors import ProbeError
from probe.rundir.run import Run
from probe.rundir.tensor_layouts import STRIDED

_NOT_DUMPABLE = "not dumpable"


@dataclass(frozen=True)
class FoldedPiece:
    """How one logical tensor's data is put together from the ranks' dumps."""

    io: str
    position: int
    sources: tuple[tuple[int, int], ...]
    """(rank, that rank's op index) for each rank of the step's mesh, in mesh order."""
    placements: tuple[str, ...]
    """One per mesh dim (``S(d)``, ``_S(d,f)``, ``R``, ``P(sum)``, ``P(avg)``)."""
    shape: tuple[int, ...]
    """The logical shape the tensor is read in (a reshape of the parts' whole, same elements)."""
    dtype: str
    factor: float = 1.0
    """A gradient on the data-parallel dim: each rank holds the degree times its slice."""
    transposed: bool = False
    """The whole made of the parts is read transposed (a ``t`` view no rank recorded the data
    of: the parts are the dumps of the tensor it read)."""

    def describe(self) -> str:
        """How the parts make the whole, in words."""
        words = []
        for dim, placement in enumerate(self.placements):
            d = shard_dim(placement)
            if d is not None:
                words.append(f"mesh dim {dim}: {placement}, shards concatenated along dim {d}")
            elif placement.startswith("P"):
                words.append(f"mesh dim {dim}: {placement}, partial values summed in fp64 in rank order"
                             f"{' and averaged' if placement == 'P(avg)' else ''}, rounded to {self.dtype}")
            else:
                words.append(f"mesh dim {dim}: {placement}, one replica")
        if self.factor != 1.0:
            words.append(f"scaled by {self.factor:g} (a data-parallel rank's gradient)")
        if self.transposed:
            words.append(f"transposed (the ranks' {self.io} {self.position}, which the transpose read)")
        return "; ".join(words)


def _coordinates(mesh_shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Each mesh position's coordinates, in mesh order (row-major, as ``layouts`` numbers them)."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _joined(parts: list[torch.Tensor], placement: str) -> tuple[torch.Tensor, bool]:
    """The parts of one mesh dim (in coordinate order) made one; whether it summed partial values."""
    d = shard_dim(placement)
    if placement.startswith("_S("):
        assert d is not None
        blocks = int(placement[3:-1].split(",")[1])
        d %= max(parts[0].dim(), 1)
        # f outer blocks, each holding every rank's shard in turn.
        split = [p.unflatten(d, (blocks, p.shape[d] // blocks)) for p in parts]
        return torch.cat(split, d + 1).flatten(d, d + 1), False
    if d is not None:
        return torch.cat(parts, d % max(parts[0].dim(), 1)), False
    if placement == "R":
        return parts[0], False
    if placement in ("P(sum)", "P(avg)"):
        total = parts[0].to(torch.float64)
        for p in parts[1:]:
            total = total + p.to(torch.float64)
        return (total / len(parts) if placement == "P(avg)" else total), True
    raise ProbeError(f"a value placed {placement} has no whole value to fold")


def fold_parts(piece: FoldedPiece, mesh_shape: tuple[int, ...],
               parts: dict[int, torch.Tensor]) -> torch.Tensor:
    """The whole tensor from the parts of the ranks that contribute (rank -> its part; replicas
    on ``R`` dims other than the lowest coordinate may be left out)."""
    coords = dict(zip([rank for rank, _ in piece.sources], _coordinates(mesh_shape), strict=True))
    level: dict[tuple[int, ...], torch.Tensor] = {
        coords[rank]: part for rank, part in parts.items()
        if all(coords[rank][k] == 0 for k, p in enumerate(piece.placements) if p == "R")}
    summed = False
    for k in reversed(range(len(mesh_shape))):
        groups: dict[tuple[int, ...], list[tuple[int, torch.Tensor]]] = {}
        for key, part in level.items():
            groups.setdefault(key[:k], []).append((key[k], part))
        level = {}
        for key, members in groups.items():
            members.sort(key=lambda m: m[0])
            level[key], partial = _joined([part for _, part in members], piece.placements[k])
            summed = summed or partial
        # R dims keep their one replica: the key loses its last coordinate either way.
    whole = level[()]
    if summed or piece.factor != 1.0:
        whole = (whole.to(torch.float64) * piece.factor).to(getattr(torch, piece.dtype))
    if piece.transposed:
        whole = whole.t()
    if math.prod(whole.shape) != math.prod(piece.shape):
        raise ProbeError(f"the folded parts make {list(whole.shape)}, not {list(piece.shape)}")
    return whole.reshape(piece.shape)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@dataclass(frozen=True)
class FoldedEntry:
    """One logical tensor of a folded step's dump (a ``mode_records.DumpEntry``): its whole dtype,
    shape and contiguous strides, and why it has no folded data (``status``), None when the ranks'
    parts put it together."""

    op: int
    """The logical op's index."""
    io: str
    position: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    status: str | None
    layout: str = STRIDED


class LogicalDump:
    """A folded step's dump (a ``mode_records.StepDump``): entries keyed by logical op index, tensors folded
    from the ranks' dumps, calls the lead rank's (their size arguments are its local sizes: an
    op whose arguments name sizes replays on whole tensors only where they do not matter, and
    its replay is otherwise refused by the shapes)."""

    def __init__(self, run: Run, step: int, mesh_shape: tuple[int, ...],
                 pieces: dict[tuple[int, str, int], FoldedPiece | str], origins: dict[int, int],
                 lead: int) -> None:
        self.run, self.step, self.mesh_shape = run, step, mesh_shape
        self.pieces, self.origins, self.lead = pieces, origins, lead
        self._dumps: dict[int, StepDump] = {}
        self._entries: dict[tuple[int, str, int], FoldedEntry] | None = None

    def _dump(self, rank: int) -> StepDump:
        if rank not in self._dumps:
            self._dumps[rank] = self.run.dump(self.step, rank)
        return self._dumps[rank]

    @property
    def complete(self) -> bool:
        ranks = {rank for piece in self.pieces.values() if isinstance(piece, FoldedPiece)
                 for rank, _ in piece.sources} or {self.lead}
        return all(self._dump(rank).complete for rank in ranks)

    @property
    def entries(self) -> dict[tuple[int, str, int], FoldedEntry]:
        """(logical op index, io, position) -> its entry; ``status`` says why a tensor has no
        folded data (a rank's part not dumped, a placement not known)."""
        if self._entries is None:
            self._entries = {}
            for key, piece in self.pieces.items():
                entry = self._entry(key, piece)
                if entry is not None:
                    self._entries[key] = entry
        return self._entries

    def _entry(self, key: tuple[int, str, int], piece: FoldedPiece | str) -> FoldedEntry | None:
        index, io, position = key
        if isinstance(piece, str):
            lead_entry = self._dump(self.lead).entries.get((self.origins.get(index, -1), io, position))
            if lead_entry is None:
                return None
            status = lead_entry.status or f"{_NOT_DUMPABLE}: {piece}"
            return FoldedEntry(index, io, position, lead_entry.dtype, lead_entry.shape, lead_entry.stride,
                               status)
        status = None
        for rank, op in piece.sources:
            found = self._dump(rank).entries.get((op, piece.io, piece.position))
            if found is None:
                if rank == piece.sources[0][0]:
                    return None  # not dumped (a filter): as in the run
                status = f"not in rank {rank}'s dump"
            elif found.status is not None:
                by_design = found.status.startswith(_NOT_DUMPABLE)
                status = found.status if by_design else f"rank {rank}: {found.status}"
            elif found.layout != STRIDED:  # sparse, nested, quantized: no strided shards to put together
                status = f"rank {rank}: stored as {found.layout}, which ranks' pieces are not folded from"
            if status is not None:
                break
        return FoldedEntry(index, io, position, piece.dtype, piece.shape, _contiguous_strides(piece.shape),
                           status)

    def describe(self, op: int, io: str, position: int) -> str:
        """How the logical tensor's data is put together, in words."""
        piece = self.pieces.get((op, io, position))
        if piece is None or isinstance(piece, str):
            return piece or "not dumped"
        return piece.describe()

    def _parts(self, piece: FoldedPiece, ranks: list[int] | None = None) -> dict[int, torch.Tensor]:
        wanted = [(r, i) for r, i in piece.sources if ranks is None or r in ranks]
        return {rank: self._dump(rank).tensor(op, piece.io, piece.position) for rank, op in wanted}

    def tensor(self, op: int, io: str, position: int) -> torch.Tensor:
        """The logical ``io`` ``position`` of logical op #``op``, folded from the ranks' dumps."""
        entry = self.entries.get((op, io, position))
        if entry is None:
            raise ProbeError(f"{io} {position} of logical op #{op} was not dumped")
        if entry.status is not None:
            raise ProbeError(f"{io} {position} of logical op #{op} has no data: {entry.status}")
        piece = self.pieces[(op, io, position)]
        assert isinstance(piece, FoldedPiece)
        return fold_parts(piece, self.mesh_shape, self._parts(piece, self._contributing(piece)))

    def _contributing(self, piece: FoldedPiece) -> list[int]:
        coords = _coordinates(self.mesh_shape)
        return [rank for (rank, _), coord in zip(piece.sources, coords, strict=True)
                if all(coord[k] == 0 for k, p in enumerate(piece.placements) if p == "R")]

    def disagreeing_replicas(self) -> list[tuple[tuple[int, str, int], int, int, int]]:
        """Replicas whose bytes differ from their reference's: (logical key, rank, reference
        rank, elements differing), each pair of per-rank tensors checked once."""
        coords = _coordinates(self.mesh_shape)
        found, seen = [], set()
        for key, piece in sorted(self.pieces.items(), key=lambda item: (item[0][0], item[0][1] == "output")):
            entry = self.entries.get(key)
            if not isinstance(piece, FoldedPiece) or entry is None or entry.status is not None \
                    or "R" not in piece.placements:
                continue
            replicated = [k for k, p in enumerate(piece.placements) if p == "R"]
            at = dict(zip(coords, piece.sources, strict=True))
            for coord, (rank, op) in at.items():
                if all(coord[k] == 0 for k in replicated):
                    continue
                reference = at[tuple(0 if k in replicated else c for k, c in enumerate(coord))]
                pair = (reference, (rank, op), piece.io, piece.position)
                if pair in seen:
                    continue
                seen.add(pair)
                mine = self._dump(rank).tensor(op, piece.io, piece.position)
                theirs = self._dump(reference[0]).tensor(reference[1], piece.io, piece.position)
                if mine.shape != theirs.shape:
                    found.append((key, rank, reference[0], math.prod(mine.shape)))
                    continue
                differs = mine != theirs
                if mine.is_floating_point():  # NaNs at the same places are the same value
                    differs &= ~(mine.isnan() & theirs.isnan())
                differing = int(differs.sum())
                if differing:
                    found.append((key, rank, reference[0], differing))
        return found

    def call(self, op: int) -> dict[str, Any]:
        """The lead rank's recorded call of the op (its arguments beside the tensors)."""
        if op not in self.origins:
            raise ProbeError(f"logical op #{op} has no recorded call")
        return self._dump(self.lead).call(self.origins[op])
