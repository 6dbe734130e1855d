"""Where the sharded dim of a local op's inputs goes in its result, read from shapes alone.

Folding a run into logical ops (``probe.analysis.layouts``) knows the placement DTensor gave
each tensor of a DTensor op. Local ops on plain tensors carry none: the ops of a data-parallel
rank (its slice of the batch, DDP's and FSDP2's compute) and the ops between a
``ColwiseParallel`` and a ``RowwiseParallel`` module. Their results' placements on one mesh
dim follow from their inputs' placements there, as DTensor's sharding propagation would say,
and what a record holds is the op's name and its tensors' shapes (not its other arguments).
So the rules are written on shapes: a shard of dim ``d`` moves with ``t``/``transpose``/
``permute``, keeps its place through elementwise ops (right-aligned, broadcasting), through a
reshape where it stays the outermost factor of its dim (split into factors: the first; merged
with outer dims: a strided shard ``_S(k,f)``, a block within each of the ``f`` outer indices,
which folds as a shard), and through a reduction that keeps it;
a reduction over it, or a matrix product contracting two shards, leaves a partial value
(``P(sum)``, ``P(avg)`` for means and losses, ``P(other)`` for other reductions). Shapes that
do not tell (a transpose of two dims of one size) answer None: the fold then claims nothing.
"""

from __future__ import annotations

import math

Shape = tuple[int, ...]

_TRANSPOSES = frozenset({"t", "transpose", "permute", "swapaxes", "swapdims", "numpy_T", "mT"})
_SWAPS = frozenset({"t", "transpose", "swapaxes", "swapdims", "mT"})
"""Transposes that swap two dims (``permute`` and ``numpy_T`` may move more)."""
_MATMULS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}
"""Op -> positions of its two matrix operands."""
_SUMS = frozenset({"sum", "nansum", "cumsum"})
_MEANS = frozenset({"mean", "nanmean"})
_OTHER_REDUCTIONS = frozenset({"amax", "amin", "max", "min", "argmax", "argmin", "norm", "linalg_vector_norm",
                               "var", "std", "var_mean", "std_mean", "prod", "logsumexp", "all", "any"})


def base_name(name: str) -> str:
    """``aten.sum.dim_IntList`` -> ``sum``; ``fsdp.chunk_cat.default`` -> ``chunk_cat``."""
    parts = name.split(".")
    return parts[1] if len(parts) >= 3 else parts[-1]


def shard_dim(placement: str) -> int | None:
    """d of ``S(d)``, and of a strided shard ``_S(d,k)`` (its statistics fold as a shard's)."""
    if placement.startswith("S(") and placement.endswith(")"):
        return int(placement[2:-1])
    if placement.startswith("_S(") and placement.endswith(")"):
        return int(placement[3:-1].split(",")[0])
    return None


def _partial_of(name: str) -> str:
    base = base_name(name)
    if base in _MEANS or "loss" in base:
        return "P(avg)"
    if base in _OTHER_REDUCTIONS:
        return "P(other)"
    return "P(sum)"  # sums, and the sums over rows a backward computes (a weight's gradient)


def _transposed(name: str, shape: Shape, dim: int, out: Shape) -> str | None:
    if len(shape) != len(out):
        return None
    if base_name(name) == "t" and len(shape) < 2:
        return f"S({dim})"
    if base_name(name) == "t":  # a matrix's transpose: its two dims swap, whatever their sizes
        return f"S({1 - dim})"
    if base_name(name) in _SWAPS:
        # Two dims swap: where the shapes differ, they are the two (of different sizes).
        differ = [j for j in range(len(out)) if out[j] != shape[j]]
        if len(differ) == 2:
            i, j = differ
            return f"S({j if dim == i else i if dim == j else dim})"
        if differ:
            return None
        # Same shapes: only dims of one size may have swapped; a size no other dim has stays.
        return f"S({dim})" if shape.count(shape[dim]) == 1 else None
    places = [j for j in range(len(out)) if out[j] == shape[dim]]
    return f"S({places[0]})" if len(places) == 1 else None


def _matmul(name: str, shapes: list[Shape], placements: list[str], out: Shape) -> str | None:
    first, second = _MATMULS[base_name(name)]
    if second >= len(shapes):
        return None
    a, b = shapes[first], shapes[second]
    da, db = shard_dim(placements[first]), shard_dim(placements[second])
    if da is not None and da == len(a) - 1:  # A's contracted dim: partial when B's is sharded too
        return "P(sum)" if db is not None and db == len(b) - 2 else None
    if da is not None:
        return f"S({da + len(out) - len(a)})"
    if db is not None:
        if db == len(b) - 2:
            return None
        return f"S({len(out) - 1})" if db == len(b) - 1 else f"S({db + len(out) - len(b)})"
    return None


