"""The record of one traced op call, as the tracer keeps it during a step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from probe.tracer.frames import Frame
from probe.tracer.op_class import OpClass

Source = tuple[int, int, bool]
"""Where an input value came from: (producer op index, its output position, exact).

``exact`` is False when only the storage matched (a view of a buffer an in-place
op wrote): the producer wrote these bytes, but its output was another view.
"""


@dataclass(eq=False, slots=True)
class TensorMeta:
    """dtype, shape and provenance of one tensor argument or result."""

    dtype: str
    shape: tuple[int, ...]
    source: Source | None = None
    """For inputs: the op that produced this value in the step, if traced."""
    mutated: bool = False
    """For outputs: the tensor is an argument the op wrote, not a fresh result."""


@dataclass(eq=False, slots=True)
class OpCall:
    """One traced op call. Tensors are only reachable while the op runs."""

    index: int
    """Position in the step's execution order (per rank)."""
    op_id: str
    info: OpClass
    phase: str
    frame: Frame
    step: int
    rank: int
    inputs: list[TensorMeta]
    outputs: list[TensorMeta]
    callsite: int | None = None
    input_tensors: list[torch.Tensor] | None = None
    output_tensors: list[torch.Tensor] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] | None = None

    @property
    def name(self) -> str:
        return self.info.name

    @property
    def module(self) -> str:
        return self.frame.origin.fqn

    def release(self) -> None:
        """Drop every reference to live tensors once the modes are done with the op."""
        self.input_tensors = None
        self.output_tensors = None
        self.args = ()
        self.kwargs = None
