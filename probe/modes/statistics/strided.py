"""Strided views as the multi-tensor kernel reads them in place: blocks of rows of contiguous values.

Imported by the reducer (which routes a tensor) and by the kernel (which reads it); a module of its
own, so that neither imports the other.
"""

from __future__ import annotations

import torch


def strided_layout(x: torch.Tensor) -> tuple[int, int, int, int] | None:
    """``x`` as (rows, cols, row stride, block stride) in elements, its values read in storage
    order as blocks of ``rows`` rows of ``cols`` contiguous values, or None where it is not
    (no unit stride, or more than three levels once mergeable dims are merged). The slices of an
    attention head (``rotate_half``'s halves, a q/k split, transposed or not) are such a layout."""
    # In the order of the strides (statistics do not depend on the order values are read in):
    # a transposed slice is a slice.
    dims = sorted(((size, stride) for size, stride in zip(x.shape, x.stride(), strict=True) if size != 1),
                  key=lambda dim: dim[1], reverse=True)
    if not dims or dims[-1][1] != 1:
        return None
    merged = [dims[-1]]
    for size, stride in reversed(dims[:-1]):
        inner_size, inner_stride = merged[-1]
        if stride == inner_size * inner_stride:
            merged[-1] = (size * inner_size, inner_stride)
        else:
            merged.append((size, stride))
    if len(merged) > 3:
        return None
    merged += [(1, 0)] * (3 - len(merged))
    (cols, _), (rows, row_stride), (_, block_stride) = merged
    return rows, cols, row_stride, block_stride
