"""What rounding a dtype makes, and how far two computations of one op may differ by it.

Read by the free benchmark (its rounding rule, ``docs/free_benchmark.md``) and by compare (its
exact regime's tolerance) alike, so the two judge an op's rounding by the same bound: a result
computed another way may differ by ``CONDITION * delta + max(ROUNDING_ULPS * eps(out) * sqrt(K),
RELATIVE_FLOOR)``, ``K`` the terms each output element sums (:func:`reduction_length`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

CONDITION = 32.0
ROUNDING_ULPS = 4.0
RELATIVE_FLOOR = 1e-5
"""The smallest relative bound, whatever the dtype."""


def eps(dtype: torch.dtype) -> float:
    """The machine epsilon of a floating dtype (0 for others)."""
    return torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def threshold(delta: float, out_dtype: torch.dtype, reduction: int = 1) -> float:
    """The rounding rule's bound on the relative output change (see the module docstring)."""
    rounding = ROUNDING_ULPS * eps(out_dtype) * math.sqrt(max(reduction, 1))
    return CONDITION * delta + max(rounding, RELATIVE_FLOOR)


# Contractions: (argument holding the left operand, its contracted dimension).
_CONTRACTIONS = {
    "aten.mm.default": (0, -1), "aten.bmm.default": (0, -1), "aten.matmul.default": (0, -1),
    "aten.mv.default": (0, -1), "aten.dot.default": (0, -1), "aten.linear.default": (0, -1),
    "aten.addmm.default": (1, -1), "aten.baddbmm.default": (1, -1), "aten.addbmm.default": (1, -1),
    "aten.addmv.default": (1, -1),
    # A mixture of experts' grouped GEMM: each group's rows times its expert's matrix. Its
    # weight gradient sums over the tokens (mat_a's last dimension, all groups': at least each
    # group's), the others over the features.
    "aten._grouped_mm.default": (0, -1),
}


def reduction_length(name: str, args: Sequence[Any], output: int = 0) -> int:
    """How many terms each element of output ``output`` of a contraction sums (1 for other ops).

    Two runs of a sum of K terms round differently by about sqrt(K) ULPs (the
    random-walk model of floating-point summation), and libraries differ in how
    they block the sum (cuBLAS splits K where MKL does not): the bound grows with it.
    Layer norm's backward sums over the normalized elements for the input's gradient
    and over the rows for the weight's and the bias's.
    """
    if name == "aten.native_layer_norm_backward.default":
        if len(args) < 3 or not isinstance(args[0], torch.Tensor) or not isinstance(args[2], (list, tuple)):
            return 1
        normalized = math.prod(int(n) for n in args[2])
        return max(normalized if output == 0 else args[0].numel() // max(normalized, 1), 1)
    if name in _CONVOLUTIONS:
        return _convolution_length(name, args, output)
    where = _CONTRACTIONS.get(name)
    if where is None or len(args) <= where[0] or not isinstance(args[where[0]], torch.Tensor):
        return 1
    operand = args[where[0]]
    return operand.shape[where[1]] if operand.dim() else 1


_CONVOLUTIONS = frozenset({"aten.convolution.default", "aten.convolution_backward.default"})


def _convolution_length(name: str, args: Sequence[Any], output: int) -> int:
    """Terms per output element of a convolution (its input channels per group times the kernel's
    size: a weight of shape (out, in / groups, *kernel)) and of its backward, whose input gradient
    sums over the output channels of a group and the kernel, and whose weight and bias gradients
    sum over the batch and the output positions. From the tensor arguments alone (the input, the
    weight; for the backward the output gradient first): groups are the input's channels over the
    weight's. Not transposed (a transposed convolution's weight is (in, out / groups, *kernel):
    its count is then of the same order, not exact)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if name == "aten.convolution.default":
        if len(tensors) < 2 or tensors[1].dim() < 2:
            return 1
        weight = tensors[1]
        return max(math.prod(weight.shape[1:]), 1)
    if len(tensors) < 3 or tensors[2].dim() < 2 or tensors[0].dim() < 2:
        return 1
    grad, inp, weight = tensors[:3]
    if output == 0:
        groups = max(inp.shape[1] // max(weight.shape[1], 1), 1)
        return max(weight.shape[0] // groups * math.prod(weight.shape[2:]), 1)
    return max(grad.numel() // max(grad.shape[1], 1), 1)
