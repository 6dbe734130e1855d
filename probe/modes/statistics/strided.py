"""Strided views as the multi-tensor kernel reads them in place (up to four nested levels of
values, the innermost contiguous), and the sketch signs it reads them with.

Imported by the reducer (which routes a tensor), the sketches (which take a view in its logical
order) and the kernel (which reads it); a module of its own, so that none imports the other.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

LEVELS = 4
"""Nested levels the kernel reads: an attention head's q or k after ``transpose(1, 2)`` (batch,
heads, positions, features) read in the order a sketch takes it is four."""


class StridedLayout(NamedTuple):
    """A tensor read in storage order as nested levels, innermost first: value ``p`` of the read
    (``p = c + cols (r + rows (b + blocks q))``) is at ``q * strides[3] + b * strides[2] +
    r * strides[1] + c`` in memory and, where ``positions`` are given, at
    ``q * positions[3] + ... + c * positions[0]`` in the order a sketch takes its values."""

    sizes: tuple[int, int, int]
    """``cols``, ``rows``, ``blocks`` (the outermost level's size follows from the element count)."""
    strides: tuple[int, int, int, int]
    """Each level's stride in memory (the innermost's is 1)."""
    positions: tuple[int, int, int, int] | None
    """Each level's stride in the sketch's order; None for statistics alone (order-free)."""


def contiguous_strides(shape: Sequence[int]) -> list[int]:
    """The strides of a contiguous tensor of ``shape``: each dim's step in its logical order."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return strides[::-1]


def strided_layout(x: torch.Tensor, positions: Sequence[int] | None = None) -> StridedLayout | None:
    """``x`` read in storage order as a :class:`StridedLayout`, or None where it is not one (no
    unit stride, more than :data:`LEVELS` levels once mergeable
    dims are merged).

    ``positions``: each of ``x``'s dims' stride in the order a sketch takes its values (its
    logical order: :func:`contiguous_strides` of its shape; a permuted view's, permuted): dims
    merge only where they are contiguous both in memory and in that order. Without them, for
    statistics, which do not depend on the order values are read in, a transposed slice is a
    slice and merges as one."""
    given = positions if positions is not None else [0] * x.dim()
    dims = sorted(((size, stride, at) for size, stride, at in zip(x.shape, x.stride(), given, strict=True)
                   if size != 1), key=lambda dim: dim[1], reverse=True)
    if not dims or dims[-1][1] != 1:
        return None
    merged = [list(dims[-1])]
    for size, stride, at in reversed(dims[:-1]):
        inner_size, inner_stride, inner_at = merged[-1]
        if stride == inner_size * inner_stride and (positions is None or at == inner_size * inner_at):
            merged[-1][0] *= size
        else:
            merged.append([size, stride, at])
    if len(merged) > LEVELS:
        return None
    merged += [[1, 0, 0]] * (LEVELS - len(merged))
    return StridedLayout(
        (merged[0][0], merged[1][0], merged[2][0]), tuple(level[1] for level in merged),  # type: ignore[arg-type]
        None if positions is None else tuple(level[2] for level in merged))  # type: ignore[arg-type]


class Signs(NamedTuple):
    """A sketch pattern's signs on a device (``statistics.sketch.signs``), as the multi-tensor
    kernel takes them to sketch a batch in the read that reduces it."""

    columns: torch.Tensor
    """``[sketch.BLOCK, SKETCHES]`` column signs, int8."""
    blocks: torch.Tensor
    """Block signs, int8, as many as the batch's longest tensor has."""
    positions: Sequence[Sequence[int] | None] | None = None
    """Per tensor of the batch, its dims' strides in the sketch's order where that is not its
    own logical order (a view the engine permuted to read in storage order); None: each its own."""

    def reordered(self, index: int) -> bool:
        """Whether the batch's tensor at ``index`` is sketched in another order than its own."""
        return self.positions is not None and self.positions[index] is not None

    def of(self, indices: Sequence[int]) -> Signs:
        """The same signs for the batch's tensors at ``indices`` (a group the kernel reads)."""
        if self.positions is None:
            return self
        return self._replace(positions=[self.positions[i] for i in indices])
