"""Which ops are matmuls, which of their arguments are the multiplied operands, how each is laid
out against the reduction dimension, and what each operand is (activation, weight, gradient).

A low-precision matmul scales blocks along its reduction dimension, so an operand is looked at
with that dimension last: ``mm(a, b)`` reads ``a`` as is and ``b`` transposed; a convolution
reads its channels (dimension 1) as the reduction dimension. ``linear`` and ``matmul`` decompose
into these in dispatch; SDPA's products are seen where attention is computed eagerly (``bmm``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Layout:
    """How an operand is viewed with its reduction dimension last, and back."""

    to_reduction_last: Callable[[torch.Tensor], torch.Tensor]
    back: Callable[[torch.Tensor], torch.Tensor]


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _transpose(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(-1, -2)


def _channels_last(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(1, -1) if t.dim() > 1 else t


def _channels_first(t: torch.Tensor) -> torch.Tensor:
    return t.movedim(-1, 1) if t.dim() > 1 else t


_AS_IS = Layout(_same, _same)
_TRANSPOSED = Layout(_transpose, _transpose)
_CHANNELS = Layout(_channels_last, _channels_first)

MATMUL_OPERANDS: dict[str, tuple[tuple[int, Layout], ...]] = {
    "mm": ((0, _AS_IS), (1, _TRANSPOSED)),
    "bmm": ((0, _AS_IS), (1, _TRANSPOSED)),
    "addmm": ((1, _AS_IS), (2, _TRANSPOSED)),
    "baddbmm": ((1, _AS_IS), (2, _TRANSPOSED)),
    "addbmm": ((1, _AS_IS), (2, _TRANSPOSED)),
    "linear": ((0, _AS_IS), (1, _AS_IS)),
    "convolution": ((0, _CHANNELS), (1, _CHANNELS)),
    "convolution_backward": ((0, _CHANNELS), (1, _CHANNELS), (2, _CHANNELS)),
}
"""Matmul-like aten ops (short names) -> (argument position, view with the reduction dimension
last) of each operand; biases are not multiplied and stay out."""

_BATCHED_PRODUCTS = {"bmm", "baddbmm", "addbmm"}
_PLAIN_PRODUCTS = {"mm", "addmm", "linear"}


def paired_views(short: str, args: tuple[Any, ...], views: list[torch.Tensor]
                 ) -> list[tuple[torch.Tensor, int]] | None:
    """The two operands' reduction-last ``views`` of a product, each with the leading dimensions to
    keep apart (batches), shaped so that their energies per (batch, reduction index) pair up index
    for index once flattened; None where the op's operands do not pair that way (a transposed
    convolution, a convolution's backward: three operands, two products)."""
    if len(views) != 2:
        return None
    a, b = views
    if short in _PLAIN_PRODUCTS:
        return [(a, 0), (b, 0)]
    if short in _BATCHED_PRODUCTS:
        return [(a, 1), (b, 1)] if a.dim() == b.dim() == 3 else None
    if short == "convolution" and len(args) > 8 and not args[6]:
        # Input channel c meets weight input channel c mod (C / groups) of its group's filters.
        groups, channels = int(args[8]), b.shape[-1]
        return [(a, 0), (b.reshape(groups, -1, channels), 1)]
    return None


def positions(shape: torch.Size) -> int:
    """The spatial positions of a channels-first convolution operand or output (1 for a matmul's)."""
    return math.prod(shape[2:]) if len(shape) >= 3 else 1


ROLES = ("input", "weight", "grad_output")
INPUT, WEIGHT, GRAD_OUTPUT = range(3)


def matmul_operands(short: str, args: tuple[Any, ...]) -> Iterator[tuple[int, torch.Tensor, Layout]]:
    """(argument position, tensor, layout) of each dense floating-point operand of a matmul op
    (sparse, meta and empty operands hold no values to quantize)."""
    for position, layout in MATMUL_OPERANDS.get(short, ()):
        if position < len(args):
            value = args[position]
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel()
                    and value.layout == torch.strided and not value.is_meta):
                yield position, value, layout


class Roles:
    """Tells an operand's role from where its value came from: a parameter of the model (by
    storage) is a weight; a value made in the backward pass is a gradient; anything else (data,
    activations saved from the forward pass) an input. Without ``model=``, a value from outside
    the step is taken for a weight."""

    def __init__(self) -> None:
        self._parameters: set[int] = set()
        self._model: Any = None
        self._first_backward: int | None = None

    def attach(self, model: Any) -> None:
        self._model = model

    def begin_step(self) -> None:
        self._first_backward = None
        if self._model is None:
            return
        models = self._model.values() if isinstance(self._model, dict) else [self._model]
        # Data pointers, refreshed each step: an optimizer may replace a parameter's storage.
        self._parameters = {p.untyped_storage().data_ptr() for m in models for p in m.parameters()}

    def role(self, phase: str, index: int, t: torch.Tensor, source: tuple[int, int, bool] | None) -> int:
        if phase == "backward" and self._first_backward is None:
            self._first_backward = index
        try:
            if t.untyped_storage().data_ptr() in self._parameters:
                return WEIGHT
        except (RuntimeError, NotImplementedError):
            pass
        if source is None:
            return INPUT if self._model is not None else WEIGHT
        if self._first_backward is not None and source[0] >= self._first_backward:
            return GRAD_OUTPUT
        return INPUT