def _moved(name: str, shape: Shape, dim: int, out: Shape) -> str | None:
    """Where shard dim ``dim`` of an input of ``shape`` lands in a result of shape ``out``."""
    if base_name(name) in _TRANSPOSES:
        return _transposed(name, shape, dim, out)
    aligned = dim + len(out) - len(shape)  # elementwise, broadcast, keepdim reductions over others
    if 0 <= aligned < len(out) and out[aligned] == shape[dim]:
        return f"S({aligned})"
    numel, out_numel = math.prod(shape), math.prod(out)
    if out_numel < numel:  # a reduction: does it keep the sharded dim? (right-aligned embedding)
        j = len(shape) - 1
        kept: dict[int, int] = {}
        for i in range(len(out) - 1, -1, -1):
            while j >= 0 and shape[j] != out[i]:
                j -= 1
            if j < 0:
                break
            kept[j], j = i, j - 1
        else:
            return f"S({kept[dim]})" if dim in kept else _partial_of(name)
        return _partial_of(name) if len(out) < len(shape) or out[dim] == 1 else None
    return _reshaped(shape, dim, out)


def _reshaped(shape: Shape, dim: int, out: Shape) -> str | None:
    """A reshape (same number of elements) of a tensor sharded along ``dim``: where the shard
    goes. Logically the shard is a block of its dim, so it stays a block of what the dim
    becomes when it is the outermost factor there: merged with inner dims (``S(k)``), or split
    into factors (``S`` of the first one, the heads of ``(b, s, h*d) -> (b, s, h, d)``).
    Merged with outer dims (``(b, h, s, d) -> (b*h, s, d)`` with ``h`` sharded) it is a block
    within each outer index: a strided shard ``_S(k,f)``, ``f`` the outer factor, whose
    statistics and size fold as a shard's; split back by ``f`` it is ``S`` of the next dim."""
    if math.prod(out) != math.prod(shape):
        return None
    prefix, size = math.prod(shape[:dim]), shape[dim]
    ks = [k for k in range(len(out) + 1) if math.prod(out[:k]) == prefix]
    if ks:
        k = ks[-1]  # past dims of size 1
        if k < len(out) and out[k] % size == 0:
            return f"S({k})"  # merged with inner dims (or kept)
        for end in range(k + 1, len(out) + 1):  # split into out[k:end]
            if math.prod(out[k:end]) == size:
                return f"S({k})"
            if math.prod(out[k:end]) > size:
                break
        return None
    for k in range(len(out)):  # merged with outer dims: the out dim that holds it
        outer = math.prod(out[:k])
        if outer > prefix:
            break
        if prefix % outer == 0 and (outer * out[k]) % (prefix * size) == 0:
            return f"_S({k},{prefix // outer})"
    return None


def _strided(name: str, shape: Shape, placement: str, out: Shape) -> str | None:
    """Where a strided shard ``_S(d,f)`` (``f`` outer blocks, each sharded) goes: split back
    into ``f`` and the rest, the shard is the rest's outermost factor; through an op that keeps
    the dim (elementwise, the batch of a ``bmm``), it stays strided."""
    d, f = (int(v) for v in placement[3:-1].split(","))
    d %= max(len(shape), 1)
    prefix = math.prod(shape[:d])
    if math.prod(out) == math.prod(shape) and base_name(name) not in _TRANSPOSES:
        ks = [k for k in range(len(out)) if math.prod(out[:k]) == prefix]
        if ks and out[ks[0]] == f and out[ks[0]] != shape[d]:
            rest = ks[0] + 1
            while rest < len(out) and out[rest] == 1:
                rest += 1
            return f"S({rest})" if rest < len(out) else None
    moved = _moved(name, shape, d, out)
    if moved is None or shard_dim(moved) is None or not moved.startswith("S("):
        return moved  # a partial value (a sum over it), or not known
    k = shard_dim(moved)
    return f"_S({k},{f})" if out[k] == shape[d] else None  # type: ignore[index]


def local_placement(name: str, shapes: list[Shape], placements: list[str], out: Shape) -> str | None:
    """The placement on one mesh dim of a local op's result of shape ``out``, from its tensor
    inputs' shapes and placements on that dim (``"S(d)"``, ``"R"``, ``"P(...)"``); None when
    the shapes do not tell, or the inputs mix shards and partial values."""
    sharded = [i for i, p in enumerate(placements) if shard_dim(p) is not None]
    partial = [i for i, p in enumerate(placements) if p.startswith("P")]
    if sharded and partial:
        return None
    if partial:  # linear ops on a partial value (views, scaling, adding partials) keep it partial
        return placements[partial[0]]
    if not sharded:
        return "R" if all(p == "R" for p in placements) else None
    if base_name(name) in _MATMULS:
        found = _matmul(name, shapes, placements, out)
        strided = [p for p in placements if p.startswith("_S(")]
        if strided and found is not None and found.startswith("S(") and shard_dim(found) < len(out) - 2:
            # The batch of a bmm, merged from (batch, sharded heads): still strided.
            return f"_S({shard_dim(found)},{strided[0][3:-1].split(',')[1]})"
        return found
    for i in sharded:
        if placements[i].startswith("_S("):
            found = _strided(name, shapes[i], placements[i], out)
            if found is not None:
                return found
            continue
        found = _moved(name, shapes[i], shard_dim(placements[i]) % max(len(shapes[i]), 1), out)  # type: ignore[operator]
        if found is not None:
            return found
    return None
